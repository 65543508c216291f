#!/usr/bin/env bash
# The GPU runs behind perf/README.md's figures, and the gpu-marked tests, in parts that each fit
# one 10-minute device call. On the GPU machine, from the repository root:
#   bash perf/gpu.sh PART        (carry .whl: wheels the machine lacks, e.g. pytest-xdist,
#                                 flashinfer-python; they are installed first)
# Parts:
#   rounds       the BF16 round, then the NVFP4-experts + FP8-KV round (one process each)
#   ops          dlmc::nvfp4_moe alone (routed experts; with the shared expert), dlmc::bf16_moe
#                alone, paged attention at 1k / 4k / 16k (and FlashInfer when installed)
#   sampled      the NVFP4 + FP8 round sampled at temperature 0.7
#   loop         the BF16 round with whole decodes: the decode loop's host overhead
#   post-attention  the NVFP4 + FP8 round profiled with dlmc::linear_residual and
#                dlmc::norm_router_gemm (the default) and without (--no-fused-post-attention-norm;
#                one process each), then those ops' GPU tests and the LLaDA2 rounds' on CUDA
#   canvas [P]   DiffusionGemma-26B-A4B's denoising step, canvas 256, prefix 1024, graph mode,
#                profiled (default kernels: dlmc's experts and attention): BF16, then NVFP4 +
#                FP8 KV (one process each; a cold compile takes minutes; CANVAS_LIMIT seconds
#                each, 270). P: bf16 or nvfp4 alone.
#   canvas-dense  DiffusionGemma's dense products alone at 256 rows (bench_dense.py, cuBLAS)
#   canvas-sampler  DiffusionGemma's step proposal alone (256 x 262144): dlmc::canvas_propose
#                against the torch ops compiled by Inductor, and the op's work splits
#                (ProposeTiles: chunk, block, warps), then the op's gpu-marked tests
#   canvas-projections  the proposal alone (bench_canvas_sampler.py: the torch form, the op after
#                Inductor's cap, the op capping itself), then the BF16 step profiled with
#                separate and with fused q/k/v and gate/up projections (--gemma-fused-projections)
#   canvas-ops [A [KV]]  dlmc::paged_attention's launch variants (the chunked and the
#                speculative merge, split-kernel tiles) alone at DiffusionGemma's canvas
#                shapes, FP8 and BF16 caches (KV: fp8 or bf16 alone), against torch's SDPA
#                over the same keys laid out contiguously in BF16, then dlmc::nvfp4_moe at
#                the canvas shapes (width 768, as loaded): the op's choice and NVFP4Tiles.
#                A: "attention" or "experts" for one half alone
#   canvas-pad   dlmc::nvfp4_moe alone at DiffusionGemma's width (704, kernel v3) and widened
#                to 768 (kernel v7), then the NVFP4 + FP8 step without and with the
#                widening (--no-nvfp4-pad-experts, then the default; one process each;
#                proposal in torch ops, --gemma-sampler torch, as perf/README's row)
#   canvas-tiles [T]  the NVFP4 + FP8 step profiled with the op's tiles, then with
#                --nvfp4-tiles T (block_m=32: one routing block per expert; one process
#                each, CANVAS_LIMIT seconds each)
#   canvas-reductions  the BF16 step profiled with Inductor's split reductions and without
#                (--split-reductions on, then off: the torch-op sampler's rows, --gemma-sampler
#                torch, one program each)
#   canvas-experts  DiffusionGemma's BF16 experts alone (dlmc::bf16_moe's launch and block_m
#                sweeps against torch._grouped_mm), then the BF16 step with them in
#                torch._grouped_mm and in dlmc::bf16_moe (--gemma-bf16-experts triton), profiled
#   canvas-loop  a whole graph-mode DiffusionGemma BF16 decode's host overhead (--loop; the
#                step timed eager only)
#   hf-gemma     dlmc's BF16 DiffusionGemma step (graph), then transformers' own step at the
#                same shape (bench_hf_gemma.py: eager, then its compiled static-cache path;
#                one process each) and the ratio
#   tests-NAME   pytest -m gpu of one test part, NAME one of TEST_PARTS below
#   list         each test part's files; checks that the parts hold every gpu-marked test file
#                exactly once (runs nothing, needs no GPU)
# Output in $OUT: versions.txt, PART.txt (every command and its output), the benches' JSON.
# Env: OUT (/tmp/dlmc-out), DLMC_CACHE (/tmp/dlmc-cache), TEST_TIMEOUT (560 seconds),
#      CANVAS_LIMIT (270 seconds), HF_LIMIT (330 seconds).
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/dlmc-out}
PART=${1:-}
TEST_PARTS="default op runner kernels rest fuzz-moe fuzz-gelu fuzz-other"
# Each part's test files: an extended regex over the paths of the gpu-marked files, chosen when
# the script runs (a renamed file falls to `rest`, which takes every file no pattern matches).
declare -A PATTERN=(
  [default]="test_nvfp4_loading|test_moe_overlap|tests/models/test_moe\.py|test_pdl"
  [op]="test_nvfp4_moe\.py"
  [runner]="tests/graphs/test_runner\.py"
  [kernels]="gluon|test_paged_attention_variants|test_paged_attention_append"
  [fuzz-moe]="test_nvfp4_moe_v7\.py"
  [fuzz-gelu]="test_nvfp4_moe_gelu\.py"
  [fuzz-other]="test_paged_attention\.py"
)
ROUND=(dlmc bench round --shape llada2.1-mini --block-length 32 --prefix 1024 --routing uniform
       --rounds 60)
