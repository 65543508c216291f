#!/usr/bin/env bash
# Session 27's H200 calls (helpers of perf/h200_session.sh). Each call's output is tarred in $OUT.
# (The Gluon gate/up tests ran from tests/custom_ops/test_nvfp4_moe_gluon.py in calls 4-8; they
# have moved to tests/custom_ops/test_nvfp4_gate_up_gluon.py, which the modes below now name.)
# `grid` ran at commit 2660087: its sixth --downs value (the gate/up grid) has been removed since.
#   bash perf/h200_s26.sh shareddown  # call 1 (carry .whl): session 26's prepared call
#   bash perf/h200_s27.sh warps8   # call 2 (carry .whl): the gate/up prototype with 8 consumer
#                                  # warps (2 programs per SM) against 4 (3 per SM), x by TMA;
#                                  # then the model and graph GPU tests at the current defaults
#                                  # (the Gluon down kernel with tickets)
#   bash perf/h200_s27.sh sweep    # call 3: the Gluon down kernel's ring depth, programs per
#                                  # SM and registers in the op (routed experts, tickets), two
#                                  # passes in opposite orders
#   bash perf/h200_s27.sh gateup   # call 4 (carry .whl): DLMC_NVFP4_GATE_UP=gluon (the fused
#                                  # kernel's gate/up items alone, then the Gluon down kernel):
#                                  # the Gluon GPU tests, then the op (routed experts) against
#                                  # the default and Triton, twice
#   bash perf/h200_s27.sh grid     # call 5 (carry .whl): the Gluon gate/up's grid, one program
#                                  # per item (GATE_UP_GRID="items") or the resident programs:
#                                  # its GPU tests, then the op, two processes
#   bash perf/h200_s27.sh ncu      # call 6: Nsight Compute (full set, SASS source page with
#                                  # stall reasons) of the Gluon gate/up prototype (x by TMA)
#                                  # (NCU_KERNEL=_gate_up_kernel: v7's Triton gate/up)
#   bash perf/h200_s27.sh final    # call 8 (carry .whl): the Gluon GPU tests with the new
#                                  # default (DLMC_NVFP4_GATE_UP=gluon), then the op (routed
#                                  # experts) with DLMC_NVFP4_GATE_UP=triton and at the
#                                  # defaults, one process each, twice
#   bash perf/h200_s27.sh split    # call 9: the gate/up prototype's SPLIT form (four one-warp
#                                  # consumer partitions, no barrier across consumer warps)
#                                  # against the 4-warp consumer, x by TMA, three repeats
#   bash perf/h200_s27.sh hybrid   # call 10 (carry .whl): the fused kernel with its gate/up
#                                  # items by program and its down items by ticket (TICKETS=2):
#                                  # its GPU tests, then the op (routed experts) against the
#                                  # default (Gluon gate/up + Gluon down) and the other fused
#                                  # forms, two passes
#   bash perf/h200_s27.sh last     # call 11 (carry .whl): the three Gluon GPU test files after
#                                  # the module split; the op at the default against the fused
#                                  # kernel with down items by ticket (3 or 2 stages, x by TMA
#                                  # or loaded)
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib

# op_rows FILES...: a line per timing in perf/bench_nvfp4_moe.py's output (down kernel,
# bit-equality, ms per layer, fraction of copy, and with --profile the kernels' µs per layer)
op_rows() {
  grep -hE "^kernel=" "$@" | sed -E 's/.*down=([^ ]*).*equal_to_v7=([A-Za-z]*).*nvfp4_ms_per_layer=([0-9.]*).*fraction_of_copy=([0-9.]*)(.*kernel_us_per_layer=(\{[^}]*\}))?.*/\1 equal=\2 ms=\3 of_copy=\4 \6/' | cut -c 1-330
}

