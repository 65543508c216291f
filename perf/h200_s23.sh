#!/usr/bin/env bash
# Session 23's H200 calls (helpers of perf/h200_session.sh). Each call's output is tarred in $OUT.
#   bash perf/h200_s23.sh defaults  # call 2 (carry .whl): GPU tests of the new defaults (PDL
#                                   # edges, combine outside), the NVFP4 + FP8 round at the new
#                                   # defaults, the old ones and with Inductor's PDL
#   bash perf/h200_s23.sh sampled   # call 3 (carry .whl): sampled rounds (graph forward, eager
#                                   # decision) against greedy, eager sampled rounds, GPU tests,
#                                   # perf/probe_moe_l2_warm.py
#   bash perf/h200_s23.sh final     # call 4 (carry .whl): the shared-expert fuzz, DLMC_PDL's
#                                   # GPU test, the op's host time per launch
set -u
source "$(dirname "$0")/h200_session.sh" lib
NVFP4=(--precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop)

case "${1:-}" in
defaults)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout 200 python3 -m pytest -v -p no:cacheprovider -rf -m gpu -n 3 \
    tests/custom_ops/test_moe_overlap.py tests/custom_ops/test_moe_combine.py \
    tests/models/test_moe.py > "$OUT/gpu_tests_defaults.txt" 2>&1
  echo "gpu tests defaults rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" \
    "$OUT/gpu_tests_defaults.txt" | tail -12
  round round_nvfp4_default 150 "${NVFP4[@]}"
  ( export DLMC_NVFP4_PDL_EDGES=0 DLMC_MOE_COMBINE=triton
    round round_nvfp4_s22defaults 150 "${NVFP4[@]}" )
  ( export TORCHINDUCTOR_ENABLE_PDL=1; round round_nvfp4_inductor_pdl 150 "${NVFP4[@]}" )
  tar_out s23_defaults ;;
sampled)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout 90 python3 perf/probe_moe_l2_warm.py --out "$OUT/probe_moe_l2_warm.json" 2>&1 | tail -8
  round round_nvfp4_sampled 200 --precision nvfp4 --kv-cache-dtype fp8 --modes eager,graph \
    --no-loop --temperature 0.7
  timeout 280 python3 -m pytest -v -p no:cacheprovider -rf -m gpu -n 6 tests/graphs \
    tests/models/test_moe.py tests/models/test_llada2.py tests/loading/test_nvfp4_loading.py \
    > "$OUT/gpu_tests_sampled.txt" 2>&1
  echo "gpu tests sampled rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" \
    "$OUT/gpu_tests_sampled.txt" | tail -30
  tar_out s23_sampled ;;
final)  # call 4: the v7 shared-expert fuzz (with its statistics) beside DLMC_PDL's GPU
  # test, then the op's host time per launch (eager / compile-mode cost)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  ( timeout 300 python3 -m pytest -v -p no:cacheprovider -m gpu --hypothesis-show-statistics \
      "tests/custom_ops/test_nvfp4_moe.py::test_shared_expert_tail_matches_reference_gpu[7]" \
      > "$OUT/gpu_tests_shared_fuzz.txt" 2>&1; echo "shared fuzz rc=$?" >> "$OUT/gpu_tests_shared_fuzz.txt" ) &
  timeout 240 python3 -m pytest -v -p no:cacheprovider -rf -m gpu tests/custom_ops/test_pdl.py \
    > "$OUT/gpu_tests_pdl.txt" 2>&1
  echo "gpu tests pdl rc=$?"; grep -E "PASSED|FAILED|passed|failed" "$OUT/gpu_tests_pdl.txt" | tail -4
  wait
  tail -2 "$OUT/gpu_tests_shared_fuzz.txt"
  timeout 60 python3 perf/probe_op_overhead.py --per-launch --out "$OUT/overhead_launches.json" \
    2>&1 | tail -6
  tar_out s23_final ;;
*) echo "usage: bash perf/h200_s23.sh defaults|sampled|final"; exit 2 ;;
esac
