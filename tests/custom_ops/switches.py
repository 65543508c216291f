"""Switches that dlmc's kernel modules read from the environment at import: read in a fresh
process, so that a test sees what a user's setting gives."""

from __future__ import annotations

import os
import subprocess
import sys


def read_switch(module: str, name: str, variable: str,
                value: str | None) -> subprocess.CompletedProcess:
    """`dlmc.custom_ops.<module>.<name>` printed by a fresh Python with the environment
    variable `variable` set to `value` (or unset: None)."""
    env = {k: v for k, v in os.environ.items() if k != variable}
    if value is not None:
        env[variable] = value
    code = f"from dlmc.custom_ops import {module} as m; print(m.{name})"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def assert_reads(module: str, name: str, variable: str, value: str | None,
                 expected: str) -> None:
    """With `variable` set to `value`, the module's `name` prints as `expected`."""
    result = read_switch(module, name, variable, value)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == expected


def assert_refused(module: str, name: str, variable: str, value: str, choices: str) -> None:
    """With `variable` set to `value`, importing the module fails with an error that names the
    variable, the value and the `choices`."""
    result = read_switch(module, name, variable, value)
    assert result.returncode != 0
    assert f"{variable}={value!r}: expected one of {choices}" in result.stderr
