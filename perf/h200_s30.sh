#!/usr/bin/env bash
# Session 30's prepared H200 call (helpers of perf/h200_session.sh); output tarred in $OUT.
#   bash perf/h200_s30.sh stream  # perf/probe_shared_stream.py: the LLaDA shared expert fused
#                                 # in the op, on a side stream, serial, or absent (19 layers of
#                                 # router GEMM, routing and op per graph), 8 passes, twice
#   bash perf/h200_s30.sh wait    # (carry .whl) DLMC_NVFP4_SELF_WAIT_STEP: the Gluon gate/up
#                                 # GPU tests with "last", then the op (routed experts) with
#                                 # first (the default) / 7 / last, one process each, 3 passes
#   bash perf/h200_s30.sh both    # (carry .whl) `wait`, then `stream`, in one call (~6 min);
#                                 # run as session 31's call 1. DLMC_NVFP4_SELF_WAIT_STEP was
#                                 # removed after it (no gain): `wait` now times one form thrice
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib
source <(sed -n '/^op_rows()/,/^}/p' "$HERE/h200_s27.sh")

stream_probe() {
  for run in 1 2; do
    timeout 200 python3 perf/probe_shared_stream.py --passes 8 \
      --out "$OUT/probe_shared_stream$run.json" > "$OUT/probe_shared_stream$run.txt" 2>&1
    echo "probe $run rc=$?"; tail -6 "$OUT/probe_shared_stream$run.txt"
  done
}

wait_steps() {
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  DLMC_NVFP4_SELF_WAIT_STEP=last TEST_TIMEOUT=200 gpu_tests wait_last -n 4 \
    tests/custom_ops/test_nvfp4_gate_up_gluon.py
  if ! grep -qE "failed|error|Timeout" "$OUT/gpu_tests_wait_last.txt"; then
    for pass in 1 2 3; do
      for step in first 7 last; do
        op_env "op_${step}_$pass" "DLMC_NVFP4_SELF_WAIT_STEP=$step" \
          $([ $pass = 1 ] && echo --profile)
      done
    done
  fi
}

case "${1:-}" in
stream) stream_probe; tar_out s30_stream ;;
wait) wait_steps; tar_out s30_wait ;;
both) wait_steps; stream_probe; tar_out s30_both ;;
*) echo "usage: $0 stream|wait|both" >&2; exit 2 ;;
esac
