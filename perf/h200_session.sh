#!/usr/bin/env bash
# H200 runs, in parts that each fit one 10-minute device call. Outputs go to $OUT.
#   bash perf/h200_session.sh rounds   # BF16 and NVFP4+FP8 rounds: graph, profile, and whole
#                                      # decodes with the refresh fused vs separate (--loop).
#                                      # The loop compiles prefill/fused/refresh graphs too: give
#                                      # each spec its own call (ROUND_SPECS=bf16:bf16, then
#                                      # ROUND_SPECS=nvfp4:fp8) unless the Inductor cache is warm.
#   bash perf/h200_session.sh ops      # nvfp4_moe v3 vs v2, paged attention, targeted GPU tests
#   bash perf/h200_session.sh ncu      # Nsight Compute sections of the nvfp4_moe v3 kernels
#   bash perf/h200_session.sh diag     # BF16 round profiles by matmul shape (GEMM autotune on/off),
#                                      # ncu of nvfp4_moe and paged attention, attention GPU tests
#   bash perf/h200_session.sh tune     # BF16 graph round + profile, GEMM autotune off vs on, and
#                                      # the GPU tests of the new ops / paged BF16 graph replay
#   bash perf/h200_session.sh final    # BF16 rounds (3 modes + loop + profile), NVFP4+FP8 graph
#                                      # round + profile, GPU tests of the new ops
#   bash perf/h200_session.sh shared   # BF16 round with the shared expert unfused vs fused into
#                                      # the routed kernel (--fuse-shared-expert), + its GPU tests
# Env: ROUND_SPECS ("bf16:bf16 nvfp4:fp8"), ROUND_TIMEOUT (270), TEST_TIMEOUT (150). Each part
# stays under ~9 minutes of timeouts (run it with timeout_s 580).
set -u
OUT=${OUT:-/tmp/dlmc-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DLMC_CACHE=${DLMC_CACHE:-/tmp/dlmc-cache}
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | grep -v WARN | tail -1
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, dlmc; print(sys.version.split()[0], torch.__version__, triton.__version__, dlmc.__file__)"
} > "$OUT/versions.txt" 2>&1
case "${1:-rounds}" in
rounds)
  for spec in ${ROUND_SPECS:-bf16:bf16 nvfp4:fp8}; do
    set -- ${spec/:/ }
    timeout "${ROUND_TIMEOUT:-270}" dlmc bench round --shape llada2.1-mini --precision "$1" \
      --kv-cache-dtype "$2" --block-length 32 --prefix 1024 --routing uniform --rounds 60 \
      --modes eager,compile,graph --profile --loop --out "$OUT/round_$1_$2.json" \
      > "$OUT/round_$1_$2.txt" 2>&1
    echo "round $1/$2 rc=$?" >> "$OUT/round_$1_$2.txt"
    grep -E "│ (eager|compile|graph)|loop|rc=" "$OUT/round_$1_$2.txt" | head -7
  done ;;
