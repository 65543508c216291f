#!/usr/bin/env bash
# Session 28's H200 calls (helpers of perf/h200_session.sh). Each call's output is tarred in $OUT.
#   bash perf/h200_s28.sh ring    # call 1 (carry .whl): DLMC_NVFP4_RING_EMPTY=named (consumers
#                                 # hand ring slots back with bar.arrive on named barriers):
#                                 # the Gluon GPU tests in that mode, then the op (routed
#                                 # experts) in both modes, one process each, two passes in
#                                 # opposite orders, then NVFP4 + FP8 rounds in both modes
#   bash perf/h200_s28.sh ring2   # call 2 (carry .whl): the same after the arrival was pinned
#                                 # before the slot's decode (a zero read back after it):
#                                 # GPU tests in named mode, the op in both modes, 3 passes
#   bash perf/h200_s28.sh rounds  # call 3: NVFP4 + FP8 rounds: named mode, the default, and
#                                 # DLMC_NVFP4_SHARED=separate (the shared expert outside the
#                                 # op, which then takes the Gluon gate/up)
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib
source <(sed -n '/^op_rows()/,/^}/p' "$HERE/h200_s27.sh")

op() {  # op NAME MODE [bench args]: the op (routed experts) with DLMC_NVFP4_RING_EMPTY=MODE
  op_env "$1" "DLMC_NVFP4_RING_EMPTY=$2" "${@:3}"
}

named_tests() {  # the Gluon GPU test files in named mode; true if none failed
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  DLMC_NVFP4_RING_EMPTY=named TEST_TIMEOUT=240 gpu_tests named -n 4 \
    tests/custom_ops/test_nvfp4_moe_gluon.py tests/custom_ops/test_nvfp4_down_gluon.py \
    tests/custom_ops/test_nvfp4_gate_up_gluon.py
  ! grep -qE "failed|error|Timeout" "$OUT/gpu_tests_named.txt"
}

ring_rounds() {  # NVFP4 + FP8 rounds, named mode then the default
  local args=(--precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop)
  DLMC_NVFP4_RING_EMPTY=named round round_nvfp4_named 150 "${args[@]}"
  round round_nvfp4_default 150 "${args[@]}"
}

case "${1:-}" in
ring)
  if named_tests; then
    op op_mbarrier1 mbarrier --profile
    op op_named1 named --profile
    op op_named2 named
    op op_mbarrier2 mbarrier
    ring_rounds
  fi
  tar_out s28_ring ;;
ring2)
  if named_tests; then
    op op_named1 named --profile
    op op_mbarrier1 mbarrier --profile
    op op_mbarrier2 mbarrier
    op op_named2 named
    op op_named3 named
    op op_mbarrier3 mbarrier
  fi
  tar_out s28_ring2 ;;
rounds)
  ring_rounds
  # the shared expert outside the op (cuBLAS SwiGLU): the op is then routed-only and takes the
  # Gluon gate/up; what the round would gain from moving the shared expert out of the op
  DLMC_NVFP4_SHARED=separate round round_nvfp4_shared_separate 150 \
    --precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop
  tar_out s28_rounds ;;
*) echo "usage: $0 ring|ring2|rounds" >&2; exit 2 ;;
esac
