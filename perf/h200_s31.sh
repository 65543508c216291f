#!/usr/bin/env bash
# Session 31's H200 calls (helpers of perf/h200_session.sh); output tarred in $OUT.
#   bash perf/h200_s31.sh record  # the op at the defaults in 5 processes (routed experts, one
#                                 # copy measurement each); the paged-attention variants with
#                                 # fewer splits (ilv16, ilv8) against ilv32 (the FP8 default)
#                                 # at 1k / 4k prefixes; NVFP4 + FP8 rounds default / ilv16 / ilv8
#   bash perf/h200_s31.sh splits  # the GPU tests of ilv16 / ilv8 (graph-captured, appending),
#                                 # the split counts at 2k / 3k prefixes
#   bash perf/h200_s31.sh health [rest|fuzz|all]  # (carry .whl) pytest -m gpu -n 4 -v of the
#                                 # test files that session 30's call 6 and this session's calls
#                                 # did not run: "rest" (default) without, "fuzz" only, the three
#                                 # files with 200-example GPU fuzzes (nvfp4_moe_v4/v5,
#                                 # paged_attention); all of them did not fit 450 s (call 4)
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib
source <(sed -n '/^op_rows()/,/^}/p' "$HERE/h200_s27.sh")

record() {
  for pass in 1 2 3 4 5; do
    op_env "op_default_$pass" "DLMC_NVFP4_SELF_ROUTE=1" $([ $pass = 1 ] && echo --profile)
  done
  timeout 200 python3 perf/bench_paged_attention.py --prefixes 1024 4096 --no-flashinfer \
    --sweep ilv32 ilv16 ilv16-bf16part ilv8 --out "$OUT/attention_splits.json" \
    > "$OUT/attention_splits.txt" 2>&1
  echo "attention rc=$?"; tail -20 "$OUT/attention_splits.txt"
  local args=(--precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop)
  round round_nvfp4_default 200 "${args[@]}"
  for variant in ilv16 ilv8; do
    ( export DLMC_ATTENTION_VARIANT=$variant; round "round_nvfp4_$variant" 200 "${args[@]}" )
  done
}

splits() {
  TEST_TIMEOUT=300 gpu_tests splits -k "ilv16 or ilv8" \
    tests/custom_ops/test_paged_attention_variants.py tests/custom_ops/test_paged_attention_append.py
  timeout 200 python3 perf/bench_paged_attention.py --prefixes 2048 3072 --no-flashinfer \
    --sweep ilv32 ilv16 ilv8 --out "$OUT/attention_splits_2k3k.json" \
    > "$OUT/attention_splits_2k3k.txt" 2>&1
  echo "attention rc=$?"; grep "triton" "$OUT/attention_splits_2k3k.txt"
}

health() {
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  local files part=${1:-rest}  # (the parts of perf/gpu_sweep.sh)
  case "$part" in
  rest) files=$(bash "$HERE/gpu_sweep.sh" files rest) ;;
  fuzz) files=$(for p in fuzz-moe fuzz-other; do bash "$HERE/gpu_sweep.sh" files $p; done) ;;
  all) files=$(for p in rest fuzz-moe fuzz-other; do bash "$HERE/gpu_sweep.sh" files $p; done) ;;
  *) echo "health: expected rest, fuzz or all, got $part" >&2; return 2 ;;
  esac
  files=$(echo "$files" | sort)
  echo "$files" > "$OUT/health_files_$part.txt"
  TEST_TIMEOUT=${TEST_TIMEOUT:-560} gpu_tests "health_$part" -n 4 $files
}

case "${1:-}" in
health) health "${2:-rest}"; tar_out "s31_health_${2:-rest}" ;;
record) record; tar_out s31_record ;;
splits) splits; tar_out s31_splits ;;
*) echo "usage: $0 record|splits|health" >&2; exit 2 ;;
esac
