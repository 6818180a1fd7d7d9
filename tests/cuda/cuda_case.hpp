// Test support for the CUDA backend: a generated forward problem held on the host and
// mirrored on the device, run through the public API on platform cuda and compared with
// the scalar double reference on the same (rounded) host inputs.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <recattn/recattn.hpp>

namespace recattn_test {

using recattn::dtype;

inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

/// A strided host tensor with a device mirror of the same layout.
struct mirrored {
  dtype type = dtype::float32;
  std::vector<std::int64_t> shape, strides;
  std::vector<unsigned char> host;
  void* dev = nullptr;

  mirrored() = default;
  mirrored(const mirrored&) = delete;
  mirrored& operator=(const mirrored&) = delete;
  mirrored(mirrored&& o) noexcept { *this = std::move(o); }
  mirrored& operator=(mirrored&& o) noexcept {
    std::swap(type, o.type);
    std::swap(shape, o.shape);
    std::swap(strides, o.strides);
    std::swap(host, o.host);
    std::swap(dev, o.dev);
    return *this;
  }
  ~mirrored() {
    if (dev) cudaFree(dev);
  }

  /// `pad` extra elements after the last dimension of each row (strided rows when > 0).
  mirrored(dtype t, std::vector<std::int64_t> shp, std::int64_t pad = 0) : type(t), shape(std::move(shp)) {
    strides.assign(shape.size(), 1);
    std::int64_t s = 1;
    for (std::size_t i = shape.size(); i-- > 0;) {
      strides[i] = s;
      s *= (i + 1 == shape.size()) ? shape[i] + pad : shape[i];
    }
    std::int64_t extent = 1;
    for (std::size_t i = 0; i < shape.size(); ++i) extent += (shape[i] - 1) * strides[i];
    for (auto d : shape)
      if (d == 0) extent = 1;
    host.assign(std::size_t(extent) * recattn::dtype_size(t), 0);
    cuda_ok(cudaMalloc(&dev, host.size()), "cudaMalloc");
  }
  std::int64_t elements() const { return std::int64_t(host.size() / recattn::dtype_size(type)); }
  void upload() { cuda_ok(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice), "upload"); }
  void download() { cuda_ok(cudaMemcpy(host.data(), dev, host.size(), cudaMemcpyDeviceToHost), "download"); }
  void fill_bytes(unsigned char b) {
    std::memset(host.data(), b, host.size());
    cuda_ok(cudaMemset(dev, b, host.size()), "cudaMemset");
  }
  recattn::tensor_view host_view() const { return recattn::tensor_view(host.data(), type, shape, strides); }
  recattn::mutable_tensor_view host_mview() { return recattn::mutable_tensor_view(host.data(), type, shape, strides); }
  recattn::tensor_view dev_view() const { return recattn::tensor_view(dev, type, shape, strides); }
  recattn::mutable_tensor_view dev_mview() { return recattn::mutable_tensor_view(dev, type, shape, strides); }
  double at(std::int64_t i) const { return recattn::load_as<double>(host.data(), type, i); }
  /// Offset of a multi-index.
  std::int64_t offset(std::initializer_list<std::int64_t> idx) const {
    std::int64_t o = 0, d = 0;
    for (auto i : idx) o += i * strides[std::size_t(d++)];
    return o;
  }
};

/// One generated forward problem.
struct spec {
  dtype type = dtype::float32;
  dtype gate_type = dtype::float32;  ///< float32 or `type`
  std::int64_t B = 2, T = 33, Hq = 2, Hk = 2, Hv = 2, K = 16, V = 16;
  unsigned gates = 0;
  bool reverse = false;
  std::vector<std::int64_t> cu;  ///< non-empty: varlen (B must be 1, T = cu.back())
  bool cu_int32 = false;
  bool cu_on_device = true;
  bool initial_state = false;
  bool return_state = true;
  bool alias_state = false;  ///< final state written over the initial state
  recattn::state_layout layout = recattn::state_layout::kv;
  std::int64_t pad = 0;       ///< row padding of q, k, v, gates (strided tensors)
  bool gamma_per_seq = false;
  /// When set, g and g_gamma are drawn uniformly from [first, second] (log decays: strong,
  /// mixed or positive), and `neg_inf_every` > 0 puts -inf into every that-many-th g.
  std::optional<std::pair<double, double>> scalar_range;
  int neg_inf_every = 0;
  /// The same for gk: drawn from [first, second], -inf at every that-many-th element.
  std::optional<std::pair<double, double>> gk_range;
  int gk_neg_inf_every = 0;
  /// The same for gv.
  std::optional<std::pair<double, double>> gv_range;
  int gv_neg_inf_every = 0;
  std::optional<double> scale;
  std::optional<recattn::cfg> cfg;
  void* stream = nullptr;
  std::uint64_t seed = 1;

