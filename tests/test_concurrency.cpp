// Issue 7, concurrency: recattn keeps no mutable global state, so many threads may call it at
// once. Threads share read-only inputs and write separate outputs; every call must give, bit
// for bit, what the same call gives when nothing else runs. The calls themselves use one or
// several worker threads (cfg.threads), so the library's own parallel_for runs nested inside
// the callers' threads. tests/run-sanitizers.sh also runs this file under ThreadSanitizer.
//
// Operations are entries of a table (name, a call writing fresh buffers): a new operation is
// one more entry. Steps run on a private copy of a shared initial pool (state_indices with a
// padding row, single-token, multi-token and varlen rows); the last test has threads step
// disjoint slots of one shared pool in place, as a continuous-batching server does.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support/forward.hpp"
#include "test_backward_common.hpp"
#include "test_step_common.hpp"

using namespace recattn;
using namespace recattn::testing;

namespace {

/// One call of the library into freshly allocated sentinel buffers; returns those buffers.
struct operation {
  std::string name;
  std::function<std::vector<buffer>()> call;
  std::vector<buffer> expected;  ///< the call's buffers when it ran alone
};

cfg with_threads(int threads) {
  cfg c;
  c.threads = threads;
  return c;
}

/// The shared read-only inputs of every operation (kept alive for the whole test).
struct inputs {
  problem_data dense, varlen;
  incoming dense_grads, varlen_grads;
  buffer pool0;  ///< the initial state pool every step copies
  buffer dense_slots, padded_slots, varlen_slots;  ///< state_indices
};

constexpr std::int64_t pool_slots = 6;

problem_spec concurrency_spec(bool varlen) {
  problem_spec s;
  s.B = 2;
  s.T = 24;
  s.Hq = 2, s.Hk = 1, s.Hv = 2;  // grouped keys: backward sums over shared heads
  s.K = 13, s.V = 10;
  s.gates = 15;
  s.initial_state = true;
  s.g_gamma_per_sequence = true;
  s.seed = varlen ? 71 : 70;
  if (varlen) {
    s.with_seqlens({9, 0, 15, 6});
    s.cu_type = dtype::int32;
  }
  return s;
}

std::vector<operation> operations(const inputs& in) {
  // Every entry captures pointers into `in`, which outlives the operations.
  std::vector<operation> ops;
  for (const problem_data* d : {&in.dense, &in.varlen}) {
    const incoming& grads = d == &in.dense ? in.dense_grads : in.varlen_grads;
    for (bool reverse : {false, true}) {
      for (int threads : {1, 3}) {
        const std::string tag = std::string(d->spec.varlen() ? "varlen" : "dense") + (reverse ? " reverse" : "") +
                                " threads=" + std::to_string(threads);
        ops.push_back({"forward " + tag, [d, reverse, threads] {
                         forward_options o = d->options();
                         o.reverse = reverse;
                         o.return_state = true;
                         o.cfg = with_threads(threads);
                         std::vector<buffer> out{d->make_output(), d->make_state()};
                         recurrent_attention(d->q, d->k, d->v, o, {out[0].mutable_view(), out[1].mutable_view()});
                         return out;
                       }, {}});
        ops.push_back({"backward " + tag, [d, &grads, reverse, threads] {
                         forward_options o = d->options();
                         o.reverse = reverse;
                         o.cfg = with_threads(threads);
                         std::vector<buffer> out;
                         for (const buffer* b : {&d->q, &d->k, &d->v, &d->g, &d->g_gamma, &d->gk, &d->gv, &d->initial_state})
                           out.push_back(sentinel_buffer(b->type(), b->shape()));
                         backward_outputs bo{out[0].mutable_view(), out[1].mutable_view(), out[2].mutable_view(),
                                             out[3].mutable_view(), out[4].mutable_view(), out[5].mutable_view(),
                                             out[6].mutable_view(), out[7].mutable_view()};
                         recurrent_attention_backward(d->q, d->k, d->v, o, grads.view(), bo);
                         return out;
                       }, {}});
        if (reverse) continue;  // a step has no direction
        const buffer& slots = d->spec.varlen() ? in.varlen_slots : threads == 1 ? in.dense_slots : in.padded_slots;
        ops.push_back({"step " + tag, [d, &in, &slots, threads] {
                         // A private copy of the shared pool, stepped in place.
                         std::vector<buffer> out{in.pool0};
                         step_options base;
                         base.state_indices = slots.view();
                         base.cfg = with_threads(threads);
                         const problem_spec& s = d->spec;
                         if (s.varlen()) {
                           // Every sequence at once: q [1, Ttot, Hq, K] with cu_seqlens.
                           step_options o = base;
                           o.g = d->g.view(), o.g_gamma = d->g_gamma.view(), o.gk = d->gk.view(), o.gv = d->gv.view();
                           o.cu_seqlens = d->cu_seqlens.view();
                           out.push_back(d->make_output());
                           step(d->q.view(), d->k.view(), d->v.view(), out[0].mutable_view(), out.back().mutable_view(), o);
                           return out;
                         }
                         // Four single tokens, then a window of five tokens per row.
                         for (std::int64_t t = 0; t < 4; ++t) {
                           const token_args a = token_of(*d, t, base);
                           out.push_back(sentinel_buffer(s.type, {s.B, s.H(), s.V}));
                           step(a.q, a.k, a.v, out[0].mutable_view(), out.back().mutable_view(), a.opt);
                         }
                         const token_args a = window_of(*d, 4, 5, base);
                         out.push_back(sentinel_buffer(s.type, {s.B, 5, s.H(), s.V}));
                         step(a.q, a.k, a.v, out[0].mutable_view(), out.back().mutable_view(), a.opt);
                         return out;
                       }, {}});
      }
    }
  }
  return ops;
}

bool same_buffers(const std::vector<buffer>& a, const std::vector<buffer>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].bytes() != b[i].bytes()) return false;
  return true;
}

