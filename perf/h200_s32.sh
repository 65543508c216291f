#!/usr/bin/env bash
# Session 32's H200 calls (helpers of perf/h200_session.sh); output tarred in $OUT.
#   bash perf/h200_s32.sh check   # the GPU tests of moe_align (fixed: the op, not its body,
#                                 # under torch.compile) and of the align users; v6's GPU fuzz
#                                 # with -s (each example prints a line), which session 32's
#                                 # call 2 cut off unfinished. (Its -k "... and 6" also picks
#                                 # [5] and [7]: every name holds "v6". Call 3 ran [5] (200
#                                 # examples, passed), then 17 of [6]. Call 5 ran [6] alone, by
#                                 # its node id, h200_session.sh's `gpu_tests` sourced by hand;
#                                 # `check` now selects it so.)
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib

check() {
  TEST_TIMEOUT=200 gpu_tests align tests/custom_ops/test_moe_align.py \
    tests/custom_ops/test_moe_route_last_align.py tests/custom_ops/test_moe_route_align.py
  TEST_TIMEOUT=${FUZZ_TIMEOUT:-330} gpu_tests fuzz_v6 -s \
    "tests/custom_ops/test_nvfp4_moe_v5.py::test_v5_v6_equal_v3_gpu[6]"
  echo "v6 examples: $(grep -c '^v6 == v3' "$OUT/gpu_tests_fuzz_v6.txt")"
}

case "${1:-}" in
check) check; tar_out s32_check ;;
*) echo "usage: $0 check" >&2; exit 2 ;;
esac