  std::string str() const {
    return recattn::detail::cat(recattn::dtype_name(type), " gates=", recattn::gate_mask_name(gates), " gate_type=",
                                recattn::dtype_name(gate_type), " B", B, " T", T, " Hq", Hq, " Hk", Hk, " Hv", Hv, " K",
                                K, " V", V, reverse ? " reverse" : "", cu.empty() ? "" : " varlen",
                                initial_state ? " h0" : "", alias_state ? " aliased" : "",
                                layout == recattn::state_layout::vk ? " vk" : "", pad ? " padded" : "",
                                scalar_range ? recattn::detail::cat(" g in [", scalar_range->first, ", ", scalar_range->second, "]")
                                             : std::string(),
                                gk_range ? recattn::detail::cat(" gk in [", gk_range->first, ", ", gk_range->second, "]")
                                         : std::string(),
                                gv_range ? recattn::detail::cat(" gv in [", gv_range->first, ", ", gv_range->second, "]")
                                         : std::string(),
                                neg_inf_every || gk_neg_inf_every || gv_neg_inf_every
                                    ? recattn::detail::cat(" -inf every ", neg_inf_every, "/", gk_neg_inf_every, "/",
                                                           gv_neg_inf_every)
                                    : std::string(),
                                cfg ? " cfg=" + cfg->str() : std::string());
  }
};

struct errors {
  double output = 0, state = 0;
  bool output_written = true;  ///< every output element finite (the poison was overwritten)
};

inline double tolerance(dtype t) {
  return t == dtype::float64 ? 1e-10 : t == dtype::float32 ? 1e-4 : 1e-2;
}

/// The problem's tensors; the output and final state are poisoned (NaN bytes) before a run.
struct instance {
  spec s;
  std::int64_t H = 0, N = 0;
  mirrored q, k, v, g, gg, gk, gv, h0, out, ht, cu;

