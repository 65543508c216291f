"""dlmc::split_k_linear (split-K partials of a bf16 `x @ W^T`) against the exact product and
`split_k_linear_reference`. Products of bf16 values are exact in fp32, so the partials' sum
differs from the exact product only by fp32 summation order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dlmc.custom_ops.split_k_linear as split_k_module
from dlmc.custom_ops.split_k_linear import (
    linear_splits,
    split_k_linear,
    split_k_linear_reference,
)

from .graph_capture import compile_and_capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(tokens: int, features: int, inner: int, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, inner, generator=gen).bfloat16()
    weight = (torch.randn(features, inner, generator=gen) * inner**-0.5).bfloat16()
    return x.to(DEVICE), weight.to(DEVICE)


def assert_partials(partial: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Shape `[S, T, N]` fp32; each split's partial and the sum within 2^-20 of the sum of
    |products| of the exact (float64) product."""
    splits, per_split = linear_splits(weight.shape[1])
    assert partial.shape == (splits, x.shape[0], weight.shape[0])
    assert partial.dtype == torch.float32
    for s in range(splits):
        xs = x.double()[:, s * per_split:(s + 1) * per_split]
        ws = weight.double()[:, s * per_split:(s + 1) * per_split]
        magnitude = xs.abs() @ ws.abs().t()
        assert ((partial[s].double() - xs @ ws.t()).abs() <= 2**-20 * magnitude + 1e-30).all()
    want = x.double() @ weight.double().t()
    magnitude = x.double().abs() @ weight.double().abs().t()
    assert ((partial.double().sum(0) - want).abs() <= 2**-20 * magnitude + 1e-30).all()


@settings(max_examples=8, deadline=None)
@given(tokens=st.sampled_from([1, 3, 17, 32, 64]), features=st.sampled_from([16, 40, 96]),
       inner=st.sampled_from([16, 130, 512, 1040]), seed=st.integers(0, 2**16))
def test_partials_sum_to_the_product(tokens: int, features: int, inner: int, seed: int) -> None:
    x, weight = make_case(tokens, features, inner, seed)
    partial = split_k_linear(x, weight)
    assert_partials(partial, x, weight)
    assert_partials(split_k_linear_reference(x, weight), x, weight)


@pytest.mark.parametrize("config", [(16, 8, 32, 4, 2), (64, 2, 64, 4, 3)])
def test_other_launch_configs(monkeypatch: pytest.MonkeyPatch, config: tuple[int, ...]) -> None:
    """Other tile / split counts (the bench's sweep): still the product, split as configured."""
    monkeypatch.setattr(split_k_module, "_CONFIG", config)
    x, weight = make_case(5, 48, 300, 1)
    assert_partials(split_k_linear(x, weight), x, weight)


def test_rounded_sum_is_f_linear_up_to_order() -> None:
    x, weight = make_case(32, 64, 2048, 7)
    out = split_k_linear(x, weight).sum(0).to(torch.bfloat16)
    ref = F.linear(x.float(), weight.float())
    bf16_step = ref.abs().clamp_min(1e-30) * 2**-7
    assert ((out.float() - ref).abs() <= bf16_step).all()


def test_bad_operands_are_named() -> None:
    x, weight = make_case(3, 16, 32, 0)
    with pytest.raises(ValueError, match="split_k_linear: weight must be bf16"):
        split_k_linear(x, weight.float())
    with pytest.raises(ValueError, match=r"split_k_linear: x must be bf16 \[T <= 64, K\]"):
        split_k_linear(torch.zeros(65, 32, dtype=torch.bfloat16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="K=32"):
        split_k_linear(x, weight[:, :16])


@pytest.mark.gpu
def test_compile_and_cuda_graph_replay() -> None:
    """LLaDA2.1-mini's o_proj and qkv shapes: compiled + graph-replayed partials == eager."""
    for features in (2048, 3072):
        x, weight = make_case(32, features, 2048, features)
        eager = split_k_linear(x, weight)
        assert_partials(eager, x, weight)
        graph, replayed = compile_and_capture(split_k_linear, x, weight)
        replayed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)


def test_split_k_or_linear_takes_only_small_bf16_cuda_blocks() -> None:
    """`split_k_or_linear` is `F.linear` for CPU tensors; `takes_split_k` wants a bf16 CUDA
    `[T <= 64, K]`."""
    from dlmc.models.layers import split_k_or_linear, takes_split_k

    x, weight = make_case(3, 16, 32, 2)
    torch.testing.assert_close(split_k_or_linear(x.cpu(), weight.cpu()),
                               F.linear(x.cpu(), weight.cpu()))
    assert not takes_split_k(x.cpu())
    if torch.cuda.is_available():
        assert takes_split_k(x.cuda().bfloat16())
        assert not takes_split_k(x.cuda().float())
        assert not takes_split_k(torch.zeros(65, 16, device="cuda", dtype=torch.bfloat16))


def _patch_cublas(monkeypatch) -> None:
    """Every projection through F.linear (cuBLAS), as if no block took split-K."""
    import dlmc.models.layers as layers
    import dlmc.models.llada2 as llada2

    for module in (layers, llada2):
        monkeypatch.setattr(module, "takes_split_k", lambda x: False)


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", ["tiny_dir", "nvfp4_dir"])
def test_tiny_model_logits_and_graph_tokens_with_split_k(fixture, request, monkeypatch) -> None:
    """The tiny LLaDA2 model (BF16, and NVFP4 with the FP8 paged cache: qkv partials into
    `qk_norm_rope_append`): qkv, o_proj and the dense down projection go through split-K;
    logits within bf16 rounding of cuBLAS's (sums in another order), and graph-mode generation
    replays itself."""
    import json
    from pathlib import Path

    import dlmc.models.layers as layers
    import dlmc.models.llada2 as llada2
    from dlmc.api import LLM

    model_dir = request.getfixturevalue(fixture)
    shapes = []  # the weights that went through split_k_linear (recorded while tracing)
    for module in (layers, llada2):
        op = module.split_k_linear
        monkeypatch.setattr(module, "split_k_linear",
                            lambda x, w, op=op: shapes.append(tuple(w.shape)) or op(x, w))
    logits = {}
    for split in (True, False):
        if not split:
            _patch_cublas(monkeypatch)
            shapes.clear()
        llm = LLM(model_dir, device="cuda", mode="graph")
        runs = [llm.generate(prompt_token_ids=list(range(60, 110)), max_new_tokens=32).token_ids
                for _ in range(2)]
        assert runs[0] == runs[1]
        logits[split] = llm.logits(list(range(40, 90)))
        del llm
        if split:
            cfg = json.loads((Path(model_dir) / "config.json").read_text())
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
            o_proj = (cfg["hidden_size"], cfg["num_attention_heads"] * head_dim)
            qkv_rows = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim
            assert o_proj in shapes and any(rows == qkv_rows for rows, _ in shapes), shapes
    assert not shapes  # the cuBLAS run took no split-K
    diff = (logits[True] - logits[False]).norm() / logits[False].norm()
    assert diff < 2e-2, diff
