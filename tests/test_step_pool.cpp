// The state pool: multi-token steps and snapshots, pool indirection with shuffled slots and
// padding rows, varlen rows, and no allocation per call.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>
#include <random>

#include "test_step_common.hpp"

using namespace recattn;
using namespace recattn::testing;

// The replacement below pairs malloc with free; GCC's mismatch warning does not see that.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

// Counts operator new calls while `counting` is on (the no-allocation test).
namespace {
std::atomic<long> allocations{0};
std::atomic<bool> counting{false};
}  // namespace
// Every form that the replaced operator delete may free is replaced too: a runtime with its
// own nothrow or array forms (AddressSanitizer's, unlike libstdc++'s, do not call operator
// new) would otherwise pair its allocation with this free (Catch allocates with nothrow new).
void* operator new(std::size_t n) {
  if (counting) ++allocations;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  if (counting) ++allocations;
  return std::malloc(n ? n : 1);
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace {

/// A pool of P slots, every byte the sentinel, with state b of `states` in slot slots[b].
buffer pool_with(dtype t, std::int64_t P, const problem_spec& s, const tensor_view& states,
                 const std::vector<std::int64_t>& slots) {
  buffer pool = make_pool(t, P, s);
  pool.fill_bytes(sentinel_byte);
  for (std::size_t b = 0; b < slots.size(); ++b)
    if (slots[b] >= 0) put_state(pool, slots[b], states, std::int64_t(b));
  return pool;
}

bool slot_untouched(const buffer& pool, std::int64_t slot) { return untouched(buffer::copy_of(slot_view(pool, slot))); }

problem_spec pool_spec(unsigned gates, state_layout layout, std::int64_t K, std::int64_t V, std::int64_t T) {
  problem_spec s;
  s.B = 4;
  s.T = T;
  s.Hq = 2, s.Hk = 1, s.Hv = 2, s.K = K, s.V = V;
  s.gates = gates;
  s.initial_state = true;
  s.layout = layout;
  s.seed = 50 + gates;
  return s;
}

}  // namespace

TEST_CASE("a multi-token step equals that many single steps; each snapshot is the state after its token",
          "[step][pool]") {
  const std::int64_t T = 5;
  for (unsigned gates = 0; gates < 16; ++gates)
    for (state_layout layout : {state_layout::kv, state_layout::vk})
      for (auto kv : {std::pair<std::int64_t, std::int64_t>{16, 32}, {5, 7}})
        for (dtype storage : {dtype::float32, dtype::bfloat16}) {
          problem_spec s = pool_spec(gates, layout, kv.first, kv.second, T);
          s.g_gamma_per_sequence = gates & 1u;
          INFO(s.str() << " storage=" << dtype_name(storage));
          const problem_data d = generate(s);
          const std::vector<std::int64_t> slots{5, 0, 3, 2};
          const buffer ix = index_buffer(slots);
          buffer multi_pool = pool_with(storage, 6, s, d.initial_state.view(), slots);
          buffer single_pool = multi_pool;
          // Snapshot slots: token t of row b -> a shuffled slot, some tokens not kept.
          const std::int64_t Ps = s.B * T + 2;
          std::vector<std::int64_t> perm(static_cast<std::size_t>(Ps));
          std::iota(perm.begin(), perm.end(), 0);
          std::shuffle(perm.begin(), perm.end(), std::mt19937(gates));
          buffer snap_ix(dtype::int32, {s.B, T});
          snap_ix.fill([&](const idx& i) { return (i[0] + i[1]) % 3 == 2 ? -1.0 : double(perm[std::size_t(i[0] * T + i[1])]); });
          buffer snaps = make_pool(storage, Ps, s);
          snaps.fill_bytes(sentinel_byte);

          step_options mo;
          mo.state_indices = ix.view();
          mo.snapshots = snaps.mutable_view();
          mo.snapshot_indices = snap_ix.view();
          const token_args m = window_of(d, 0, T, mo);
          buffer multi_out = d.make_output();
          step(m.q, m.k, m.v, multi_pool.mutable_view(), multi_out.mutable_view(), m.opt);

          step_options so;
          so.state_indices = ix.view();
          buffer single_out = d.make_output();
          bool snapshots_equal = true, kept_untouched = true;
          for (std::int64_t t = 0; t < T; ++t) {
            const token_args a = token_of(d, t, so);
            mutable_tensor_view o = drop_dim(single_out.mutable_view(), 1, t);
            step(a.q, a.k, a.v, single_pool.mutable_view(), o, a.opt);
            for (std::int64_t b = 0; b < s.B; ++b) {
              const std::int64_t sl = std::int64_t(snap_ix.get({b, t}));
              if (sl < 0) continue;
              if (storage == dtype::float32)
                snapshots_equal = snapshots_equal && bitwise_equal(slot_view(snaps, sl), slot_view(single_pool, slots[std::size_t(b)]));
              else
                snapshots_equal = snapshots_equal && rel_error(slot_view(snaps, sl), slot_view(single_pool, slots[std::size_t(b)])) < 1e-2;
            }
          }
          for (std::int64_t sl = 0; sl < Ps; ++sl) {
            bool used = false;
            for_each_index({s.B, T}, [&](const idx& i) { used = used || std::int64_t(snap_ix.get(i)) == sl; });
            if (!used) kept_untouched = kept_untouched && slot_untouched(snaps, sl);
          }
          CHECK(snapshots_equal);
          CHECK(kept_untouched);
          CHECK(slot_untouched(multi_pool, 1));
          CHECK(slot_untouched(multi_pool, 4));
          if (storage == dtype::float32) {
            // One rounding per call with bfloat16 storage: several single steps round more often.
            CHECK(bitwise_equal(multi_out.view(), single_out.view()));
            CHECK(bitwise_equal(multi_pool.view(), single_pool.view()));
          } else {
            CHECK(rel_error(multi_out.view(), single_out.view()) < 1e-2);
            CHECK(rel_error(multi_pool.view(), single_pool.view()) < 1e-2);
          }
        }
}

TEST_CASE("bfloat16 storage: one token streamed in place equals the scratch-tile path bit for bit", "[step][pool]") {
  // [K, V] with V a multiple of the SIMD width takes the in-place stream (step_stream_storage);
  // the transposed [V, K] pool takes the scratch tile: the same operations on the same values,
  // one rounding on the store, so the same bits. Snapshots of the token too.
  for (unsigned gates = 0; gates < 16; ++gates) {
    problem_spec s = pool_spec(gates, state_layout::kv, 16, 32, 1);
    s.g_gamma_per_sequence = gates & 1u;
    INFO(s.str());
    const problem_data d = generate(s);
    const std::vector<std::int64_t> slots{2, -1, 0, 4};
    const buffer ix = index_buffer(slots);
    buffer kv_pool = pool_with(dtype::bfloat16, 5, s, d.initial_state.view(), slots);
    buffer vk_pool = transpose_last2(kv_pool.view());
    buffer kv_snaps = make_pool(dtype::bfloat16, 4, s), kv_out = sentinel_buffer(s.type, {s.B, s.H(), s.V});
    kv_snaps.fill_bytes(sentinel_byte);
    buffer vk_snaps = transpose_last2(kv_snaps.view()), vk_out = kv_out;
    const buffer snap_ix = index_buffer({1, 0, -1, 3});
    step_options base;
    base.state_indices = ix.view();
    base.snapshot_indices = snap_ix.view();
    token_args a = token_of(d, 0, base);
    a.opt.snapshots = kv_snaps.mutable_view();
    step(a.q, a.k, a.v, kv_pool.mutable_view(), kv_out.mutable_view(), a.opt);
    a.opt.state_layout = state_layout::vk;
    a.opt.snapshots = vk_snaps.mutable_view();
    step(a.q, a.k, a.v, vk_pool.mutable_view(), vk_out.mutable_view(), a.opt);
    CHECK(bitwise_equal(kv_out.view(), vk_out.view()));
    CHECK(bitwise_equal(kv_pool.view(), transpose_last2(vk_pool.view()).view()));
    CHECK(bitwise_equal(kv_snaps.view(), transpose_last2(vk_snaps.view()).view()));
    CHECK(!bitwise_equal(kv_pool.view(), pool_with(dtype::bfloat16, 5, s, d.initial_state.view(), slots).view()));
  }
}

TEST_CASE("pool indirection with shuffled slots and padding rows equals the dense case", "[step][pool]") {
  for (unsigned gates : {0u, 3u, 12u, 15u})
    for (state_layout layout : {state_layout::kv, state_layout::vk})
      for (std::int64_t T : {1, 3})
        for (dtype index_type : {dtype::int32, dtype::int64}) {
          problem_spec s = pool_spec(gates, layout, 8, 16, T);
          s.B = 5;
          INFO(s.str() << " T=" << T << " indices=" << dtype_name(index_type));
          const problem_data d = generate(s);
          // Dense: row b in slot b, no indices.
          std::vector<std::int64_t> dense_slots{0, 1, 2, 3, 4};
          buffer dense_pool = pool_with(dtype::float32, s.B, s, d.initial_state.view(), dense_slots);
          buffer dense_out = d.make_output();
          const token_args a = T == 1 ? token_of(d, 0) : window_of(d, 0, T);
          mutable_tensor_view dense_o = T == 1 ? drop_dim(dense_out.mutable_view(), 1, 0) : dense_out.mutable_view();
          step(a.q, a.k, a.v, dense_pool.mutable_view(), dense_o, a.opt);

          // Pooled: rows 1 and 3 are padding, the others in shuffled slots of a larger pool.
          const std::vector<std::int64_t> slots{7, -1, 2, -5, 4};
          const buffer ix = index_buffer(slots, index_type);
          buffer pool = pool_with(dtype::float32, 9, s, d.initial_state.view(), slots);
          const buffer before = pool;
          buffer out = d.make_output();
          token_args p = a;
          p.opt.state_indices = ix.view();
          mutable_tensor_view o = T == 1 ? drop_dim(out.mutable_view(), 1, 0) : out.mutable_view();
          step(p.q, p.k, p.v, pool.mutable_view(), o, p.opt);

          for (std::int64_t b = 0; b < s.B; ++b) {
            const tensor_view row = drop_dim(out.view(), 0, b);
            if (slots[std::size_t(b)] < 0) {
              CHECK(untouched(buffer::copy_of(row)));
            } else {
              CHECK(bitwise_equal(row, drop_dim(dense_out.view(), 0, b)));
              CHECK(bitwise_equal(slot_view(pool, slots[std::size_t(b)]), slot_view(dense_pool, b)));
            }
          }
          for (std::int64_t sl : {0, 1, 3, 5, 6, 8}) CHECK(bitwise_equal(slot_view(pool, sl), slot_view(before, sl)));
        }
}

TEST_CASE("varlen rows equal each row stepped on its own", "[step][pool]") {
  for (unsigned gates : {0u, 5u, 10u, 15u})
    for (state_layout layout : {state_layout::kv, state_layout::vk}) {
      problem_spec s = pool_spec(gates, layout, 8, 16, 0);
      s.with_seqlens({3, 0, 1, 4});
      s.g_gamma_per_sequence = true;
      INFO(s.str());
      const problem_data d = generate(s);
      const std::vector<std::int64_t> slots{2, 0, -1, 3};
      const buffer ix = index_buffer(slots);
      buffer pool = pool_with(dtype::float32, 4, s, d.initial_state.view(), slots);
      buffer snaps = make_pool(dtype::float32, 8, s);
      snaps.fill_bytes(sentinel_byte);
      buffer snap_ix(dtype::int64, {1, s.T});
      snap_ix.fill([&](const idx& i) { return double(s.T - 1 - i[1]); });  // every token kept
      buffer out = d.make_output();
      token_args a = window_of(d, 0, s.T);
      a.opt.cu_seqlens = d.cu_seqlens.view();
      a.opt.state_indices = ix.view();
      a.opt.snapshots = snaps.mutable_view();
      a.opt.snapshot_indices = snap_ix.view();
      if (d.g_gamma.present()) a.opt.g_gamma = d.g_gamma.view();
      step(a.q, a.k, a.v, pool.mutable_view(), out.mutable_view(), a.opt);

      const std::vector<std::int64_t> cu = s.cu_seqlens();
      for (std::int64_t n = 0; n < s.N(); ++n) {
        const std::int64_t t0 = cu[std::size_t(n)], L = cu[std::size_t(n) + 1] - t0;
        if (slots[std::size_t(n)] < 0) {
          for (std::int64_t t = t0; t < t0 + L; ++t) {
            CHECK(untouched(buffer::copy_of(drop_dim(out.view(), 1, t))));
            CHECK(slot_untouched(snaps, s.T - 1 - t));
          }
          continue;
        }
        // Row n alone: a dense B = 1 problem of its tokens.
        problem_spec one = s;
        one.seqlens.clear();
        one.B = 1;
        one.T = L;
        buffer alone_pool = pool_with(dtype::float32, 1, one, d.initial_state.view(), {});
        put_state(alone_pool, 0, d.initial_state.view(), n);
        for (std::int64_t t = t0; t < t0 + L; ++t) {
          token_args b;
          b.q = window(drop_dim(d.q.view(), 1, t), 0, 0, 1);
          b.k = window(drop_dim(d.k.view(), 1, t), 0, 0, 1);
          b.v = window(drop_dim(d.v.view(), 1, t), 0, 0, 1);
          b.opt.state_layout = layout;
          if (d.g.present()) b.opt.g = window(drop_dim(d.g.view(), 1, t), 0, 0, 1);
          if (d.gk.present()) b.opt.gk = window(drop_dim(d.gk.view(), 1, t), 0, 0, 1);
          if (d.gv.present()) b.opt.gv = window(drop_dim(d.gv.view(), 1, t), 0, 0, 1);
          if (d.g_gamma.present()) b.opt.g_gamma = window(d.g_gamma.view(), 0, n, 1);
          buffer o1 = sentinel_buffer(s.type, {1, s.H(), s.V});
          step(b.q, b.k, b.v, alone_pool.mutable_view(), o1.mutable_view(), b.opt);
          CHECK(bitwise_equal(o1.view(), window(drop_dim(out.view(), 1, t), 0, 0, 1)));
          CHECK(bitwise_equal(slot_view(snaps, s.T - 1 - t), slot_view(alone_pool, 0)));
        }
        CHECK(bitwise_equal(slot_view(pool, slots[std::size_t(n)]), slot_view(alone_pool, 0)));
      }
      CHECK(slot_untouched(pool, 1));
    }
}

TEST_CASE("a step allocates nothing after the first call (operator new counted)", "[step][pool]") {
  problem_spec s = pool_spec(15, state_layout::kv, 16, 32, 3);
  s.B = 4;
  const problem_data d = generate(s);
  const std::vector<std::int64_t> slots{3, -1, 0, 1};
  const buffer ix = index_buffer(slots);
  buffer pool = pool_with(dtype::float32, 5, s, d.initial_state.view(), slots);
  buffer snaps = make_pool(dtype::float32, 12, s);
  buffer snap_ix(dtype::int64, {s.B, s.T});
  snap_ix.fill([&](const idx& i) { return double(i[0] * s.T + i[1]); });
  buffer out = d.make_output(), out1 = sentinel_buffer(s.type, {s.B, s.H(), s.V});
  step_options o;
  o.state_indices = ix.view();
  o.snapshots = snaps.mutable_view();
  o.snapshot_indices = snap_ix.view();
  cfg c;
  c.threads = 2;
  o.cfg = c;
  const token_args multi = window_of(d, 0, s.T, o);
  step_options o1;
  o1.state_indices = ix.view();
  o1.cfg = c;
  const token_args single = token_of(d, 0, o1);
  auto run = [&] {
    step(multi.q, multi.k, multi.v, pool.mutable_view(), out.mutable_view(), multi.opt);
    step(single.q, single.k, single.v, pool.mutable_view(), out1.mutable_view(), single.opt);
  };
  run();  // warm-up: thread-local scratch, the thread pool
  allocations = 0;
  counting = true;
  for (int i = 0; i < 20; ++i) run();
  counting = false;
  CHECK(allocations.load() == 0);
}
