// libFuzzer target (issue 7): bytes -> one forward, backward or step call of the CPU backend.
//
// The bytes choose the operation, the shapes (small), gates, flags, cu_seqlens (int32/int64),
// strides, the cfg, the seed of the values, up to three non-finite values (NaN, +inf, -inf)
// placed in the inputs, and at most one deliberately bad argument (wrong rank or shape, dtype
// mismatch, bad cu_seqlens, null data, a last-dimension stride, a non-finite scale, ...; for a
// step also state_indices out of range, repeated, of the wrong shape or dtype, and a pool of
// the wrong size, shape or dtype). A step (bit 6 of the third byte) runs against a state pool
// with spare slots: with or without state_indices (a shuffled slot per row, some rows padding),
// in its single-token (dense, T = 1), multi-token or varlen form. The oracle:
//
//   - a bad argument throws recattn::Error ("recattn: <argument>: expected ..., got ...")
//     and every output, state, pool and gradient buffer keeps its bytes;
//   - a valid call does not throw (but for what this build cut, RECATTN_DISABLE_*), and
//     matches the double reference: forward (and step, whose reference is the forward from
//     the rows' pool slots) within SPEC §6 on every (sequence, head) whose reference output
//     is finite (so NaN reaches only the (n, h) it was put in), backward on every gradient
//     when all inputs are finite; nothing is written into stride gaps; a step leaves the
//     outputs of padding rows and every slot no row uses untouched.
//
// Anything else aborts, and so does any sanitizer report. The same file builds the replay
// executable of the CTest suite (fuzz/replay.cpp calls LLVMFuzzerTestOneInput on the corpus
// and the regression inputs) and the libFuzzer binary (tests/run-fuzz.sh).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <list>
#include <random>
#include <string>
#include <vector>

#include <recattn/recattn.hpp>

#include "support/generators.hpp"
#include "support/views.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

