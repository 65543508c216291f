#!/usr/bin/env bash
# Session 29's H200 calls (helpers of perf/h200_session.sh). Each call's output is tarred in $OUT.
#   bash perf/h200_s29.sh self    # call 3 (carry .whl): the Gluon gate/up GPU tests (aligned and
#                                 # self-routed), then the op (routed experts) with
#                                 # DLMC_NVFP4_SELF_ROUTE=0 / 1, one process each, three passes,
#                                 # and perf/probe_op_edges.py with it on
#   bash perf/h200_s29.sh rounds  # call 7: NVFP4 + FP8 rounds, DLMC_NVFP4_SELF_ROUTE=1 vs 0
#   bash perf/h200_s29.sh layout  # session 30, call 1 (carry .whl): the Gluon gate/up GPU tests
#                                 # (aligned, spread and replicated self-routing), then the op
#                                 # with DLMC_NVFP4_SELF_ROUTE_LAYOUT=spread / replicated, one
#                                 # process each, three passes (replicated was slower and was
#                                 # removed after it: the switch no longer exists)
#   bash perf/h200_s29.sh shared  # session 30, calls 2-5 (carry .whl): DLMC_NVFP4_SHARED=router
#                                 # (the shared expert in the router's launches): its tests on
#                                 # the GPU, then NVFP4 + FP8 rounds at the default and with it
#                                 # (0.38 ms per round slower: removed after them)
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_session.sh" lib
source <(sed -n '/^op_rows()/,/^}/p' "$HERE/h200_s27.sh")

op() {  # op NAME SELF [bench args]: the op (routed experts) with DLMC_NVFP4_SELF_ROUTE=SELF
  op_env "$1" "DLMC_NVFP4_SELF_ROUTE=$2" "${@:3}"
}

case "${1:-}" in
self)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=300 gpu_tests self -n 4 tests/custom_ops/test_nvfp4_gate_up_gluon.py \
    tests/custom_ops/test_nvfp4_down_gluon.py
  if ! grep -qE "failed|error|Timeout" "$OUT/gpu_tests_self.txt"; then
    op op_self1 1 --profile
    op op_aligned1 0 --profile
    op op_aligned2 0
    op op_self2 1
    op op_self3 1
    op op_aligned3 0
    DLMC_NVFP4_SELF_ROUTE=1 timeout 120 python3 perf/probe_op_edges.py --passes 8 \
      --out "$OUT/probe_op_edges_self.json" > "$OUT/probe_op_edges_self.txt" 2>&1
    tail -5 "$OUT/probe_op_edges_self.txt"
  fi
  tar_out s29_self ;;
rounds)
  ab_rounds DLMC_NVFP4_SELF_ROUTE=1 self_route 200
  grep -h "graph" "$OUT"/round_*.txt | tail -4
  tar_out s29_rounds ;;
layout)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=300 gpu_tests layout -n 4 tests/custom_ops/test_nvfp4_gate_up_gluon.py
  if ! grep -qE "failed|error|Timeout" "$OUT/gpu_tests_layout.txt"; then
    for pass in 1 2 3; do
      op_env "op_spread$pass" DLMC_NVFP4_SELF_ROUTE_LAYOUT=spread $([ $pass = 1 ] && echo --profile)
      op_env "op_replicated$pass" DLMC_NVFP4_SELF_ROUTE_LAYOUT=replicated \
        $([ $pass = 1 ] && echo --profile)
    done
  fi
  tar_out s29_layout ;;
shared)
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rf -n 4 \
    tests/custom_ops/test_router_shared.py tests/models/test_moe.py -k "router or shared" \
    > "$OUT/tests_router.txt" 2>&1
  echo "router tests rc=$?"; tail -2 "$OUT/tests_router.txt"
  if ! grep -qE "failed|error" "$OUT/tests_router.txt"; then
    ab_rounds DLMC_NVFP4_SHARED=router shared_router 200
    grep -h "graph" "$OUT"/round_*.txt | tail -4
  fi
  tar_out s29_shared ;;
*) echo "usage: $0 self|rounds|layout|shared" >&2; exit 2 ;;
esac
