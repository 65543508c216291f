"""`dlmc serve` as a user runs it: `python -m dlmc serve --model tiny-llada2 ...` in a
subprocess, then the README's curl call (same body, same Content-Type as `curl -d`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from click.testing import CliRunner

from dlmc.cli import main
from dlmc.cli.serve import serve
from dlmc.server import ServerSettings
from tests.serve.conftest import sse_data

README_BODY = '{"messages": [{"role": "user", "content": "Hi!"}], "max_new_tokens": 512}'


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_command_runs_the_readme_example(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "DLMC_CACHE": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "dlmc", "serve", "--model", "tiny-llada2"]
    command += ["--port", str(port), "--log-level", "warning"]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"dlmc serve exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"dlmc serve did not come up:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert f"on http://127.0.0.1:{port}" in log.read_text()
        headers = {"Content-Type": "application/x-www-form-urlencoded"}  # what curl -d sends
        with httpx.stream(
            "POST", f"{url}/generate", content=README_BODY, headers=headers, timeout=120
        ) as response:
            assert response.status_code == 200
            events = list(sse_data(response))
        assert {e["type"] for e in events[:-1]} == {"block"}
        done = events[-1]
        assert done["type"] == "done" and 0 < done["tokens"] <= 512
        assert done["finish_reason"] in ("length", "stop") and done["tokens_per_second"] > 0
        assert httpx.get(f"{url}/health").json()["requests"]["completed"] == 1

        # Ctrl-C with a stream open: the stream ends at once with an error event
        long_body = {"prompt": "x", "max_new_tokens": 4000}
        with httpx.stream("POST", f"{url}/generate", json=long_body, timeout=60) as response:
            events = sse_data(response)
            assert next(events)["type"] == "block"
            proc.send_signal(signal.SIGINT)
            rest = list(events)
        assert rest[-1]["type"] == "error" and "shutting down" in rest[-1]["error"]["message"]
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, log.read_text()


def test_serve_defaults_are_the_servers() -> None:
    defaults = {p.name: p.default for p in serve.params}
    settings = ServerSettings()
    assert defaults["max_body_bytes"] == settings.max_body_bytes
    assert defaults["queue_size"] == settings.queue_size
    assert defaults["request_timeout"] == settings.request_timeout_s


def test_serve_help_and_option_errors(tiny_dir: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    options = ("--model", "--host", "--port", "--queue-size", "--request-timeout")
    for option in (*options, "--max-body-bytes"):
        assert option in result.output
    assert "--max-new-tokens" in result.output and "--edit-threshold" in result.output
    result = runner.invoke(main, ["serve", "--model", "tiny-llada2", "--queue-size", "-1"])
    assert result.exit_code == 2 and "--queue-size" in result.output
    result = runner.invoke(main, ["serve", "--model", "tiny-llada2", "--request-timeout", "0"])
    assert result.exit_code == 2 and "--request-timeout" in result.output
    result = runner.invoke(main, ["serve", "--model", "tiny-llada2", "--max-body-bytes", "0"])
    assert result.exit_code == 2 and "--max-body-bytes" in result.output
    result = runner.invoke(main, ["serve", "--model", str(tiny_dir), "--threshold", "2"])
    assert result.exit_code == 1 and "`threshold`" in result.output
