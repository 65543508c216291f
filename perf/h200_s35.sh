#!/usr/bin/env bash
# Session 35's H200 calls (helpers of perf/h200_session.sh and h200_s34.sh); output in $OUT.
#   bash perf/h200_s35.sh fused   # (carry .whl) the paged attention's fused merge: its GPU
#                                 # tests (the compiled op under DLMC_ATTENTION_VARIANT=
#                                 # ilv32-fused), ilv32 vs ilv32-fused alone at 1k / 4k, then
#                                 # the NVFP4 + FP8 round with it and at the defaults
#                                 # (the fused merge was measured, found no faster in the
#                                 # round, and reverted: run it from commit abe15f5)
#   bash perf/h200_s35.sh spec    # (carry .whl) the merge that reads parts 16-31 only when
#                                 # live: its GPU tests, ilv32 / ilv32-spec16 / ilv16 alone
#                                 # at 1k-16k, the NVFP4 + FP8 round with it and at the
#                                 # defaults (run in session 36, found slower, and
#                                 # reverted: run it from commit 047c53b)
# Env: ROUND_TIMEOUT (150 per round), TEST_TIMEOUT (200).
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_s34.sh" lib

case "${1:-}" in
fused)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  (export DLMC_ATTENTION_VARIANT=ilv32-fused TEST_TIMEOUT=${TEST_TIMEOUT:-200}
   gpu_tests fused -n 4 tests/custom_ops/test_paged_attention_fused_merge.py \
     tests/custom_ops/test_paged_attention_variants.py \
     tests/custom_ops/test_paged_attention.py::test_compile_and_cuda_graph_replay)
  timeout 120 python3 perf/bench_paged_attention.py --sweep ilv32 ilv32-fused --no-flashinfer \
    --prefixes 1024 4096 --out "$OUT/attention_fused.json" > "$OUT/attention_fused.txt" 2>&1
  echo "bench rc=$?"; grep -E "ilv32|default" "$OUT/attention_fused.txt" | head -12
  ROUND_TIMEOUT=${ROUND_TIMEOUT:-150} env_round round_fused DLMC_ATTENTION_VARIANT=ilv32-fused
  ROUND_TIMEOUT=${ROUND_TIMEOUT:-150} env_round round_default
  tar_out s35_fused ;;
spec)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=${TEST_TIMEOUT:-200} gpu_tests spec -n 4 \
    tests/custom_ops/test_paged_attention_variants.py tests/custom_ops/test_paged_attention.py
  timeout 150 python3 perf/bench_paged_attention.py --sweep ilv32 ilv32-spec16 ilv16 \
    --no-flashinfer --prefixes 1024 2048 4096 16384 --capacity 32768 \
    --out "$OUT/attention_spec.json" > "$OUT/attention_spec.txt" 2>&1
  echo "bench rc=$?"; grep -E "ilv|default " "$OUT/attention_spec.txt" | head -16
  ROUND_TIMEOUT=${ROUND_TIMEOUT:-150} env_round round_spec16 DLMC_ATTENTION_VARIANT=ilv32-spec16
  ROUND_TIMEOUT=${ROUND_TIMEOUT:-150} env_round round_default
  tar_out s35_spec ;;
*) echo "usage: $0 fused|spec" >&2; exit 2 ;;
esac
