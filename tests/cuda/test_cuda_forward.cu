// The CUDA forward pass against the scalar double reference (SPEC §1, §6): generated shapes,
// all 16 gate combinations, both directions, initial and final state, strides, float, bf16
// and half, K and V up to 256 and beyond, every candidate cfg, streams; bad input (§5).
// Layouts (varlen, grouped heads, [V,K], double) are in test_cuda_layouts.cu.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "cuda_case.hpp"

using recattn::dtype;
using recattn_test::errors;
using recattn_test::instance;
using recattn_test::spec;
using recattn_test::tolerance;

namespace {

void check_case(const spec& s) {
  INFO(s.str());
  instance in(s);
  const errors e = in.check();
  INFO("output rel err " << e.output << ", state rel err " << e.state);
  CHECK(e.output_written);
  CHECK(e.output < tolerance(s.type));
  if (s.return_state) CHECK(e.state < tolerance(s.type));
}

const dtype fast_types[] = {dtype::float32, dtype::bfloat16, dtype::float16};

}  // namespace

TEST_CASE("cuda forward: every gate combination, both directions", "[cuda]") {
  std::uint64_t seed = 100;
  for (dtype t : fast_types)
    for (unsigned gates = 0; gates < 16; ++gates)
      for (bool reverse : {false, true}) {
        spec s;
        s.type = t;
        s.gate_type = (gates & 1) ? t : dtype::float32;  // both gate dtypes are legal
        s.gates = gates;
        s.reverse = reverse;
        s.B = 2;
        s.T = 45;
        s.Hq = s.Hk = s.Hv = 2;
        s.K = 24;
        s.V = 20;
        s.initial_state = gates % 3 == 0;
        s.seed = seed++;
        check_case(s);
      }
}

// Scalar decays alone take the rescaled no-decay loop (recurrence.cuh, scalar_factors):
// segments end where the cumulative log decay leaves its bucket, so strong decays (a segment
// per token), mixed and positive ones, decays that underflow to exactly 0 (-inf), chunk
// boundaries (every chunk length) and long sequences are checked against the reference.
TEST_CASE("cuda forward: scalar decays, strong, mixed, positive, underflowing", "[cuda]") {
  const std::pair<double, double> ranges[] = {{-20.0, -5.0}, {-6.0, 0.0}, {-1.0, 0.8}, {-0.2, 0.0}, {-40.0, 0.5}};
  std::uint64_t seed = 2000;
  for (dtype t : {dtype::float32, dtype::bfloat16})
    for (unsigned gates : {unsigned(recattn::gate_g), unsigned(recattn::gate_g_gamma),
                           unsigned(recattn::gate_g | recattn::gate_g_gamma)})
      for (const auto& r : ranges)
        for (int chunk : {0, 4, 12, 64}) {
          spec s;
          s.type = t;
          s.gate_type = t;
          s.gates = gates;
          s.scalar_range = r;
          if ((gates & recattn::gate_g_gamma) && r.second > 0.0) continue;  // a constant growth overflows
          s.B = 2;
          s.T = 200;
          s.Hq = s.Hk = s.Hv = 2;
          s.K = 40;
          s.V = 24;
          s.reverse = (seed & 1) != 0;
          s.initial_state = true;
          s.gamma_per_seq = (seed & 2) != 0;
          if (chunk) {
            recattn::cfg c;
            c.num_warps = 4;
            c.chunk = chunk;
            s.cfg = c;
          }
          s.seed = seed++;
          check_case(s);
        }
  // Decays of exactly 0 (g = -inf) between ordinary ones, and a long mild sequence: the
  // recurrent kernel forced (for bfloat16 these lengths would go to the chunked kernel,
  // which test_cuda_chunked covers).
  for (dtype t : {dtype::float32, dtype::bfloat16}) {
    spec s;
    recattn::cfg rec;
    rec.algo = recattn::algorithm::recurrent;
    s.cfg = rec;
    s.type = t;
    s.gate_type = t;
    s.gates = recattn::gate_g | recattn::gate_g_gamma;
    s.scalar_range = std::make_pair(-3.0, 0.0);
    s.neg_inf_every = 37;
    s.T = 300;
    s.initial_state = true;
    s.seed = seed++;
    check_case(s);
    s.neg_inf_every = 0;
    s.scalar_range = std::make_pair(-0.02, 0.0);
    s.B = 1;
    s.T = 16384;
    s.Hq = s.Hk = s.Hv = 1;
    s.K = s.V = 64;
    s.seed = seed++;
    check_case(s);
    s.gates = recattn::gate_g_gamma;  // every full chunk after the second reuses its factors
    s.seed = seed++;
    check_case(s);
  }
}

