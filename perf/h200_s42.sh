#!/usr/bin/env bash
# Session 42's H200 calls (helpers of perf/h200_session.sh); output tarred in $OUT.
#   bash perf/h200_s42.sh first   # the GPU tests of test_nvfp4_shared_items.py, then the op
#                                 # with the shared expert (`--shared-expert`) in PASSES (2)
#                                 # process pairs alternating DLMC_NVFP4_SHARED_ITEMS=A / B
#                                 # (MODES, "1 0"), then the NVFP4 + FP8 round both ways
#                                 # (calls 1-4 ran it at 1e9fe0f-ce8083c, when the switch was
#                                 # DLMC_NVFP4_SHARED_LAUNCH=own|items|gate_up and the test
#                                 # file test_nvfp4_shared_launch.py)
#   bash perf/h200_s42.sh ab      # the op and the round as in `first`, without the tests
#   bash perf/h200_s42.sh final   # at the new default (DLMC_NVFP4_SHARED_ITEMS=1): the GPU
#                                 # tests of the shared items and the Gluon kernels, the op
#                                 # with the shared expert at 1 / 0, rounds at 1 / 0 / 1
#   bash perf/h200_s42.sh tests   # the GPU tests of the files that run the op's Gluon path
# Env: TEST_TIMEOUT, PASSES, ROUNDS (1: round pairs).
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib
source <(sed -n '/^op_rows()/,/^}/p' "$HERE/h200_s27.sh")
source <(sed -n '/^env_round()/,/^}/p' "$HERE/h200_s34.sh")

ab() {
  for pass in $(seq 1 "${PASSES:-2}"); do
    read -r first second <<< "${MODES:-1 0}"
    [ $((pass % 2)) = 0 ] && read -r second first <<< "${MODES:-1 0}"
    for v in $first $second; do
      op_env "op_shared_${v}_$pass" "DLMC_NVFP4_SHARED_ITEMS=$v" --shared-expert \
        $([ "$pass" = 1 ] && echo --profile)
    done
  done
  for pass in $(seq 1 "${ROUNDS:-1}"); do
    for v in ${MODES:-1 0}; do
      env_round "round_${v}_$pass" "DLMC_NVFP4_SHARED_ITEMS=$v"
    done
  done
}

case "${1:-}" in
first)
  TEST_TIMEOUT=${TEST_TIMEOUT:-200} gpu_tests shared -n 4 tests/custom_ops/test_nvfp4_shared_items.py
  ab ;;
ab)
  ab ;;
final)
  TEST_TIMEOUT=${TEST_TIMEOUT:-150} gpu_tests final -n 4 tests/custom_ops/test_nvfp4_shared_items.py \
    tests/custom_ops/test_nvfp4_gate_up_gluon.py tests/custom_ops/test_nvfp4_down_gluon.py
  for v in 1 0; do
    op_env "op_items${v}" "DLMC_NVFP4_SHARED_ITEMS=$v" --shared-expert --profile
  done
  env_round round_items1_a DLMC_NVFP4_SHARED_ITEMS=1
  env_round round_items0 DLMC_NVFP4_SHARED_ITEMS=0
  env_round round_items1_b DLMC_NVFP4_SHARED_ITEMS=1 ;;
tests)
  TEST_TIMEOUT=${TEST_TIMEOUT:-400} gpu_tests op -n 4 tests/custom_ops/test_nvfp4_shared_items.py \
    tests/custom_ops/test_nvfp4_gate_up_gluon.py tests/custom_ops/test_nvfp4_down_gluon.py ;;
*)
  echo "usage: $0 first|ab|tests|final" >&2; exit 2 ;;
esac
tar_out "s42_${1:-}"
