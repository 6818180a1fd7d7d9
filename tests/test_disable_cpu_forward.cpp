// RECATTN_DISABLE_CPU_FORWARD (config.hpp): a translation unit compiled without the CPU
// forward kernels (the CUDA tests and benchmarks are) turns a forward that would run on the
// CPU into a recattn::Error naming the macro, before anything is written; can_implement says
// the same; the scalar reference still runs. This file is compiled with the macro.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <recattn/recattn.hpp>

using namespace recattn;

static_assert(RECATTN_DISABLE_CPU_FORWARD, "this test is built with RECATTN_DISABLE_CPU_FORWARD=1");

TEST_CASE("RECATTN_DISABLE_CPU_FORWARD: a CPU forward is a recattn::Error, nothing written", "[forward][bad_input]") {
  const std::int64_t B = 1, T = 5, H = 2, K = 4, V = 3;
  std::vector<float> q(B * T * H * K), k(q.size()), v(B * T * H * V);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.3f * float(i)), k[i] = std::cos(0.7f * float(i));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(1.1f * float(i) + 0.2f);
  const tensor_view qv(q.data(), dtype::float32, {B, T, H, K}), kv(k.data(), dtype::float32, {B, T, H, K}),
      vv(v.data(), dtype::float32, {B, T, H, V});
  std::vector<float> out(B * T * H * V);
  std::memset(out.data(), 0x5a, out.size() * sizeof(float));
  const std::vector<float> before = out;
  const forward_outputs outs{mutable_tensor_view(out.data(), dtype::float32, {B, T, H, V}), std::nullopt};
  for (platform pl : {platform::automatic, platform::cpu}) {
    INFO(platform_name(pl));
    forward_options o;
    o.platform = pl;
    bool thrown = false;
    try {
      recurrent_attention(qv, kv, vv, o, outs);
    } catch (const Error& e) {
      thrown = true;
      INFO(e.what());
      CHECK(std::string(e.what()).find("platform: expected cuda (this translation unit was compiled with "
                                       "RECATTN_DISABLE_CPU_FORWARD") != std::string::npos);
      CHECK(std::string(e.what()).find(", got cpu") != std::string::npos);
    }
    CHECK(thrown);
    CHECK(std::memcmp(out.data(), before.data(), out.size() * sizeof(float)) == 0);
    CHECK_THAT(can_implement(qv, kv, vv, o, outs), Catch::Matchers::Contains("RECATTN_DISABLE_CPU_FORWARD"));
    // The implementation reached directly refuses too.
    CHECK_THROWS_WITH(RecurrentAttention().get_impl(platform::cpu).run(make_problem(qv, kv, vv, o, &outs), cfg{}, o),
                      Catch::Matchers::Contains("RECATTN_DISABLE_CPU_FORWARD"));
  }
  const forward_result ref = reference_recurrent_attention(qv, kv, vv, forward_options{});
  CHECK(ref.output.view().type() == dtype::float64);
}