constexpr int caller_threads = 8;

}  // namespace

TEST_CASE("concurrent forward and backward calls on shared inputs give the single-threaded results bitwise",
          "[concurrency][threads]") {
  inputs in;
  in.dense = generate(concurrency_spec(false));
  in.varlen = generate(concurrency_spec(true));
  in.dense_grads = make_incoming(in.dense.spec, true, 5);
  in.varlen_grads = make_incoming(in.varlen.spec, true, 6);
  in.pool0 = make_pool(dtype::float32, pool_slots, in.dense.spec);
  rng r(8);
  in.pool0.fill([&](const idx&) { return r.normal(); });
  in.dense_slots = index_buffer({3, 0}, dtype::int32);
  in.padded_slots = index_buffer({-1, 4});
  in.varlen_slots = index_buffer({2, -1, 0, 5});
  std::vector<operation> ops = operations(in);
  for (operation& op : ops) op.expected = op.call();
  // The reference agrees with the results the threads are held to (so they are not garbage).
  {
    forward_options o = in.dense.options();
    o.return_state = true;
    const forward_result ref = run_reference(in.dense, o);
    CHECK(rel_error(ops[0].expected[0], ref.output) < 1e-4);
    CHECK(rel_error(ops[0].expected[1], *ref.final_state) < 1e-4);
    const backward_result gref = run_reference_backward(in.dense, in.dense.options(), in.dense_grads);
    CHECK(rel_error(ops[1].expected[0], gref.dq) < 1e-4);
    CHECK(rel_error(ops[1].expected[5], *gref.dgk) < 1e-4);
    // The varlen step: sequence n starts from pool0's slot varlen_slots[n] and ends there;
    // sequence 1 (no tokens) is the padding row; the other slots keep pool0's values.
    const auto vstep = std::find_if(ops.begin(), ops.end(), [](const operation& op) { return op.name == "step varlen threads=3"; });
    REQUIRE(vstep != ops.end());
    const std::int64_t slot_of[] = {2, -1, 0, 5};
    buffer h0 = buffer(dtype::float32, in.varlen.spec.state_shape()).fill([](const idx&) { return 0.0; });
    for (std::int64_t n : {0, 2, 3}) put_state(h0, n, in.pool0.view(), slot_of[n]);
    forward_options vo = in.varlen.options();
    vo.initial_state = h0.view();
    vo.return_state = true;
    const forward_result vref = reference_recurrent_attention(in.varlen.q, in.varlen.k, in.varlen.v, vo);
    CHECK(rel_error(vstep->expected[1], vref.output) < 1e-4);
    for (std::int64_t n : {0, 2, 3})
      CHECK(rel_error(slot_view(vstep->expected[0], slot_of[n]), drop_dim(vref.final_state->view(), 0, n)) < 1e-4);
    for (std::int64_t untouched_slot : {1, 3, 4})
      CHECK(bitwise_equal(slot_view(vstep->expected[0], untouched_slot), slot_view(in.pool0, untouched_slot)));
  }

  const int rounds = 3;
  std::vector<std::vector<std::string>> mismatches(caller_threads);
  std::vector<int> calls(caller_threads, 0);
  std::atomic<int> ready{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < caller_threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < caller_threads) std::this_thread::yield();  // start together
      for (int r = 0; r < rounds; ++r)
        for (std::size_t i = 0; i < ops.size(); ++i) {
          const operation& op = ops[(i + std::size_t(t)) % ops.size()];  // threads out of step
          try {
            if (!same_buffers(op.call(), op.expected)) mismatches[std::size_t(t)].push_back(op.name);
          } catch (const std::exception& e) {
            mismatches[std::size_t(t)].push_back(op.name + ": threw " + e.what());
          }
          ++calls[std::size_t(t)];
        }
    });
  }
  for (std::thread& th : pool) th.join();
  int total = 0;
  for (int t = 0; t < caller_threads; ++t) {
    total += calls[std::size_t(t)];
    for (const std::string& m : mismatches[std::size_t(t)]) FAIL_CHECK("thread " << t << ": " << m);
  }
  CHECK(total == caller_threads * rounds * int(ops.size()));
}

