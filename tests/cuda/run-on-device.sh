#!/usr/bin/env bash
# Runs on the GPU machine, from the folder that build-for-device.sh filled:
#   bash run-on-device.sh <out-dir> [tests|sanitize|bench|all]...
# Each test binary runs alone, then under compute-sanitizer memcheck and racecheck (when the
# device allows it); each benchmark with 5 repetitions, medians reported. Logs go to out-dir.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:?out dir}"; shift
modes=("$@"); [ ${#modes[@]} -eq 0 ] && modes=(all)
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
has() { for m in "${modes[@]}"; do [ "$m" = "$1" ] || [ "$m" = all ] && return 0; done; return 1; }
status=0
for t in "$here"/test_*; do
  [ -x "$t" ] || continue
  n="$(basename "$t")"
  if has tests; then
    "$t" > "$out/$n.log" 2>&1; rc=$?; echo "$n: rc=$rc $(tail -2 "$out/$n.log" | tr '\n' ' ')"; [ $rc -eq 0 ] || status=1
  fi
  if has sanitize; then
    for tool in memcheck racecheck; do
      compute-sanitizer --tool "$tool" --error-exitcode 9 "$t" > "$out/$n.$tool.log" 2>&1; rc=$?
      echo "$n $tool: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|not supported' "$out/$n.$tool.log" | head -2 | tr '\n' ' ')"
      [ $rc -eq 0 ] || status=1
    done
  fi
done
if has bench; then
  for b in "$here"/cuda_*; do
    [ -x "$b" ] || continue
    n="$(basename "$b")"
    "$b" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true > "$out/$n.txt" 2>&1
    grep -E "median|ERROR" "$out/$n.txt"
  done
fi
exit $status
