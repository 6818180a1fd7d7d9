# Backward-pass tests (issue 4), included by tests/CMakeLists.txt. Each executable is one
# translation unit cut to the variants it runs (see the note at the top of CMakeLists.txt).

# Every gradient against the double reference: all gate combinations, reverse, varlen.
recattn_add_test(test_backward_reference
  SOURCES test_backward_reference.cpp
  DEFINES ${recattn_float_only} RECATTN_DISABLE_VK_STATE=1
  LABELS cpu backward)
# Central finite differences in double for every input; double against the reference.
recattn_add_test(test_backward_finite_differences
  SOURCES test_backward_finite_differences.cpp
  DEFINES RECATTN_DISABLE_BFLOAT16=1 RECATTN_DISABLE_FLOAT16=1 RECATTN_DISABLE_VARLEN=1 RECATTN_DISABLE_VK_STATE=1
  LABELS cpu backward)
# Split, reverse, varlen, grouped heads, [V, K] state, g_gamma sums, buffers, bad input:
# every gate present, so each property covers every gradient.
recattn_add_test(test_backward_invariants
  SOURCES test_backward_invariants.cpp
  DEFINES ${recattn_float_only} RECATTN_GATE_MASK_ONLY=15
  LABELS cpu backward)
# bfloat16 and half inputs, gates in float32 or the input dtype.
recattn_add_test(test_backward_low_precision
  SOURCES test_backward_low_precision.cpp
  DEFINES RECATTN_DISABLE_FLOAT64=1 RECATTN_DISABLE_VARLEN=1 RECATTN_DISABLE_VK_STATE=1 RECATTN_DISABLE_REVERSE=1
  LABELS cpu backward)
# Strong, mixed, moderate, growing and zero decays (the rescaled sweeps' segment bounds).
recattn_add_test(test_backward_decay
  SOURCES test_backward_decay.cpp
  DEFINES ${recattn_float_only} RECATTN_DISABLE_VARLEN=1 RECATTN_DISABLE_VK_STATE=1
  LABELS cpu backward)
