#!/usr/bin/env bash
# Every gpu-marked test file on the H200, in parts that each fit one device call (run with
# carry [".whl"] for pytest-xdist; timeout_s ~590). Output tarred in $OUT.
#   bash perf/gpu_sweep.sh list        # the parts' files (checks that they cover every
#                                      # gpu-marked file once); runs nothing
#   bash perf/gpu_sweep.sh files PART  # PART's files, one per line; runs nothing
#   bash perf/gpu_sweep.sh PART        # pytest -m gpu -n 4 -v of PART's files, where PART is
#     default    NVFP4 loading, overlap, MoE model, PDL (with the runner and the op: ~460 s
#                in session 30, over 560 s in session 34, so both have their own parts)
#     op         test_nvfp4_moe.py (its 200-example fuzz and graph replays: over 450 s in
#                session 37)
#     runner     tests/graphs/test_runner.py (6 tests; 3 took the last ~250 s of session 34's)
#     kernels    the Gluon kernels and the attention variants / append files (not timed whole)
#     rest       the other kernels, engine, graphs, KV, model files (~210 s, session 32)
#     fuzz-moe   test_nvfp4_moe_v5.py: three 200-example fuzzes (~250 s each, session 32)
#     fuzz-other test_nvfp4_moe_v4.py, test_paged_attention.py (their 200-example fuzzes)
# Env: TEST_TIMEOUT (560).
set -u
HERE="$(dirname "$0")"
PARTS="default op runner kernels rest fuzz-moe fuzz-other"

DEFAULT="test_nvfp4_loading|test_moe_overlap|tests/models/test_moe\.py|test_pdl"
OP="test_nvfp4_moe\.py"
RUNNER="tests/graphs/test_runner\.py"
KERNELS="gluon|test_paged_attention_variants|test_paged_attention_append"
FUZZ_MOE="test_nvfp4_moe_v5\.py"
FUZZ_OTHER="test_nvfp4_moe_v4\.py|test_paged_attention\.py"

part_files() {  # part_files PART: the part's test files, one per line
  local all
  all=$(grep -rl "mark.gpu" tests --include="test_*.py" | sort)
  case "$1" in
  default) echo "$all" | grep -E "$DEFAULT" ;;
  op) echo "$all" | grep -E "$OP" ;;
  runner) echo "$all" | grep -E "$RUNNER" ;;
  kernels) echo "$all" | grep -E "$KERNELS" ;;
  fuzz-moe) echo "$all" | grep -E "$FUZZ_MOE" ;;
  fuzz-other) echo "$all" | grep -E "$FUZZ_OTHER" ;;
  rest) echo "$all" | grep -vE "$DEFAULT|$OP|$RUNNER|$KERNELS|$FUZZ_MOE|$FUZZ_OTHER" ;;
  *) echo "gpu_sweep: expected list, files PART or one of: $PARTS; got $1" >&2
     return 2 ;;
  esac
}

case "${1:-}" in
list)
  for part in $PARTS; do
    echo "== $part"; part_files "$part" || exit 2
  done
  listed=$(for part in $PARTS; do part_files "$part"; done | sort)
  all=$(grep -rl "mark.gpu" tests --include="test_*.py" | sort)
  if [ "$listed" != "$all" ]; then
    echo "gpu_sweep: the parts do not cover every gpu-marked file exactly once" >&2
    diff <(echo "$all") <(echo "$listed") >&2
    exit 1
  fi
  echo "$(echo "$all" | wc -l) files, each in one part" ;;
files) part_files "${2:-}" ;;
*)
  files=$(part_files "${1:-}") || exit 2
  source "$HERE/h200_session.sh" lib
  python3 -m pip install --no-deps -q .whl/*.whl 2>&1 | grep -v WARN | tail -1
  echo "$files" > "$OUT/sweep_files_$1.txt"
  # shellcheck disable=SC2086  # one argument per file
  TEST_TIMEOUT=${TEST_TIMEOUT:-560} gpu_tests "sweep_$1" -n 4 $files
  tar_out "gpu_sweep_$1" ;;
esac