NVFP4=(--precision nvfp4 --kv-cache-dtype fp8)
GEMMA_TILES=(base merge-spec t64x32w8 t64x32w4)
CANVAS=(dlmc bench round --shape diffusiongemma-26b-a4b --canvas 256 --prefix 1024
        --routing uniform --rounds 40 --modes eager,graph)

gpu_files() { grep -rl "mark.gpu" tests --include="test_*.py" | sort; }

part_files() {  # part_files NAME: the test part's files, one per line
  local all
  if [ "$1" = rest ]; then
    all=$(IFS='|'; echo "${PATTERN[*]}")
    gpu_files | grep -vE "$all"
  elif [ -n "${PATTERN[$1]+set}" ]; then
    gpu_files | grep -E "${PATTERN[$1]}"
  else
    echo "gpu.sh: unknown test part '$1' (expected one of: $TEST_PARTS)" >&2
    return 2
  fi
  return 0
}

setup() {  # install the wheels and the checkout, record the machine
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1 DLMC_CACHE=${DLMC_CACHE:-/tmp/dlmc-cache}
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARN
  {
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
    python3 -c "import platform, torch, triton; print('python', platform.python_version(),
      'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  } > "$OUT/versions.txt" 2>&1
  cat "$OUT/versions.txt"
}

step() {  # step NAME LIMIT COMMAND...: COMMAND under a time limit, output into $OUT/PART.txt
  local name=$1 limit=$2 rc
  shift 2
  echo "== $name: $*" >> "$OUT/$PART.txt"
  timeout "$limit" "$@" >> "$OUT/$PART.txt" 2>&1
  rc=$?
  echo "== $name rc=$rc" | tee -a "$OUT/$PART.txt"
}

summary() {  # the lines of $OUT/PART.txt that hold the figures
  local figures='│ +(graph|queued|flight)|host overhead|"nvfp4_ms_per_layer"|of_copy'
  grep -E "^== [a-z0-9_]+: |$figures|^(triton|flashinfer|torch-sdpa) +(default|fa2 run|flash|cudnn|efficient) " "$OUT/$PART.txt" \
    | cut -c1-160
}

case "$PART" in
list)
  for name in $TEST_PARTS; do
    echo "== $name"; part_files "$name"
  done
  listed=$(for name in $TEST_PARTS; do part_files "$name"; done | sort)
  if [ "$listed" != "$(gpu_files)" ]; then
    echo "gpu.sh: the test parts do not hold every gpu-marked file exactly once" >&2
    diff <(gpu_files) <(echo "$listed") >&2
    exit 1
  fi
  echo "$(gpu_files | wc -l) gpu-marked test files, each in one part" ;;
rounds)
  setup
  step round_bf16 270 "${ROUND[@]}" --precision bf16 --modes graph --no-loop --profile \
    --out "$OUT/round_bf16.json"
  step round_nvfp4_fp8 270 "${ROUND[@]}" "${NVFP4[@]}" --modes graph --no-loop --profile \
    --out "$OUT/round_nvfp4_fp8.json"
  summary ;;
ops)
  setup
  export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
  step op_nvfp4_routed 120 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 \
    --profile --out "$OUT/op_nvfp4_routed.json"
  step op_nvfp4_shared 120 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 \
    --shared-expert --profile --out "$OUT/op_nvfp4_shared.json"
  step op_bf16_moe 90 python3 perf/bench_bf16_moe.py --out "$OUT/op_bf16_moe.json"
  step attention 200 python3 perf/bench_paged_attention.py --prefixes 1024 4096 16384 \
    --capacity 32768 --out "$OUT/attention.json"
  summary ;;
