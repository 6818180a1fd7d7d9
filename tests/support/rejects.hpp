// SPEC §5 bad-input tests (tests/test_forward_bad_input.cpp, test_step_bad_input.cpp,
// test_checks.cpp): a test builds a valid call into sentinel-filled buffers, breaks one
// argument, runs the call and checks that it throws a recattn::Error naming the argument, the
// expected and the given value, and that every sentinel buffer keeps its bytes.
//
//   struct call : replacements { ... };        // the valid call, its buffers, run()
//   call c;
//   c.k = c.make(dtype::float64, {3, 2, 4});   // break one argument
//   check_message(error_of([&] { c.run(); }), "key", "dtype float32", "float64");
//   CHECK(c.sentinels_untouched());            // and the call's own outputs
//
// Uses Catch2 (check_message); nothing here calls the dispatcher.
#pragma once

#include <algorithm>
#include <cstdint>
#include <list>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <recattn/recattn.hpp>

#include "generators.hpp"
#include "views.hpp"

namespace recattn::testing {

/// The message of the recattn::Error that `run` throws ("" when it throws none).
template <class Run>
std::string error_of(Run&& run) {
  try {
    run();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

/// SPEC §5: "recattn: <argument>: expected <expected...>, got <got...>". `expected` anywhere
/// after the argument, `got` right after ", got " (either empty: that part unchecked).
inline void check_message(const std::string& message, const std::string& argument, const std::string& expected = {},
                          const std::string& got = {}) {
  using Catch::Matchers::Contains;
  INFO("message: " << message);
  CHECK_THAT(message, Catch::Matchers::StartsWith("recattn: "));
  CHECK_THAT(message, Contains(argument + ": expected "));
  if (!expected.empty()) CHECK_THAT(message, Contains(expected));
  CHECK_THAT(message, Contains(", got " + got));
}

/// What a test puts in place of a valid call's arguments: replacement inputs (`keep`, whose
/// views stay valid while the object lives) and replacement outputs, states and pools
/// (`sentinels`, every byte sentinel_byte), which a rejected call must leave bit for bit.
struct replacements {
  std::list<buffer> keep;
  std::list<buffer> sentinels;

  /// A new input of the given dtype and shape, every element `value`.
  tensor_view make(dtype t, std::vector<std::int64_t> shape, double value = -0.25) {
    keep.push_back(buffer(t, std::move(shape)).fill([=](const idx&) { return value; }));
    return keep.back().view();
  }
  /// A new [n] integer input (cu_seqlens, indices) holding `values`.
  tensor_view indices(const std::vector<std::int64_t>& values, dtype t = dtype::int64) {
    keep.push_back(index_buffer(values, t));
    return keep.back().view();
  }
  /// A new sentinel-filled output of the given dtype and shape.
  mutable_tensor_view sentinel(dtype t, std::vector<std::int64_t> shape) {
    sentinels.push_back(sentinel_buffer(t, std::move(shape)));
    return sentinels.back().mutable_view();
  }
  /// Whether every buffer `sentinel` made still holds the sentinel.
  bool sentinels_untouched() const {
    return std::all_of(sentinels.begin(), sentinels.end(), [](const buffer& b) { return untouched(b); });
  }
};

/// Turns a step call `c` (a `replacements` with step arguments q, k, v, o and out_view) into
/// the multi-token varlen form: q, k, v, g, gk and gv of T tokens in one row [1, T, H, ...],
/// every element -0.25, and a sentinel [1, T, H, V] output; H, K and V are those of the call's
/// query and value (one head count for query, key and value). cu_seqlens, g_gamma and the
/// indices stay the caller's to set.
template <class StepCall>
void to_varlen_step(StepCall& c, std::int64_t T) {
  const dtype t = c.q.type();
  const std::int64_t H = c.q.size(c.q.rank() - 2), K = c.q.size(c.q.rank() - 1), V = c.v.size(c.v.rank() - 1);
  c.q = c.make(t, {1, T, H, K});
  c.k = c.make(t, {1, T, H, K});
  c.v = c.make(t, {1, T, H, V});
  c.o.g = c.make(t, {1, T, H});
  c.o.gk = c.make(t, {1, T, H, K});
  c.o.gv = c.make(t, {1, T, H, V});
  c.out_view = c.sentinel(t, {1, T, H, V});
}

}  // namespace recattn::testing
