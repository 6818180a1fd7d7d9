// Test support for the chunked CUDA forward (issue 8): one generated problem run with the
// chunked kernel (forced by cfg.algo) and compared with the double reference and with the
// recurrent CUDA kernel (forced by cfg.algo) on the same inputs; and the rejection of what
// the chunked kernel does not take (an Error before anything is written).
#pragma once

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "cuda_case.hpp"

namespace recattn_test {

inline recattn::cfg algo_cfg(recattn::algorithm a, int chunk = 0, int block_v = 0, int splits = 0) {
  recattn::cfg c;
  c.algo = a;
  c.chunk = chunk;
  c.block_v = block_v;
  c.splits = splits;
  return c;
}

/// ||a - b|| / ||b|| over every element of two host buffers of the same layout.
inline double rel_diff(const mirrored& a, const mirrored& b) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < b.elements(); ++i) {
    const double x = a.at(i), y = b.at(i);
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

struct agreement {
  errors vs_ref;             ///< chunked against the double reference
  double out_vs_rec = 0;     ///< chunked against the recurrent kernel: output
  double state_vs_rec = 0;   ///< and final state
  double rec_vs_ref = 0;     ///< the recurrent kernel against the reference (for the log)
};

/// Runs s (its cfg replaced) with the chunked and with the recurrent kernel.
inline agreement run_both(const spec& s, int chunk, int block_v, int splits) {
  agreement r;
  spec sc = s;
  sc.cfg = algo_cfg(recattn::algorithm::chunked, chunk, block_v, splits);
  instance a(sc);
  r.vs_ref = a.check();  // downloads a's output and state
  spec sr = s;
  sr.cfg = algo_cfg(recattn::algorithm::recurrent);
  instance b(sr);
  const errors eb = b.check();
  r.rec_vs_ref = eb.output;
  r.out_vs_rec = rel_diff(a.out, b.out);
  if (s.return_state) r.state_vs_rec = rel_diff(s.alias_state ? a.h0 : a.ht, s.alias_state ? b.h0 : b.ht);
  return r;
}

/// The chunked result within SPEC §6 of the reference and of the recurrent kernel.
inline void require_agreement(const spec& s, int chunk = 0, int block_v = 0, int splits = 0) {
  INFO(s.str() << " chunk=" << chunk << " block_v=" << block_v << " splits=" << splits);
  const agreement r = run_both(s, chunk, block_v, splits);
  INFO("chunked vs reference: output " << r.vs_ref.output << ", state " << r.vs_ref.state
                                       << "; chunked vs recurrent: output " << r.out_vs_rec << ", state "
                                       << r.state_vs_rec << "; recurrent vs reference: output " << r.rec_vs_ref);
  CHECK(r.vs_ref.output_written);
  CHECK(r.vs_ref.output < tolerance(s.type));
  CHECK(r.out_vs_rec < tolerance(s.type));
  if (s.return_state) {
    CHECK(r.vs_ref.state < tolerance(s.type));
    CHECK(r.state_vs_rec < tolerance(s.type));
  }
}

/// A call that must throw a recattn::Error whose message holds `needle`, with the output and
/// final state left as they were (sentinel bytes).
inline void expect_chunked_rejected(const spec& s, const char* needle) {
  instance in(s);
  in.out.fill_bytes(0x5a);
  if (s.return_state) in.ht.fill_bytes(0x5a);
  const recattn::forward_options o = in.options(true);
  recattn::forward_outputs outs{in.out.dev_mview(), std::nullopt};
  if (s.return_state) outs.final_state = in.ht.dev_mview();
  bool thrown = false;
  try {
    recattn::recurrent_attention(in.q.dev_view(), in.k.dev_view(), in.v.dev_view(), o, outs);
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

}  // namespace recattn_test