sampled)
  setup
  step round_nvfp4_fp8_temperature 300 "${ROUND[@]}" "${NVFP4[@]}" --modes graph --no-loop \
    --temperature 0.7 --out "$OUT/round_nvfp4_fp8_temperature.json"
  summary ;;
post-attention)
  setup
  for fused in fused no-fused; do
    step "round_nvfp4_fp8_${fused//-/_}" 200 "${ROUND[@]}" "${NVFP4[@]}" --modes graph --no-loop \
      --profile "--$fused-post-attention-norm" --out "$OUT/round_nvfp4_fp8_${fused//-/_}.json"
  done
  workers=""
  python3 -c "import xdist" 2> /dev/null && workers="-n 4"
  # shellcheck disable=SC2086  # the workers option
  step post_attention_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider $workers \
    tests/custom_ops/test_linear_residual.py tests/custom_ops/test_norm_router_gemm.py \
    tests/graphs/test_runner.py tests/engine/test_gpu_decoding.py tests/engine/test_fp8_kv.py
  grep -E "device launches|passed|failed" "$OUT/$PART.txt" | cut -c1-200
  summary ;;
canvas)
  setup
  for precision in ${2:-bf16 nvfp4}; do
    kv=$([ "$precision" = bf16 ] && echo bf16 || echo fp8)
    step "canvas_${precision}_$kv" "${CANVAS_LIMIT:-270}" "${CANVAS[@]}" --modes graph \
      --precision "$precision" --kv-cache-dtype "$kv" --no-loop --profile \
      --out "$OUT/canvas_${precision}_$kv.json"
  done
  summary ;;
canvas-dense)
  setup
  step dense 150 python3 perf/bench_dense.py --out "$OUT/dense.json"
  grep -E "µs|rc=" "$OUT/$PART.txt" | cut -c1-200 ;;
canvas-sampler)
  setup
  step sampler 200 python3 perf/bench_canvas_sampler.py --out "$OUT/sampler.json" \
    --tiles 8192,1024,8 4096,1024,4 16384,1024,4 8192,2048,8
  step sampler_tests 300 python3 -m pytest -q -m gpu tests/custom_ops/test_canvas_propose.py
  grep -E "µs|copy|passed|failed" "$OUT/$PART.txt" | cut -c1-200 ;;
canvas-projections)
  setup
  step sampler 120 python3 perf/bench_canvas_sampler.py --out "$OUT/sampler.json"
  for fused in separate fused; do
    flags=()
    [ "$fused" = fused ] && flags=(--gemma-fused-projections)
    step "canvas_bf16_$fused" 230 "${CANVAS[@]}" --modes graph --precision bf16 --no-loop \
      --profile "${flags[@]}" --out "$OUT/canvas_bf16_$fused.json"
  done
  grep -E "µs|copy" "$OUT/$PART.txt" | grep -v "^ " | cut -c1-200
  summary ;;
canvas-ops)
  setup
  [ "${2:-}" = experts ] && kvs="" || kvs=${3:-fp8 bf16}
  for kv in $kvs; do  # dlmc::paged_attention at the canvas's shapes, prefix 1024, tiles
    step "attention_gemma_sliding_$kv" 140 python3 perf/bench_paged_attention.py --no-flashinfer \
      --prefixes 1024 --layers 25 --num-queries 256 --q-heads 16 --kv-heads 8 --head-dim 256 \
      --kv-dtype "$kv" --sweep "${GEMMA_TILES[@]}" --torch-sdpa \
      --out "$OUT/attention_gemma_sliding_$kv.json"
    step "attention_gemma_full_$kv" 140 python3 perf/bench_paged_attention.py --no-flashinfer \
      --prefixes 1024 --layers 5 --num-queries 256 --q-heads 16 --kv-heads 2 --head-dim 512 \
      --kv-dtype "$kv" --sweep "${GEMMA_TILES[@]}" --torch-sdpa \
      --out "$OUT/attention_gemma_full_$kv.json"
  done
  [ "${2:-}" = attention ] && { summary; exit 0; }
  # dlmc::nvfp4_moe at the canvas's shapes, experts widened to 768 as loaded (kernel v7): the
  # op's choice (16-slot blocks, the Triton kernels), then changes to it (NVFP4Tiles)
  for tiles in "" block_m=32 block_m=64 gate_up_warps=8,down_warps=8 num_stages=4; do
    step "op_gemma_nvfp4${tiles:+_${tiles//[=,]/_}}" 60 python3 perf/bench_nvfp4_moe.py --hidden 2816 \
      --inter 768 --experts 128 --tokens 256 --activation gelu_tanh --layers 12 \
      ${tiles:+--tiles "$tiles"}
  done
  summary ;;
