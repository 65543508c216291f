#!/usr/bin/env bash
# Session 26's H200 calls (helpers of perf/h200_session.sh). Each call's output is tarred in $OUT.
#   bash perf/h200_s26.sh fused    # call 1 (carry .whl): session 25's prepared
#                                  # `bash perf/h200_s25.sh fused` (the reworked fused kernel:
#                                  # checks, GPU tests, op, rounds), then the Gluon down tests
#                                  # (their counter check had not run on a GPU)
#   bash perf/h200_s26.sh tickets  # call 2 (carry .whl): the Gluon down kernel with its items
#                                  # by ticket (DLMC_NVFP4_DOWN_TICKETS=1): its GPU tests, the op
#                                  # with each down kernel (with the shared expert), NVFP4 + FP8
#                                  # rounds gluon + tickets / default, then the op without the
#                                  # shared expert
#   bash perf/h200_s26.sh probe    # call 3: what holds the Gluon gate/up consumer
#                                  # (perf/proto_gluon_gate_up.py PROBE forms: no x loads, no
#                                  # decode, neither) against v7; NVFP4 + FP8 rounds default /
#                                  # gluon + tickets / default again
#   bash perf/h200_s26.sh xtma     # call 4 (carry .whl): x rows by the producer's TMA copies
#                                  # (X_TMA): the fused kernel's check and GPU tests, the gate/up
#                                  # prototype with and without, the op (routed experts only,
#                                  # then with the shared expert) per down kernel
#   bash perf/h200_s26.sh four     # call 5: 4 programs per SM at 64 registers (2 stages, x by
#                                  # TMA), gate/up prototype and fused kernel, with/without
#                                  # tickets; routed experts only
#   bash perf/h200_s26.sh final    # call 6 (carry .whl): the Gluon GPU tests (down: both item
#                                  # forms, tickets now the default; fused with x by TMA), the
#                                  # op with the shared expert per down kernel
#   bash perf/h200_s26.sh shareddown  # prepared for the next stop (carry .whl): the shared
#                                  # expert's down parts in gate/up's launch
#                                  # (DLMC_NVFP4_SHARED_DOWN=gate_up): the Gluon GPU tests, the
#                                  # op with the shared expert (gluon / gluon:1,1 / triton),
#                                  # NVFP4 + FP8 rounds default / gate_up
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib

case "${1:-}" in
fused)
  bash "$HERE/h200_s25.sh" fused
  mkdir -p "$OUT/down" && OUT="$OUT/down" gpu_tests gluon_down -n 4 \
    tests/custom_ops/test_nvfp4_down_gluon.py
  tar -C "$OUT" -czf /tmp/s26_down.tgz down && rm -rf "$OUT/down" && mv /tmp/s26_down.tgz "$OUT/" ;;
tickets)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=100 gpu_tests gluon_down -n 4 tests/custom_ops/test_nvfp4_down_gluon.py
  if grep -q " passed" "$OUT/gpu_tests_gluon_down.txt" && ! grep -q "failed" "$OUT/gpu_tests_gluon_down.txt"; then
    OP=(--tokens 32 --iters 60 --profile --downs triton gluon gluon:1 fused)
    timeout 150 python3 perf/bench_nvfp4_moe.py "${OP[@]}" --shared-expert \
      --out "$OUT/op_shared.json" > "$OUT/op_shared.txt" 2>&1
    echo "op rc=$?"; grep -E "^kernel=" "$OUT/op_shared.txt" | cut -c 1-420
    NVFP4=(--precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop)
    ( export DLMC_NVFP4_DOWN=gluon DLMC_NVFP4_DOWN_TICKETS=1
      round round_nvfp4_gluon_tickets 110 "${NVFP4[@]}" )
    round round_nvfp4_default 110 "${NVFP4[@]}"
    timeout 100 python3 perf/bench_nvfp4_moe.py "${OP[@]}" \
      --out "$OUT/op_routed.json" > "$OUT/op_routed.txt" 2>&1
    echo "op routed rc=$?"; grep -E "^kernel=" "$OUT/op_routed.txt" | cut -c 1-420
  fi
  tar_out s26_tickets ;;
probe)
  timeout 200 python3 perf/proto_gluon_gate_up.py --repeats 2 \
    --configs 3,3,80 3,3,80,1 3,3,80,2 3,3,80,3 \
    --out "$OUT/proto_gate_up_probe.json" > "$OUT/proto_gate_up_probe.txt" 2>&1
  echo "proto rc=$?"; tail -14 "$OUT/proto_gate_up_probe.txt"
  NVFP4=(--precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop)
  round round_nvfp4_default 110 "${NVFP4[@]}"
  ( export DLMC_NVFP4_DOWN=gluon DLMC_NVFP4_DOWN_TICKETS=1
    round round_nvfp4_gluon_tickets 110 "${NVFP4[@]}" )
  round round_nvfp4_default2 110 "${NVFP4[@]}"
  tar_out s26_probe ;;
