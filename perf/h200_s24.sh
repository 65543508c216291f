#!/usr/bin/env bash
# Session 24's H200 calls (helpers of perf/h200_session.sh). Each call's output is tarred in $OUT.
#   bash perf/h200_s24.sh probe   # call 1 (carry .whl): perf/probe_ws_stream.py (how fast the
#                                 # gate/up bytes stream from a warp-specialized Gluon kernel
#                                 # against the op's one-program-per-tile structure), then the
#                                 # GPU tests left from session 23 (sampled rounds, runner)
#   bash perf/h200_s24.sh down    # call 2: perf/proto_gluon_down.py (CONFIGS to override)
set -u
source "$(dirname "$0")/h200_session.sh" lib

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
*) echo "usage: bash perf/h200_s24.sh probe|down"; exit 2 ;;
esac