[[noreturn]] void failure(const std::string& what) {
  std::fprintf(stderr, "fuzz_forward: FAILURE: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

/// Reads the input; zeros once it is exhausted (so every prefix is a valid input).
struct reader {
  const std::uint8_t* p;
  std::size_t n, i = 0;
  std::uint8_t u8() { return i < n ? p[i++] : 0; }
  std::uint16_t u16() {
    const std::uint16_t lo = u8();
    return std::uint16_t(lo | (u8() << 8));
  }
};

/// What the bad-argument byte selects (0: none).
enum bad_kind : int {
  bad_none,
  bad_rank,             ///< q, k or v of rank 3
  bad_shape,            ///< one tensor one element longer in one dimension
  bad_dtype,            ///< key, value, a gate or a state of another dtype
  bad_null,             ///< null data in a non-empty tensor
  bad_cu_start,         ///< cu_seqlens[0] != 0
  bad_cu_order,         ///< decreasing cu_seqlens
  bad_cu_end,           ///< cu_seqlens[N] != T
  bad_cu_batch,         ///< cu_seqlens with B = 2
  bad_stride,           ///< a last dimension with stride 2
  bad_scale,            ///< non-finite softmax_scale
  bad_cfg,              ///< a negative cfg field
  bad_no_state_buffer,  ///< return_state without a final_state buffer
  bad_alias,            ///< final_state sharing initial_state's memory with other strides
  bad_platform,         ///< platform cuda in a CPU-only build
  bad_grad_no_input,    ///< backward: a gate gradient without its gate
  bad_grad_overlap,     ///< backward: dv overlapping dk, or a gradient overlapping an input
  bad_count,            ///< forward and backward draw from the kinds above, a step from all
  bad_index_range = bad_count,  ///< step: a state index >= P
  bad_index_dup,        ///< step: two rows on one slot
  bad_index_shape,      ///< step: N + 1 state indices
  bad_index_dtype,      ///< step: float32 state indices
  bad_pool_small,       ///< step: no state_indices and P < N
  bad_pool_shape,       ///< step: a pool with one more element along one dimension
  bad_pool_dtype,       ///< step: a float16 pool
  bad_pool_null,        ///< step: a pool with null data
  bad_out_overlap,      ///< step: an output overlapping the pool
  step_bad_count
};

const char* bad_name(int b) {
  static const char* names[] = {"none", "rank", "shape", "dtype", "null", "cu_start", "cu_order", "cu_end",
                                "cu_batch", "stride", "scale", "cfg", "no_state_buffer", "alias", "platform",
                                "grad_no_input", "grad_overlap", "index_range", "index_dup", "index_shape",
                                "index_dtype", "pool_small", "pool_shape", "pool_dtype", "pool_null",
                                "out_overlap"};
  return b >= 0 && b < step_bad_count ? names[b] : "?";
}

}  // namespace

// The harness's own helpers, outside the anonymous namespace so that
// tests/fuzz/coverage-ignorelist.txt can name them (fuzz_helpers): the fuzzer's coverage
// is the library's and run_one's, not that of the loops that check a result.
namespace fuzz_helpers {

/// Calls f(index) for every multi-index of `shape` (rank <= 4) in row-major order: the
/// order of for_each_index, in plain nested loops.
template <class F>
void walk(const std::vector<std::int64_t>& shape, F&& f) {
  std::int64_t n[max_rank] = {1, 1, 1, 1};
  const std::size_t rank = shape.size(), pad = max_rank - rank;
  for (std::size_t d = 0; d < rank; ++d) {
    if (shape[d] <= 0) return;
    n[pad + d] = shape[d];
  }
  idx i{};
  std::int64_t* at[max_rank];
  idx scratch{};
  for (std::size_t d = 0; d < max_rank; ++d) at[d] = d < pad ? &scratch[d] : &i[d - pad];
  for (*at[0] = 0; *at[0] < n[0]; ++*at[0])
    for (*at[1] = 0; *at[1] < n[1]; ++*at[1])
      for (*at[2] = 0; *at[2] < n[2]; ++*at[2])
        for (*at[3] = 0; *at[3] < n[3]; ++*at[3]) f(static_cast<const idx&>(i));
}

/// Flat element `e` (modulo numel, row-major) of a buffer set to x.
void set_flat(buffer& b, std::uint64_t e, double x) {
  const std::int64_t n = b.numel();
  if (n <= 0) return;
  std::int64_t rest = std::int64_t(e % std::uint64_t(n));
  idx i{};
  for (int d = b.rank() - 1; d >= 0; --d) {
    i[std::size_t(d)] = rest % b.size(d);
    rest /= b.size(d);
  }
  b.set(i, x);
}

buffer abs_copy(const tensor_view& t) {
  buffer b = buffer::copy_of(t);
  walk(b.shape(), [&](const idx& i) { b.set(i, std::fabs(b.get(i))); });
  return b;
}

double sq_norm(const tensor_view& t) {
  double s = 0;
  walk(t.shape_vec(), [&](const idx& i) {
    const double x = element(t, i);
    s += x * x;
  });
  return s;
}

/// ||a - b||^2 over all elements.
double sq_diff(const tensor_view& a, const tensor_view& b) {
  double s = 0;
  walk(a.shape_vec(), [&](const idx& i) {
    const double x = element(a, i) - element(b, i);
    s += x * x;
  });
  return s;
}

/// testing::gaps_untouched (every storage byte outside an element still holds the sentinel)
/// without its vector<bool> of bytes.
bool gaps_clean(const buffer& b) {
  const std::size_t es = dtype_size(b.type()), slots = b.bytes().size() / es;
  std::vector<unsigned char> element(slots, 0);
  walk(b.shape(), [&](const idx& i) { element[std::size_t(b.offset(i))] = 1; });
  const unsigned char* p = b.bytes().data();
  for (std::size_t e = 0; e < slots; ++e)
    if (!element[e])
      for (std::size_t c = 0; c < es; ++c)
        if (p[e * es + c] != sentinel_byte) return false;
  return true;
}

/// testing::rng's normal() as libstdc++ computes it (std::normal_distribution's polar method
/// over std::generate_canonical), without generate_canonical's logl per draw, which was the
/// largest single cost of an execution; integer() is testing::rng's. fast_rng_exact() checks
/// that both give the same numbers, bit for bit, and generate_fast is used only then.
class fast_rng {
 public:
  /// exact false: std::normal_distribution's own draws (fast_rng_exact() said they differ).
  explicit fast_rng(std::uint64_t seed, bool exact = true) : gen_(seed), exact_(exact) {}
  double normal() {
    if (!exact_) return std::normal_distribution<double>(0.0, 1.0)(gen_);
    double x, y, r2;
    do {
      x = 2.0 * canonical() - 1.0;
      y = 2.0 * canonical() - 1.0;
      r2 = x * x + y * y;
    } while (r2 > 1.0 || r2 == 0.0);
    const double mult = std::sqrt(-2 * std::log(r2) / r2);
    return y * mult * 1.0 + 0.0;
  }
  std::int64_t integer(std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(gen_); }

 private:
  double canonical() {
    const double r = double(gen_() - std::mt19937_64::min()) / 18446744073709551616.0;
    return r >= 1.0 ? std::nextafter(1.0, 0.0) : r;
  }
  std::mt19937_64 gen_;
  bool exact_;
};

/// testing::generate with fast_rng: the same draws in the same order.
problem_data generate_fast(const problem_spec& s) { return generate_with<fast_rng>(s); }

/// Whether fast_rng and generate_fast give testing::rng's and testing::generate's numbers,
/// bit for bit (checked once per process): otherwise the harness uses those.
bool fast_rng_exact() {
  for (std::uint64_t seed : {1u, 2u, 77u, 65536u}) {
    rng a(seed);
    fast_rng b(seed);
    for (int i = 0; i < 4000; ++i) {
      const double x = i % 5 == 4 ? double(a.integer(0, 3 + i % 7)) : a.normal();
      const double y = i % 5 == 4 ? double(b.integer(0, 3 + i % 7)) : b.normal();
      if (std::memcmp(&x, &y, sizeof x) != 0) return false;
    }
  }
  for (int v = 0; v < 8; ++v) {
    problem_spec s;
    s.B = 1 + v % 2, s.T = 3 + v, s.Hq = 2, s.Hk = 1 + v % 2, s.Hv = 2, s.K = 3 + v, s.V = 5;
    s.gates = unsigned(v * 5) & 15u;
    s.g_gamma_per_sequence = v & 1;
    s.initial_state = v & 2;
    s.strided = v & 4;
    s.gates_in_input_dtype = v & 1;
    s.gate_bias = v - 2.5;
    s.seed = 1 + std::uint64_t(v) * 977;
    if (v == 5) s.with_seqlens({2, 0, 4});
    const problem_data a = generate(s), b = generate_fast(s);
    const buffer* x[] = {&a.q, &a.k, &a.v, &a.g, &a.g_gamma, &a.gk, &a.gv, &a.initial_state, &a.cu_seqlens};
    const buffer* y[] = {&b.q, &b.k, &b.v, &b.g, &b.g_gamma, &b.gk, &b.gv, &b.initial_state, &b.cu_seqlens};
    for (int t = 0; t < 9; ++t)
      if (x[t]->present() != y[t]->present() || x[t]->bytes() != y[t]->bytes() || x[t]->strides() != y[t]->strides())
        return false;
  }
  return true;
}

/// The absolute difference a result may show because its dtype cannot hold values below its
/// smallest normal number (they round to a denormal or 0; the reference, in double, keeps
/// them): that number per element, as a norm. Found by the fuzzer: a d initial_state of
/// 2.4e-58 (the decays of 12 tokens), 0 in float32 (tests/fuzz/regressions/dh0-underflow-aa2f9bd0...).
double underflow_floor(const tensor_view& t) {
  double n = 1.0;
  for (std::int64_t e : t.shape_vec()) n *= double(e);
  const double tiny = t.type() == dtype::float64   ? std::numeric_limits<double>::min()
                      : t.type() == dtype::float16 ? 6.103515625e-05
                                                   : double(std::numeric_limits<float>::min());
  return std::sqrt(n) * tiny;
}

bool all_finite(const tensor_view& t) {
  bool ok = true;
  walk(t.shape_vec(), [&](const idx& i) { ok = ok && std::isfinite(element(t, i)); });
  return ok;
}

/// Whether the bytes of element i of b equal those of `before` (b's storage before a call).
bool element_same(const buffer& b, const std::vector<unsigned char>& before, const idx& i) {
  const std::size_t es = dtype_size(b.type()), at = std::size_t(b.offset(i)) * es;
  return std::memcmp(b.bytes().data() + at, before.data() + at, es) == 0;
}

bool element_is_sentinel(const buffer& b, const idx& i) {
  const std::size_t es = dtype_size(b.type()), at = std::size_t(b.offset(i)) * es;
  return std::all_of(b.bytes().begin() + std::ptrdiff_t(at), b.bytes().begin() + std::ptrdiff_t(at + es),
                     [](unsigned char x) { return x == sentinel_byte; });
}

}  // namespace fuzz_helpers

namespace {

using namespace fuzz_helpers;

struct snapshot {
  std::vector<const buffer*> bufs;
  std::vector<std::vector<unsigned char>> bytes;
  void add(const buffer& b) {
    if (!b.present()) return;
    bufs.push_back(&b);
    bytes.push_back(b.bytes());
  }
  bool unchanged() const {
    for (std::size_t i = 0; i < bufs.size(); ++i)
      if (bufs[i]->bytes() != bytes[i]) return false;
    return true;
  }
};

/// The message of a recattn::Error from a failed check, as SPEC §5 wants it.
void check_message(const std::string& m, bool compiled_out) {
  if (m.rfind("recattn: ", 0) != 0) failure("error message without the recattn prefix: " + m);
  if (compiled_out) return;
  if (m.find(": expected ") == std::string::npos || m.find(", got ") == std::string::npos)
    failure("error message without 'expected' and 'got': " + m);
}

struct fuzz_case {
  problem_spec s;
  problem_data d;
  bool backward = false, return_state = false, in_place = false, with_dht = false;
  bool step = false, single = false;  ///< a step; in its single-token form
  int bad = bad_none;
  bool compiled_out = false;  ///< a dtype this build cut: Error expected, not a failure
  std::list<buffer> keep;
};

int run_one(const std::uint8_t* data, std::size_t size) {
  reader r{data, size};
  fuzz_case c;
  problem_spec& s = c.s;
  const std::uint8_t flags = r.u8(), gate_byte = r.u8(), dtype_byte = r.u8();
  c.backward = flags & 1;
  const bool reverse = flags & 2, varlen = flags & 4, vk = flags & 8;
  c.return_state = flags & 16;
  s.initial_state = flags & 32;
  const bool has_scale = flags & 64, has_cfg = flags & 128;
  s.gates = gate_byte & 15u;
  s.g_gamma_per_sequence = gate_byte & 16;
  s.cu_type = gate_byte & 32 ? dtype::int32 : dtype::int64;
  s.strided = gate_byte & 64;
  s.gates_in_input_dtype = gate_byte & 128;
  switch (dtype_byte % 16) {
    case 13: s.type = dtype::bfloat16; break;
    case 14: s.type = dtype::float16; break;
    case 15: s.type = dtype::float64; break;
    default: s.type = dtype::float32; break;
  }
  // This target is built for float32 and the [K, V] state only (tests/reliability.cmake).
  c.compiled_out = s.type != dtype::float32 || vk;
  c.in_place = dtype_byte & 16;
  c.with_dht = dtype_byte & 32;
  s.layout = vk ? state_layout::vk : state_layout::kv;
  // A step: no backward, no direction, no final_state buffer (the pool is the state, and
  // the initial state is what the rows' slots hold); the backward bit picks the single-token
  // form of a dense step; bit 7: a bfloat16 pool (this build cut it: RECATTN_DISABLE_BF16_STATE).
  c.step = dtype_byte & 64;
  // (float64 inputs take a float64 pool only: their bit 7 is ignored.)
  const bool pool_bf16 = c.step && (dtype_byte & 128) && s.type != dtype::float64;
  if (c.step) {
    c.single = c.backward && !varlen;
    c.backward = false;
    c.return_state = false;
    c.in_place = false;
    s.initial_state = true;
    c.compiled_out = c.compiled_out || pool_bf16;
  }

  const std::int64_t H = 1 + r.u8() % 4;
  std::vector<std::int64_t> divisors;
  for (std::int64_t x = 1; x <= H; ++x)
    if (H % x == 0) divisors.push_back(x);
  s.Hq = divisors[r.u8() % divisors.size()];
  s.Hk = divisors[r.u8() % divisors.size()];
  s.Hv = divisors[r.u8() % divisors.size()];
  if (std::max(s.Hq, std::max(s.Hk, s.Hv)) != H) s.Hv = H;
  s.K = 1 + r.u8() % 20;
  s.V = 1 + r.u8() % 20;
  if (varlen) {
    std::vector<std::int64_t> lens(r.u8() % 5);  // N = 0 .. 4
    for (auto& l : lens) l = r.u8() % 9;
    s.with_seqlens(lens);
  } else {
    s.B = 1 + r.u8() % 3;
    s.T = r.u8() % 13;
    if (c.single) s.T = 1;
  }
  s.seed = 1 + r.u16();
  s.gate_bias = (int(r.u8()) - 64) / 16.0;  // log(sigmoid(bias + N(0, 1))), bias in [-4, 12)
  const double scale = (int(r.u8()) - 128) / 32.0;
  cfg user_cfg;
  user_cfg.threads = r.u8() % 5;
  user_cfg.block_v = r.u8() % 70;
  user_cfg.chunk = r.u8() % 70;
  struct poison { int tensor; std::uint16_t at; int kind; };
  std::vector<poison> poisons(r.u8() % 4);
  for (auto& p : poisons) {
    p.tensor = r.u8() % 8;
    p.at = r.u16();
    p.kind = r.u8() % 3;
  }
  const std::uint8_t bad_byte = r.u8(), bad_arg = r.u8();
  c.bad = bad_byte < 160 ? bad_none : 1 + (bad_byte - 160) % ((c.step ? step_bad_count : bad_count) - 1);
  // A step's pool: spare slots beyond one per row, state_indices or none, padding rows.
  const std::uint8_t pool_byte = c.step ? r.u8() : 0, padding_byte = c.step ? r.u8() : 0;

  static const bool fast = [] {
    const bool exact = fast_rng_exact();
    std::fprintf(stderr, exact ? "fuzz_forward: values from fast_rng (bit-identical to testing::rng)\n"
                               : "fuzz_forward: fast_rng differs from testing::rng here: using testing::generate\n");
    return exact;
  }();
  c.d = fast ? generate_fast(s) : generate(s);
  problem_data& d = c.d;
  // Non-finite values: q, k, v, g, g_gamma, gk, gv, initial_state.
  buffer* poisonable[] = {&d.q, &d.k, &d.v, &d.g, &d.g_gamma, &d.gk, &d.gv, &d.initial_state};
  const double nonfinite[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                              -std::numeric_limits<double>::infinity()};
  bool poisoned = false;
  for (const poison& p : poisons) {
    buffer& b = *poisonable[p.tensor];
    if (!b.present() || b.numel() == 0) continue;
    set_flat(b, p.at, nonfinite[p.kind]);
    poisoned = true;
  }

  const std::vector<std::int64_t> out_gaps = s.strided ? std::vector<std::int64_t>{1, 2, 1} : std::vector<std::int64_t>{};
  buffer out = d.make_output(out_gaps);
  buffer state = d.make_state(out_gaps);
  if (c.in_place && s.initial_state && c.return_state) {
    // final_state aliases initial_state: the state buffer starts as the initial state.
    state = buffer(d.initial_state.type(), d.initial_state.shape(), out_gaps);
    state.fill_bytes(sentinel_byte);
    for_each_index(state.shape(), [&](const idx& i) { state.set_raw(i, d.initial_state.view(), i); });
  } else {
    c.in_place = false;
  }

  tensor_view q = d.q, k = d.k, v = d.v;
  forward_options o = d.options();
  o.reverse = reverse && !c.step;
  o.return_state = c.return_state;
  if (has_scale) o.softmax_scale = scale;
  if (has_cfg) o.cfg = user_cfg;
  if (c.in_place) o.initial_state = state.view();
  forward_outputs outs{out.mutable_view(), std::nullopt};
  if (c.return_state) outs.final_state = state.mutable_view();

  // The step's pool [P, H, K, V] ([P, H, V, K] for vk): row n's slot holds initial_state[n],
  // the other slots random values; gaps (strided) keep the sentinel.
  buffer pool, indices;
  std::vector<std::int64_t> slot_of;  ///< row -> slot; negative: padding row
  std::int64_t P = 0;
  if (c.step) {
    const std::int64_t N = s.N();
    const bool with_indices = pool_byte & 4;
    P = N + pool_byte % 4;
    slot_of.resize(std::size_t(N));
    std::vector<std::int64_t> perm(static_cast<std::size_t>(P));
    for (std::int64_t i = 0; i < P; ++i) perm[std::size_t(i)] = i;
    fast_rng pr(s.seed + 3, fast);
    if (with_indices)
      for (std::int64_t i = P - 1; i > 0; --i) std::swap(perm[std::size_t(i)], perm[std::size_t(pr.integer(0, i))]);
    for (std::int64_t n = 0; n < N; ++n)
      slot_of[std::size_t(n)] = with_indices && (padding_byte >> (n % 8) & 1) ? -1 - n % 2 : perm[std::size_t(n)];
    std::vector<std::int64_t> pool_shape = s.state_shape();
    pool_shape[0] = P;
    pool = sentinel_buffer(pool_bf16 ? dtype::bfloat16 : s.state_type(), pool_shape, out_gaps);
    pool.fill([&](const idx&) { return pr.normal(); });
    for (std::int64_t n = 0; n < N; ++n)
      if (slot_of[std::size_t(n)] >= 0)
        for_each_index({pool_shape[1], pool_shape[2], pool_shape[3]}, [&](const idx& i) {
          pool.set_raw({slot_of[std::size_t(n)], i[0], i[1], i[2]}, d.initial_state.view(), {n, i[0], i[1], i[2]});
        });
    if (with_indices) {
      indices = buffer(s.cu_type, {N});
      indices.fill([&](const idx& i) { return double(slot_of[std::size_t(i[0])]); });
    }
    o.initial_state.reset();
    if (c.single) {
      q = drop_dim(q, 1, 0), k = drop_dim(k, 1, 0), v = drop_dim(v, 1, 0);
      for (std::optional<tensor_view>* g : {&o.g, &o.gk, &o.gv})
        if (*g) **g = drop_dim(**g, 1, 0);
      outs.output = drop_dim(out.mutable_view(), 1, 0);
    }
  }
  mutable_tensor_view pool_view = pool.present() ? pool.mutable_view() : mutable_tensor_view();
  std::optional<tensor_view> state_indices;
  if (indices.present()) state_indices = indices.view();
  const std::vector<unsigned char> pool_before = pool.bytes();

  // Backward: dO, d_final_state, gradient buffers for the inputs the byte selects.
  buffer dO, dht;
  std::vector<buffer> grads(8);  // dq dk dv dg dg_gamma dgk dgv dh0
  backward_outputs bo;
  output_grads og;
  if (c.backward) {
    fast_rng rr(s.seed + 7, fast);
    dO = buffer(s.type, s.output_shape()).fill([&](const idx&) { return rr.normal(); });
    if (c.with_dht) dht = buffer(s.state_type(), s.state_shape()).fill([&](const idx&) { return rr.normal(); });
    og.d_output = dO.view();
    if (dht.present()) og.d_final_state = dht.view();
    const buffer* like[] = {&d.q, &d.k, &d.v, &d.g, &d.g_gamma, &d.gk, &d.gv, &d.initial_state};
    for (int i = 0; i < 8; ++i)
      if (like[i]->present())
        grads[std::size_t(i)] = sentinel_buffer(like[i]->type(), like[i]->shape(), s.strided ? out_gaps : std::vector<std::int64_t>{});
    bo.dq = grads[0].mutable_view();
    bo.dk = grads[1].mutable_view();
    bo.dv = grads[2].mutable_view();
    std::optional<mutable_tensor_view>* opt_grads[] = {&bo.dg, &bo.dg_gamma, &bo.dgk, &bo.dgv, &bo.d_initial_state};
    for (int i = 3; i < 8; ++i)
      if (grads[std::size_t(i)].present()) *opt_grads[i - 3] = grads[std::size_t(i)].mutable_view();
  }

  // The bad argument. `applied` stays false when the selected break does not apply to this
  // call (then the call is valid and judged as such).
  bool applied = false;
  auto keep = [&](buffer b) -> buffer& {
    c.keep.push_back(std::move(b));
    return c.keep.back();
  };
  const int which = bad_arg % 11;
  std::optional<tensor_view>* gates_opt[] = {&o.g, &o.g_gamma, &o.gk, &o.gv, &o.initial_state};
  switch (c.bad) {
    case bad_rank: {
      tensor_view& t = which % 3 == 0 ? q : which % 3 == 1 ? k : v;
      if (t.rank() == 4) t = tensor_view(t.data(), t.type(), {t.size(0) * t.size(1), t.size(2), t.size(3)});
      else t = tensor_view(t.data(), t.type(), {t.size(0), 1, t.size(1), t.size(2)});  // single-token step
      applied = true;
      break;
    }
    case bad_shape: {
      // One more element along one dimension of one tensor: q (in K), k (B, T or K), v (B or
      // T), a gate, the initial state, the output or the final state. Head counts of q, k, v
      // are not grown: a new count can be legal (it may change H).
      const int t = which % 10, dim = bad_arg / 11 % 4;
      auto grow = [&](const tensor_view& x, int dm) {
        std::vector<std::int64_t> sh = x.shape_vec();
        sh[std::size_t(dm % int(sh.size()))] += 1;
        return keep(buffer(x.type(), sh).fill([](const idx&) { return -0.5; })).view();
      };
      if (t == 0) {
        q = grow(q, q.rank() - 1);
        applied = true;
      } else if (t == 1) {
        // B, T or K (rank 4); B or K (a single-token key [B, Hk, K]).
        k = grow(k, k.rank() == 4 ? (dim == 2 ? 3 : dim) : (dim % 2 ? 2 : 0));
        applied = true;
      } else if (t == 2) {
        v = grow(v, v.rank() == 4 ? dim % 2 : 0);
        applied = true;
      } else if (t < 8) {
        std::optional<tensor_view>& g = *gates_opt[t - 3];
        if (g) {
          g = grow(*g, dim);
          applied = true;
        }
      } else if (t == 8 && !c.backward) {
        std::vector<std::int64_t> sh = out.shape();
        sh[std::size_t(dim)] += 1;
        outs.output = keep(sentinel_buffer(out.type(), sh)).mutable_view();
        applied = true;
      } else if (t == 9 && !c.backward && c.return_state) {
        std::vector<std::int64_t> sh = state.shape();
        sh[std::size_t(dim)] += 1;
        outs.final_state = keep(sentinel_buffer(state.type(), sh)).mutable_view();
        applied = true;
      }
      break;
    }
    case bad_dtype: {
      const int t = which % 6;
      const dtype other = s.type == dtype::float64 ? dtype::bfloat16 : dtype::float64;
      auto retype = [&](const tensor_view& x, dtype to) {
        return keep(buffer(to, x.shape_vec()).fill([](const idx&) { return -0.5; })).view();
      };
      if (t == 0) { k = retype(k, other); applied = true; }
      else if (t == 1) { v = retype(v, other); applied = true; }
      else if (t == 2 && o.initial_state) {
        // The state dtype is float (double for double inputs): a float16 one never is.
        o.initial_state = retype(*o.initial_state, dtype::float16);
        applied = true;
      } else if (t == 3 && c.return_state && !c.backward) {
        outs.final_state = keep(sentinel_buffer(dtype::float16, state.shape())).mutable_view();
        applied = true;
      } else if (t == 4 && !c.backward) {
        outs.output = keep(sentinel_buffer(other, out.shape())).mutable_view();
        applied = true;
      } else if (t == 5) {
        // A gate neither float32 nor the query's dtype: int32 never is.
        for (int gi = 0; gi < 4; ++gi)
          if (*gates_opt[gi]) {
            *gates_opt[gi] = retype(**gates_opt[gi], dtype::int32);
            applied = true;
            break;
          }
      }
      break;
    }
    case bad_null: {
      const int t = which % 9;
      if (t < 3) {
        tensor_view& x = t == 0 ? q : t == 1 ? k : v;
        if (x.numel() > 0) { x = null_data(x); applied = true; }
      } else if (t < 8) {
        std::optional<tensor_view>& g = *gates_opt[t - 3];
        if (g && g->numel() > 0 && !(c.in_place && t == 7)) { g = null_data(*g); applied = true; }
      } else if (!c.backward && out.numel() > 0) {
        outs.output = mutable_tensor_view(nullptr, out.type(), out.shape(), out.strides());
        applied = true;
      }
      break;
    }
    case bad_cu_start:
    case bad_cu_order:
    case bad_cu_end:
      if (varlen) {
        std::vector<std::int64_t> cu = s.cu_seqlens();
        if (c.bad == bad_cu_start) cu[0] = 1 + which % 3;
        if (c.bad == bad_cu_order) {
          if (cu.size() < 3) break;
          const std::size_t at = 1 + which % (cu.size() - 2);  // an inner entry
          cu[at] = cu[at + 1] + 1 + which % 2;                 // above its successor
        }
        if (c.bad == bad_cu_end) cu.back() += which % 2 ? 1 : -1;
        buffer& b = keep(buffer(s.cu_type, {std::int64_t(cu.size())}));
        b.fill([&](const idx& i) { return double(cu[std::size_t(i[0])]); });
        o.cu_seqlens = b.view();
        applied = true;
      }
      break;
    case bad_cu_batch:
      if (!varlen && s.B > 1) {
        buffer& b = keep(buffer(dtype::int64, {s.B + 1}));
        b.fill([&](const idx& i) { return double(std::min(i[0], std::int64_t(1)) * s.T); });
        o.cu_seqlens = b.view();
        applied = true;
      }
      break;
    case bad_stride: {
      auto spread = [&](const tensor_view& x) {
        std::vector<std::int64_t> wide = x.shape_vec();
        wide.back() *= 2;
        buffer& w = keep(buffer(x.type(), wide).fill([](const idx&) { return 0.25; }));
        std::vector<std::int64_t> st = w.strides();
        st.back() = 2;
        return tensor_view(w.data(), x.type(), x.shape_vec(), st);
      };
      const int t = which % 3;
      tensor_view& x = t == 0 ? q : t == 1 ? k : v;
      if (x.size(x.rank() - 1) > 1) { x = spread(x); applied = true; }
      break;
    }
    case bad_scale:
      o.softmax_scale = which % 3 == 0 ? std::numeric_limits<double>::quiet_NaN()
                                       : (which % 3 == 1 ? 1 : -1) * std::numeric_limits<double>::infinity();
      applied = true;
      break;
    case bad_cfg: {
      cfg cf = o.cfg ? *o.cfg : cfg{};
      if (which % 3 == 0) cf.threads = -1 - which;
      if (which % 3 == 1) cf.block_v = -1 - which;
      if (which % 3 == 2) cf.chunk = -1 - which;
      o.cfg = cf;
      applied = true;
      break;
    }
    case bad_no_state_buffer:
      if (c.return_state && !c.backward) {
        outs.final_state.reset();
        applied = true;
      }
      break;
    case bad_alias:
      if (!c.backward && c.return_state && s.initial_state && !c.in_place) {
        // One dense buffer read as the initial state and written with the first two strides
        // swapped.
        // With H = 1 the swap changes nothing (a valid in-place call, which would write h0
        // instead of `state`): then the call is left as it is.
        const std::vector<std::int64_t> st = buffer(d.initial_state.type(), d.initial_state.shape()).strides();
        if (st[0] == st[1]) break;
        buffer& h0 = keep(buffer::copy_of(d.initial_state.view()));  // in c.keep: snapshotted below
        o.initial_state = h0.view();
        outs.final_state = mutable_tensor_view(h0.data(), h0.type(), h0.shape(), {st[1], st[0], st[2], 1});
        applied = true;
      }
      break;
    case bad_platform:
      o.platform = platform::cuda;
      applied = true;
      break;
    case bad_grad_no_input:
      if (c.backward) {
        for (int gi = 0; gi < 5; ++gi) {
          std::optional<tensor_view>& in = *gates_opt[(which + gi) % 5];
          if (in) {
            in.reset();
            applied = true;
            break;
          }
        }
      }
      break;
    case bad_grad_overlap:
      if (c.backward) {
        if (which % 2) bo.dv = mutable_tensor_view(grads[1].data(), grads[1].type(), grads[2].shape());
        else bo.dq = mutable_tensor_view(const_cast<void*>(d.q.data()), d.q.type(), d.q.shape(), d.q.strides());
        // dv over dk only overlaps when dk is not empty.
        applied = which % 2 ? grads[1].numel() > 0 && grads[2].numel() > 0 : d.q.numel() > 0;
      }
      break;
    case bad_index_range:
    case bad_index_dup:
      if (c.step && s.N() >= (c.bad == bad_index_dup ? 2 : 1)) {
        std::vector<std::int64_t> ix = slot_of;
        if (!state_indices) for (std::int64_t n = 0; n < s.N(); ++n) ix[std::size_t(n)] = n;
        const std::size_t at = std::size_t(which % s.N());
        if (c.bad == bad_index_range) ix[at] = P + which % 3;
        else ix[at] = ix[(at + 1) % ix.size()] = std::max<std::int64_t>(ix[at], 0);
        buffer& b = keep(buffer(s.cu_type, {s.N()}));
        b.fill([&](const idx& i) { return double(ix[std::size_t(i[0])]); });
        state_indices = b.view();
        applied = true;
      }
      break;
    case bad_index_shape:
      if (!c.step) break;
      state_indices = keep(buffer(dtype::int64, {s.N() + 1}).fill([](const idx& i) { return double(i[0]); })).view();
      applied = true;
      break;
    case bad_index_dtype:
      if (!c.step) break;
      state_indices = keep(buffer(dtype::float32, {s.N()}).fill([](const idx& i) { return double(i[0]); })).view();
      applied = true;
      break;
    case bad_pool_small:
      if (c.step && s.N() >= 1) {
        state_indices.reset();
        std::vector<std::int64_t> sh = pool.shape();
        sh[0] = s.N() - 1;
        pool_view = mutable_tensor_view(pool.data(), pool.type(), sh, pool.strides());
        applied = true;
      }
      break;
    case bad_pool_shape:
      if (c.step) {
        std::vector<std::int64_t> sh = pool.shape();
        sh[std::size_t(1 + which % 3)] += 1;
        pool_view = keep(sentinel_buffer(pool.type(), sh)).mutable_view();
        applied = true;
      }
      break;
    case bad_pool_dtype:
      if (c.step) {
        pool_view = keep(sentinel_buffer(dtype::float16, pool.shape())).mutable_view();
        applied = true;
      }
      break;
    case bad_pool_null:
      if (c.step && pool.numel() > 0) {
        pool_view = mutable_tensor_view(nullptr, pool.type(), pool.shape(), pool.strides());
        applied = true;
      }
      break;
    case bad_out_overlap:
      // The output's first element on the pool's: rejected before anything is written, so the
      // view may claim more memory than the pool has.
      if (c.step && pool.numel() > 0 && out.numel() > 0) {
        const mutable_tensor_view& ov = outs.output;
        outs.output = mutable_tensor_view(pool.data(), ov.type(), ov.shape_vec(), strides_of(ov));
        applied = true;
      }
      break;
    default: break;
  }

  snapshot snap;
  snap.add(out);
  snap.add(state);
  snap.add(pool);
  for (const buffer& g : grads) snap.add(g);
  for (const buffer& b : c.keep) snap.add(b);
  // Inputs are never written.
  snapshot inputs;
  for (const buffer* b : poisonable) inputs.add(*b);

  std::string message;
  bool threw = false;
  try {
    if (c.step) {
      step_options so;
      so.g = o.g, so.g_gamma = o.g_gamma, so.gk = o.gk, so.gv = o.gv;
      so.cu_seqlens = o.cu_seqlens;
      so.state_indices = state_indices;
      so.softmax_scale = o.softmax_scale;
      so.state_layout = s.layout;
      so.platform = o.platform;
      so.cfg = o.cfg;
      step(q, k, v, pool_view, outs.output, so);
    } else if (c.backward) {
      recurrent_attention_backward(q, k, v, o, og, bo);
    } else {
      recurrent_attention(q, k, v, o, outs);
    }
  } catch (const Error& e) {
    threw = true;
    message = e.what();
  } catch (const std::exception& e) {
    failure(std::string("an exception that is not recattn::Error: ") + e.what());
  }
  if (!inputs.unchanged()) failure("an input was written");
  std::string what = std::string(c.step ? (c.single ? "step (single token)" : "step") : c.backward ? "backward" : "forward") +
                     " " + s.str() + " bad=" + bad_name(applied ? c.bad : 0);
  if (c.step) {
    what += " P=" + std::to_string(P) + " slots=";
    for (std::int64_t x : slot_of) what += std::to_string(x) + ",";
    if (!indices.present()) what += " (no state_indices)";
  }
  // RECATTN_FUZZ_VERBOSE=1: one line per input (what it called, and the error if any).
  static const bool verbose = std::getenv("RECATTN_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "fuzz_forward: %s: %s\n", what.c_str(), threw ? message.c_str() : "ok");
  if (threw) {
    if (!snap.unchanged()) failure("rejected call wrote its buffers: " + what + ": " + message);
    const bool cut = c.compiled_out && message.find("compiled without") != std::string::npos;
    check_message(message, cut);
    if (!applied && !cut) failure("valid call rejected: " + what + ": " + message);
    return 0;
  }
  if (applied) failure("bad argument accepted: " + what);
  if (c.compiled_out) failure("a dtype this build cut was accepted: " + what);
  if (!gaps_clean(out) || !gaps_clean(state) || (pool.present() && !gaps_clean(pool)))
    failure("a stride gap of an output was written: " + what);
  std::vector<bool> padding(std::size_t(s.N()), false);
  if (c.step) {
    // Slots no row uses keep their bytes; row n's final state is what its slot holds now.
    std::vector<bool> used(std::size_t(P), false);
    for (std::int64_t n = 0; n < s.N(); ++n) {
      const std::int64_t sl = slot_of[std::size_t(n)];
      padding[std::size_t(n)] = sl < 0;
      if (sl >= 0) used[std::size_t(sl)] = true;
    }
    for_each_index(pool.shape(), [&](const idx& i) {
      if (!used[std::size_t(i[0])] && !element_same(pool, pool_before, i))
        failure("a step wrote a pool slot no row uses (slot " + std::to_string(i[0]) + "): " + what);
    });
    for (std::int64_t n = 0; n < s.N(); ++n)
      if (!padding[std::size_t(n)])
        for_each_index({state.size(1), state.size(2), state.size(3)}, [&](const idx& i) {
          state.set_raw({n, i[0], i[1], i[2]}, pool.view(), {slot_of[std::size_t(n)], i[0], i[1], i[2]});
        });
  }

  // Against the double reference, on the same (unbroken) tensors.
  forward_options ro = d.options();
  ro.reverse = reverse && !c.step;
  ro.return_state = true;
  if (has_scale) ro.softmax_scale = scale;
  const double tol = 1e-4;
  const bool with_state = c.return_state || c.step;
  if (!c.backward) {
    const forward_result ref = reference_recurrent_attention(d.q, d.k, d.v, ro);
    // Magnitudes: the reference on |q|, |k|, |v|, |h0| bounds every term of every sum, so
    // rounding error is measured against it where the result itself cancels to near zero.
    const buffer aq = abs_copy(d.q), ak = abs_copy(d.k), av = abs_copy(d.v);
    buffer ah0;
    forward_options ao = ro;
    if (s.initial_state) {
      ah0 = abs_copy(d.initial_state);
      ao.initial_state = ah0.view();
    }
    const forward_result mag = reference_recurrent_attention(aq, ak, av, ao);
    double diff = 0, norm = 0, magn = 0;
    const std::vector<std::int64_t> cu = s.varlen() ? s.cu_seqlens() : std::vector<std::int64_t>{};
    const bool kv = s.layout == state_layout::kv;
    for (std::int64_t n = 0; n < s.N(); ++n) {
      const std::int64_t b = s.varlen() ? 0 : n, t0 = s.varlen() ? cu[std::size_t(n)] : 0;
      const std::int64_t t1 = s.varlen() ? cu[std::size_t(n + 1)] : s.T;
      if (padding[std::size_t(n)]) {
        // A padding row: its outputs keep the sentinel.
        for (std::int64_t t = t0; t < t1; ++t)
          for_each_index({s.H(), s.V}, [&](const idx& i) {
            if (!element_is_sentinel(out, {b, t, i[0], i[1]}))
              failure("a step wrote the output of a padding row (row " + std::to_string(n) + "): " + what);
          });
        continue;
      }
      for (std::int64_t h = 0; h < s.H(); ++h) {
        double dd = 0, nn = 0, mm = 0;
        bool ref_finite = true, got_finite = true;
        auto acc = [&](double got, double want, double m) {
          ref_finite = ref_finite && std::isfinite(want) && std::isfinite(m);
          got_finite = got_finite && std::isfinite(got);
          dd += (got - want) * (got - want);
          nn += want * want;
          mm += m * m;
        };
        for (std::int64_t t = t0; t < t1; ++t)
          for (std::int64_t j = 0; j < s.V; ++j) {
            const idx i{b, t, h, j};
            acc(out.get(i), element(ref.output, i), element(mag.output, i));
          }
        if (with_state)
          for (std::int64_t a = 0; a < s.K; ++a)
            for (std::int64_t j = 0; j < s.V; ++j) {
              const idx i = kv ? idx{n, h, a, j} : idx{n, h, j, a};
              acc(state.get(i), element(*ref.final_state, i), element(*mag.final_state, i));
            }
        if (!ref_finite) continue;  // a non-finite input of this (n, h): anything goes
        if (!got_finite) failure("non-finite result where the reference is finite (n " + std::to_string(n) + ", h " +
                                 std::to_string(h) + "): " + what);
        diff += dd, norm += nn, magn += mm;
      }
    }
    if (std::sqrt(diff) > tol * std::sqrt(norm) + 3e-5 * std::sqrt(magn))
      failure("forward differs from the reference: |diff| " + std::to_string(std::sqrt(diff)) + " |ref| " +
              std::to_string(std::sqrt(norm)) + " |magnitudes| " + std::to_string(std::sqrt(magn)) + ": " + what);
    return 0;
  }

  // Backward: compared when every input is finite (a non-finite input may reach every
  // gradient of its sequence through the state, by design).
  if (poisoned) return 0;
  const backward_result ref = reference_recurrent_attention_backward(d.q, d.k, d.v, ro, og);
  // Magnitudes of the terms: the reference gradients of |inputs| against |dO|, |dht|.
  const buffer aq = abs_copy(d.q), ak = abs_copy(d.k), av = abs_copy(d.v), adO = abs_copy(dO);
  buffer ah0, adht;
  forward_options ao = ro;
  if (s.initial_state) {
    ah0 = abs_copy(d.initial_state);
    ao.initial_state = ah0.view();
  }
  output_grads ag{adO.view(), std::nullopt};
  if (dht.present()) {
    adht = abs_copy(dht);
    ag.d_final_state = adht.view();
  }
  const backward_result mag = reference_recurrent_attention_backward(aq, ak, av, ao, ag);
  const forward_result omag = reference_recurrent_attention(aq, ak, av, ao);
  // The gate gradients are telescoping sums of k.dk - q.dq (and v.dv - o.dO, h0.dh0)
  // over up to T tokens: their rounding is bounded by those products' magnitudes.
  auto nrm = [](const tensor_view& t) { return std::sqrt(sq_norm(t)); };
  double gate_mag = nrm(aq) * nrm(mag.dq) + nrm(ak) * nrm(mag.dk) + nrm(av) * nrm(mag.dv) + nrm(adO) * nrm(omag.output);
  if (s.initial_state) gate_mag += nrm(ah0) * nrm(*mag.d_initial_state);
  gate_mag *= double(s.T + 1);
  struct cmp { const char* name; const buffer* got; const tensor* want; const tensor* m; bool gate; };
  const cmp cmps[] = {
      {"dq", &grads[0], &ref.dq, &mag.dq, false},
      {"dk", &grads[1], &ref.dk, &mag.dk, false},
      {"dv", &grads[2], &ref.dv, &mag.dv, false},
      {"dg", &grads[3], ref.dg ? &*ref.dg : nullptr, nullptr, true},
      {"dg_gamma", &grads[4], ref.dg_gamma ? &*ref.dg_gamma : nullptr, nullptr, true},
      {"dgk", &grads[5], ref.dgk ? &*ref.dgk : nullptr, nullptr, true},
      {"dgv", &grads[6], ref.dgv ? &*ref.dgv : nullptr, nullptr, true},
      {"d_initial_state", &grads[7], ref.d_initial_state ? &*ref.d_initial_state : nullptr,
       mag.d_initial_state ? &*mag.d_initial_state : nullptr, false},
  };
  for (const cmp& x : cmps) {
    if (!x.got->present()) continue;
    if (!x.want) failure(std::string("no reference for ") + x.name + ": " + what);
    if (!gaps_clean(*x.got)) failure(std::string("a stride gap of ") + x.name + " was written: " + what);
    if (!all_finite(*x.got)) failure(std::string("non-finite ") + x.name + " from finite inputs: " + what);
    const double dd = std::sqrt(sq_diff(*x.got, *x.want)), nn = std::sqrt(sq_norm(*x.want));
    const double mm = x.gate ? gate_mag : nrm(*x.m);
    if (dd > tol * nn + 3e-5 * mm + underflow_floor(*x.got))
      failure(std::string(x.name) + " differs from the reference: |diff| " + std::to_string(dd) + " |ref| " +
              std::to_string(nn) + " |magnitudes| " + std::to_string(mm) + ": " + what);
  }
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { return run_one(data, size); }

// libFuzzer calls this once before the first input (the replay executable does not). OpenMP
// workers sleep as soon as a parallel region ends instead of spinning for libomp's default
// 200 ms: an execution's threaded call is over in microseconds, and the spinning workers
// took a fifth of the fuzzer's CPU time on two shared cores (an environment setting of
// KMP_BLOCKTIME wins). The calls still run on cfg.threads workers (0: every hardware thread).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("KMP_BLOCKTIME", "0", 0);
  return 0;
}
