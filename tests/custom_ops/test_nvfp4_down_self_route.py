"""`DLMC_NVFP4_DOWN_SELF_ROUTE` (`custom_ops/_nvfp4_down_self_route.py`): the switch as read at
import. The kernel forms are lowered for sm_90 in `test_nvfp4_down_gluon.py` and
`test_nvfp4_moe_gluon.py`; on the H200 the op without an alignment launch equals the Triton
kernels bit for bit (`test_nvfp4_gate_up_gluon.py`'s `no_align` cases)."""

from __future__ import annotations

import pytest

from tests.custom_ops.switches import assert_reads, assert_refused

SWITCH = ("_nvfp4_down_self_route", "DOWN_SELF_ROUTE", "DLMC_NVFP4_DOWN_SELF_ROUTE")


@pytest.mark.parametrize("value,expected", [(None, "True"), ("1", "True"), ("0", "False")])
def test_the_switch_is_on_by_default_and_off_with_zero(value: str | None, expected: str) -> None:
    assert_reads(*SWITCH, value, expected)


def test_a_bad_value_is_refused_naming_the_switch() -> None:
    assert_refused(*SWITCH, "yes", "1, 0")
