#!/usr/bin/env bash
# Session 20's H200 calls (helpers of perf/h200_session.sh). Each call's output is tarred in $OUT.
#   bash perf/h200_s20.sh tma    # nvfp4_moe v8 (TMA chunk copies) against v7 alone, v8's GPU
#                                # tests, then (only if v8 is faster alone) the NVFP4 round A/B.
#                                # Call 1; v8 was slower and was removed: it needs commit e14e6e2.
set -u
source "$(dirname "$0")/h200_session.sh" lib

case "${1:-}" in
tma)
  timeout 200 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --kernels v7 v8 --profile \
    --out "$OUT/op_v7_v8.json" > "$OUT/op_v7_v8.txt" 2>&1
  echo "op rc=$?"; grep -E "^kernel=" "$OUT/op_v7_v8.txt" | cut -c1-260
  TEST_TIMEOUT=150 gpu_tests s20_v8 tests/custom_ops/test_nvfp4_moe_v5.py -k "8 and not equal_v3_gpu"
  faster=$(python3 -c "import json; r = json.load(open('$OUT/op_v7_v8.json'))['results']
print(int(r[1]['nvfp4_ms_per_layer'] < 0.99 * r[0]['nvfp4_ms_per_layer']))" 2>/dev/null || echo 0)
  if [ "$faster" = 1 ]; then
    ab_rounds DLMC_NVFP4_KERNEL=v8 v8 170
  else
    echo "v8 not faster alone: no round"
    ( timeout 120 python3 -m pytest -q -s -p no:cacheprovider -m gpu \
        tests/custom_ops/test_nvfp4_moe_v5.py -k "equal_v3_gpu and 8" > "$OUT/fuzz_v8.txt" 2>&1
      echo "fuzz rc=$?"; grep -c "v8 == v3" "$OUT/fuzz_v8.txt"; tail -2 "$OUT/fuzz_v8.txt" )
  fi
  tar_out s20_tma ;;
*) echo "usage: bash perf/h200_s20.sh tma"; exit 2 ;;
esac