TEST_CASE("threads updating disjoint slots of one shared state pool in place do not disturb each other",
          "[concurrency][threads]") {
  // One pool of [slots, H, K, V] states; thread t owns slots t, t + caller_threads, ... and
  // runs the forward on each of them in place (final_state aliasing initial_state), twice.
  problem_spec s = concurrency_spec(false);
  s.B = 1;
  s.initial_state = false;
  const problem_data d = generate(s);
  const std::int64_t slots = 2 * caller_threads, H = s.H(), K = s.K, V = s.V;
  buffer pool = buffer(dtype::float32, {slots, H, K, V});
  rng r(9);
  pool.fill([&](const idx&) { return r.normal(); });
  const std::vector<unsigned char> start = pool.bytes();
  const std::int64_t slot_elems = H * K * V;
  auto update = [&](buffer& p, std::int64_t slot, std::vector<buffer>* outs) {
    float* st = static_cast<float*>(p.data()) + slot * slot_elems;
    forward_options o = d.options();
    o.initial_state = tensor_view(st, dtype::float32, {1, H, K, V});
    o.return_state = true;
    o.cfg = with_threads(1 + int(slot % 2));
    buffer out = d.make_output();
    recurrent_attention(d.q, d.k, d.v, o, {out.mutable_view(), mutable_tensor_view(st, dtype::float32, {1, H, K, V})});
    outs->push_back(std::move(out));
  };
  // Alone: every slot updated twice, in order.
  buffer alone = pool;
  std::vector<std::vector<buffer>> alone_out(static_cast<std::size_t>(slots));
  for (int rep = 0; rep < 2; ++rep)
    for (std::int64_t slot = 0; slot < slots; ++slot) update(alone, slot, &alone_out[std::size_t(slot)]);
  REQUIRE(alone.bytes() != start);

  std::vector<std::vector<buffer>> outs(static_cast<std::size_t>(slots));
  std::vector<std::string> errors(caller_threads);
  std::vector<std::thread> threads;
  for (int t = 0; t < caller_threads; ++t)
    threads.emplace_back([&, t] {
      try {
        for (int rep = 0; rep < 2; ++rep)
          for (std::int64_t slot = t; slot < slots; slot += caller_threads) update(pool, slot, &outs[std::size_t(slot)]);
      } catch (const std::exception& e) {
        errors[std::size_t(t)] = e.what();
      }
    });
  for (std::thread& th : threads) th.join();
  for (const std::string& e : errors) CHECK(e.empty());
  CHECK(pool.bytes() == alone.bytes());
  for (std::int64_t slot = 0; slot < slots; ++slot) {
    REQUIRE(outs[std::size_t(slot)].size() == 2);
    for (int rep = 0; rep < 2; ++rep)
      CHECK(outs[std::size_t(slot)][std::size_t(rep)].bytes() == alone_out[std::size_t(slot)][std::size_t(rep)].bytes());
  }
}

