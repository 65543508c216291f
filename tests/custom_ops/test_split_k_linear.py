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


def test_switch_applies_to_o_proj_and_dense_down_only() -> None:
    """DLMC_SMALL_M_GEMM=splitk: qkv and the dense MLP's gate/up stay cuBLAS (`wide_gemm`);
    CPU tensors always take F.linear."""
    from dlmc.models.layers import linear, wide_gemm

    assert wide_gemm("splitk") == "cublas"
    assert wide_gemm("triton") == "triton" and wide_gemm("cublas") == "cublas"
    x, weight = make_case(3, 16, 32, 2)
    torch.testing.assert_close(linear(x.cpu(), weight.cpu(), "splitk"),
                               F.linear(x.cpu(), weight.cpu()))


@pytest.mark.gpu
def test_tiny_model_logits_and_graph_tokens_with_split_k(tiny_dir, monkeypatch) -> None:
    """The tiny LLaDA2 model with DLMC_SMALL_M_GEMM=splitk: logits within bf16 rounding of
    cuBLAS's (sums in another order), and graph-mode generation replays itself."""
    import dlmc.models.layers as layers
    from dlmc import LLM

    shapes = []  # the weights that went through split_k_linear (recorded while tracing)
    op = layers.split_k_linear
    monkeypatch.setattr(layers, "split_k_linear",
                        lambda x, w: shapes.append(tuple(w.shape)) or op(x, w))
    logits, tokens = {}, {}
    monkeypatch.setenv("DLMC_QKV_SPLIT_K", "0")  # qkv in cuBLAS (its partials: below)
    for switch in ("cublas", "splitk"):
        monkeypatch.setenv("DLMC_SMALL_M_GEMM", switch)
        llm = LLM(tiny_dir, device="cuda", dtype="bf16", mode="graph")
        runs = [llm.generate(prompt="The capital of France is", max_new_tokens=32).token_ids
                for _ in range(2)]
        assert runs[0] == runs[1]
        tokens[switch] = runs[0]
        logits[switch] = llm.logits(list(range(40, 90)))
        del llm
    diff = (logits["splitk"] - logits["cublas"]).norm() / logits["cublas"].norm()
    assert diff < 2e-2, diff
    import json
    from pathlib import Path

    cfg = json.loads((Path(tiny_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    o_proj = (cfg["hidden_size"], cfg["num_attention_heads"] * head_dim)
    qkv_rows = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim
    assert o_proj in shapes and all(rows != qkv_rows for rows, _ in shapes), shapes


@pytest.mark.gpu
def test_tiny_nvfp4_model_with_qkv_partials(nvfp4_dir, monkeypatch) -> None:
    """`DLMC_QKV_SPLIT_K=1` on the tiny NVFP4 model with the FP8 paged cache (the round's path:
    qkv partials into `qk_norm_rope_append`): every layer's qkv goes through split-K, logits
    within bf16 rounding of the bf16 qkv's, graph-mode generation replays itself."""
    import dlmc.models.llada2 as llada2
    from dlmc import LLM

    shapes = []
    op = llada2.split_k_linear
    monkeypatch.setattr(llada2, "split_k_linear",
                        lambda x, w: shapes.append(tuple(w.shape)) or op(x, w))
    logits = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("DLMC_QKV_SPLIT_K", switch)
        llm = LLM(nvfp4_dir, device="cuda", precision="nvfp4", mode="graph")
        runs = [llm.generate(prompt_token_ids=list(range(60, 110)), max_new_tokens=32).token_ids
                for _ in range(2)]
        assert runs[0] == runs[1]
        logits[switch] = llm.logits(list(range(40, 90)))
        del llm
        assert bool(shapes) == (switch == "1")
    diff = (logits["1"] - logits["0"]).norm() / logits["0"].norm()
    assert diff < 2e-2, diff
