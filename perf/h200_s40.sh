#!/usr/bin/env bash
# Session 40's H200 calls (helpers of perf/h200_session.sh); output tarred in $OUT.
#   bash perf/h200_s40.sh last   # the NVFP4 + FP8 round with DLMC_FUSED_ROUTE_ALIGN=last
#                                # (moe_route's last program aligns the pairs, one launch
#                                # fewer) against the default, alternating processes
#                                # (ORDER, default "last off last off")
#   bash perf/h200_s40.sh warps  # perf/probe_route_align.py (routing + alignment alone: two
#                                # launches, or moe_route_last_align at 1 / 2 / 4 warps), then
#                                # rounds with DLMC_FUSED_ROUTE_ALIGN=last and the default
#                                # (ORDER, default "last off"); call 2 ran it at commit
#                                # 9425263 with DLMC_ROUTE_LAST_WARPS=$LAST_WARPS (2), a knob
#                                # removed after it
#   bash perf/h200_s40.sh route  # the routing GPU tests, perf/probe_route_align.py with
#                                # moe_route as it is and reduced over the groups first
#                                # (results/s40/moe_route_reordered.py.txt), then a round;
#                                # call 3 ran it at commit ffcf256, whose moe_route picked by
#                                # order keys (`git show ffcf256:custom_ops/moe_route.py`),
#                                # with session 39's moe_route as a third form and round
#   bash perf/h200_s40.sh one    # perf/probe_route_align.py with moe_route_align (one program
#                                # routes and aligns) at 4-32 warps, then rounds with
#                                # DLMC_FUSED_ROUTE_ALIGN=on and the default (ORDER, "on off")
# Env: ROUND_TIMEOUT (170), ORDER, LAST_WARPS.
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib
source "$HERE/h200_s34.sh" lib

# fused_rounds MODE...: a round per DLMC_FUSED_ROUTE_ALIGN mode in turn (round_MODE_N), each
# with $ROUND_ENV's settings too
fused_rounds() {
  local n=0 mode
  for mode in "$@"; do
    n=$((n + 1))
    env_round "round_${mode}_$n" DLMC_FUSED_ROUTE_ALIGN=$mode ${ROUND_ENV:-}
  done
}

# probe NAME ARGS...: perf/probe_route_align.py ARGS into $OUT/NAME.{json,txt}
probe() {
  local name=$1; shift
  timeout 150 python3 perf/probe_route_align.py "$@" --out "$OUT/$name.json" \
    > "$OUT/$name.txt" 2>&1
  echo "probe $name rc=$?"; cat "$OUT/$name.txt"
}

case "${1:-}" in
last)
  fused_rounds ${ORDER:-last off last off}
  tar_out s40_last ;;
warps)
  probe route_align
  ROUND_ENV="DLMC_ROUTE_LAST_WARPS=${LAST_WARPS:-2}" fused_rounds ${ORDER:-last off}
  tar_out s40_warps ;;
route)
  R=custom_ops/moe_route.py
  TEST_TIMEOUT=${TEST_TIMEOUT:-150} gpu_tests route tests/custom_ops/test_moe_route.py \
    tests/custom_ops/test_moe_route_align.py tests/custom_ops/test_moe_route_last_align.py
  probe route_head --warps 1
  swapped $R perf/results/s40/moe_route_reordered.py.txt probe route_reordered --warps 1
  env_round round_head
  tar_out s40_route ;;
one)
  probe route_one --warps 1 4 --one-warps 4 8 16 32
  fused_rounds ${ORDER:-on off}
  tar_out s40_one ;;
*) echo "h200_s40.sh: expected last, warps, route or one; got ${1:-nothing}" >&2
   exit 2 ;;
esac