TEST_CASE("threads stepping disjoint slots of one shared state pool in place give the single-threaded results",
          "[concurrency][threads][step]") {
  // One pool; thread t owns slots t and t + caller_threads (its two batch rows, given as
  // state_indices in reverse order) and steps them token by token: six single tokens, then a
  // window of four, with 1 or 2 worker threads of its own.
  const problem_data d = generate(concurrency_spec(false));
  const problem_spec& s = d.spec;
  const std::int64_t slots = 2 * caller_threads;
  buffer pool = make_pool(dtype::float32, slots, s);
  rng r(10);
  pool.fill([&](const idx&) { return r.normal(); });
  std::vector<buffer> index_of;
  for (int t = 0; t < caller_threads; ++t) index_of.push_back(index_buffer({t + caller_threads, t}, dtype::int32));
  auto run = [&](buffer& p, int t, std::vector<buffer>* outs) {
    step_options base;
    base.state_indices = index_of[std::size_t(t)].view();
    base.cfg = with_threads(1 + t % 2);
    for (std::int64_t tok = 0; tok < 6; ++tok) {
      const token_args a = token_of(d, tok, base);
      outs->push_back(sentinel_buffer(s.type, {s.B, s.H(), s.V}));
      step(a.q, a.k, a.v, p.mutable_view(), outs->back().mutable_view(), a.opt);
    }
    const token_args a = window_of(d, 6, 4, base);
    outs->push_back(sentinel_buffer(s.type, {s.B, 4, s.H(), s.V}));
    step(a.q, a.k, a.v, p.mutable_view(), outs->back().mutable_view(), a.opt);
  };
  buffer alone = pool;
  std::vector<std::vector<buffer>> alone_out(caller_threads);
  for (int t = 0; t < caller_threads; ++t) run(alone, t, &alone_out[std::size_t(t)]);
  REQUIRE(alone.bytes() != pool.bytes());

  std::vector<std::vector<buffer>> outs(caller_threads);
  std::vector<std::string> errors(caller_threads);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < caller_threads; ++t)
    threads.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < caller_threads) std::this_thread::yield();
      try {
        run(pool, t, &outs[std::size_t(t)]);
      } catch (const std::exception& e) {
        errors[std::size_t(t)] = e.what();
      }
    });
  for (std::thread& th : threads) th.join();
  for (const std::string& e : errors) CHECK(e.empty());
  CHECK(pool.bytes() == alone.bytes());
  for (int t = 0; t < caller_threads; ++t) {
    REQUIRE(outs[std::size_t(t)].size() == alone_out[std::size_t(t)].size());
    for (std::size_t i = 0; i < outs[std::size_t(t)].size(); ++i)
      CHECK(outs[std::size_t(t)][i].bytes() == alone_out[std::size_t(t)][i].bytes());
  }
}
