#!/usr/bin/env bash
# Session 24's H200 calls (helpers of perf/h200_session.sh). Each call's output is tarred in $OUT.
#   bash perf/h200_s24.sh probe   # call 1 (carry .whl): perf/probe_ws_stream.py (how fast the
#                                 # gate/up bytes stream from a warp-specialized Gluon kernel
#                                 # against the op's one-program-per-tile structure), then the
#                                 # GPU tests left from session 23 (sampled rounds, runner)
#   bash perf/h200_s24.sh down    # calls 2-7: perf/proto_gluon_down.py (CONFIGS, REPEATS)
#   bash perf/h200_s24.sh v9      # call 8 (carry .whl): kernel v9 (v7 with wide-multiply
#                                 # rotations) against v7: op, GPU tests, rounds. v9 was removed
#                                 # afterwards: run this at commit 09f89dd
#   bash perf/h200_s24.sh variance  # call 9: three processes of the prototype, GPU clocks
#   bash perf/h200_s24.sh graphs    # call 10: the prototype timed by CUDA graph replays
#   bash perf/h200_s24.sh gluon     # call 11 (carry .whl): the op's DLMC_NVFP4_DOWN=gluon path
#   bash perf/h200_s24.sh gluontests  # call 12 (carry .whl): its GPU tests again (refused:
#                                     # no device time left; run it first next stop)
#   bash perf/h200_s24.sh gateup    # prepared for next stop: the Gluon gate/up prototype
set -u
source "$(dirname "$0")/h200_session.sh" lib

# the op alone with both down kernels in one process, then NVFP4 + FP8 rounds with each
gluon_down_op_and_rounds() {
  timeout 75 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --profile --shared-expert \
    --downs triton gluon --out "$OUT/op_downs.json" > "$OUT/op_downs.txt" 2>&1
  echo "op rc=$?"; grep -E "^kernel=" "$OUT/op_downs.txt" | cut -c 1-420
  NVFP4=(--precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop)
  ( export DLMC_NVFP4_DOWN=gluon; round round_nvfp4_gluon_down 120 "${NVFP4[@]}" )
  round round_nvfp4_default 120 "${NVFP4[@]}"
}

case "${1:-}" in
probe)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout 150 python3 perf/probe_ws_stream.py --out "$OUT/probe_ws_stream.json" \
    > "$OUT/probe_ws_stream.txt" 2>&1
  echo "probe rc=$?"; cat "$OUT/probe_ws_stream.txt" | tail -30
  timeout 240 python3 -m pytest -v -p no:cacheprovider -rf -m gpu -n 5 \
    tests/graphs/test_sampled_rounds.py tests/graphs/test_runner.py \
    > "$OUT/gpu_tests_s23_left.txt" 2>&1
  echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" \
    "$OUT/gpu_tests_s23_left.txt" | tail -16
  tar_out s24_probe ;;
down)  # call 2: perf/proto_gluon_down.py, the Gluon down kernel against v7's down kernel
  timeout 300 python3 perf/proto_gluon_down.py --out "$OUT/proto_gluon_down.json" \
    --repeats ${REPEATS:-1} \
    --configs ${CONFIGS:-4,2,4,128 6,2,4,128 8,2,4,128 8,1,4,168 12,1,4,168 6,2,8,80 8,1,8,128} \
    > "$OUT/proto_gluon_down.txt" 2>&1
  echo "proto rc=$?"; tail -30 "$OUT/proto_gluon_down.txt"
  tar_out s24_down ;;
v9)  # call 8 (carry .whl): the op with v9's decode against v7's in one process (both orders),
  # v9's GPU tests, then NVFP4 + FP8 rounds with v7 and v9
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  OP=(--tokens 32 --iters 60 --profile --shared-expert)
  timeout 120 python3 perf/bench_nvfp4_moe.py "${OP[@]}" --kernels v7 v9 \
    --out "$OUT/op_v7_v9.json" > "$OUT/op_v7_v9.txt" 2>&1; echo "op v7 v9 rc=$?"
  timeout 120 python3 perf/bench_nvfp4_moe.py "${OP[@]}" --kernels v9 v7 \
    --out "$OUT/op_v9_v7.json" > "$OUT/op_v9_v7.txt" 2>&1; echo "op v9 v7 rc=$?"
  grep -hE "^kernel=" "$OUT"/op_v*.txt | cut -c 1-400
  ( timeout 170 python3 -m pytest -q -p no:cacheprovider -rf -m gpu -n 4 \
      "tests/custom_ops/test_nvfp4_moe_v5.py::test_v5_v6_equal_v3_gpu[9]" \
      "tests/custom_ops/test_nvfp4_moe_v5.py::test_v5_v6_w4a4_and_negative_scales_gpu[9]" \
      "tests/custom_ops/test_nvfp4_moe.py::test_v3_single_code_weights_are_exact_gpu[9]" \
      "tests/custom_ops/test_nvfp4_moe.py::test_compile_and_cuda_graph_replay" \
      > "$OUT/gpu_tests_v9.txt" 2>&1; echo "gpu tests v9 rc=$?" >> "$OUT/gpu_tests_v9.txt" )
  tail -4 "$OUT/gpu_tests_v9.txt"
  NVFP4=(--precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop)
  round round_nvfp4_v7 150 "${NVFP4[@]}"
  ( export DLMC_NVFP4_KERNEL=v9; round round_nvfp4_v9 150 "${NVFP4[@]}" )
  tar_out s24_v9 ;;
