// cfg.algo on the CPU backend (issue 8): automatic and recurrent run the CPU kernel; chunked
// (a CUDA-only algorithm) is a recattn::Error naming cfg.algorithm, thrown before anything
// is written. Self-contained (plain host vectors) and capped to one variant: cheap to build.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <recattn/recattn.hpp>

using namespace recattn;

TEST_CASE("cfg.algo on platform cpu: chunked rejected, nothing written; recurrent and automatic run", "[forward][bad_input]") {
  const std::int64_t B = 1, T = 7, H = 2, K = 4, V = 3;
  std::vector<float> q(B * T * H * K), k(q.size()), v(B * T * H * V);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.3f * float(i)), k[i] = std::cos(0.7f * float(i));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(1.1f * float(i) + 0.2f);
  const tensor_view qv(q.data(), dtype::float32, {B, T, H, K}), kv(k.data(), dtype::float32, {B, T, H, K}),
      vv(v.data(), dtype::float32, {B, T, H, V});
  std::vector<float> out(B * T * H * V), state(B * H * K * V);
  auto poison = [&] {
    std::memset(out.data(), 0x5a, out.size() * sizeof(float));
    std::memset(state.data(), 0x5a, state.size() * sizeof(float));
  };
  auto untouched = [&] {
    std::vector<unsigned char> ref(std::max(out.size(), state.size()) * sizeof(float), 0x5a);
    return std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)) == 0 &&
           std::memcmp(state.data(), ref.data(), state.size() * sizeof(float)) == 0;
  };
  const forward_outputs outs{mutable_tensor_view(out.data(), dtype::float32, {B, T, H, V}),
                             mutable_tensor_view(state.data(), dtype::float32, {B, H, K, V})};
  forward_options o;
  o.return_state = true;
  o.platform = platform::cpu;
  o.cfg = cfg{};
  o.cfg->algo = algorithm::chunked;

  poison();
  bool thrown = false;
  try {
    recurrent_attention(qv, kv, vv, o, outs);
  } catch (const Error& e) {
    thrown = true;
    INFO(e.what());
    CHECK(std::string(e.what()).find("cfg.algorithm") != std::string::npos);
    CHECK(std::string(e.what()).find("chunked") != std::string::npos);
  }
  CHECK(thrown);
  CHECK(untouched());
  CHECK_THAT(can_implement(qv, kv, vv, o, outs), Catch::Matchers::Contains("cfg.algorithm"));

  const forward_result ref = reference_recurrent_attention(qv, kv, vv, o);
  for (algorithm a : {algorithm::recurrent, algorithm::automatic}) {
    INFO(algorithm_name(a));
    o.cfg->algo = a;
    CHECK(can_implement(qv, kv, vv, o, outs).empty());
    poison();
    recurrent_attention(qv, kv, vv, o, outs);
    double err = 0, norm = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      const double r = ref.output.data<double>()[i];
      err += (out[i] - r) * (out[i] - r);
      norm += r * r;
    }
    CHECK(std::sqrt(err / norm) < 1e-5);
  }
}