ops)
  for v in v3 v2; do
    DLMC_NVFP4_KERNEL=$v timeout 50 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 50 \
      --out "$OUT/nvfp4_op_$v.json" > "$OUT/nvfp4_op_$v.txt" 2>&1
    echo "nvfp4 op $v rc=$?"; grep -E "tokens=32" "$OUT/nvfp4_op_$v.txt" | head -2
  done
  for kern in gate_up down; do  # one kernel's tile at a time, the other at its default
    timeout 100 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 30 --tile-kernel $kern \
      --tiles 64,128,4,3 128,128,4,3 64,128,4,4 64,128,4,5 64,256,4,3 64,64,4,5 128,128,4,4 \
      128,64,4,4 32,256,4,3 64,128,2,4 --out "$OUT/nvfp4_sweep_$kern.json" \
      > "$OUT/nvfp4_sweep_$kern.txt" 2>&1
    echo "nvfp4 sweep $kern rc=$?"; grep "tile=" "$OUT/nvfp4_sweep_$kern.txt"
  done
  timeout 90 python3 perf/bench_paged_attention.py --no-flashinfer \
    --out "$OUT/paged_attention.json" > "$OUT/paged_attention.txt" 2>&1
  echo "paged attention rc=$?"; grep -E "^triton" "$OUT/paged_attention.txt" | head -6
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -rf \
    tests/engine/test_fp8_kv.py tests/graphs/test_runner.py tests/engine/test_gpu_decoding.py \
    tests/custom_ops/test_bf16_moe.py tests/custom_ops/test_kv_append.py \
    tests/loading/test_nvfp4_loading.py \
    "tests/custom_ops/test_nvfp4_moe.py::test_compile_and_cuda_graph_replay" \
    "tests/custom_ops/test_moe_align.py::test_compile_and_graph_replay" \
    "tests/custom_ops/test_paged_attention.py::test_compile_and_cuda_graph_replay" \
    -m gpu > "$OUT/gpu_tests.txt" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.txt" ;;
shared)
  for variant in unfused fused; do
    flag=""; [ "$variant" = fused ] && flag="--fuse-shared-expert"
    timeout "${ROUND_TIMEOUT:-200}" dlmc bench round --shape llada2.1-mini --precision bf16 \
      --block-length 32 --prefix 1024 --routing uniform --rounds 60 --modes graph --profile \
      --no-loop $flag --out "$OUT/round_bf16_shared_$variant.json" \
      > "$OUT/round_bf16_shared_$variant.txt" 2>&1
    echo "round bf16 shared $variant rc=$?" >> "$OUT/round_bf16_shared_$variant.txt"
    grep -E "│ graph|rc=" "$OUT/round_bf16_shared_$variant.txt" | head -3
  done
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -rf \
    "tests/graphs/test_runner.py::test_graph_replay_with_the_shared_expert_fused_on_cuda" \
    tests/models/test_moe.py tests/custom_ops/test_bf16_moe.py > "$OUT/gpu_tests_shared.txt" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests_shared.txt" ;;
ncu)  # why nvfp4_moe v3 sits at ~44 % of copy bandwidth: occupancy, memory SOL, stalls
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout 300 "$NCU" -k "regex:_gate_up_kernel|_down_kernel" -c 2 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats \
    python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 1 --layers 1 \
    > "$OUT/ncu_nvfp4_v3.txt" 2>&1
  echo "ncu rc=$?"; grep -E "Memory Throughput|Achieved Occupancy|Registers Per|Duration" \
    "$OUT/ncu_nvfp4_v3.txt" | head -12 ;;
diag)  # BF16 round (shared expert fused; optionally Inductor GEMM autotune) with a per-kernel and
       # per-matmul-shape profile; Nsight Compute of nvfp4_moe and paged attention; attention tests
  for variant in ${DIAG_VARIANTS:-fused fused_autotune}; do
    auto=0; [ "$variant" = fused_autotune ] && auto=1
    DLMC_MAX_AUTOTUNE_GEMM=$auto timeout "${ROUND_TIMEOUT:-200}" dlmc bench round \
      --shape llada2.1-mini --precision bf16 --block-length 32 --prefix 1024 --routing uniform \
      --rounds 60 --modes graph --profile --no-loop --fuse-shared-expert \
      --out "$OUT/round_bf16_$variant.json" > "$OUT/round_bf16_$variant.txt" 2>&1
    echo "round bf16 $variant rc=$?" >> "$OUT/round_bf16_$variant.txt"
    grep -E "│ graph|rc=|compile" "$OUT/round_bf16_$variant.txt" | head -4
  done
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout 120 "$NCU" -k "regex:_gate_up_kernel|_down_kernel" -c 2 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats \
    python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 1 --layers 1 \
    > "$OUT/ncu_nvfp4_v3.txt" 2>&1
  echo "ncu nvfp4 rc=$?"; grep -E "Memory Throughput|Achieved Occupancy|Registers Per|Duration" \
    "$OUT/ncu_nvfp4_v3.txt" | head -12
  timeout 120 "$NCU" -k "regex:paged_attention" -c 4 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 perf/bench_paged_attention.py --prefixes 4096 --layers 1 --iters 1 --no-flashinfer \
    > "$OUT/ncu_paged_attention.txt" 2>&1
  echo "ncu attention rc=$?"; grep -E "Duration|Achieved Occupancy|Registers Per" \
    "$OUT/ncu_paged_attention.txt" | head -12
  timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -rf -m gpu \
    tests/custom_ops/test_paged_attention.py tests/engine/test_rules.py \
    > "$OUT/gpu_tests_attention.txt" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests_attention.txt" ;;
