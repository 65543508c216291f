#!/usr/bin/env bash
# Session 38's H200 calls (helpers of perf/h200_session.sh / h200_s34.sh); output tarred in $OUT.
#   bash perf/h200_s38.sh decision  # (carry .whl) the greedy decision in one pass against two
#                                   # (perf/bench_decision.py), the NVFP4 + FP8 round at the
#                                   # defaults with a profile, then the four GPU tests session 37
#                                   # left unfinished
#   bash perf/h200_s38.sh widths    # (carry .whl) the one-pass decision at several chunk widths;
#                                   # the NVFP4 + FP8 round at the fastest width and with
#                                   # session 37's rules.py (two passes,
#                                   # results/s38/rules_s37.py.txt); then the op's
#                                   # hypothesis fuzz test_matches_reference_gpu
# Env: ROUND_TIMEOUT (170 per round), TEST_TIMEOUT.
set -u
HERE="$(dirname "$0")"
source "$HERE/h200_s34.sh" lib

case "${1:-}" in
decision)
  timeout 150 python3 perf/bench_decision.py --out "$OUT/decision.json" > "$OUT/decision.txt" 2>&1
  echo "decision rc=$?"; tail -3 "$OUT/decision.txt"
  env_round round_default
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  T=tests/custom_ops/test_nvfp4_moe.py
  TEST_TIMEOUT=${TEST_TIMEOUT:-240} gpu_tests s37_left -n 4 \
    "$T::test_kernel_matches_reference_gpu[2]" "$T::test_v3_single_code_weights_are_exact_gpu[3]" \
    tests/custom_ops/test_pdl.py::test_graph_generate_equal_with_pdl_on_and_off \
    "$T::test_matches_reference_gpu"
  tar_out s38_decision ;;
widths)
  timeout 200 python3 perf/bench_decision.py --widths 614 512 1024 2048 4096 8192 \
    --out "$OUT/widths.json" > "$OUT/widths.txt" 2>&1
  echo "widths rc=$?"; grep -E "ratio|/ two" "$OUT/widths.txt"
  best=$(python3 -c "import json; r = json.load(open('$OUT/widths.json'))['rows']; \
print(min((v['us_per_call'], k) for k, v in r.items() if k.startswith('one'))[1].split('_')[-1])")
  echo "fastest width $best"
  R=src/dlmc/engine/rules.py
  cp $R /tmp/rules_new.py
  sed -i "s/^ARGMAX_CHUNK_WIDTH = .*/ARGMAX_CHUNK_WIDTH = $best/" $R
  env_round round_width_$best
  cp perf/results/s38/rules_s37.py.txt $R
  env_round round_s37_rules
  cp /tmp/rules_new.py $R
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  TEST_TIMEOUT=${TEST_TIMEOUT:-250} gpu_tests fuzz_op \
    "tests/custom_ops/test_nvfp4_moe.py::test_matches_reference_gpu"
  tar_out s38_widths ;;
*) echo "h200_s38.sh: expected decision or widths; got ${1:-nothing}" >&2; exit 2 ;;
esac
