"""The sandboxed subprocess runner: pass/fail, timeouts, memory cap, no network, temp cwd."""

from __future__ import annotations

import os
import time

from dlmc.bench.scorers.code_exec import run_program, run_programs

LOOP = "while True:\n    pass\n"
ALLOCATE = "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 * 1024))\n"


def test_exit_code_zero_passes_and_a_failed_assert_fails() -> None:
    assert run_program("assert 1 + 1 == 2\n").passed
    failed = run_program("assert 1 + 1 == 3\n")
    assert not failed.passed and failed.returncode == 1 and "AssertionError" in failed.reason


def test_an_infinite_loop_is_stopped_and_fails() -> None:
    start = time.perf_counter()
    result = run_program(LOOP, timeout_s=1.0)
    assert not result.passed and result.timed_out and result.returncode is None
    assert time.perf_counter() - start < 5.0


def test_unbounded_allocation_hits_the_memory_cap() -> None:
    result = run_program(ALLOCATE, timeout_s=10.0, memory_mb=256)
    assert not result.passed and not result.timed_out
    assert "MemoryError" in result.stderr_tail


def test_children_of_a_timed_out_program_are_killed() -> None:
    program = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('child', p.pid, flush=True)\n"
        "p.wait()\n"
    )
    result = run_program(program, timeout_s=1.0)
    assert result.timed_out
    # The grandchild's pid is gone (killed with the process group, reaped by init).
    time.sleep(0.2)
    for line in os.popen("ps -eo args").read().splitlines():
        assert "time.sleep(60)" not in line


def test_network_is_refused() -> None:
    result = run_program(
        "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n")
    assert not result.passed and "network access is disabled" in result.stderr_tail
    raw = run_program("import socket\nsocket.socket()\n")
    assert not raw.passed and "network access is disabled" in raw.stderr_tail


def test_runs_in_an_isolated_temporary_directory() -> None:
    program = (
        "import os, sys\n"
        "assert os.path.basename(os.getcwd()).startswith('dlmc-exec-')\n"
        "assert sys.flags.isolated == 1\n"
        "assert not any('wt-bench' in p or p == '' for p in sys.path), sys.path\n"
        "open('scratch.txt', 'w').write('x')\n"
    )
    result = run_program(program)
    assert result.passed, result.reason


def test_an_early_clean_exit_does_not_pass() -> None:
    for early in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
        result = run_program(early + "assert False\n")
        assert not result.passed and "before the end" in result.reason


def test_bad_programs_do_not_harm_the_good_ones_running_beside_them() -> None:
    good = "print(sum(range(10)))\n"
    programs = [LOOP, ALLOCATE, good, good, "import os; os.kill(os.getpid(), 9)\n", good]
    results = run_programs(programs, timeout_s=4.0, memory_mb=256, workers=3)
    assert [r.passed for r in results] == [False, False, True, True, False, True]
    assert results[0].timed_out and results[4].returncode == -9
