#!/usr/bin/env bash
# Session 25's H200 calls (helpers of perf/h200_session.sh). Each call's output is tarred in $OUT.
# Calls 1 and 2 were session 24's prepared `bash perf/h200_s24.sh gluontests` and `... gateup`.
#   bash perf/h200_s25.sh fused    # calls 3 and 5 (carry .whl): the fused Gluon kernel
#                                  # (DLMC_NVFP4_DOWN=fused): GPU tests, the op with each kernel
#                                  # choice (FUSED: more stages,per_sm,maxnreg settings), NVFP4 +
#                                  # FP8 rounds fused / default. Call 3 (96 registers, before the
#                                  # fix) hung at LLaDA shapes; its script had no rounds
#   bash perf/h200_s25.sh hang     # call 4 (carry .whl): perf/check_fused.py per programs per SM
#   bash perf/h200_s25.sh blocks   # call 6 (carry .whl): 16/32/64-slot routing blocks against
#                                  # the Triton kernels and the reference; the Gluon down tests
#   bash perf/h200_s25.sh tests    # call 7 (carry .whl): the fused kernel's GPU tests
set -u
source "$(dirname "$0")/h200_session.sh" lib

case "${1:-}" in
hang)  # call 4 (carry .whl): the fused kernel at LLaDA shapes per programs-per-SM setting
  # (perf/check_fused.py, 60 s each), then its GPU tests
  for setting in "--per-sm 3" "--per-sm 2" "--per-sm 1" "--per-sm 3 --shared"; do
    PYTHONPATH=. timeout 60 python3 perf/check_fused.py $setting > "$OUT/check.txt" 2>&1
    echo "check $setting rc=$?"; tail -2 "$OUT/check.txt"; cat "$OUT/check.txt" >> "$OUT/checks.txt"
  done
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout 120 python3 -m pytest -v -p no:cacheprovider -rf -m gpu -n 4 \
    tests/custom_ops/test_nvfp4_moe_gluon.py > "$OUT/gpu_tests_fused.txt" 2>&1
  echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_fused.txt"
  tar_out s25_hang ;;
fused)  # calls 3 and 5 (carry .whl): the fused kernel: (since the rework) a 45 s check per
  # form first (perf/check_fused.py: static items, tickets, shared expert; a hang or a
  # mismatch skips the rest), GPU tests, the op with each kernel choice, rounds
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  ok=1
  for setting in "" "--tickets" "--shared --tickets"; do
    PYTHONPATH=. timeout 45 python3 perf/check_fused.py $setting > "$OUT/check.txt" 2>&1
    rc=$?; echo "check $setting rc=$rc"; tail -1 "$OUT/check.txt"
    cat "$OUT/check.txt" >> "$OUT/checks.txt"; [ $rc -eq 0 ] || ok=0
  done
  if [ $ok = 1 ]; then
    timeout 100 python3 -m pytest -v -p no:cacheprovider -rf -m gpu -n 4 \
      tests/custom_ops/test_nvfp4_moe_gluon.py > "$OUT/gpu_tests_fused.txt" 2>&1
    echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_fused.txt"
    DOWNS=(triton gluon fused)
    for config in ${FUSED:-3,3,80,1 2,3,80}; do DOWNS+=("fused:$config"); done
    timeout 150 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --profile \
      --shared-expert --downs "${DOWNS[@]}" --out "$OUT/op_fused.json" > "$OUT/op_fused.txt" 2>&1
    echo "op rc=$?"; grep -E "^kernel=" "$OUT/op_fused.txt" | cut -c 1-600
    NVFP4=(--precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop)
    ( export DLMC_NVFP4_DOWN=fused; round round_nvfp4_fused 120 "${NVFP4[@]}" )
    round round_nvfp4_default 120 "${NVFP4[@]}"
  else
    echo "the fused kernel's check failed: op and rounds skipped"
  fi
  tar_out s25_fused ;;
blocks)  # call 6 (carry .whl): the fused kernel with 32- and 64-slot routing blocks (call 5's
  # prompt-case mismatch) against the Triton kernels and the reference; the Gluon down tests
  for setting in "--shape 8,256,256,256,4" "--shape 8,256,256,16,8 --skew" \
      "--shape 16,2048,512,256,8" "--shape 256,2048,512,512,8 --shared" "--shared"; do
    PYTHONPATH=. timeout 50 python3 perf/check_fused.py $setting > "$OUT/check.txt" 2>&1
    echo "check $setting rc=$?"; tail -2 "$OUT/check.txt"; cat "$OUT/check.txt" >> "$OUT/checks.txt"
  done
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout 100 python3 -m pytest -q -p no:cacheprovider -rf -m gpu -n 4 \
    tests/custom_ops/test_nvfp4_down_gluon.py > "$OUT/gpu_tests_gluon_down.txt" 2>&1
  echo "gpu tests rc=$?"; tail -2 "$OUT/gpu_tests_gluon_down.txt"
  tar_out s25_blocks ;;
tests)  # call 7 (carry .whl), run by hand then: the fused kernel's GPU tests
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout 120 python3 -m pytest -v -p no:cacheprovider -rf -m gpu -n 4 \
    tests/custom_ops/test_nvfp4_moe_gluon.py > "$OUT/gpu_tests_fused.txt" 2>&1
  echo "rc=$?"; grep -E "PASSED|FAILED|passed|failed" "$OUT/gpu_tests_fused.txt" ;;
*) echo "usage: bash perf/h200_s25.sh fused|hang|blocks|tests"; exit 2 ;;
esac
