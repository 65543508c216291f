#!/usr/bin/env bash
# One H200 call: install, GPU tests, compiled-round benchmarks (BF16 and NVFP4 + FP8 KV, with a
# per-kernel profile and the loop overhead), the NVFP4 op v1 vs v2. Outputs go to $OUT.
set -u
OUT=${OUT:-/tmp/dlmc-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DLMC_CACHE=/tmp/dlmc-cache
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | grep -v WARN | tail -1
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, dlmc; print(sys.version.split()[0], torch.__version__, triton.__version__, dlmc.__file__)"
} > "$OUT/versions.txt" 2>&1
timeout "${TEST_TIMEOUT:-170}" python3 -m pytest tests -q -m gpu -p no:cacheprovider --ignore=tests/serve \
  > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" >> "$OUT/gpu_tests.txt"
tail -4 "$OUT/gpu_tests.txt"
for spec in ${ROUND_SPECS:-bf16:bf16 nvfp4:fp8}; do
  set -- ${spec/:/ }
  timeout "${ROUND_TIMEOUT:-150}" dlmc bench round --shape llada2.1-mini --precision "$1" \
    --kv-cache-dtype "$2" --block-length 32 --prefix 1024 --routing uniform --rounds 60 \
    --modes graph --profile ${ROUND_ARGS:-} --out "$OUT/round_$1_$2.json" > "$OUT/round_$1_$2.txt" 2>&1
  echo "round $1/$2 rc=$?" >> "$OUT/round_$1_$2.txt"
  grep -E "graph|loop|rc=" "$OUT/round_$1_$2.txt" | head -4
done
for v in ${NVFP4_VARIANTS:-v1 v2}; do
  DLMC_NVFP4_KERNEL=$v timeout 60 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 50 \
    --out "$OUT/nvfp4_op_$v.json" > "$OUT/nvfp4_op_$v.txt" 2>&1
  echo "nvfp4 op $v rc=$?"; tail -3 "$OUT/nvfp4_op_$v.txt"
done
