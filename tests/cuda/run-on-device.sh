#!/usr/bin/env bash
# Runs on the GPU machine, from the folder that build-for-device.sh filled:
#   bash run-on-device.sh <out-dir> [tests|sanitize|bench|all]...
# Each test binary runs alone, then under each compute-sanitizer tool of SAN_TOOLS (default
# memcheck racecheck initcheck synccheck; skipped where the device refuses it, which the log
# says); each benchmark with 5 repetitions, medians reported. Logs go to out-dir.
# Test cases tagged [api-error] (a CUDA call refused on purpose) run under each tool on their
# own, with --report-api-errors no; the rest with the tool's defaults.
# Environment: SAN_TOOLS, SAN_TIMEOUT (seconds per tool and binary, default 600), SAN_EXCLUDE
# (a Catch2 tag such as [long] left out of the sanitizer runs, for time),
# TESTS (test binaries, default every test_*), BENCHES (default every cuda_*), BENCH_ARGS.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:?out dir}"; shift
modes=("$@"); [ ${#modes[@]} -eq 0 ] && modes=(all)
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
has() { for m in "${modes[@]}"; do [ "$m" = "$1" ] || [ "$m" = all ] && return 0; done; return 1; }
tests="${TESTS:-$(cd "$here" && ls test_* 2>/dev/null)}"
benches="${BENCHES:-$(cd "$here" && ls cuda_* 2>/dev/null)}"
status=0
# The lines of a sanitizer log worth a summary line.
san_summary() { grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|not supported|test cases' "$1" | head -3 | tr '\n' ' '; }
for n in $tests; do
  t="$here/$n"
  [ -x "$t" ] || continue
  if has tests; then
    s=$SECONDS
    "$t" > "$out/$n.log" 2>&1; rc=$?
    echo "$n: rc=$rc $((SECONDS - s))s $(tail -2 "$out/$n.log" | tr '\n' ' ')"; [ $rc -eq 0 ] || status=1
  fi
  if has sanitize; then
    for tool in ${SAN_TOOLS:-memcheck racecheck initcheck synccheck}; do
      s=$SECONDS
      extra=()
      [ "$tool" = memcheck ] && extra=(--leak-check full)
      timeout "${SAN_TIMEOUT:-600}" compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 9 "$t" \
        "~[api-error]${SAN_EXCLUDE:+~$SAN_EXCLUDE}" > "$out/$n.$tool.log" 2>&1; rc=$?
      echo "$n $tool: rc=$rc $((SECONDS - s))s $(san_summary "$out/$n.$tool.log")"
      [ $rc -eq 0 ] || status=1
      # Cases tagged [api-error] make a CUDA call fail on purpose (a refused launch) and check
      # that it becomes a recattn::Error: the tool runs them with API errors unreported.
      if [ -n "$("$t" --list-test-names-only "[api-error]" 2>/dev/null | grep -v '^$')" ]; then
        s=$SECONDS
        timeout "${SAN_TIMEOUT:-600}" compute-sanitizer --tool "$tool" "${extra[@]}" --report-api-errors no \
          --error-exitcode 9 "$t" "[api-error]" > "$out/$n.$tool.api-error.log" 2>&1; rc=$?
        echo "$n [api-error] $tool: rc=$rc $((SECONDS - s))s $(san_summary "$out/$n.$tool.api-error.log")"
        [ $rc -eq 0 ] || status=1
      fi
    done
  fi
done
if has bench; then
  for n in $benches; do
    b="$here/$n"
    [ -x "$b" ] || continue
    # shellcheck disable=SC2086
    "$b" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true ${BENCH_ARGS:-} > "$out/$n.txt" 2>&1
    grep -E "median|ERROR" "$out/$n.txt"
  done
fi
exit $status
