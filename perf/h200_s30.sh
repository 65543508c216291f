#!/usr/bin/env bash
# Session 30's prepared H200 call (helpers of perf/h200_session.sh); output tarred in $OUT.
#   bash perf/h200_s30.sh stream  # perf/probe_shared_stream.py: the LLaDA shared expert fused
#                                 # in the op, on a side stream, serial, or absent (19 layers of
#                                 # router GEMM, routing and op per graph), 8 passes, twice
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib

case "${1:-}" in
stream)
  for run in 1 2; do
    timeout 200 python3 perf/probe_shared_stream.py --passes 8 \
      --out "$OUT/probe_shared_stream$run.json" > "$OUT/probe_shared_stream$run.txt" 2>&1
    echo "probe $run rc=$?"; tail -6 "$OUT/probe_shared_stream$run.txt"
  done
  tar_out s30_stream ;;
*) echo "usage: $0 stream" >&2; exit 2 ;;
esac