TEST_CASE("cuda forward: K and V of any size up to 256", "[cuda]") {
  const std::int64_t sizes[][2] = {{1, 1},   {2, 3},    {16, 8},   {31, 33},  {32, 32},  {33, 17}, {64, 64},
                                   {65, 64}, {100, 70}, {128, 128}, {129, 5}, {200, 256}, {256, 256}, {256, 300},
                                   {7, 520}};
  std::uint64_t seed = 300;
  for (dtype t : fast_types)
    for (auto& kv : sizes) {
      spec s;
      s.type = t;
      s.gate_type = t;
      s.gates = recattn::gate_g | recattn::gate_gk | recattn::gate_gv;
      s.B = 1;
      s.T = 40;
      s.Hq = s.Hk = s.Hv = 2;
      s.K = kv[0];
      s.V = kv[1];
      s.initial_state = true;
      s.seed = seed++;
      check_case(s);
    }
}

TEST_CASE("cuda forward: strided inputs", "[cuda]") {
  std::uint64_t seed = 800;
  for (dtype t : fast_types)
    for (std::int64_t pad : {1, 3, 8})
      for (unsigned gates : {0u, 12u, 15u}) {
        spec s;
        s.type = t;
        s.gate_type = t;
        s.gates = gates;
        s.pad = pad;
        s.K = 37;
        s.V = 45;
        s.initial_state = gates == 15u;
        s.seed = seed++;
        check_case(s);
      }
}

TEST_CASE("cuda forward: every candidate configuration", "[cuda]") {
  spec s;
  s.type = dtype::bfloat16;
  s.gates = recattn::gate_gk | recattn::gate_gv | recattn::gate_g;
  s.B = 1;
  s.T = 150;
  s.Hq = s.Hk = s.Hv = 2;
  s.K = 128;
  s.V = 128;
  s.initial_state = true;
  instance probe(s);
  recattn::forward_outputs outs{probe.out.dev_mview(), probe.ht.dev_mview()};
  const recattn::problem p = recattn::make_problem(probe.q.dev_view(), probe.k.dev_view(), probe.v.dev_view(),
                                                   probe.options(true), &outs);
  const auto cands = recattn::RecurrentAttention(recattn::platform::cuda).candidate_cfgs(p);
  CHECK(cands.size() > 4);
  std::uint64_t seed = 900;
  for (const recattn::cfg& c : cands) {
    s.cfg = c;
    s.seed = seed++;
    check_case(s);
  }
}

TEST_CASE("cuda forward: long sequence, softmax scale, a stream", "[cuda]") {
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  spec s;
  s.type = dtype::bfloat16;
  s.gate_type = dtype::float32;
  s.gates = recattn::gate_gk;
  s.B = 1;
  s.T = 4096;
  s.Hq = s.Hk = s.Hv = 1;
  s.K = 64;
  s.V = 64;
  s.initial_state = true;
  s.scale = 0.3;
  s.stream = stream;
  s.seed = 1000;
  check_case(s);
  cudaStreamDestroy(stream);
}

TEST_CASE("cuda forward: platform automatic picks cuda for device memory", "[cuda]") {
  spec s;
  s.gates = recattn::gate_g;
  instance in(s);
  recattn::forward_options o = in.options(true);
  o.platform = recattn::platform::automatic;
  recattn::forward_outputs outs{in.out.dev_mview(), in.ht.dev_mview()};
  recattn::recurrent_attention(in.q.dev_view(), in.k.dev_view(), in.v.dev_view(), o, outs);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  in.out.download();
  bool finite = true;
  for (std::int64_t i = 0; i < in.out.elements(); ++i) finite = finite && std::isfinite(in.out.at(i));
  CHECK(finite);
}

namespace {

/// Runs a call that must throw recattn::Error and checks that output and state are untouched.
template <class Mutate>
void expect_rejected(spec s, Mutate mutate, const char* needle) {
  instance in(s);
  in.out.fill_bytes(0x5a);
  if (s.return_state) in.ht.fill_bytes(0x5a);
  recattn::forward_options o = in.options(true);
  recattn::forward_outputs outs{in.out.dev_mview(), std::nullopt};
  if (s.return_state) outs.final_state = in.ht.dev_mview();
  recattn::tensor_view q = in.q.dev_view(), k = in.k.dev_view(), v = in.v.dev_view();
  mutate(in, q, k, v, o, outs);
  bool thrown = false;
  try {
    recattn::recurrent_attention(q, k, v, o, outs);
  } catch (const recattn::Error& e) {
    thrown = true;
    INFO(e.what());
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
  }
  CHECK(thrown);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  in.out.download();
  bool untouched = true;
  for (unsigned char b : in.out.host) untouched = untouched && b == 0x5a;
  if (s.return_state) {
    in.ht.download();
    for (unsigned char b : in.ht.host) untouched = untouched && b == 0x5a;
  }
  CHECK(untouched);
}

}  // namespace

