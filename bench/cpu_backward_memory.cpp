// Peak extra memory of one CPU backward call (issue 4), for reading under heaptrack:
//
//   heaptrack build/bench/cpu_backward_memory T {float32|bfloat16} [threads]
//   heaptrack_print heaptrack.cpu_backward_memory.<pid>.zst | grep 'peak heap'
//
// Shape B1 H16 K=V=128 with every gate (so every gate gradient is formed); inputs and gates
// in the given dtype (16-bit gates take 16-bit gate gradients). It allocates every input and
// gradient first, prints their bytes (io_bytes) and the kernel's computed scratch, then runs
// one backward: heaptrack's peak minus io_bytes is the extra memory of the call.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include <recattn/recattn.hpp>

int main(int argc, char** argv) {
  using namespace recattn;
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s T float32|bfloat16 [threads]\n", argv[0]);
    return 2;
  }
  const std::int64_t B = 1, T = std::atoll(argv[1]), H = 16, K = 128, V = 128;
  const dtype type = std::string(argv[2]) == "bfloat16" ? dtype::bfloat16 : dtype::float32;
  cfg c;
  c.threads = argc > 3 ? std::atoi(argv[3]) : 2;
  std::mt19937_64 gen(42);
  std::normal_distribution<float> normal;
  std::size_t io = 0;
  auto make = [&](std::vector<std::int64_t> shape, bool gate) {
    tensor t(type, shape);
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      float x = normal(gen);
      if (gate) x = -std::log1p(std::exp(-(2.0f + x)));  // log(sigmoid(2 + x))
      store_as(t.raw(), t.type(), i, x);
    }
    io += std::size_t(t.numel()) * dtype_size(type);
    return t;
  };
  tensor q = make({B, T, H, K}, false), k = make({B, T, H, K}, false), v = make({B, T, H, V}, false);
  tensor dO = make({B, T, H, V}, false);
  tensor g = make({B, T, H}, true), g_gamma = make({H}, true), gk = make({B, T, H, K}, true), gv = make({B, T, H, V}, true);
  tensor dq = make(q.shape(), false), dk = make(k.shape(), false), dv = make(v.shape(), false);
  tensor dg = make(g.shape(), false), dg_gamma = make(g_gamma.shape(), false), dgk = make(gk.shape(), false),
         dgv = make(gv.shape(), false);
  forward_options opt;
  opt.g = g.view();
  opt.g_gamma = g_gamma.view();
  opt.gk = gk.view();
  opt.gv = gv.view();
  opt.cfg = c;
  const output_grads grads{dO.view(), std::nullopt};
  const backward_outputs outs{dq.view(), dk.view(), dv.view(), dg.view(), dg_gamma.view(), dgk.view(), dgv.view(), {}};
  const cpu::backward_workspace w = backward_workspace_bytes(q.view(), k.view(), v.view(), opt, grads, outs);
  std::printf("T %lld dtype %s threads %d: io_bytes %zu scratch_bytes %zu\n", (long long)T, dtype_name(type), c.threads,
              io, w.total());
  recurrent_attention_backward(q.view(), k.view(), v.view(), opt, grads, outs);
  std::printf("dg_gamma[0] %g\n", load_as<double>(dg_gamma.raw(), dg_gamma.type(), 0));
  return 0;
}
