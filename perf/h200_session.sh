#!/usr/bin/env bash
# H200 runs, in parts that each fit one 10-minute device call (run with timeout_s ~590).
# Outputs go to $OUT. Full-size rounds compile for about a minute each on a fresh machine.
#   bash perf/h200_session.sh final    # the record: BF16 rounds (eager, compiled, graph + whole
#                                      # decodes + profile), NVFP4+FP8 graph round + profile,
#                                      # GPU tests of the newest ops
#   bash perf/h200_session.sh rounds   # ROUND_SPECS ("bf16:bf16 nvfp4:fp8"): all three modes +
#                                      # loop + profile per spec (one spec per call when cold)
#   bash perf/h200_session.sh ops      # nvfp4_moe v3 vs v4 (+ shared tail), tile sweeps of
#                                      # SWEEP_KERNELS (v3; deeper pipelines: session 13's
#                                      # static occupancy table), paged attention,
#                                      # the kernels' GPU tests
#   bash perf/h200_session.sh words    # nvfp4_moe v3-v6 alone, v5/v6 tile sweeps, their GPU tests
#   bash perf/h200_session.sh codes    # session 15's first call: v7 (one-byte scale codes) against
#                                      # v5 alone and in the NVFP4 round, v7's GPU tests
#   bash perf/h200_session.sh defaults # v7's GPU fuzz, NVFP4 + FP8 and BF16 rounds at the defaults
#   bash perf/h200_session.sh moe      # dlmc::bf16_moe alone, launch-config sweeps (MOE_CONFIGS)
#   bash perf/h200_session.sh gemm     # dlmc::small_m_linear vs cuBLAS, sweeps (GEMM_CONFIGS)
#   bash perf/h200_session.sh share    # NVFP4+FP8 graph round at PREFIX (4096) + profile, then
#                                      # the attention variants (SWEEP) at 1k/4k/16k
#   bash perf/h200_session.sh tests    # the gpu-marked tests of TESTS
#   bash perf/h200_session.sh rope     # Inductor's output code of a BF16 round (rope call sites)
#   source perf/h200_session.sh lib   # install, then call round / gpu_tests / ncu_run by hand
#   bash perf/h200_session.sh ncu      # Nsight Compute of nvfp4_moe and paged attention
#   bash perf/h200_session.sh repeat   # the BF16 graph round in REPEATS (3) fresh processes
#   bash perf/h200_session.sh s16      # session 16's rounds (each change off in turn) + GPU tests
#   bash perf/h200_session.sh s17      # session 17: the op per token count, old vs new kernels
#   bash perf/h200_session.sh s18      # DLMC_FUSED_ROUTE_ALIGN=last vs default, its GPU tests,
#                                      # perf/probe_pdl.py, a round with Inductor's PDL
#   bash perf/h200_session.sh s18b     # DLMC_PDL=1 vs default, its GPU test
#   bash perf/h200_session.sh s18c     # tokens of a tiny NVFP4 model per launch switch
#   bash perf/h200_session.sh s19      # DLMC_DETERMINISTIC_COMPILE=1 vs default, DLMC_PDL's test
#   bash perf/h200_session.sh s19b     # three fresh compiles' tokens, deterministic mode or not
#   bash perf/h200_session.sh s19p     # the L2 prefetch probe, DLMC_PDL's GPU test
#   bash perf/h200_session.sh s19q     # split-K linear sweep, round with DLMC_SMALL_M_GEMM=splitk
#   bash perf/h200_session.sh s19r     # split-K tests, rounds default / splitk / splitk + PDL
#   bash perf/h200_session.sh s19d     # fresh compiles' tokens with/without deterministic mode
#   bash perf/h200_session.sh s19e     # model GPU tests, tiny tokens again, BF16 splitk vs cublas
#   bash perf/h200_session.sh variants # graph round + profile per VARIANTS entry, each
#                                      # "name:ENV=VAL,...:flag,flag" (commas for spaces);
#                                      # PRECISION (bf16) and KV_DTYPE (bf16) for all of them
# Env: ROUND_TIMEOUT (300), NVFP4_TIMEOUT (170), TEST_TIMEOUT (150).
set -u
OUT=${OUT:-/tmp/dlmc-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DLMC_CACHE=${DLMC_CACHE:-/tmp/dlmc-cache}
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | grep -v WARN | tail -1
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  # the machine's state: SM / memory clocks, power, temperature, active throttle reasons
  nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active --format=csv
  python3 -c "import sys, torch, triton, dlmc; print(sys.version.split()[0], torch.__version__, triton.__version__, dlmc.__file__)"
} > "$OUT/versions.txt" 2>&1

# round NAME TIMEOUT ARGS...: one `dlmc bench round` at LLaDA2.1-mini shapes into $OUT/NAME.*
round() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" dlmc bench round --shape llada2.1-mini --block-length 32 --prefix 1024 \
    --routing uniform --rounds 60 --profile --out "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$?" >> "$OUT/$name.txt"
  grep -E "│ +(eager|compile|graph)|loop|rc=" "$OUT/$name.txt" | head -7
}

