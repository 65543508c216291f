"""LLaDA2 (`llada2_moe`) as plain nn.Modules with Hugging Face parameter names.

Attention goes through one seam: the attention module computes q, k, v of the tokens it is
given and calls `ctx.attend(layer_idx, q, k, v)`; the engine's context object decides which
keys they see (the block-causal mask, a KV cache, a paged FP8 cache); a context whose cache can
take the block's K/V from the norm/rope launch says so through `rope_append_target` (see
`AttentionContext`). The MoE seam is the `experts` module inside `MoEBlock` (see moe.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dlmc.custom_ops._registration import INTERPRETED
from dlmc.custom_ops.linear_residual import linear_residual
from dlmc.custom_ops.norm_router_gemm import norm_router_gemm
from dlmc.custom_ops.qk_norm_rope import kernel_takes_qkv, qk_norm_rope, qk_norm_rope_reference
from dlmc.custom_ops.qk_norm_rope_append import qk_norm_rope_append
from dlmc.custom_ops.split_k_linear import split_k_linear
from dlmc.models.config import LLaDA2Config
from dlmc.models.layers import RMSNorm, SwiGLUMLP, rope_cos_sin, split_k_or_linear, takes_split_k
from dlmc.models.moe import MoEBlock


class AttentionContext(Protocol):
    """What the model needs from the engine: attention of new tokens over whatever keys apply.

    Optionally (looked up with `getattr`, so other contexts need neither) a context that stores
    the new tokens' K/V in a paged cache may let the model store them from its norm/rope launch
    (`dlmc::qk_norm_rope_append`, bf16 on CUDA or under Triton's interpreter):
    `rope_append_target(layer_idx)` gives that layer's `(k_cache, v_cache, page_table, offset,
    k_scale, v_scale)`, or None to keep `attend`; with a target the model calls
    `attend_appended(layer_idx, q, k, v)` (as `attend`, without storing K/V) instead of `attend`.
    """

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q `[T, Hq, D]`, k/v `[T, Hkv, D]` of the T new tokens -> output `[T, Hq, D]`."""
        ...


class Attention(nn.Module):
    """HF `attention`: fused `query_key_value`, per-head qk-norm, partial RoPE, `dense`."""

    def __init__(self, config: LLaDA2Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, qkv_rows, bias=False)
        self.query_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.key_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        out = self.context(x, cos, sin, ctx)  # [T, Hq*D]
        return split_k_or_linear(out, self.dense.weight)

    def context(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """The attention output `[T, Hq*D]` before the output projection `dense`."""
        tokens = x.shape[0]
        if takes_split_k(x):  # fp32 partials, summed and rounded by the norm/rope kernel
            qkv = split_k_linear(x, self.query_key_value.weight)  # fp32 [S, T, (Hq+2Hkv)*D]
        else:
            qkv = F.linear(x, self.query_key_value.weight)  # [T, (Hq+2Hkv)*D]
        args = (qkv, self.query_layernorm.weight, self.key_layernorm.weight, cos, sin,
                self.num_heads, self.num_kv_heads, self.query_layernorm.eps)
        target = self._rope_append_target(qkv, ctx)
        if target is not None:  # the context's K/V append done by the norm/rope launch
            q, k, v = qk_norm_rope_append(*args, *target)
            out = ctx.attend_appended(self.layer_idx, q, k, v)
        else:
            norm_rope = qk_norm_rope if qkv.is_cuda and kernel_takes_qkv(qkv) else (
                qk_norm_rope_reference)  # one Triton launch on the GPU; eager maths elsewhere
            q, k, v = norm_rope(*args)
            out = ctx.attend(self.layer_idx, q, k, v)  # q [T, Hq, D], k/v [T, Hkv, D]
        return out.reshape(tokens, -1)

    def _rope_append_target(self, qkv: torch.Tensor, ctx: AttentionContext
                            ) -> tuple[torch.Tensor, ...] | None:
        """The context's `rope_append_target` of this layer, where it has one and the Triton
        kernel runs (bf16 qkv or split-K partials, on CUDA or under the interpreter); else
        None."""
        target = getattr(ctx, "rope_append_target", None)
        if target is None or not kernel_takes_qkv(qkv) or not (qkv.is_cuda or INTERPRETED):
            return None
        return target(self.layer_idx)


class DecoderLayer(nn.Module):
    """Attention and MLP, each behind an RMSNorm and added to the residual stream.

    On a MoE layer (an `mlp` with `router_weight` and `routed`, as `MoEBlock`) on the split-K
    path (a bf16 CUDA block of at most 64 tokens) with `fuse_post_attention`
    (`KernelConfig.fused_post_attention_norm`, set by `apply_kernel_config`), o_proj +
    residual + the post-attention RMSNorm + the router GEMM run as two launches,
    `dlmc::linear_residual` (the residual stream and its tile sums of squares) and
    `dlmc::norm_router_gemm` (the norm applied on the way into the router, the normalised rows
    kept for the experts), instead of three (`split_k_linear`, an Inductor norm kernel,
    `router_gemm`); the same maths up to the order of the norm's fp32 sum.
    `pdl`: those two ops' programmatic dependent launches (`KernelConfig.pdl`).
    """

    def __init__(self, config: LLaDA2Config, layer_idx: int) -> None:
        super().__init__()
        self.fuse_post_attention = True
        self.pdl = True
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            MoEBlock(config)
            if config.is_moe_layer(layer_idx)
            else SwiGLUMLP(config.hidden_size, config.intermediate_size)
        )

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.fuse_post_attention and hasattr(self.mlp, "routed") and takes_split_k(x):
            norm = self.post_attention_layernorm
            out = self.attention.context(x, cos, sin, ctx)  # [T, Hq*D]
            h, sumsq = linear_residual(out, self.attention.dense.weight, h, self.pdl)
            xn, logits = norm_router_gemm(h, sumsq, norm.weight, norm.eps,
                                          self.mlp.router_weight, self.pdl)  # [S, T, E] partials
            return h + self.mlp.routed(xn, logits)
        h = h + self.attention(x, cos, sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class LLaDA2Model(nn.Module):
    """HF `model`: `word_embeddings`, `layers`, `norm`."""

    def __init__(self, config: LLaDA2Config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LLaDA2ForDiffusion(nn.Module):
    """The full network: token ids of some positions -> fp32 logits `[T, vocab]` of the same.

    The model is a mask predictor: logits at position i predict the token at i (no shift).
    """

    def __init__(self, config: LLaDA2Config) -> None:
        super().__init__()
        self.config = config
        self.model = LLaDA2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        compute_logits: bool = True,
        logits_from: int = 0,
    ) -> torch.Tensor | None:
        """input_ids `[T]` int64, positions `[T]` (absolute canvas indices) -> `[T, V]` fp32
        (only rows `logits_from:` when set: `[T - logits_from, V]`)."""
        h = self.model.word_embeddings(input_ids)  # [T, H]
        cos, sin = rope_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, ctx)
        if not compute_logits:
            return None
        return self.lm_head(self.model.norm(h[logits_from:])).float()