case "${1:-}" in
warps8)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout 200 python3 perf/proto_gluon_gate_up.py --repeats 3 \
    --configs 3,3,80,0,1 3,2,80,0,1,8 4,2,80,0,1,8 2,2,80,0,1,8 \
    --out "$OUT/proto_gate_up_warps8.json" > "$OUT/proto_gate_up_warps8.txt" 2>&1
  echo "proto rc=$?"; tail -16 "$OUT/proto_gate_up_warps8.txt" | cut -c 1-220
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rf -m gpu -n 6 tests/graphs \
    tests/models/test_moe.py tests/models/test_llada2.py tests/loading/test_nvfp4_loading.py \
    > "$OUT/gpu_tests_models.txt" 2>&1
  echo "gpu tests models rc=$?"; tail -6 "$OUT/gpu_tests_models.txt"
  tar_out s27_warps8 ;;
sweep)
  CONFIGS=(gluon:1,0,4,3,80 gluon:1,0,3,3,80 gluon:1,0,6,3,80 gluon:1,0,2,3,80
           gluon:1,0,4,4,64 gluon:1,0,3,4,64 gluon:1,0,4,4,56 gluon:1,0,8,2,80 triton)
  REVERSED=(); for ((j=${#CONFIGS[@]}-1; j>=0; j--)); do REVERSED+=("${CONFIGS[j]}"); done
  for pass in 1 2; do
    if [ $pass = 1 ]; then DOWNS=("${CONFIGS[@]}"); else DOWNS=("${REVERSED[@]}"); fi
    timeout 270 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --downs "${DOWNS[@]}" \
      --out "$OUT/op_sweep$pass.json" > "$OUT/op_sweep$pass.txt" 2>&1
    echo "op sweep $pass rc=$?"
    op_rows "$OUT/op_sweep$pass.txt"
  done
  tar_out s27_sweep ;;
gateup)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=150 gpu_tests gluon -n 4 tests/custom_ops/test_nvfp4_moe_gluon.py \
    tests/custom_ops/test_nvfp4_down_gluon.py tests/custom_ops/test_nvfp4_gate_up_gluon.py
  if ! grep -qE "failed|error" "$OUT/gpu_tests_gluon.txt"; then
    timeout 200 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --profile \
      --downs gluon gluon-gu triton gluon-gu gluon \
      --out "$OUT/op_gateup.json" > "$OUT/op_gateup.txt" 2>&1
    echo "op rc=$?"
    op_rows "$OUT/op_gateup.txt"
  fi
  tar_out s27_gateup ;;
grid)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=150 gpu_tests gateup -n 4 tests/custom_ops/test_nvfp4_gate_up_gluon.py
  if ! grep -qE "failed|error" "$OUT/gpu_tests_gateup.txt"; then
    G=gluon-gu:1,0,4,3,80
    for pass in 1 2; do
      timeout 200 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --profile \
        --downs gluon "$G,1" "$G,0" triton "$G,1" gluon \
        --out "$OUT/op_grid$pass.json" > "$OUT/op_grid$pass.txt" 2>&1
      echo "op $pass rc=$?"
      op_rows "$OUT/op_grid$pass.txt"
    done
  fi
  tar_out s27_grid ;;
ncu)
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout 400 "$ncu" -k "regex:${NCU_KERNEL:-gate_up_gluon}" -c 1 --set full --import-source no \
    -f -o "$OUT/ncu_gate_up" python3 perf/proto_gluon_gate_up.py --repeats 1 --iters 2 \
    --configs 3,3,80,0,1 > "$OUT/ncu_gate_up_log.txt" 2>&1
  echo "ncu rc=$?"; tail -3 "$OUT/ncu_gate_up_log.txt"
  "$ncu" -i "$OUT/ncu_gate_up.ncu-rep" --page details > "$OUT/ncu_gate_up_details.txt" 2>&1
  "$ncu" -i "$OUT/ncu_gate_up.ncu-rep" --page source --print-source sass --csv \
    > "$OUT/ncu_gate_up_source.csv" 2>&1
  gzip "$OUT/ncu_gate_up_source.csv"
  grep -E "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Warp Cycles Per Issued" \
    "$OUT/ncu_gate_up_details.txt" | head -20
  rm -f "$OUT/ncu_gate_up.ncu-rep"  # (large; the details and the source page stay)
  tar_out s27_ncu ;;
