#!/usr/bin/env python3
"""Writes the step seeds of tests/fuzz/corpus (files 200-319, *-step-*): the byte layout is the one
fuzz_forward.cpp's run_one reads. Run from anywhere: python3 tests/fuzz/make_step_seeds.py"""
import os

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
# Bad kinds as fuzz_forward.cpp numbers them (a step draws 1 + (byte - 160) % 25).
BAD = {"rank": 1, "shape": 2, "dtype": 3, "null": 4, "cu_start": 5, "cu_order": 6, "cu_end": 7,
       "cu_batch": 8, "stride": 9, "scale": 10, "cfg": 11, "platform": 14, "index_range": 17,
       "index_dup": 18, "index_shape": 19, "index_dtype": 20, "pool_small": 21, "pool_shape": 22,
       "pool_dtype": 23, "pool_null": 24, "out_overlap": 25}


def seed(form, gates, *, strided=False, per_seq=False, cu32=False, scale=None, cfg=None, poisons=(),
         bad=None, bad_arg=0, indices=True, spare=2, padding=0, bf16_pool=False, H=2, K=5, V=3, seed_value=1):
    flags = (1 if form == "single" else 0) | (4 if form == "varlen" else 0)
    flags |= 64 if scale is not None else 0
    flags |= 128 if cfg is not None else 0
    gate_byte = gates | (16 if per_seq else 0) | (32 if cu32 else 0) | (64 if strided else 0)
    dtype_byte = 64 | (128 if bf16_pool else 0)
    b = [flags, gate_byte, dtype_byte, H - 1, 0, 0, H - 1 if H > 1 else 0, K - 1, V - 1]
    # Head counts: divisors of H in increasing order; index 0 = 1, last = H (Hv = H keeps H).
    if form == "varlen":
        lens = [3, 0, 5]
        b += [len(lens)] + lens
    else:
        b += [2 - 1, 6]  # B = 2, T = 6 (1 for the single-token form)
    b += [seed_value & 255, seed_value >> 8, 64 + 16, 128 + int(32 * (scale or 0))]
    b += list(cfg or (0, 0, 0))
    b += [len(poisons)]
    for tensor, at, kind in poisons:
        b += [tensor, at & 255, at >> 8, kind]
    b += [0 if bad is None else 160 + BAD[bad] - 1, bad_arg]  # below 160: no bad argument
    b += [spare | (4 if indices else 0), padding]
    return bytes(b)


def main():
    seeds = {}
    n = 200
    for form in ("single", "multi", "varlen"):
        for gates in range(16):
            seeds[f"{n:03d}-step-{form}-gates{gates}"] = seed(form, gates, per_seq=gates & 2 and form != "single",
                                                              padding=0b010 if gates % 3 == 0 else 0, seed_value=n)
            n += 1
    extra = {
        "step-single-no-indices": seed("single", 15, indices=False, spare=0),
        "step-multi-strided": seed("multi", 15, strided=True, cu32=True),
        "step-varlen-strided-int32": seed("varlen", 15, strided=True, cu32=True, padding=0b101),
        "step-cfg": seed("multi", 15, cfg=(3, 8, 2)),
        "step-scale": seed("varlen", 5, scale=1.5),
        "step-bf16-pool": seed("single", 15, bf16_pool=True),
        "step-nonfinite-q": seed("multi", 15, poisons=[(0, 7, 0)]),
        "step-nonfinite-state": seed("single", 15, poisons=[(7, 3, 1), (2, 9, 2)]),
        "step-all-padding": seed("varlen", 15, padding=0b111),
    }
    for what, b in extra.items():
        seeds[f"{n:03d}-{what}"] = b
        n += 1
    for bad in BAD:
        for arg in (0, 1, 2):
            form = ("single", "multi", "varlen")[arg]
            if bad.startswith("cu_") and bad != "cu_batch":
                form = "varlen"
            seeds[f"{n:03d}-step-bad-{bad}-{arg}"] = seed(form, 15, bad=bad, bad_arg=arg * 37 + 1)
            n += 1
    for name, b in seeds.items():
        with open(os.path.join(HERE, name), "wb") as f:
            f.write(b)
    print(f"wrote {len(seeds)} step seeds to {HERE}")


if __name__ == "__main__":
    main()
