#!/usr/bin/env bash
# Session 40's H200 calls (helpers of perf/h200_session.sh); output tarred in $OUT.
#   bash perf/h200_s40.sh last   # the NVFP4 + FP8 round with DLMC_FUSED_ROUTE_ALIGN=last
#                                # (moe_route's last program aligns the pairs, one launch
#                                # fewer) against the default, alternating processes
#                                # (ORDER, default "last off last off")
#   bash perf/h200_s40.sh warps  # (ran at commit 9425263; DLMC_ROUTE_LAST_WARPS was removed
#                                # after it) perf/probe_route_align.py (routing + alignment alone: two
#                                # launches, or moe_route_last_align at 1 / 2 / 4 warps), then
#                                # rounds with DLMC_FUSED_ROUTE_ALIGN=last at LAST_WARPS (2) and
#                                # the default (ORDER, default "last off")
#   bash perf/h200_s40.sh route  # (ran at commit ffcf256; the order keys were removed after
#                                # it) moe_route's picks as one max over order keys, each token's
#                                # groups reduced in registers first: the routing GPU tests,
#                                # perf/probe_route_align.py with it, with session 39's
#                                # moe_route reduced in that order
#                                # (results/s40/moe_route_reordered.py.txt) and with session
#                                # 39's (results/s40/moe_route_head.py.txt), then rounds with
#                                # it and with session 39's
#   bash perf/h200_s40.sh one    # perf/probe_route_align.py with moe_route_align (one program
#                                # routes and aligns) at 4-32 warps, then rounds with
#                                # DLMC_FUSED_ROUTE_ALIGN=on and the default (ORDER, "on off")
# Env: ROUND_TIMEOUT (170), ORDER, LAST_WARPS.
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib
source "$HERE/h200_s34.sh" lib

case "${1:-}" in
last)
  n=0
  for mode in ${ORDER:-last off last off}; do
    n=$((n + 1))
    env_round "round_${mode}_$n" DLMC_FUSED_ROUTE_ALIGN=$mode
  done
  tar_out s40_last ;;
warps)
  timeout 120 python3 perf/probe_route_align.py --out "$OUT/route_align.json" \
    > "$OUT/route_align.txt" 2>&1
  echo "probe rc=$?"; cat "$OUT/route_align.txt"
  n=0
  for mode in ${ORDER:-last off}; do
    n=$((n + 1))
    env_round "round_${mode}_$n" DLMC_FUSED_ROUTE_ALIGN=$mode \
      DLMC_ROUTE_LAST_WARPS=$([ "$mode" = last ] && echo "${LAST_WARPS:-2}" || echo 0)
  done
  tar_out s40_warps ;;
route)
  R=custom_ops/moe_route.py
  TEST_TIMEOUT=${TEST_TIMEOUT:-150} gpu_tests route tests/custom_ops/test_moe_route.py \
    tests/custom_ops/test_moe_route_align.py tests/custom_ops/test_moe_route_last_align.py
  for form in keys reordered head; do
    run=(swapped $R perf/results/s40/moe_route_$form.py.txt)
    [ $form = keys ] && run=()
    "${run[@]}" timeout 120 python3 perf/probe_route_align.py --warps 1 \
      --out "$OUT/route_$form.json" > "$OUT/route_$form.txt" 2>&1
    echo "probe $form rc=$?"; cat "$OUT/route_$form.txt"
  done
  env_round round_keys
  swapped $R perf/results/s40/moe_route_head.py.txt env_round round_head
  tar_out s40_route ;;
one)
  timeout 150 python3 perf/probe_route_align.py --warps 1 4 --one-warps 4 8 16 32 \
    --out "$OUT/route_one.json" > "$OUT/route_one.txt" 2>&1
  echo "probe rc=$?"; cat "$OUT/route_one.txt"
  n=0
  for mode in ${ORDER:-on off}; do
    n=$((n + 1))
    env_round "round_${mode}_$n" DLMC_FUSED_ROUTE_ALIGN=$mode
  done
  tar_out s40_one ;;
*) echo "h200_s40.sh: expected last, warps, route or one; got ${1:-nothing}" >&2
   exit 2 ;;
esac
