#!/usr/bin/env bash
# On the H200 (no network): install dlmc + the FlashInfer wheels from .whl/, run the benchmark
# and the GPU tests; outputs go to $OUT. See perf/README.md for how .whl/ is filled.
set -u
OUT=${OUT:-/tmp/dlmc-out}
mkdir -p "$OUT"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
  export PYTHONPATH=/tmp/site
fi
export MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import sys, torch, triton; print(sys.version, torch.__version__, triton.__version__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
} > "$OUT/versions.txt" 2>&1
timeout "${BENCH_TIMEOUT:-200}" python3 perf/bench_paged_attention.py ${BENCH_ARGS:---sweep} \
  --out "$OUT/paged_attention_h200.json" > "$OUT/bench.txt" 2>&1
echo "bench rc=$?" >> "$OUT/bench.txt"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest tests/custom_ops tests/kv -q -p no:cacheprovider \
  --durations=15 > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
cat "$OUT/versions.txt"; tail -45 "$OUT/bench.txt"; tail -30 "$OUT/pytest_gpu.txt"