variance)  # call 9: three fresh processes of the down prototype (v7's down kernel and the
  # Gluon one with 8-slot blocks), the GPU's clocks / power / throttle reasons around each
  for i in 1 2 3; do
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader >> "$OUT/clocks.txt"
    timeout 100 python3 perf/proto_gluon_down.py --out "$OUT/proto_$i.json" --repeats 2 \
      --configs 4,4,4,64,1,1 4,4,4,64,1,0 > "$OUT/proto_$i.txt" 2>&1
    echo "process $i rc=$?"
    grep -h '"kernel"' "$OUT/proto_$i.txt" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r['kernel'], r.get('swap', ''), round(r['us_per_layer'], 1), [round(v, 1) for v in r['min_max_us_per_layer']])"
  done
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader >> "$OUT/clocks.txt"
  nvidia-smi -q -d PERFORMANCE,CLOCK > "$OUT/nvidia_smi_q.txt" 2>&1
  cat "$OUT/clocks.txt"
  tar_out s24_variance ;;
graphs)  # call 10: the down prototype timed by CUDA graph replays, two processes
  for i in 1 2; do
    timeout 120 python3 perf/proto_gluon_down.py --out "$OUT/proto_graph_$i.json" --repeats 2 \
      --configs ${CONFIGS:-4,4,4,64,1,1 4,4,4,64,1,0 8,2,4,128,1,1 4,3,4,80,1,1} \
      > "$OUT/proto_graph_$i.txt" 2>&1
    echo "process $i rc=$?"
    grep -h '"kernel"' "$OUT/proto_graph_$i.txt" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['kernel'], r.get('stages', ''), r.get('ctas_per_sm', ''), r.get('swap', ''),
          round(r['us_per_layer'], 2), [round(v, 2) for v in r['min_max_us_per_layer']],
          r.get('bit_equal_to_v7', ''))"
  done
  tar_out s24_graphs ;;
gluon)  # call 11 (carry .whl): the op's Gluon down path (DLMC_NVFP4_DOWN=gluon): GPU tests,
  # the op alone with both down kernels in one process, NVFP4 + FP8 rounds with each
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout 140 python3 -m pytest -q -p no:cacheprovider -rf -m gpu -n 4 \
    tests/custom_ops/test_nvfp4_down_gluon.py > "$OUT/gpu_tests_gluon_down.txt" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests_gluon_down.txt"
  gluon_down_op_and_rounds
  tar_out s24_gluon ;;
gluontests)  # call 12 (carry .whl; refused in session 24): the Gluon down path's GPU tests
  # (block-size fix, overlap with gate/up), then the op and the round with it against the
  # defaults
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout 140 python3 -m pytest -v -p no:cacheprovider -rf -m gpu -n 4 \
    tests/custom_ops/test_nvfp4_down_gluon.py > "$OUT/gpu_tests_gluon_down.txt" 2>&1
  echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|passed|failed" "$OUT/gpu_tests_gluon_down.txt"
  gluon_down_op_and_rounds
  tar_out s24_gluontests ;;
gateup)  # next stop (not run yet): perf/proto_gluon_gate_up.py against v7's gate/up kernel
  timeout 150 python3 perf/proto_gluon_gate_up.py --out "$OUT/proto_gluon_gate_up.json" \
    > "$OUT/proto_gluon_gate_up.txt" 2>&1
  echo "proto rc=$?"; tail -12 "$OUT/proto_gluon_gate_up.txt"
  tar_out gateup ;;
*) echo "usage: bash perf/h200_s24.sh probe|down|v9|variance|graphs|gluon|gluontests|gateup"
   exit 2 ;;
esac