tune)  # BF16 graph rounds with a per-kernel profile, Inductor GEMM autotune off vs on; then the
       # GPU tests of this session's ops and of graph replay with the paged BF16 cache
  for auto in ${TUNE_AUTOTUNE:-0 1}; do
    DLMC_MAX_AUTOTUNE_GEMM=$auto timeout "${ROUND_TIMEOUT:-200}" dlmc bench round \
      --shape llada2.1-mini --precision bf16 --block-length 32 --prefix 1024 --routing uniform \
      --rounds 60 --modes graph --profile --no-loop --out "$OUT/round_bf16_autotune$auto.json" \
      > "$OUT/round_bf16_autotune$auto.txt" 2>&1
    echo "round bf16 autotune=$auto rc=$?" >> "$OUT/round_bf16_autotune$auto.txt"
    grep -E "│ graph|rc=" "$OUT/round_bf16_autotune$auto.txt" | head -3
  done
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -rf -m gpu \
    tests/custom_ops/test_qk_norm_rope.py tests/custom_ops/test_moe_route.py \
    tests/models/test_moe.py tests/graphs/test_runner.py tests/engine/test_gpu_decoding.py \
    tests/engine/test_fp8_kv.py > "$OUT/gpu_tests_tune.txt" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests_tune.txt" ;;
final)  # the session's record: BF16 rounds in all three modes + whole decodes (both refresh
        # modes) + profile; the NVFP4 + FP8 graph round + profile; GPU tests of the new ops
  timeout "${ROUND_TIMEOUT:-300}" dlmc bench round --shape llada2.1-mini --precision bf16 \
    --block-length 32 --prefix 1024 --routing uniform --rounds 60 --modes eager,compile,graph \
    --profile --loop --out "$OUT/round_bf16_final.json" > "$OUT/round_bf16_final.txt" 2>&1
  echo "round bf16 rc=$?" >> "$OUT/round_bf16_final.txt"
  grep -E "│ (eager|compile|graph)|loop|rc=" "$OUT/round_bf16_final.txt" | head -7
  timeout "${NVFP4_TIMEOUT:-170}" dlmc bench round --shape llada2.1-mini --precision nvfp4 \
    --kv-cache-dtype fp8 --block-length 32 --prefix 1024 --routing uniform --rounds 60 \
    --modes graph --profile --no-loop --out "$OUT/round_nvfp4_final.json" \
    > "$OUT/round_nvfp4_final.txt" 2>&1
  echo "round nvfp4 rc=$?" >> "$OUT/round_nvfp4_final.txt"
  grep -E "│ graph|rc=" "$OUT/round_nvfp4_final.txt" | head -3
  timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -q -p no:cacheprovider -rf -m gpu \
    tests/custom_ops/test_qk_norm_rope.py tests/custom_ops/test_moe_route.py \
    tests/graphs/test_runner.py > "$OUT/gpu_tests_final.txt" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests_final.txt" ;;
*) echo "usage: $0 rounds|ops|shared|ncu|diag|tune|final" >&2; exit 2 ;;
esac