TEST_CASE("cuda forward: bad input is rejected before anything is written", "[cuda]") {
  using recattn::forward_options;
  using recattn::forward_outputs;
  using recattn::tensor_view;
  spec s;
  s.gates = recattn::gate_gk;
  s.initial_state = true;
  SECTION("K larger than the kernel holds") {
    spec big = s;
    big.K = 257;
    expect_rejected(big, [](instance&, tensor_view&, tensor_view&, tensor_view&, forward_options&, forward_outputs&) {},
                    "K <= 256");
  }
  SECTION("platform cuda with host tensors") {
    expect_rejected(
        s,
        [](instance& in, tensor_view& q, tensor_view& k, tensor_view& v, forward_options& o, forward_outputs&) {
          q = in.q.host_view();
          k = in.k.host_view();
          v = in.v.host_view();
          o.gk = in.gk.host_view();
          o.initial_state = in.h0.host_view();
        },
        "platform");
  }
  SECTION("one host tensor among device tensors") {
    expect_rejected(
        s, [](instance& in, tensor_view&, tensor_view&, tensor_view&, forward_options& o, forward_outputs&) {
          o.gk = in.gk.host_view();
        },
        "gk");
  }
  SECTION("host initial state") {
    expect_rejected(
        s, [](instance& in, tensor_view&, tensor_view&, tensor_view&, forward_options& o, forward_outputs&) {
          o.initial_state = in.h0.host_view();
        },
        "initial_state");
  }
  SECTION("platform cpu with device tensors") {
    expect_rejected(
        s, [](instance&, tensor_view&, tensor_view&, tensor_view&, forward_options& o, forward_outputs&) {
          o.platform = recattn::platform::cpu;
        },
        "platform");
  }
  SECTION("bad cu_seqlens in device memory") {
    spec vs = s;
    vs.B = 1;
    vs.T = 20;
    vs.cu = {0, 12, 7, 20};  // decreasing
    expect_rejected(vs, [](instance&, tensor_view&, tensor_view&, tensor_view&, forward_options&, forward_outputs&) {},
                    "cu_seqlens");
  }
  SECTION("a cfg the kernel cannot take") {
    expect_rejected(
        s, [](instance&, tensor_view&, tensor_view&, tensor_view&, forward_options& o, forward_outputs&) {
          recattn::cfg c;
          c.block_v = 24;
          o.cfg = c;
        },
        "cfg.block_v");
  }
}

// Issue 7, item 6: a launch the device refuses surfaces as recattn::Error naming the CUDA
// call and error, writes nothing, and leaves the context usable for the next call. The public
// call checks cfg first (resolve_cfg); the implementation reached through get_impl takes a
// cfg as given, so a chunk whose shared memory exceeds the device's limit reaches the launch.
TEST_CASE("cuda forward: a refused launch is a recattn::Error and the context stays usable", "[cuda][api-error]") {
  spec s;
  s.type = dtype::bfloat16;
  s.gate_type = dtype::bfloat16;
  s.gates = recattn::gate_gk;
  s.B = 1;
  s.T = 70;
  s.Hq = s.Hk = s.Hv = 1;
  s.K = 256;
  s.V = 64;
  s.initial_state = true;
  instance in(s);
  in.out.fill_bytes(0x5a);
  in.ht.fill_bytes(0x5a);
  const recattn::forward_options o = in.options(true);
  const recattn::forward_outputs outs{in.out.dev_mview(), in.ht.dev_mview()};
  const recattn::problem p = recattn::make_problem(in.q.dev_view(), in.k.dev_view(), in.v.dev_view(), o, &outs);
  recattn::cfg c;
  c.num_warps = 8;
  c.block_v = 64;
  c.block_k = 256;
  c.chunk = 64;  // 64 tokens of K = 256 with gk: about 430 KiB of shared memory
  REQUIRE(recattn::cuda::detail::layout_for(p, 8, 64).bytes > recattn::cuda::detail::smem_budget());
  CHECK_THROWS_WITH(recattn::cuda::resolve_cfg(p, c), Catch::Contains("cfg.chunk"));

  const recattn::forward_impl impl = recattn::RecurrentAttention().get_impl(recattn::platform::cuda);
  bool thrown = false;
  try {
    impl.run(p, c, o);
  } catch (const recattn::Error& e) {
    thrown = true;
    INFO(e.what());
    CHECK(std::string(e.what()).find("cuda: cudaFuncSetAttribute") != std::string::npos);
  }
  CHECK(thrown);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  in.out.download();
  in.ht.download();
  bool untouched = true;
  for (unsigned char b : in.out.host) untouched = untouched && b == 0x5a;
  for (unsigned char b : in.ht.host) untouched = untouched && b == 0x5a;
  CHECK(untouched);

  // The same context, the same buffers, the heuristic cfg: the right answer.
  const errors e = in.check();
  CHECK(e.output_written);
  CHECK(e.output < tolerance(s.type));
  CHECK(e.state < tolerance(s.type));
}
