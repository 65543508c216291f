#!/usr/bin/env bash
# Session 22's H200 calls (helpers of perf/h200_session.sh). Each call's output is tarred in $OUT.
#   bash perf/h200_s22.sh check   # call 1: what sessions 20-21 changed without a GPU run: the
#                                 # op's host time (both registrations), the op alone with the
#                                 # shared expert, GPU tests of moe_overlap / the model / the
#                                 # runner, the NVFP4 + FP8 round at the defaults
#   bash perf/h200_s22.sh sweep   # call 2: each kernel's launch configs with the per-slot waits,
#                                 # the model / runner GPU tests under xdist (carry .whl)
#   bash perf/h200_s22.sh fuzz    # call 3: cProfile of the op's host time, the op's GPU tests
#                                 # (200-example fuzzes) under xdist (carry .whl)
#   bash perf/h200_s22.sh fuzz2   # call 4: the fuzzes call 3 left unfinished (v7 vs v3, the op
#                                 # vs the reference), two processes side by side
#   bash perf/h200_s22.sh edges   # next session: DLMC_NVFP4_PDL_EDGES=1 against the default,
#                                 # the op alone and the NVFP4 round; DLMC_MOE_COMBINE=outside
#   bash perf/h200_s22.sh overhead  # next session (carry .whl): the GPU tests of moe_overlap
#                                 # (edges too) and moe_combine (outside too), the op's host time
#                                 # per launch, the shared-expert fuzz
set -u
source "$(dirname "$0")/h200_session.sh" lib

op_alone() {  # op_alone NAME [ENV=VAL...]: nvfp4_moe alone with the shared expert, 32 tokens
  local name=$1; shift
  ( [ $# -gt 0 ] && export "$@"
    timeout 100 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --profile \
      --shared-expert --out "$OUT/op_$name.json" > "$OUT/op_$name.txt" 2>&1
    echo "op_$name rc=$?"; grep -E "^kernel=" "$OUT/op_$name.txt" | cut -c1-330 )
}

case "${1:-}" in
check)
  timeout 60 python3 perf/probe_op_overhead.py --out "$OUT/overhead_opaque.json" 2>&1 | tail -2
  DLMC_NVFP4_OVERLAP=0 timeout 60 python3 perf/probe_op_overhead.py \
    --out "$OUT/overhead_traced.json" 2>&1 | tail -2
  op_alone default
  round round_nvfp4_default 170 --precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop
  TEST_TIMEOUT=120 gpu_tests s22_overlap tests/custom_ops/test_moe_overlap.py
  TEST_TIMEOUT=150 gpu_tests s22_models tests/models/test_llada2.py tests/graphs/test_runner.py
  tar_out s22_check ;;
sweep)  # call 2: launch-config sweeps of each kernel with the per-slot waits (never swept
  # since session 20 made them the default; session 14 tried 4 warps, 3-4 stages, BLOCK_N
  # 64/128 only), then the model / runner GPU tests under pytest-xdist (carried .whl/)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  for kernel in down gate_up; do
    timeout 150 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --profile \
      --shared-expert --tile-kernel $kernel --tiles 128,128,4,3 128,128,4,2 128,128,8,3 \
      128,128,8,4 256,128,8,3 256,128,4,3 64,128,2,3 128,128,4,3,128 \
      --out "$OUT/sweep_$kernel.json" > "$OUT/sweep_$kernel.txt" 2>&1
    echo "sweep $kernel rc=$?"; grep -E "^kernel=" "$OUT/sweep_$kernel.txt" | cut -c1-100
  done
  timeout 250 python3 -m pytest -q -p no:cacheprovider -rf -m gpu -n 6 \
    tests/models/test_llada2.py tests/graphs/test_runner.py > "$OUT/gpu_tests_s22_models.txt" 2>&1
  echo "gpu tests models rc=$?"; tail -3 "$OUT/gpu_tests_s22_models.txt"
  tar_out s22_sweep ;;
fuzz)  # call 3: where the op's host time goes (cProfile of perf/probe_op_overhead.py), then
  # every gpu-marked test of the op's two test files (the 200-example fuzzes of v2/v3 against
  # the reference and of v5-v7 against v3) with the per-slot waits on, under pytest-xdist
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout 90 python3 -m cProfile -o "$OUT/op_host.prof" perf/probe_op_overhead.py --calls 300 \
    > "$OUT/op_host.txt" 2>&1; echo "cprofile rc=$?"; tail -2 "$OUT/op_host.txt"
  python3 -c "import pstats; s = pstats.Stats('$OUT/op_host.prof'); s.sort_stats('tottime')
