#!/usr/bin/env bash
# Session 41's H200 calls (helpers of perf/h200_session.sh); output tarred in $OUT.
#   bash perf/h200_s41.sh probe   # perf/probe_pre_aligned.py in PROBES (2) processes: the op
#                                 # as it runs, with the alignment made before capture, and
#                                 # with no alignment launch (calls 1-4, at the commits that
#                                 # perf/README.md names)
#   bash perf/h200_s41.sh ab      # the op alone (routed experts, 32 tokens) in PASSES (3)
#                                 # process pairs alternating DLMC_NVFP4_DOWN_SELF_ROUTE=1 / 0
#   bash perf/h200_s41.sh tests   # the GPU tests of the files that run the op's Gluon path
# Env: TEST_TIMEOUT, PASSES, PROBES.
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib
source <(sed -n '/^op_rows()/,/^}/p' "$HERE/h200_s27.sh")

case "${1:-}" in
probe)
  for i in $(seq 1 "${PROBES:-2}"); do
    timeout 200 python3 perf/probe_pre_aligned.py --out "$OUT/pre_aligned_$i.json" \
      > "$OUT/pre_aligned_$i.txt" 2>&1
    echo "probe $i rc=$?"; tail -6 "$OUT/pre_aligned_$i.txt"
  done ;;
ab)
  for pass in $(seq 1 "${PASSES:-3}"); do
    first=1 second=0
    [ $((pass % 2)) = 0 ] && first=0 second=1
    for v in $first $second; do
      op_env "op_self${v}_$pass" "DLMC_NVFP4_DOWN_SELF_ROUTE=$v" \
        $([ "$pass" = 1 ] && echo --profile)
    done
  done ;;
tests)
  TEST_TIMEOUT=${TEST_TIMEOUT:-400} gpu_tests op -n 4 tests/custom_ops/test_nvfp4_gate_up_gluon.py \
    tests/custom_ops/test_nvfp4_down_gluon.py tests/custom_ops/test_nvfp4_moe.py ;;
*)
  echo "usage: $0 probe|ab|tests" >&2; exit 2 ;;
esac
tar_out "s41_${1:-}"
