#!/usr/bin/env bash
# Session 33's H200 calls (helpers of perf/h200_session.sh); output tarred in $OUT.
#   bash perf/h200_s33.sh flight   # (carry .whl) rounds in flight (graphs/in_flight.py): their
#                                  # GPU tests and the runner's, then the NVFP4 + FP8 round with
#                                  # host read / queued / in flight and the whole-decode loop
#                                  # with lookahead on and off. Call 1 ran the first form (CUDA
#                                  # graph conditional nodes): torch 2.11 has none.
#   bash perf/h200_s33.sh measure  # the round alone (--no-loop), then with the loops
#   bash perf/h200_s33.sh ipdl     # the same round with Inductor's PDL (TORCHINDUCTOR_ENABLE_PDL=1)
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib

# flight_round NAME LIMIT [--loop|--no-loop]: the NVFP4 + FP8 graph round (host read, queued,
# in flight), with the whole-decode loops unless --no-loop; no profile
flight_round() {
  local name=$1 limit=$2 loop=${3:---loop}
  timeout "$limit" dlmc bench round --shape llada2.1-mini --block-length 32 --prefix 1024 \
    --routing uniform --rounds 60 --precision nvfp4 --kv-cache-dtype fp8 --modes graph "$loop" \
    --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$?" >> "$OUT/$name.txt"
  grep -E "│ +graph|loop|rc=|Error" "$OUT/$name.txt" | head -8
}

case "${1:-}" in
flight)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=${TEST_TIMEOUT:-260} gpu_tests flight -n 3 tests/graphs/test_in_flight.py \
    tests/graphs/test_runner.py tests/engine/test_gpu_decoding.py
  flight_round round_nvfp4_flight "${ROUND_TIMEOUT:-260}"
  tar_out s33_flight ;;
measure)  # call 2's round ran out of its 260 s (cold compiles of the round, fill and fused
  # graphs): the round alone first, then the loops over the now warm Inductor cache
  flight_round round_nvfp4_flight 170 --no-loop
  flight_round round_nvfp4_flight_loop 330 --loop
  tar_out s33_measure ;;
ipdl)
  ( export TORCHINDUCTOR_ENABLE_PDL=1; flight_round round_nvfp4_flight_ipdl 260 )
  flight_round round_nvfp4_flight 200
  tar_out s33_ipdl ;;
*) echo "usage: $0 flight|measure|ipdl" >&2; exit 2 ;;
esac
