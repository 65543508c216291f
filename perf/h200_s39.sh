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
#   bash perf/h200_s39.sh alignnew # (carry .whl) moe_align with whole-line padding stores:
#                                  # perf/probe_align.py --parts, the GPU tests of the three
#                                  # alignment kernels and the self-routed gate/up, then the
#                                  # NVFP4 + FP8 round with it and with session 38's moe_align
#                                  # (results/s39/moe_align_s38.py.txt)
# Env: TEST_TIMEOUT, PASSES (4 per setting), RECORD (6), ROUND_TIMEOUT (170).
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
alignnew)
  source "$HERE/h200_s34.sh" lib
  timeout 120 python3 perf/probe_align.py --warps 4 --parts --out "$OUT/align.json" \
    > "$OUT/align.txt" 2>&1
  echo "probe rc=$?"; cat "$OUT/align.txt"
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=${TEST_TIMEOUT:-150} gpu_tests alignnew -n 4 tests/custom_ops/test_moe_align.py \
    tests/custom_ops/test_moe_route_align.py tests/custom_ops/test_moe_route_last_align.py \
    tests/custom_ops/test_nvfp4_gate_up_gluon.py
  env_round round_align_new
  A=custom_ops/moe_align.py
  cp $A /tmp/moe_align_new.py
  cp perf/results/s39/moe_align_s38.py.txt $A
  env_round round_align_s38
  cp /tmp/moe_align_new.py $A
  tar_out s39_alignnew ;;
*) echo "h200_s39.sh: expected combine, align, record, alignprobe or alignnew; got ${1:-nothing}" >&2
   exit 2 ;;
esac