final)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=200 gpu_tests gluon -n 4 tests/custom_ops/test_nvfp4_moe_gluon.py \
    tests/custom_ops/test_nvfp4_down_gluon.py tests/custom_ops/test_nvfp4_gate_up_gluon.py
  if ! grep -qE "failed|error" "$OUT/gpu_tests_gluon.txt"; then
    for pass in 1 2; do
      DLMC_NVFP4_GATE_UP=triton timeout 100 python3 perf/bench_nvfp4_moe.py --tokens 32 \
        --iters 60 --downs gluon --out "$OUT/op_triton_gate_up$pass.json" \
        > "$OUT/op_triton_gate_up$pass.txt" 2>&1
      timeout 100 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --downs gluon \
        --out "$OUT/op_default$pass.json" > "$OUT/op_default$pass.txt" 2>&1
      op_rows "$OUT/op_triton_gate_up$pass.txt" "$OUT/op_default$pass.txt"
    done
  fi
  tar_out s27_final ;;
split)
  timeout 250 python3 perf/proto_gluon_gate_up.py --repeats 3 \
    --configs 3,3,80,0,1 3,3,80,0,1,1 3,3,80,0,1 3,3,80,0,1,1 \
    --out "$OUT/proto_gate_up_split.json" > "$OUT/proto_gate_up_split.txt" 2>&1
  echo "proto rc=$?"
  grep -E "^\{" "$OUT/proto_gate_up_split.txt" | sed -E 's/.*"kernel": "([^"]*)".*"warps": ([0-9]*).*"us_per_layer": ([0-9.]*).*"bit_equal_to_v7": ([a-z]*).*/\1 warps=\2 us=\3 equal=\4/; s/.*"kernel": "(v7[^"]*)".*"us_per_layer": ([0-9.]*).*/\1 us=\2/' | cut -c 1-200
  tar_out s27_split ;;
hybrid)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=150 gpu_tests fused -n 4 tests/custom_ops/test_nvfp4_moe_gluon.py -k fused
  if ! grep -qE "failed|error" "$OUT/gpu_tests_fused.txt"; then
    for pass in 1 2; do
      if [ $pass = 1 ]; then D=(gluon fused fused:3,3,80,2,1 fused:3,3,80,1,1 gluon)
      else D=(gluon fused:3,3,80,1,1 fused:3,3,80,2,1 fused gluon); fi
      timeout 200 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --profile \
        --downs "${D[@]}" --out "$OUT/op_hybrid$pass.json" > "$OUT/op_hybrid$pass.txt" 2>&1
      echo "op $pass rc=$?"; op_rows "$OUT/op_hybrid$pass.txt"
    done
  fi
  tar_out s27_hybrid ;;
last)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=200 gpu_tests gluon -n 4 tests/custom_ops/test_nvfp4_moe_gluon.py \
    tests/custom_ops/test_nvfp4_down_gluon.py tests/custom_ops/test_nvfp4_gate_up_gluon.py
  if ! grep -qE "failed|error" "$OUT/gpu_tests_gluon.txt"; then
    timeout 200 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 \
      --downs gluon fused:3,3,80,2,1 fused:2,3,80,2,1 fused:3,3,80,2,0 gluon \
      --out "$OUT/op_last.json" > "$OUT/op_last.txt" 2>&1
    echo "op rc=$?"; op_rows "$OUT/op_last.txt"
  fi
  tar_out s27_last ;;
*) echo "usage: bash perf/h200_s27.sh warps8|sweep|gateup|grid|ncu|final|split|hybrid|last"; exit 2 ;;
esac
