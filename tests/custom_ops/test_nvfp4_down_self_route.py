"""`DLMC_NVFP4_DOWN_SELF_ROUTE` (`custom_ops/_nvfp4_down_self_route.py`): the switch as read at
import. The kernel forms are lowered for sm_90 in `test_nvfp4_down_gluon.py` and
`test_nvfp4_moe_gluon.py`; on the H200 the op without an alignment launch equals the Triton
kernels bit for bit (`test_nvfp4_gate_up_gluon.py`'s `no_align` cases)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

READ = "from dlmc.custom_ops import _nvfp4_down_self_route as m; print(m.DOWN_SELF_ROUTE)"


def read_switch(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DLMC_NVFP4_DOWN_SELF_ROUTE"}
    if value is not None:
        env["DLMC_NVFP4_DOWN_SELF_ROUTE"] = value
    return subprocess.run([sys.executable, "-c", READ], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.parametrize("value,expected", [(None, "True"), ("1", "True"), ("0", "False")])
def test_the_switch_is_on_by_default_and_off_with_zero(value: str | None, expected: str) -> None:
    result = read_switch(value)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == expected


def test_a_bad_value_is_refused_naming_the_switch() -> None:
    result = read_switch("yes")
    assert result.returncode != 0
    assert "DLMC_NVFP4_DOWN_SELF_ROUTE='yes': expected one of 1, 0" in result.stderr