s.print_stats(45); s.sort_stats('cumulative'); s.print_stats(60)" > "$OUT/op_host_stats.txt" 2>&1
  timeout 420 python3 -m pytest -q -p no:cacheprovider -rf -m gpu -n 4 \
    tests/custom_ops/test_nvfp4_moe.py tests/custom_ops/test_nvfp4_moe_v5.py \
    > "$OUT/gpu_tests_s22_fuzz.txt" 2>&1
  echo "gpu tests fuzz rc=$?"; tail -3 "$OUT/gpu_tests_s22_fuzz.txt"
  tar_out s22_fuzz ;;
fuzz2)  # call 4: the fuzzes call 3 left unfinished, two processes side by side: v7 bit for bit
  # against v3 (-s: one progress line per example), and the op against the reference (plain
  # and with the shared expert as parts, v7) with -v
  ( timeout 280 python3 -m pytest -q -s -p no:cacheprovider -m gpu \
      "tests/custom_ops/test_nvfp4_moe_v5.py::test_v5_v6_equal_v3_gpu[7]" \
      > "$OUT/gpu_tests_s22_fuzz_v7.txt" 2>&1; echo "v7 fuzz rc=$?" >> "$OUT/gpu_tests_s22_fuzz_v7.txt" ) &
  timeout 280 python3 -m pytest -v -p no:cacheprovider -m gpu \
    tests/custom_ops/test_nvfp4_moe.py::test_matches_reference_gpu \
    "tests/custom_ops/test_nvfp4_moe.py::test_shared_expert_tail_matches_reference_gpu[7]" \
    > "$OUT/gpu_tests_s22_fuzz_ref.txt" 2>&1
  echo "reference fuzz rc=$?"; grep -E "PASSED|FAILED|passed|failed" "$OUT/gpu_tests_s22_fuzz_ref.txt" | tail -4
  wait
  tail -1 "$OUT/gpu_tests_s22_fuzz_v7.txt"; echo "v7 examples: $(grep -c 'v7 == v3' "$OUT/gpu_tests_s22_fuzz_v7.txt")"
  grep -E "passed|failed" "$OUT/gpu_tests_s22_fuzz_v7.txt" | tail -1
  tar_out s22_fuzz2 ;;
edges)  # prepared for the next session (not run): DLMC_NVFP4_PDL_EDGES=1 (the op's alignment
  # and combine launched with PDL) against the default, the op alone (one process each) and
  # the NVFP4 + FP8 round (ab_rounds); then the round with DLMC_MOE_COMBINE=outside (the
  # combine as pointwise ops that Inductor fuses into the residual add + RMSNorm)
  op_alone default
  op_alone edges DLMC_NVFP4_PDL_EDGES=1
  ab_rounds DLMC_NVFP4_PDL_EDGES=1 edges 170
  ( export DLMC_MOE_COMBINE=outside
    round round_nvfp4_outside 170 --precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop )
  tar_out s22_edges ;;
overhead)  # prepared for the next session (not run): the edges' GPU test (bit for bit), the
  # op's host time split per launch, the shared-expert fuzz call 4 left unfinished (v7)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout 240 python3 -m pytest -v -p no:cacheprovider -rf -m gpu -n 3 \
    tests/custom_ops/test_moe_overlap.py tests/custom_ops/test_moe_combine.py \
    > "$OUT/gpu_tests_edges.txt" 2>&1
  echo "gpu tests edges rc=$?"; grep -E "PASSED|FAILED|passed|failed" "$OUT/gpu_tests_edges.txt" | tail -8
  timeout 60 python3 perf/probe_op_overhead.py --per-launch --out "$OUT/overhead_launches.json" \
    2>&1 | tail -3
  timeout 220 python3 -m pytest -v -p no:cacheprovider -m gpu \
    "tests/custom_ops/test_nvfp4_moe.py::test_shared_expert_tail_matches_reference_gpu[7]" \
    > "$OUT/gpu_tests_shared_fuzz.txt" 2>&1; echo "shared fuzz rc=$?"
  tail -1 "$OUT/gpu_tests_shared_fuzz.txt"
  tar_out s22_overhead ;;
*) echo "usage: bash perf/h200_s22.sh check|sweep|fuzz|fuzz2|edges|overhead"; exit 2 ;;
esac