canvas-tiles)
  setup
  for tiles in "" "${2:-block_m=32}"; do
    step "canvas_nvfp4_fp8${tiles:+_${tiles//[=,]/_}}" "${CANVAS_LIMIT:-270}" "${CANVAS[@]}" \
      --modes graph --precision nvfp4 --kv-cache-dtype fp8 --no-loop --profile \
      --nvfp4-tiles "$tiles" --out "$OUT/canvas_nvfp4_fp8${tiles:+_${tiles//[=,]/_}}.json"
  done
  summary ;;
canvas-pad)
  setup
  for inter in 704 768; do
    step "op_gemma_nvfp4_i$inter" 60 python3 perf/bench_nvfp4_moe.py --hidden 2816 \
      --inter "$inter" --experts 128 --tokens 256 --activation gelu_tanh --layers 12
  done
  for pad in no-nvfp4-pad-experts nvfp4-pad-experts; do
    step "canvas_nvfp4_fp8_${pad//-/_}" 230 "${CANVAS[@]}" --modes graph --precision nvfp4 \
      --kv-cache-dtype fp8 --gemma-sampler torch --no-loop "--$pad" \
      --out "$OUT/canvas_nvfp4_fp8_${pad//-/_}.json"
  done
  summary ;;
canvas-reductions)
  setup
  for split in on off; do
    step "canvas_bf16_split_$split" 280 "${CANVAS[@]}" --modes graph --precision bf16 \
      --gemma-sampler torch --no-loop --profile --split-reductions "$split" \
      --out "$OUT/canvas_bf16_split_$split.json"
  done
  summary ;;
canvas-experts)
  setup
  step op_gemma_gate_up 80 python3 perf/bench_bf16_moe.py --shape diffusiongemma --grouped-mm \
    --block-m 32 64 --configs 32,128,4,4 64,64,4,4 128,64,4,3 32,256,4,3 \
    --out "$OUT/op_gemma_gate_up.json"
  step op_gemma_down 60 python3 perf/bench_bf16_moe.py --shape diffusiongemma --kernel down \
    --configs 128,64,4,3 64,64,4,4 128,128,8,3 --out "$OUT/op_gemma_down.json"
  for experts in grouped_mm triton; do
    step "canvas_bf16_$experts" 200 "${CANVAS[@]}" --modes graph --precision bf16 --no-loop \
      --profile --gemma-bf16-experts "$experts" --out "$OUT/canvas_bf16_$experts.json"
  done
  summary ;;
canvas-loop)
  setup
  # eager steps only: the loop compiles and captures its own graphs (its cache is longer than
  # the step bench's, so a graph mode here would be a second cold compile of minutes)
  step canvas_bf16_loop 560 "${CANVAS[@]}" --modes eager --precision bf16 --kv-cache-dtype bf16 \
    --loop --out "$OUT/canvas_bf16_loop.json"
  summary ;;
hf-gemma)
  setup
  step canvas_bf16_bf16 230 "${CANVAS[@]}" --modes graph --precision bf16 --kv-cache-dtype bf16 \
    --no-loop --out "$OUT/canvas_bf16_bf16.json"
  step hf_gemma "${HF_LIMIT:-330}" python3 perf/bench_hf_gemma.py --prefix 1024 \
    --against "$OUT/canvas_bf16_bf16.json" --out "$OUT/hf_gemma.json"
  summary
  grep -E "^(built|transformers) " "$OUT/$PART.txt" | cut -c1-200 ;;
loop)
  setup
  step round_bf16_loop 560 "${ROUND[@]}" --precision bf16 --modes graph --loop \
    --out "$OUT/round_bf16_loop.json"
  summary ;;
tests-*)
  files=$(part_files "${PART#tests-}") || exit 2
  [ -n "$files" ] || { echo "gpu.sh: test part ${PART#tests-} holds no gpu-marked file"; exit 0; }
  setup
  echo "$files" > "$OUT/$PART.files.txt"
  workers=""
  python3 -c "import xdist" 2> /dev/null && workers="-n 4"
  # shellcheck disable=SC2086  # one argument per file, and the workers option
  step pytest "${TEST_TIMEOUT:-560}" python3 -m pytest -v -p no:cacheprovider -rf -m gpu \
    $workers $files
  grep -E "FAILED|ERROR|passed|failed" "$OUT/$PART.txt" | tail -20 ;;
*)
  echo "usage: bash perf/gpu.sh rounds|ops|sampled|loop|post-attention|canvas|canvas-sampler|canvas-projections|canvas-ops|canvas-tiles|canvas-pad|canvas-reductions|canvas-dense|canvas-experts|canvas-loop|hf-gemma|list|tests-NAME" \
    "(NAME: ${TEST_PARTS// /, })" >&2
  exit 2 ;;
esac
