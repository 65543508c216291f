#!/usr/bin/env bash
# Session 38's H200 calls (helpers of perf/h200_session.sh / h200_s34.sh); output tarred in $OUT.
#   bash perf/h200_s38.sh decision  # (carry .whl) the greedy decision in one pass against two
#                                   # (perf/bench_decision.py), the NVFP4 + FP8 round at the
#                                   # defaults with a profile, then the four GPU tests session 37
#                                   # left unfinished
# Env: ROUND_TIMEOUT (170 per round), TEST_TIMEOUT.
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_s34.sh" lib

case "${1:-}" in
decision)
  timeout 150 python3 perf/bench_decision.py --out "$OUT/decision.json" > "$OUT/decision.txt" 2>&1
  echo "decision rc=$?"; tail -3 "$OUT/decision.txt"
  env_round round_default
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  T=tests/custom_ops/test_nvfp4_moe.py
  TEST_TIMEOUT=${TEST_TIMEOUT:-240} gpu_tests s37_left -n 4 \
    "$T::test_kernel_matches_reference_gpu[2]" "$T::test_v3_single_code_weights_are_exact_gpu[3]" \
    tests/custom_ops/test_pdl.py::test_graph_generate_equal_with_pdl_on_and_off \
    "$T::test_matches_reference_gpu"
  tar_out s38_decision ;;
*) echo "h200_s38.sh: expected decision; got ${1:-nothing}" >&2; exit 2 ;;
esac
