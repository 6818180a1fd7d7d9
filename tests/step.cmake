# Decode-step tests (issue 6), included by tests/CMakeLists.txt. Each executable is one
# translation unit cut to the variants it runs (see the note at the top of CMakeLists.txt):
# the forward variants its prefills need, and the step variants of its dtypes.

# Prefill with forward, then step token after token = forward (bit for bit) and the double
# reference: float and double, every gate combination, grouped heads, [K, V] and [V, K].
recattn_add_test(test_step_forward
  SOURCES test_step_forward.cpp
  DEFINES RECATTN_DISABLE_BFLOAT16=1 RECATTN_DISABLE_FLOAT16=1 RECATTN_DISABLE_REVERSE=1 RECATTN_DISABLE_VARLEN=1
  LABELS cpu step)
# bfloat16 and half inputs; bfloat16 state storage (4096 steps against float storage).
recattn_add_test(test_step_low_precision
  SOURCES test_step_low_precision.cpp
  DEFINES RECATTN_DISABLE_FLOAT64=1 RECATTN_DISABLE_REVERSE=1 RECATTN_DISABLE_VARLEN=1
  LABELS cpu step)
# Multi-token steps and snapshots, pool indirection and padding rows, varlen rows, no
# allocation per call: float inputs; no forward prefill (its variants cut to one).
recattn_add_test(test_step_pool
  SOURCES test_step_pool.cpp
  DEFINES ${recattn_float_only} RECATTN_DISABLE_REVERSE=1
  LABELS cpu step)
# SPEC §5: every rejected argument of a step (float, [K, V] and [V, K] pools).
recattn_add_test(test_step_bad_input
  SOURCES test_step_bad_input.cpp
  DEFINES ${recattn_float_only} RECATTN_DISABLE_REVERSE=1
  LABELS cpu step)
