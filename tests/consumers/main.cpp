// A consumer of recattn: one forward call with a gate and an initial state, checked against
// the double-precision reference. The source of both consumer projects (find_package/ and
// add_subdirectory/), which differ only in how they reach recattn.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <recattn/recattn.hpp>

int main() {
  const std::int64_t B = 2, T = 37, H = 3, K = 16, V = 24;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto random = [&](std::size_t n) {
    std::vector<float> x(n);
    for (auto& e : x) e = normal(rng);
    return x;
  };
  std::vector<float> q = random(B * T * H * K), k = random(B * T * H * K), v = random(B * T * H * V);
  std::vector<float> gk = random(B * T * H * K), h0 = random(B * H * K * V);
  for (auto& g : gk) g = -std::log1p(std::exp(-g));  // log(sigmoid(x))

  recattn::forward_options opt;
  opt.gk = recattn::view(gk.data(), {B, T, H, K});
  opt.initial_state = recattn::view(h0.data(), {B, H, K, V});
  opt.return_state = true;
  const auto qv = recattn::view(q.data(), {B, T, H, K});
  const auto kv = recattn::view(k.data(), {B, T, H, K});
  const auto vv = recattn::view(v.data(), {B, T, H, V});

  const recattn::forward_result got = recattn::recurrent_attention(qv, kv, vv, opt);
  const recattn::forward_result want = recattn::reference_recurrent_attention(qv, kv, vv, opt);

  auto rel_err = [](const recattn::tensor& a, const recattn::tensor& ref) {
    double num = 0, den = 0;
    const float* x = a.data<float>();
    const double* y = ref.data<double>();
    for (std::int64_t i = 0; i < ref.numel(); ++i) {
      num += (double(x[i]) - y[i]) * (double(x[i]) - y[i]);
      den += y[i] * y[i];
    }
    return std::sqrt(num / den);
  };
  const double e_out = rel_err(got.output, want.output);
  const double e_state = rel_err(*got.final_state, *want.final_state);
  std::printf("recattn %s consumer: output rel err %.3g, final state rel err %.3g\n", RECATTN_VERSION_STRING, e_out,
              e_state);
  return (e_out < 1e-4 && e_state < 1e-4) ? 0 : 1;
}
