#!/usr/bin/env bash
# Session 34's H200 calls (helpers of perf/h200_session.sh); output tarred in $OUT.
#   bash perf/h200_s34.sh early   # weights before the wait: the NVFP4 + FP8 round (--no-loop)
#                                 # at the defaults, with DLMC_PDL=1 + DLMC_QKV_SPLIT_K=1, and
#                                 # with DLMC_QKV_SPLIT_K=1 alone
#   bash perf/h200_s34.sh isolate # (carry .whl) the new code's tests on the GPU, then the
#                                 # defaults, DLMC_QKV_SPLIT_K=1, and DLMC_PDL=1 +
#                                 # DLMC_QKV_SPLIT_K=1 with DLMC_EARLY_WEIGHTS=0 (weights
#                                 # after the wait)
#   bash perf/h200_s34.sh next    # (carry .whl) for the next session: the two tests call 4 cut
#                                 # (the tiny NVFP4 model with qkv partials, DLMC_PDL's
#                                 # cross-process test), then the BF16 round at the defaults and
#                                 # with DLMC_QKV_SPLIT_K=1 (before making it the default)
#   source perf/h200_s34.sh lib   # the helpers only
# Env: ROUND_TIMEOUT (170 per round).
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib

# env_round NAME [ENV=VALUE ...]: the NVFP4 + FP8 graph round (host read, queued, in flight)
# with a profile, the round alone (--no-loop), under the given switches
env_round() {
  local name=$1; shift
  env "$@" timeout "${ROUND_TIMEOUT:-170}" dlmc bench round --shape llada2.1-mini \
    --block-length 32 --prefix 1024 --routing uniform --rounds 60 --precision nvfp4 \
    --kv-cache-dtype fp8 --modes graph --no-loop --profile --out "$OUT/$name.json" \
    > "$OUT/$name.txt" 2>&1
  echo "$name rc=$?" >> "$OUT/$name.txt"
  grep -E "│ +graph|│ +(queued|flight)|rc=|Error" "$OUT/$name.txt" | head -8
}

# bf16_round NAME [ENV=VALUE ...]: the BF16 graph round (BF16 experts and cache), --no-loop
bf16_round() {
  local name=$1; shift
  env "$@" timeout "${ROUND_TIMEOUT:-170}" dlmc bench round --shape llada2.1-mini \
    --block-length 32 --prefix 1024 --routing uniform --rounds 60 --precision bf16 \
    --modes graph --no-loop --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$?" >> "$OUT/$name.txt"
  grep -E "│ +graph|│ +(queued|flight)|rc=|Error" "$OUT/$name.txt" | head -8
}

# new_tests: every test (not only gpu-marked) of the files this session changed, on CUDA
new_tests() {
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout "${1:-200}" python3 -m pytest -v -p no:cacheprovider -rf -n 4 \
    tests/custom_ops/test_qk_norm_rope.py tests/custom_ops/test_qk_norm_rope_append.py \
    tests/custom_ops/test_split_k_linear.py tests/custom_ops/test_router_gemm.py \
    tests/custom_ops/test_pdl.py > "$OUT/tests_s34.txt" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/tests_s34.txt"
}

case "${1:-}" in
lib) ;;  # sourced for env_round / bf16_round / new_tests
early)
  env_round round_default
  env_round round_pdl_qkv DLMC_PDL=1 DLMC_QKV_SPLIT_K=1
  env_round round_qkv DLMC_QKV_SPLIT_K=1
  tar_out s34_early ;;
isolate)  # call 3's default round failed to compile (qk_norm_rope's SPLITS=0 path)
  new_tests 120
  env_round round_default
  env_round round_qkv DLMC_QKV_SPLIT_K=1
  env_round round_pdl_qkv_late DLMC_PDL=1 DLMC_QKV_SPLIT_K=1 DLMC_EARLY_WEIGHTS=0
  tar_out s34_isolate ;;
next)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=240 gpu_tests qkv -n 2 \
    tests/custom_ops/test_split_k_linear.py::test_tiny_nvfp4_model_with_qkv_partials \
    tests/custom_ops/test_pdl.py::test_graph_generate_equal_with_pdl_on_and_off
  bf16_round round_bf16_default
  bf16_round round_bf16_qkv DLMC_QKV_SPLIT_K=1
  tar_out s34_next ;;
*) echo "usage: $0 early|isolate|next" >&2; exit 2 ;;
esac
