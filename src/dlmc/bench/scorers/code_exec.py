"""Run untrusted generated code in a fresh, limited Python subprocess (never in this process).

Each program runs as ``python -I`` (isolated: no user site, no ``PYTHON*`` variables, no cwd on
``sys.path``) in its own session and temporary working directory, with stdin closed and output
written to files there. A small prelude, run in the child before the program, sets ``RLIMIT_AS``
(memory), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` and ``RLIMIT_CORE``, and replaces the socket API with
one that refuses to connect. On the wall-clock timeout the whole process group is killed. A
program passes iff it exits with code 0 within the timeout (human-eval semantics) and ran to its
end: the prelude then prints a random token, so an early ``sys.exit(0)`` does not pass.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT_S = 3.0  # human-eval / `code_eval`; OpenCompass MBPP uses 10 s.
DEFAULT_MEMORY_MB = 2048
_MAX_OUTPUT_BYTES = 16 * 1024 * 1024
_STDERR_TAIL = 2000

_PRELUDE = r"""
import os, resource, socket, sys
_path, _mem, _cpu, _fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
_done, _write = sys.argv[5].encode(), os.write
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the dlmc bench sandbox")

class _NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        _no_network()

socket.socket = _NoSocket
for _name in ("create_connection", "create_server", "getaddrinfo", "socketpair", "fromfd"):
    setattr(socket, _name, _no_network)
sys.argv = [_path]
with open(_path, encoding="utf-8") as _f:
    _code = compile(_f.read(), _path, "exec")
del os, resource, socket, _f, _name, _mem, _cpu, _fsize
exec(_code, {"__name__": "__main__", "__file__": _path, "__builtins__": __builtins__})
_write(1, b"\n" + _done + b"\n")
"""


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one sandboxed run.

    Attributes:
        passed: exited with code 0 before the timeout.
        returncode: the exit code (negative: killed by that signal); ``None`` when timed out.
        timed_out: the wall-clock timeout expired and the process group was killed.
        seconds: wall-clock time of the run.
        stderr_tail: the last characters of stderr (the traceback of a failing assert).
    """

    passed: bool
    returncode: int | None
    timed_out: bool
    seconds: float
    stderr_tail: str

    @property
    def reason(self) -> str:
        """A one-line reason for a failure (empty when passed)."""
        if self.passed:
            return ""
        if self.timed_out:
            return f"timed out after {self.seconds:.1f} s"
        lines = [line for line in self.stderr_tail.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else "no stderr"
        if self.returncode is not None and self.returncode < 0:
            return f"killed by signal {-self.returncode} ({last})"
        return f"exit code {self.returncode}: {last}"


def run_program(
    program: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, memory_mb: int = DEFAULT_MEMORY_MB
) -> ExecResult:
    """Run ``program`` (Python source) in a fresh sandboxed subprocess; see the module docstring.

    Args:
        program: the full test program (solution + tests).
        timeout_s: wall-clock limit; the process group is killed when it expires.
        memory_mb: address-space cap (``RLIMIT_AS``) in MiB.
    """
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout_s and memory_mb must be positive, got {timeout_s}, {memory_mb}")
    cpu_s = max(1, int(timeout_s) + 1)
    with tempfile.TemporaryDirectory(prefix="dlmc-exec-") as tmp:
        source = Path(tmp) / "program.py"
        source.write_text(program, encoding="utf-8")
        out_path, err_path = Path(tmp) / "stdout.txt", Path(tmp) / "stderr.txt"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": tmp,
               "TMPDIR": tmp, "OMP_NUM_THREADS": "1"}
        done_token = secrets.token_hex(16)
        args = [sys.executable, "-I", "-c", _PRELUDE, str(source), str(memory_mb * 1024 * 1024),
                str(cpu_s), str(_MAX_OUTPUT_BYTES), done_token]
        start = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(args, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=err, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
        seconds = time.perf_counter() - start
        stderr_tail = _tail(err_path)
        finished = done_token in _tail(out_path)
    returncode = None if timed_out else proc.returncode
    passed = not timed_out and returncode == 0 and finished
    if not timed_out and returncode == 0 and not finished:
        stderr_tail += "\nexited with code 0 before the end of the tests"
    return ExecResult(passed, returncode, timed_out, seconds, stderr_tail)


def run_programs(
    programs: Iterable[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    workers: int | None = None,
) -> list[ExecResult]:
    """Run many programs, each in its own sandboxed subprocess, ``workers`` at a time (default:
    twice the CPU count, since much of a short run is process start-up).

    Threads here only wait on the subprocesses; nothing generated runs in this process.
    """
    programs = list(programs)
    workers = workers or 2 * max(1, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: run_program(p, timeout_s=timeout_s, memory_mb=memory_mb),
                             programs))


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child's whole process group (it leads its own session) and reap the child."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(path: Path) -> str:
    """The last characters of a (possibly large) output file."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - _STDERR_TAIL))
        return f.read().decode("utf-8", errors="replace")