xtma)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  PYTHONPATH=. timeout 45 python3 perf/check_fused.py > "$OUT/check.txt" 2>&1
  rc=$?; echo "check rc=$rc"; tail -1 "$OUT/check.txt"
  if [ $rc -eq 0 ]; then
    TEST_TIMEOUT=100 gpu_tests fused -n 4 tests/custom_ops/test_nvfp4_moe_gluon.py
    timeout 150 python3 perf/proto_gluon_gate_up.py --repeats 2 --configs 3,3,80 3,3,80,0,1 \
      --out "$OUT/proto_gate_up_xtma.json" > "$OUT/proto_gate_up_xtma.txt" 2>&1
    echo "proto rc=$?"; tail -7 "$OUT/proto_gate_up_xtma.txt" | cut -c 1-200
    OP=(--tokens 32 --iters 60 --profile)
    timeout 120 python3 perf/bench_nvfp4_moe.py "${OP[@]}" \
      --downs triton gluon:1 fused fused:3,3,80,0,0 \
      --out "$OUT/op_routed.json" > "$OUT/op_routed.txt" 2>&1
    echo "op routed rc=$?"; grep -E "^kernel=" "$OUT/op_routed.txt" | cut -c 1-330
    timeout 100 python3 perf/bench_nvfp4_moe.py "${OP[@]}" --shared-expert \
      --downs triton gluon:1 fused --out "$OUT/op_shared.json" > "$OUT/op_shared.txt" 2>&1
    echo "op shared rc=$?"; grep -E "^kernel=" "$OUT/op_shared.txt" | cut -c 1-330
  fi
  tar_out s26_xtma ;;
four)
  timeout 150 python3 perf/proto_gluon_gate_up.py --repeats 2 \
    --configs 3,3,80,0,1 2,4,64,0,1 2,3,80,0,1 \
    --out "$OUT/proto_gate_up_four.json" > "$OUT/proto_gate_up_four.txt" 2>&1
  echo "proto rc=$?"; tail -8 "$OUT/proto_gate_up_four.txt" | cut -c 1-220
  timeout 150 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --profile \
    --downs triton gluon:1 fused fused:3,3,80,1,1 fused:2,4,64,0,1 fused:2,4,64,1,1 \
    --out "$OUT/op_routed_four.json" > "$OUT/op_routed_four.txt" 2>&1
  echo "op routed rc=$?"; grep -E "^kernel=" "$OUT/op_routed_four.txt" | cut -c 1-300
  tar_out s26_four ;;
final)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=120 gpu_tests gluon -n 4 tests/custom_ops/test_nvfp4_down_gluon.py \
    tests/custom_ops/test_nvfp4_moe_gluon.py
  timeout 110 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --profile --shared-expert \
    --downs triton gluon gluon:0 --out "$OUT/op_shared.json" > "$OUT/op_shared.txt" 2>&1
  echo "op shared rc=$?"; grep -E "^kernel=" "$OUT/op_shared.txt" | cut -c 1-300
  tar_out s26_final ;;
shareddown)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=120 gpu_tests gluon -n 4 tests/custom_ops/test_nvfp4_down_gluon.py
  if ! grep -qE "failed|error" "$OUT/gpu_tests_gluon.txt"; then
    timeout 120 python3 perf/bench_nvfp4_moe.py --tokens 32 --iters 60 --profile \
      --shared-expert --downs gluon gluon:1,1 triton gluon \
      --out "$OUT/op_shared.json" > "$OUT/op_shared.txt" 2>&1
    echo "op shared rc=$?"; grep -E "^kernel=" "$OUT/op_shared.txt" | cut -c 1-300
    NVFP4=(--precision nvfp4 --kv-cache-dtype fp8 --modes graph --no-loop)
    round round_nvfp4_default 150 "${NVFP4[@]}"
    ( export DLMC_NVFP4_SHARED_DOWN=gate_up; round round_nvfp4_shared_down 120 "${NVFP4[@]}" )
    round round_nvfp4_default2 120 "${NVFP4[@]}"
  fi
  tar_out s26_shareddown ;;
*) echo "usage: bash perf/h200_s26.sh fused|tickets|probe|xtma|four|final|shareddown"; exit 2 ;;
esac