# gpu_tests NAME FILES...: the gpu-marked tests of FILES into $OUT/gpu_tests_NAME.txt, one
# line per test as it finishes (-v), so a run cut off by its timeout still names its failures
gpu_tests() {
  local name=$1; shift
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -v -p no:cacheprovider -rf -m gpu "$@" \
    > "$OUT/gpu_tests_$name.txt" 2>&1
  echo "gpu tests $name rc=$?"; tail -3 "$OUT/gpu_tests_$name.txt"
}

# op_env NAME ENV=VALUE [bench args]: the op alone (routed experts, 32 tokens, Gluon down
# kernel) with ENV=VALUE into $OUT/NAME.* (its summary by h200_s27.sh's `op_rows`)
op_env() {
  local name=$1 setting=$2; shift 2
  env "$setting" timeout 120 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 \
    --downs gluon "$@" --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$? $(op_rows "$OUT/$name.txt")"
}

# ab_rounds ENV=VALUE NAME [LIMIT]: the NVFP4 + FP8 graph round at the defaults
# (round_nvfp4_default) and with ENV=VALUE (round_nvfp4_NAME), one after the other
ab_rounds() {
  local setting=$1 name=$2 limit=${3:-200}
  local args=(--precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop)
  round round_nvfp4_default "$limit" "${args[@]}"
  ( export "$setting"; round "round_nvfp4_$name" "$limit" "${args[@]}" )
}

# swapped FILE ALT COMMAND...: COMMAND with FILE's text replaced by ALT's for its duration;
# COMMAND's exit status
swapped() {
  local file=$1 alt=$2 rc; shift 2
  cp "$file" /tmp/swapped.orig && cp "$alt" "$file"
  "$@"; rc=$?
  cp /tmp/swapped.orig "$file"
  return $rc
}