  explicit instance(const spec& sp) : s(sp) {
    H = std::max(s.Hq, std::max(s.Hk, s.Hv));
    N = s.cu.empty() ? s.B : std::int64_t(s.cu.size()) - 1;
    std::mt19937_64 rng(s.seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_real_distribution<double> uni(0.0, 1.0);
    auto fill = [&](mirrored& m, auto gen) {
      for (std::int64_t i = 0; i < m.elements(); ++i) recattn::store_as(m.host.data(), m.type, i, gen());
      m.upload();
    };
    auto logsig = [&](double lo, double hi) { return [&, lo, hi] { const double x = lo + (hi - lo) * uni(rng); return -std::log1p(std::exp(-x)); }; };
    q = mirrored(s.type, {s.B, s.T, s.Hq, s.K}, s.pad);
    k = mirrored(s.type, {s.B, s.T, s.Hk, s.K}, s.pad);
    v = mirrored(s.type, {s.B, s.T, s.Hv, s.V}, s.pad);
    fill(q, [&] { return normal(rng); });
    fill(k, [&] { return normal(rng); });
    fill(v, [&] { return normal(rng); });
    auto ranged = [&](double lo, double hi, int inf_every) {
      return [&, lo, hi, inf_every, i = std::int64_t(0)]() mutable {
        const double x = lo + (hi - lo) * uni(rng);
        return (inf_every > 0 && ++i % inf_every == 0) ? -INFINITY : x;
      };
    };
    if (s.gates & recattn::gate_g) {
      g = mirrored(s.gate_type, {s.B, s.T, H});
      if (s.scalar_range) fill(g, ranged(s.scalar_range->first, s.scalar_range->second, s.neg_inf_every));
      else fill(g, logsig(1.0, 4.0));
    }
    if (s.gates & recattn::gate_g_gamma) {
      gg = s.gamma_per_seq ? mirrored(s.gate_type, {N, H}) : mirrored(s.gate_type, {H});
      if (s.scalar_range) fill(gg, ranged(s.scalar_range->first, s.scalar_range->second, 0));
      else fill(gg, logsig(2.0, 5.0));
    }
    if (s.gates & recattn::gate_gk) {
      gk = mirrored(s.gate_type, {s.B, s.T, H, s.K}, s.pad);
      if (s.gk_range) fill(gk, ranged(s.gk_range->first, s.gk_range->second, s.gk_neg_inf_every));
      else fill(gk, logsig(0.5, 5.0));
    }
    if (s.gates & recattn::gate_gv) {
      gv = mirrored(s.gate_type, {s.B, s.T, H, s.V}, s.pad);
      if (s.gv_range) fill(gv, ranged(s.gv_range->first, s.gv_range->second, s.gv_neg_inf_every));
      else fill(gv, logsig(0.5, 5.0));
    }
    const dtype st = s.type == dtype::float64 ? dtype::float64 : dtype::float32;
    const bool kv = s.layout == recattn::state_layout::kv;
    const std::vector<std::int64_t> sshape = kv ? std::vector<std::int64_t>{N, H, s.K, s.V}
                                                : std::vector<std::int64_t>{N, H, s.V, s.K};
    if (s.initial_state) {
      h0 = mirrored(st, sshape);
      fill(h0, [&] { return 0.5 * normal(rng); });
    }
    out = mirrored(s.type, {s.B, s.T, H, s.V});
    out.fill_bytes(0xff);
    if (s.return_state && !s.alias_state) {
      ht = mirrored(st, sshape);
      ht.fill_bytes(0xff);
    }
    if (!s.cu.empty()) {
      cu = mirrored(s.cu_int32 ? dtype::int32 : dtype::int64, {std::int64_t(s.cu.size())});
      for (std::size_t i = 0; i < s.cu.size(); ++i) recattn::store_as(cu.host.data(), cu.type, std::int64_t(i), s.cu[i]);
      cu.upload();
    }
  }

  recattn::forward_options options(bool device) const {
    recattn::forward_options o;
    auto pick = [&](const mirrored& m) { return device ? m.dev_view() : m.host_view(); };
    if (s.gates & recattn::gate_g) o.g = pick(g);
    if (s.gates & recattn::gate_g_gamma) o.g_gamma = pick(gg);
    if (s.gates & recattn::gate_gk) o.gk = pick(gk);
    if (s.gates & recattn::gate_gv) o.gv = pick(gv);
    if (s.initial_state) o.initial_state = pick(h0);
    if (!s.cu.empty()) o.cu_seqlens = (device && s.cu_on_device) ? cu.dev_view() : cu.host_view();
    o.softmax_scale = s.scale;
    o.reverse = s.reverse;
    o.return_state = s.return_state;
    o.state_layout = s.layout;
    o.platform = device ? recattn::platform::cuda : recattn::platform::cpu;
    o.cfg = device ? s.cfg : std::nullopt;
    o.stream = device ? s.stream : nullptr;
    return o;
  }

  /// The CUDA run through the public API, into the poisoned device buffers.
  void run_cuda() {
    recattn::forward_outputs outs{out.dev_mview(), std::nullopt};
    if (s.return_state) outs.final_state = s.alias_state ? h0.dev_mview() : ht.dev_mview();
    recattn::recurrent_attention(q.dev_view(), k.dev_view(), v.dev_view(), options(true), outs);
    cuda_ok(cudaStreamSynchronize(static_cast<cudaStream_t>(s.stream)), "kernel");
  }

  /// Runs CUDA and the double reference and returns the relative errors.
  errors check() {
    // The reference reads the initial state before the aliased CUDA run overwrites it.
    const recattn::forward_result ref =
        recattn::reference_recurrent_attention(q.host_view(), k.host_view(), v.host_view(), options(false));
    run_cuda();
    out.download();
    errors e;
    double num = 0, den = 0;
    for (std::int64_t b = 0; b < s.B; ++b)
      for (std::int64_t t = 0; t < s.T; ++t)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t c = 0; c < s.V; ++c) {
            const double x = out.at(out.offset({b, t, h, c}));
            const double r = ref.output.data<double>()[((b * s.T + t) * H + h) * s.V + c];
            if (!std::isfinite(x)) e.output_written = false;
            num += (x - r) * (x - r);
            den += r * r;
          }
    e.output = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    if (s.return_state) {
      mirrored& st = s.alias_state ? h0 : ht;
      st.download();
      num = den = 0;
      const double* r = ref.final_state->data<double>();
      for (std::int64_t i = 0; i < st.elements(); ++i) {
        const double x = st.at(i);
        if (!std::isfinite(x)) e.output_written = false;
        num += (x - r[i]) * (x - r[i]);
        den += r[i] * r[i];
      }
      e.state = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    }
    return e;
  }
};

}  // namespace recattn_test
