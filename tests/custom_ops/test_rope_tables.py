"""dlmc::rope_tables: the one-launch rotary tables against the torch reference.

On CPU the kernel runs under Triton's interpreter (numpy's float32 cos/sin, which may differ from
torch's by an fp32 ulp, so a bf16 entry may round the other way); on the GPU both are CUDA's
cosf/sinf and the tables must be equal bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmc.custom_ops.rope_tables import rope_inv_freq, rope_tables, rope_tables_reference
from dlmc.models.layers import rope_cos_sin

from .graph_capture import compile_and_capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16


def make_case(tokens: int, rotary: int, max_position: int, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_position, (tokens,), generator=gen)
    return positions.to(DEVICE), rope_inv_freq(rotary, 600000.0, DEVICE)


def assert_tables_match(got: tuple[torch.Tensor, torch.Tensor],
                        want: tuple[torch.Tensor, torch.Tensor], exact: bool) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == BF16 and g.is_contiguous()
        if exact:
            assert torch.equal(g, w)
        else:  # one bf16 step of a value in [-1, 1] at most, and almost all equal
            assert ((g.float() - w.float()).abs() <= 2**-8).all()
            assert (g == w).float().mean().item() > 0.99


@settings(max_examples=10, deadline=None)
@given(tokens=st.sampled_from([1, 3, 17, 64]), rotary=st.sampled_from([2, 8, 64, 96, 128]),
       max_position=st.sampled_from([2, 4096, 200000]), seed=st.integers(0, 2**16))
def test_matches_reference(tokens: int, rotary: int, max_position: int, seed: int) -> None:
    positions, inv_freq = make_case(tokens, rotary, max_position, seed)
    assert_tables_match(rope_tables(positions, inv_freq),
                        rope_tables_reference(positions, inv_freq, BF16), exact=DEVICE == "cuda")


def test_columns_repeat_each_frequency_and_position_zero_is_the_identity() -> None:
    positions, inv_freq = make_case(5, 64, 4096, 0)
    positions[0] = 0
    cos, sin = rope_tables(positions, inv_freq)
    assert torch.equal(cos[:, :32], cos[:, 32:]) and torch.equal(sin[:, :32], sin[:, 32:])
    assert (cos[0] == 1).all() and (sin[0] == 0).all()
    angle = positions[3].float() * inv_freq[1]  # fp32, as the reference
    assert abs(cos[3, 1].float() - torch.cos(angle)) <= 2**-8
    assert abs(sin[3, 33].float() - torch.sin(angle)) <= 2**-8


def test_model_tables_are_the_reference_maths() -> None:
    positions, _ = make_case(7, 64, 4096, 1)
    cos, sin = rope_cos_sin(positions, 64, 600000.0, torch.float32)  # fp32: the torch ops
    want = rope_tables_reference(positions, rope_inv_freq(64, 600000.0, DEVICE), torch.float32)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])


def test_bad_inputs_name_the_tensor() -> None:
    positions, inv_freq = make_case(3, 8, 100, 2)
    with pytest.raises(ValueError, match=r"positions must be integer \[T\]"):
        rope_tables(positions.float(), inv_freq)
    with pytest.raises(ValueError, match="positions must be integer"):
        rope_tables(positions[None], inv_freq)
    with pytest.raises(ValueError, match=r"inv_freq must be fp32 \[R/2\]"):
        rope_tables(positions, inv_freq.double())


def test_opcheck() -> None:
    positions, inv_freq = make_case(3, 8, 100, 3)
    torch.library.opcheck(torch.ops.dlmc.rope_tables.default, (positions, inv_freq),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_compile_and_cuda_graph_replay() -> None:
    positions, inv_freq = make_case(32, 64, 30000, 4)
    graph, out = compile_and_capture(lambda p: rope_tables(p, inv_freq), positions)
    for seed in range(3):
        positions.copy_(make_case(32, 64, 30000, 10 + seed)[0])
        graph.replay()
        assert_tables_match(out, rope_tables_reference(positions, inv_freq, BF16), exact=True)