# tar_out NAME: everything in $OUT as $OUT/NAME.tgz (a call returns at most 8 files)
tar_out() {
  tar -C "$OUT" -czf "/tmp/$1.tgz" . && rm -rf "${OUT:?}"/* && mv "/tmp/$1.tgz" "$OUT/"
}

# ncu_run NAME KERNEL_REGEX COUNT COMMAND...: Nsight Compute sections into $OUT/ncu_NAME.txt
ncu_run() {
  local name=$1 kernels=$2 count=$3; shift 3
  timeout 150 "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" -k "regex:$kernels" -c "$count" \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    "$@" > "$OUT/ncu_$name.txt" 2>&1
  echo "ncu $name rc=$?"; grep -E "Duration|Memory Throughput|Achieved Occupancy|Registers Per" \
    "$OUT/ncu_$name.txt" | head -12
}

case "${1:-final}" in
final)
  round round_bf16_final "${ROUND_TIMEOUT:-300}" --precision bf16 --modes eager,compile,graph \
    --loop
  round round_nvfp4_final "${NVFP4_TIMEOUT:-170}" --precision nvfp4 --kv-cache-dtype fp8 \
    --modes graph --no-loop
  gpu_tests final tests/custom_ops/test_qk_norm_rope.py tests/custom_ops/test_moe_route.py \
    tests/custom_ops/test_small_m_linear.py tests/custom_ops/test_router_gemm.py \
    tests/graphs/test_runner.py \
    tests/loading/test_nvfp4_loading.py ;;
rounds)
  for spec in ${ROUND_SPECS:-bf16:bf16 nvfp4:fp8}; do
    round "round_${spec/:/_}" "${ROUND_TIMEOUT:-300}" --precision "${spec%%:*}" \
      --kv-cache-dtype "${spec##*:}" --modes eager,compile,graph --loop
  done ;;
repeat)  # the BF16 graph round in REPEATS fresh processes (Inductor cache warm after the first):
  # the spread between processes on one machine, beside the spread between machines
  for i in $(seq 1 "${REPEATS:-3}"); do
    round "round_bf16_repeat$i" "${ROUND_TIMEOUT:-200}" --precision bf16 --modes graph --no-loop
  done ;;
s18b)  # session 18, call 2: DLMC_PDL=1 (every dlmc kernel of the round and Inductor's own with
  # programmatic dependent launch) against the default, same machine; its GPU tests; tarred
  ab_rounds DLMC_PDL=1 pdl
  gpu_tests s18b tests/custom_ops/test_pdl.py
  tar_out s18b ;;
s18c)  # session 18, call 3: which switch changes the tiny NVFP4 model's tokens (perf/check_pdl.py):
  # traced ops, eager, opaque ops without PDL, DLMC_PDL=1, Inductor's PDL alone; then the
  # NVFP4 round with DLMC_PDL=1 (our kernels only) against the default
  M=/tmp/pdl-model; python3 perf/check_pdl.py --model $M --write
  names=""
  for v in base:: eager::eager opaque:DLMC_PDL=opaque: pdl:DLMC_PDL=1: \
           inductor:TORCHINDUCTOR_ENABLE_PDL=1:; do
    IFS=: read -r name envs mode <<< "$v"
    (
      for e in ${envs//,/ }; do export "$e"; done
      timeout 150 python3 perf/check_pdl.py --model $M --out "$OUT/check_$name" \
        --mode "${mode:-graph}" > "$OUT/check_$name.txt" 2>&1
      echo "$name rc=$?"; tail -1 "$OUT/check_$name.txt"
    )
    names="$names $OUT/check_$name"
  done
  python3 perf/check_pdl.py --compare $names | tee "$OUT/check_compare.txt"
  ab_rounds DLMC_PDL=1 pdl 150  # now without Inductor's PDL
  tar_out s18c ;;
s19)  # prepared in session 18: the NVFP4 round with Inductor's deterministic mode against the
  # default (same machine, own caches), then DLMC_PDL's revised GPU test; tarred
  ab_rounds DLMC_DETERMINISTIC_COMPILE=1 deterministic
  gpu_tests s19 tests/custom_ops/test_pdl.py
  tar_out s19 ;;
s19b)  # do separate compiles agree? The tiny NVFP4 model's tokens from three fresh caches, with
  # and without DLMC_DETERMINISTIC_COMPILE=1 (perf/check_pdl.py); tarred
  M=/tmp/det-model; python3 perf/check_pdl.py --model $M --write
  for det in 0 1; do
    names=""
    for i in 1 2 3; do
      DLMC_DETERMINISTIC_COMPILE=$det DLMC_CACHE=/tmp/det-cache-$det-$i timeout 150 \
        python3 perf/check_pdl.py --model $M --out "$OUT/det${det}_$i" --rounds 1 \
        > "$OUT/det${det}_$i.txt" 2>&1
      echo "det=$det run $i rc=$?"; tail -1 "$OUT/det${det}_$i.txt"
      names="$names $OUT/det${det}_$i"
    done
    python3 perf/check_pdl.py --compare $names | tee "$OUT/det${det}_compare.txt"
  done
  tar_out s19b ;;
s19p)  # session 19's first call: does asking L2 for a weight early help (perf/probe_l2_prefetch.py
  # with cuBLAS GEMMs), and DLMC_PDL's GPU test; tarred. (The call also timed nvfp4_moe's
  # down-tile prefetch, DLMC_NVFP4_DOWN_PREFETCH, as of commit e7784da; removed since: slower.)
  timeout 120 python3 perf/probe_l2_prefetch.py --out "$OUT/probe_l2_prefetch.json" \
    > "$OUT/probe_l2_prefetch.txt" 2>&1; echo "probe rc=$?"; grep -v "^    " "$OUT/probe_l2_prefetch.txt" | tail -8
  gpu_tests s19p tests/custom_ops/test_pdl.py
  tar_out s19p ;;
s19q)  # session 19's second call: dlmc::split_k_linear against cuBLAS (sweep), the NVFP4 round
  # with DLMC_SMALL_M_GEMM=splitk against the default, its GPU test; tarred
  timeout 150 python3 perf/bench_small_m_linear.py --copies 20 --iters 40 --configs \
    splitk:16,4,128,4,4 splitk:64,4,128,4,4 splitk:32,8,128,4,3 splitk:64,8,128,4,3 \
    splitk:32,2,128,4,4 splitk:32,4,256,4,2 --out "$OUT/split_k_linear.json" \
    > "$OUT/split_k_linear.txt" 2>&1
  echo "bench rc=$?"; grep -E "^(qkv|o_proj|mlp)" "$OUT/split_k_linear.txt" | grep -v "err"
  ab_rounds DLMC_SMALL_M_GEMM=splitk splitk 190
  gpu_tests s19q tests/custom_ops/test_split_k_linear.py
  tar_out s19q ;;
s19r)  # session 19's third call: the split-K GPU tests (+ router_gemm's, whose kernel it shares),
  # then NVFP4 rounds: default, DLMC_SMALL_M_GEMM=splitk (o_proj), that + both PDL switches
  gpu_tests s19r tests/custom_ops/test_split_k_linear.py tests/custom_ops/test_router_gemm.py
  args=(--precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop)
  round round_nvfp4_default 170 "${args[@]}"
  ( export DLMC_SMALL_M_GEMM=splitk; round round_nvfp4_splitk 150 "${args[@]}" )
  ( export DLMC_SMALL_M_GEMM=splitk DLMC_PDL=1 TORCHINDUCTOR_ENABLE_PDL=1
    round round_nvfp4_splitk_pdl 150 "${args[@]}" )
  tar_out s19r ;;
s19d)  # session 19's fourth call: do separate compiles of the tiny NVFP4 model agree, without
  # and with DLMC_DETERMINISTIC_COMPILE=1 (two fresh caches each; eager as a third reference),
  # then the NVFP4 round at the defaults against deterministic mode; tarred
  M=/tmp/det-model; python3 perf/check_pdl.py --model $M --write > "$OUT/det_write.txt" 2>&1
  timeout 90 python3 perf/check_pdl.py --model $M --out "$OUT/eager" --rounds 1 --mode eager \
    > "$OUT/eager.txt" 2>&1; echo "eager rc=$?"; tail -1 "$OUT/eager.txt"
  for det in 0 1; do
    names="$OUT/eager"
    for i in 1 2; do
      DLMC_DETERMINISTIC_COMPILE=$det TORCHINDUCTOR_CACHE_DIR=/tmp/det-ind-$det-$i \
        DLMC_CACHE=/tmp/det-cache-$det-$i timeout 120 python3 perf/check_pdl.py --model $M \
        --out "$OUT/det${det}_$i" --rounds 2 > "$OUT/det${det}_$i.txt" 2>&1
      echo "det=$det run $i rc=$?"; tail -1 "$OUT/det${det}_$i.txt"
      names="$names $OUT/det${det}_$i"
    done
    python3 perf/check_pdl.py --compare $names | tee "$OUT/det${det}_compare.txt"
  done
  ab_rounds DLMC_DETERMINISTIC_COMPILE=1 deterministic 170
  tar_out s19d ;;
s19e)  # session 19's last call: GPU tests of the model paths the split-K default touches; the
  # tiny model's tokens again (against call 4's, another fresh start); BF16 rounds splitk vs cublas
  gpu_tests s19e tests/graphs/test_runner.py tests/models/test_llada2.py
  M=/tmp/det-model; python3 perf/check_pdl.py --model $M --write > "$OUT/det_write.txt" 2>&1
  for det in 0 1; do
    DLMC_DETERMINISTIC_COMPILE=$det TORCHINDUCTOR_CACHE_DIR=/tmp/det-ind-$det \
      DLMC_CACHE=/tmp/det-cache-$det timeout 100 python3 perf/check_pdl.py --model $M \
      --out "$OUT/det${det}_3" --rounds 2 > "$OUT/det${det}_3.txt" 2>&1
    echo "det=$det rc=$?"; tail -1 "$OUT/det${det}_3.txt"
  done
  args=(--precision bf16 --modes graph --no-loop)
  round round_bf16_default 170 "${args[@]}"
  ( export DLMC_SMALL_M_GEMM=cublas; round round_bf16_cublas 150 "${args[@]}" )
  tar_out s19e ;;
variants)  # e.g. VARIANTS="base:: gemm:DLMC_SMALL_M_GEMM=triton: dense::--kv-layout,dense"
  for v in ${VARIANTS:-base:: gemm:DLMC_SMALL_M_GEMM=triton: dense::--kv-layout,dense}; do
    IFS=: read -r name envs flags <<< "$v"
    (  # the variant's environment stays in this subshell
      for e in ${envs//,/ }; do export "$e"; done
      round "round_${PRECISION:-bf16}_$name" "${ROUND_TIMEOUT:-200}" --precision \
        "${PRECISION:-bf16}" --kv-cache-dtype "${KV_DTYPE:-bf16}" --modes graph --no-loop \
        ${flags//,/ }
    )
  done ;;
ops)
  # v3 and v4 in one process (same weights and routing), with and without the shared tail
  timeout 80 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 50 --kernels v3 v4 \
    --shared-expert --out "$OUT/nvfp4_op_v3_v4.json" > "$OUT/nvfp4_op_v3_v4.txt" 2>&1
  echo "nvfp4 op v3 v4 rc=$?"; grep -E "tokens=32" "$OUT/nvfp4_op_v3_v4.txt" | head -8
  for kern in gate_up down; do  # one kernel's tile at a time, the other at its default
    timeout 100 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 30 --tile-kernel $kern \
      --kernels ${SWEEP_KERNELS:-v3} \
      --tiles ${NVFP4_TILES:-64,128,4,3 64,128,4,4 64,128,4,5 64,128,4,6 64,64,4,6 64,64,4,8 \
      128,128,4,3 128,128,4,4 64,256,4,3 32,128,4,6 64,128,8,4 128,128,8,4} \
      --out "$OUT/nvfp4_sweep_$kern.json" \
      > "$OUT/nvfp4_sweep_$kern.txt" 2>&1
    echo "nvfp4 sweep $kern rc=$?"; grep "tile=" "$OUT/nvfp4_sweep_$kern.txt"
  done
  timeout 90 python3 perf/bench_paged_attention.py --no-flashinfer \
    --out "$OUT/paged_attention.json" > "$OUT/paged_attention.txt" 2>&1
  echo "paged attention rc=$?"; grep -E "^triton" "$OUT/paged_attention.txt" | head -6
  gpu_tests ops tests/engine/test_fp8_kv.py tests/engine/test_gpu_decoding.py \
    tests/custom_ops/test_bf16_moe.py tests/custom_ops/test_kv_append.py \
    tests/loading/test_nvfp4_loading.py \
    "tests/custom_ops/test_nvfp4_moe.py::test_compile_and_cuda_graph_replay" \
    "tests/custom_ops/test_moe_align.py::test_compile_and_graph_replay" \
    "tests/custom_ops/test_paged_attention.py::test_compile_and_cuda_graph_replay" ;;
words)  # session 14: nvfp4_moe v5/v6 (nvfp4_words' layout) against v3/v4, tiles, GPU tests
  timeout 100 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 50 --kernels ${OP_KERNELS:-v3 v4 v5 v6} \
    --shared-expert --out "$OUT/nvfp4_op_v3_to_v6.json" > "$OUT/nvfp4_op_v3_to_v6.txt" 2>&1
  echo "nvfp4 op v3-v6 rc=$?"; grep -E "tokens=32" "$OUT/nvfp4_op_v3_to_v6.txt" | head -8
  for kern in gate_up down; do
    timeout 110 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 30 --tile-kernel $kern \
      --kernels ${SWEEP_KERNELS:-v5 v6} --tiles ${NVFP4_TILES:-64,128,4,3 64,128,4,4 \
      128,128,4,3 128,128,4,4 64,128,4,5 32,128,4,4} --out "$OUT/nvfp4_sweep_$kern.json" \
      > "$OUT/nvfp4_sweep_$kern.txt" 2>&1
    echo "nvfp4 sweep $kern rc=$?"; grep "tile=" "$OUT/nvfp4_sweep_$kern.txt"
  done
  gpu_tests words "tests/custom_ops/test_nvfp4_moe.py::test_v3_single_code_weights_are_exact_gpu" \
    "tests/custom_ops/test_nvfp4_moe.py::test_compile_and_cuda_graph_replay" \
    "tests/custom_ops/test_nvfp4_moe_v5.py::test_v5_v6_w4a4_and_negative_scales_gpu" \
    "tests/custom_ops/test_nvfp4_moe_v5.py::test_v5_v6_equal_v3_gpu" ;;
codes)  # nvfp4_moe v7 against v5 (same bytes, 15-20 % fewer instructions), 16- against
  # 128-row runs (DLMC_NVFP4_TILE_ROWS, a second process), then the rounds
  timeout 90 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 50 --kernels v3 v5 v7 \
    --out "$OUT/nvfp4_op_v3_v5_v7.json" > "$OUT/nvfp4_op_v3_v5_v7.txt" 2>&1
  echo "nvfp4 op v3 v5 v7 rc=$?"; grep -E "tokens=32" "$OUT/nvfp4_op_v3_v5_v7.txt" | cut -c1-260
  DLMC_NVFP4_TILE_ROWS=128 timeout 70 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 50 \
    --kernels v5 v7 --out "$OUT/nvfp4_op_rows128.json" > "$OUT/nvfp4_op_rows128.txt" 2>&1
  echo "nvfp4 op rows 128 rc=$?"; grep -E "tokens=32" "$OUT/nvfp4_op_rows128.txt" | cut -c1-260
  round round_nvfp4_v5 "${NVFP4_TIMEOUT:-170}" --precision nvfp4 --kv-cache-dtype fp8 \
    --modes graph --no-loop
  DLMC_NVFP4_KERNEL=v7 round round_nvfp4_v7 100 --precision nvfp4 --kv-cache-dtype fp8 \
    --modes graph --no-loop
  DLMC_NVFP4_KERNEL=v7 DLMC_NVFP4_TILE_ROWS=128 round round_nvfp4_v7_rows128 100 \
    --precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop
  gpu_tests codes "tests/custom_ops/test_nvfp4_moe_v5.py::test_v5_v6_w4a4_and_negative_scales_gpu" \
    "tests/custom_ops/test_nvfp4_moe.py::test_compile_and_cuda_graph_replay" \
    "tests/custom_ops/test_nvfp4_moe_v5.py::test_v5_v6_equal_v3_gpu" ;;
defaults)  # session 15's last call: v7's GPU fuzz (200 tiled examples), then the NVFP4 + FP8
  # round at the defaults (v7, 128-row runs) and the BF16 round, one after the other
  TEST_TIMEOUT=${FUZZ_TIMEOUT:-200} gpu_tests fuzz_v7 -s \
    "tests/custom_ops/test_nvfp4_moe_v5.py::test_v5_v6_equal_v3_gpu[7]"
  grep -c "v7 == v3" "$OUT/gpu_tests_fuzz_v7.txt"
  round round_nvfp4_default "${NVFP4_TIMEOUT:-170}" --precision nvfp4 --kv-cache-dtype fp8 \
    --modes graph --no-loop
  round round_bf16_default "${ROUND_TIMEOUT:-150}" --precision bf16 --modes graph --no-loop ;;
moe)  # dlmc::bf16_moe alone: launch-config sweeps of each kernel, against copy and read ceilings
  for kern in gate_up down; do
    timeout 120 python3 perf/bench_bf16_moe.py --kernel $kern --configs ${MOE_CONFIGS:-128,128,4,3 \
      64,128,4,4 64,128,4,5 64,256,4,3 128,64,4,4 32,256,4,3 64,128,8,3 128,128,8,4 64,64,4,6 \
      256,64,8,3} --out "$OUT/bf16_moe_sweep_$kern.json" > "$OUT/bf16_moe_sweep_$kern.txt" 2>&1
    echo "bf16 moe sweep $kern rc=$?"; grep -E "us/layer|failed|read_GBps" \
      "$OUT/bf16_moe_sweep_$kern.txt" | cut -c1-160
  done ;;
gemm)  # dlmc::small_m_linear vs cuBLAS at the round's skinny GEMMs, launch-config sweeps
  timeout 150 python3 perf/bench_small_m_linear.py --configs ${GEMM_CONFIGS:-fp32split:16,8,128,4,2 fp32split:32,16,128,4,2 fp32split:16,16,128,4,2 \
    fp32split:64,32,64,4,2 fp32split:32,8,256,4,2 fp32split:16,4,256,4,2 fp32split:16,8,64,4,3 \
    fp32split:16,8,128,2,2} --out "$OUT/small_m_linear.json" > "$OUT/small_m_linear.txt" 2>&1
  echo "small_m_linear rc=$?"; grep -E " us |failed" "$OUT/small_m_linear.txt" | cut -c1-120 ;;
share)  # attention's share of the NVFP4 + FP8 graph round at a long prefix (PREFIX, 4096), and
  # the attention launch variants (SWEEP) at 1k / 4k / 16k in a long-context pool
  round "round_nvfp4_prefix${PREFIX:-4096}" "${NVFP4_TIMEOUT:-170}" --precision nvfp4 \
    --kv-cache-dtype fp8 --modes graph --no-loop --prefix "${PREFIX:-4096}"
  timeout 150 python3 perf/bench_paged_attention.py --no-flashinfer --capacity 32768 --sweep \
    ${SWEEP:-base ilv32 ilv32-bf16part ilv16 ilv16-bf16part} --out "$OUT/attention_variants.json" \
    > "$OUT/attention_variants.txt" 2>&1
  echo "attention variants rc=$?"; grep -E "^(triton|variant|  )" "$OUT/attention_variants.txt" \
    | head -20 ;;
tests)  # the gpu-marked tests of TESTS (files or node ids, spaces between)
  gpu_tests "${TESTS_NAME:-tests}" ${TESTS:?set TESTS} ;;
ncu)  # why nvfp4_moe v3 sits near 45 % of copy bandwidth, and what limits paged attention
  ncu_run nvfp4_v3 "_gate_up_kernel|_down_kernel" 2 \
    python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 1 --layers 1
  ncu_run paged_attention "paged_attention" 4 \
    python3 perf/bench_paged_attention.py --prefixes 4096 --layers 1 --iters 1 --no-flashinfer ;;
rope)  # why the rope tables are computed 10-11 times per round: Inductor's output code of one
  # BF16 round, and where its cos/sin kernels are called
  TORCH_LOGS=output_code timeout 200 dlmc bench round --shape llada2.1-mini --block-length 32 \
    --prefix 1024 --routing uniform --rounds 10 --precision bf16 --modes compile --no-loop \
    > "$OUT/output_code.txt" 2>&1
  echo "output code rc=$?"; grep -n -B3 "_sin[_0-9]*\.run(" "$OUT/output_code.txt" \
    | head -120 > "$OUT/rope_call_sites.txt"; wc -l "$OUT/rope_call_sites.txt"
  gzip -f "$OUT/output_code.txt" ;;
s16)  # session 16: NVFP4 + FP8 rounds at the new defaults (rope tables in one launch, Triton
  # combine, K/V stored by the norm/rope launch) against each change switched off, each in its
  # own Inductor cache (runner.inductor_cache_dir); then the new ops' GPU tests
  for v in default:: ropeappend_off:DLMC_ROPE_KV_APPEND=off: combine_inductor:DLMC_MOE_COMBINE=inductor:; do
    IFS=: read -r name envs _ <<< "$v"
    ( for e in ${envs//,/ }; do export "$e"; done
      round "round_nvfp4_$name" "${ROUND_TIMEOUT:-150}" --precision nvfp4 --kv-cache-dtype fp8 \
        --modes graph --no-loop )
  done
  TEST_TIMEOUT=${TEST_TIMEOUT:-170} gpu_tests s16 tests/custom_ops/test_rope_tables.py \
    tests/custom_ops/test_qk_norm_rope.py tests/custom_ops/test_qk_norm_rope_append.py \
    tests/graphs/test_runner.py tests/engine/test_fp8_kv.py ;;
s16b)  # session 16, call 3: the default NVFP4 round with Inductor's output code (what the
  # pointwise kernel `add_mul_slice` beside the Triton combine is), the Inductor combine in its
  # own cache directory, then the GPU tests (verbose)
  env | grep -i -E "inductor|triton" >> "$OUT/versions.txt"
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-default TORCH_LOGS=output_code timeout 200 dlmc bench round \
    --shape llada2.1-mini --block-length 32 --prefix 1024 --routing uniform --rounds 60 \
    --profile --precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop \
    --out "$OUT/round_nvfp4_default.json" > "$OUT/round_nvfp4_default.txt" 2> "$OUT/output_code.txt"
  echo "default rc=$?"; grep -E "│ +graph" "$OUT/round_nvfp4_default.txt"
  grep -n -B2 -A45 "def triton_poi_fused_add_mul_slice" "$OUT/output_code.txt" | head -120 \
    > "$OUT/add_mul_slice.txt"
  grep -n -B3 -A3 "triton_poi_fused_add_mul_slice_6.run" "$OUT/output_code.txt" | head -40 \
    >> "$OUT/add_mul_slice.txt"
  gzip -f "$OUT/output_code.txt"
  ( export DLMC_MOE_COMBINE=inductor TORCHINDUCTOR_CACHE_DIR=/tmp/ind-combine
    round round_nvfp4_combine_inductor 170 --precision nvfp4 --kv-cache-dtype fp8 --modes graph \
      --no-loop )
  timeout "${TEST_TIMEOUT:-230}" python3 -m pytest -v -p no:cacheprovider -rf -m gpu \
    tests/custom_ops/test_rope_tables.py tests/custom_ops/test_qk_norm_rope.py \
    tests/custom_ops/test_qk_norm_rope_append.py tests/graphs/test_runner.py \
    tests/engine/test_fp8_kv.py > "$OUT/gpu_tests_s16b.txt" 2>&1
  echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_s16b.txt" | tail -25 ;;
s16c)  # session 16, call 4: the record at the defaults (uniform routing without its extra
  # launch, bench.round_bench.UniformRoutingMoE), the GPU tests call 3 did not reach, BF16 last
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-nvfp4 round round_nvfp4_final 130 --precision nvfp4 \
    --kv-cache-dtype fp8 --modes graph --no-loop
  timeout 130 python3 -m pytest -v -p no:cacheprovider -rf -m gpu \
    "tests/graphs/test_runner.py::test_rope_kv_append_graph_rounds_match_the_separate_append_on_cuda" \
    tests/engine/test_fp8_kv.py > "$OUT/gpu_tests_s16c.txt" 2>&1
  echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_s16c.txt" | tail -8
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-bf16 round round_bf16_final 150 --precision bf16 \
    --modes graph --no-loop ;;
s17)  # session 17, call 1: the op alone per token count (waves) with kernel times, down at 2
  # warps; the early-load kernels against the previous ones (.ab/kernels_old.py, carried);
  # the NVFP4 + FP8 round at the defaults
  timeout 200 python3 perf/bench_nvfp4_moe.py --tokens 8 12 16 20 24 32 40 48 64 --iters 40 \
    --profile --tile-kernel down --tiles 128,128,4,3 128,128,2,3 --out "$OUT/op_sweep.json" \
    2>&1 | grep "^kernel=" > "$OUT/op_sweep.txt"; cut -c1-90 "$OUT/op_sweep.txt"
  cp custom_ops/_nvfp4_moe_kernels.py /tmp/kernels_new.py
  for side in old new; do
    if [ "$side" = old ]; then cp .ab/kernels_old.py custom_ops/_nvfp4_moe_kernels.py; fi
    if [ "$side" = new ]; then cp /tmp/kernels_new.py custom_ops/_nvfp4_moe_kernels.py; fi
    timeout 120 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --profile \
      --out "$OUT/op_$side.json" > "$OUT/op_$side.txt" 2>&1
    grep -o '"nvfp4_ms_per_layer": [0-9.]*\|"fraction_of_copy": [0-9.]*' "$OUT/op_$side.json"
  done
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-nvfp4 round round_nvfp4_default 200 --precision nvfp4 \
    --kv-cache-dtype fp8 --modes graph --no-loop ;;
s17b)  # session 17, call 3: the shared expert as parts (moe_shared_parts) against the tail
  # blocks (.ab: the previous kernels and launch, carried), the round, the GPU tests
  cp custom_ops/_nvfp4_moe_kernels.py /tmp/k_new.py; cp custom_ops/nvfp4_moe.py /tmp/m_new.py
  for side in tail parts_k64 parts; do  # parts_k64: the parts at the tail blocks' K-tiles
    if [ "$side" = tail ]; then
      cp .ab/kernels_early.py custom_ops/_nvfp4_moe_kernels.py
      cp .ab/nvfp4_moe_head.py custom_ops/nvfp4_moe.py
    else
      cp /tmp/k_new.py custom_ops/_nvfp4_moe_kernels.py; cp /tmp/m_new.py custom_ops/nvfp4_moe.py
    fi
    k=128,128; [ "$side" = parts_k64 ] && k=64,32
    DLMC_NVFP4_SHARED_BLOCK_K=$k timeout 120 python3 perf/bench_nvfp4_moe.py --tokens 16 32 64 \
      --iters 60 --profile --shared-expert --out "$OUT/op_shared_$side.json" \
      > "$OUT/op_shared_$side.txt" 2>&1
    echo "$side rc=$?"
  done
  timeout 100 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 40 --tile-kernel down \
    --tiles 128,128,4,3 128,128,4,3,96 128,128,4,3,80 --out "$OUT/down_maxnreg.json" 2>&1 \
    | grep "^kernel=" | cut -c1-100
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-nvfp4 round round_nvfp4_parts 200 --precision nvfp4 \
    --kv-cache-dtype fp8 --modes graph --no-loop
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rf -m gpu \
    "tests/custom_ops/test_nvfp4_moe.py::test_compile_and_cuda_graph_replay" \
    "tests/custom_ops/test_nvfp4_moe_v5.py::test_v5_v6_w4a4_and_negative_scales_gpu" \
    "tests/custom_ops/test_nvfp4_moe.py::test_shared_expert_tail_matches_reference_gpu" \
    > "$OUT/gpu_tests_s17b.txt" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests_s17b.txt" ;;
s17c)  # session 17, call 4: the op alone with and without the shared expert (parts), wider
  # tiles with 8 warps for each kernel, v7's shared-expert fuzz, the NVFP4 + FP8 round at the
  # defaults with its profile; everything tarred (a call returns at most 8 files)
  for shared in "" --shared-expert; do
    timeout 100 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --profile $shared \
      --out "$OUT/op${shared:+_shared}.json" > "$OUT/op${shared:+_shared}.txt" 2>&1
    grep -o '"nvfp4_ms_per_layer": [0-9.]*\|"fraction_of_copy": [0-9.]*' \
      "$OUT/op${shared:+_shared}.json"
  done
  for kernel in down gate_up; do
    timeout 100 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 40 --tile-kernel $kernel \
      --tiles 128,128,4,3 256,128,8,3 256,128,8,4 128,128,8,3 --out "$OUT/wide_$kernel.json" \
      2>&1 | grep "^kernel=" | cut -c1-100
  done
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rf -m gpu \
    "tests/custom_ops/test_nvfp4_moe.py::test_shared_expert_tail_matches_reference_gpu[7]" \
    > "$OUT/gpu_tests_s17c.txt" 2>&1
  echo "gpu tests rc=$?"; tail -2 "$OUT/gpu_tests_s17c.txt"
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-nvfp4 round round_nvfp4_default 200 --precision nvfp4 \
    --kv-cache-dtype fp8 --modes graph --no-loop
  tar -C "$OUT" -czf /tmp/s17c.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/s17c.tgz "$OUT/" ;;
s17d)  # session 17, call 5: GPU tests of the changed kernels (each under its own limit, -s so
  # the fuzz tests' progress lines count the examples that ran), tarred
  t() {  # t NAME LIMIT PYTEST-ARGS...
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 -m pytest -q -s -p no:cacheprovider -rf "$@" \
      > "$OUT/gpu_tests_$name.txt" 2>&1
    echo "$name rc=$? examples=$(grep -c '^v[0-9]' "$OUT/gpu_tests_$name.txt")"
    grep -E "passed|failed|error" "$OUT/gpu_tests_$name.txt" | tail -1
  }
  t loading 60 -m gpu tests/loading/test_nvfp4_loading.py
  t shared_fuzz_v7 170 -m gpu \
    "tests/custom_ops/test_nvfp4_moe.py::test_shared_expert_tail_matches_reference_gpu[7]"
  t fuzz_v7 230 -m gpu "tests/custom_ops/test_nvfp4_moe_v5.py::test_v5_v6_equal_v3_gpu[7]"
  t bf16_moe 90 tests/custom_ops/test_bf16_moe.py
  tar -C "$OUT" -czf /tmp/s17d.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/s17d.tgz "$OUT/" ;;
s18)  # prepared in session 17 for the next GPU session: the route launch whose last program
  # aligns (DLMC_FUSED_ROUTE_ALIGN=last) against the default in the NVFP4 + FP8 round, then its
  # GPU tests (the programs race for the tickets there); tarred
  for v in default last; do
    (  # the switch stays in this subshell; Inductor's cache is per switch set (graphs.runner)
      [ "$v" = last ] && export DLMC_FUSED_ROUTE_ALIGN=last
      round "round_nvfp4_route_$v" 200 --precision nvfp4 --kv-cache-dtype fp8 --modes graph \
        --no-loop
    )
  done
  timeout 60 python3 perf/probe_pdl.py --out "$OUT/pdl_probe.json" > "$OUT/pdl_probe.txt" 2>&1
  echo "pdl probe rc=$?"; cat "$OUT/pdl_probe.txt"
  (  # Inductor's own kernels with programmatic dependent launch, where this torch has it
    export TORCHINDUCTOR_ENABLE_PDL=1
    round round_nvfp4_inductor_pdl 200 --precision nvfp4 --kv-cache-dtype fp8 --modes graph \
      --no-loop
  )
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rf -m gpu \
    tests/custom_ops/test_moe_route_last_align.py \
    "tests/models/test_llada2.py::test_generate_equal_with_fused_route_align_on_and_off" \
    > "$OUT/gpu_tests_s18.txt" 2>&1
  echo "gpu tests rc=$?"; tail -2 "$OUT/gpu_tests_s18.txt"
  tar -C "$OUT" -czf /tmp/s18.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/s18.tgz "$OUT/" ;;
lib) ;;  # `source perf/h200_session.sh lib`: install and define round/gpu_tests/ncu_run only
*) echo "usage: $0 final|rounds|repeat|variants|ops|words|codes|defaults|v7tests|moe|gemm|share|tests|rope|lib|ncu|s16|s16b|s16c|s17|s17b|s17c|s17d|s18" >&2; exit 2 ;;
esac
