#!/usr/bin/env bash
# Session 39's H200 calls (helpers of perf/h200_session.sh); output tarred in $OUT.
#   bash perf/h200_s39.sh combine  # (carry .whl; ran at commit 99194c9, whose combine in the
#                                  # down kernel was removed after it) the Gluon gate/up + down
#                                  # GPU tests with the combine in the down kernel
#                                  # (DLMC_NVFP4_DOWN_COMBINE=1), then the op alone in 8
#                                  # processes alternating DLMC_NVFP4_DOWN_COMBINE=1 / 0
#                                  # (routed experts, 32 tokens)
#   bash perf/h200_s39.sh align    # (carry .whl; ran at commit 211498f, whose written
#                                  # alignment was removed after it) the Gluon gate/up, down
#                                  # and fused GPU tests with the alignment written by the
#                                  # gate/up programs
#                                  # (DLMC_NVFP4_SELF_ALIGN=1, no moe_align launch), then the
#                                  # op alone in 8 processes alternating DLMC_NVFP4_SELF_ALIGN=1 / 0
#   bash perf/h200_s39.sh record   # the op alone at the defaults in RECORD (6) processes
#                                  # (routed experts, 32 tokens; the first with a profile)
#   bash perf/h200_s39.sh alignprobe  # perf/probe_align.py: moe_align alone at 4 / 8 / 16
#                                  # warps (WARPS) against one-element adds, in CUDA graphs;
#                                  # PARTS=1: its pieces alone too
# Env: TEST_TIMEOUT, PASSES (4 per setting), RECORD (6).
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib
source <(sed -n '/^op_rows()/,/^}/p' "$HERE/h200_s27.sh")

# ab_op NAME_A ENV_A NAME_B ENV_B: the op in PASSES process pairs, A then B, B then A, ...
ab_op() {
  local pass
  for pass in $(seq 1 "${PASSES:-4}"); do
    if [ $((pass % 2)) = 1 ]; then
      op_env "op_$1_$pass" "$2" $([ "$pass" = 1 ] && echo --profile)
      op_env "op_$3_$pass" "$4" $([ "$pass" = 1 ] && echo --profile)
    else
      op_env "op_$3_$pass" "$4"
      op_env "op_$1_$pass" "$2"
    fi
  done
}

case "${1:-}" in
combine)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=${TEST_TIMEOUT:-240} gpu_tests combine -n 4 \
    tests/custom_ops/test_nvfp4_gate_up_gluon.py tests/custom_ops/test_nvfp4_down_gluon.py
  ab_op combine DLMC_NVFP4_DOWN_COMBINE=1 launch DLMC_NVFP4_DOWN_COMBINE=0
  tar_out s39_combine ;;
align)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=${TEST_TIMEOUT:-240} gpu_tests align -n 4 tests/custom_ops/test_nvfp4_gate_up_gluon.py \
    tests/custom_ops/test_nvfp4_down_gluon.py tests/custom_ops/test_nvfp4_moe_gluon.py
  ab_op self_align DLMC_NVFP4_SELF_ALIGN=1 launch_align DLMC_NVFP4_SELF_ALIGN=0
  tar_out s39_align ;;
record)
  for pass in $(seq 1 "${RECORD:-6}"); do
    op_env "op_default_$pass" "DLMC_NVFP4_SELF_ROUTE=1" $([ "$pass" = 1 ] && echo --profile)
  done
  tar_out s39_record ;;
alignprobe)
  timeout 120 python3 perf/probe_align.py --warps ${WARPS:-4 8 16} ${PARTS:+--parts} --out "$OUT/align.json" \
    > "$OUT/align.txt" 2>&1
  echo "probe rc=$?"; cat "$OUT/align.txt"
  tar_out s39_alignprobe ;;
*) echo "h200_s39.sh: expected combine, align, record or alignprobe; got ${1:-nothing}" >&2
   exit 2 ;;
esac
