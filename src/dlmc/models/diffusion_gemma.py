"""DiffusionGemma (`diffusion_gemma`) text model as plain nn.Modules with the checkpoint's
names.

One set of weights (`model.decoder.*`) runs two passes:
- the encoder pass: causal over clean tokens (prompt, finished canvases), which the attention
  context stores in its KV cache;
- the decoder pass (`decoder=True`): over a canvas whose input goes through self-conditioning;
  the canvas attends bidirectionally to [cache ; canvas] and the context never writes the cache.

Attention goes through one seam: the attention module computes q, k, v of the tokens it is
given and calls `ctx.attend(layer_idx, q, k, v, window=..., scale=1.0)`; the context decides
which keys those tokens see (see `GemmaAttentionContext`). The MoE seam is the `experts` module
of each layer (see diffusion_gemma_moe.py). The lm_head is the embedding (tied).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dlmc.custom_ops.rope_tables import cos_sin_tables
from dlmc.models.diffusion_gemma_config import FULL, SLIDING, DiffusionGemmaConfig
from dlmc.models.diffusion_gemma_layers import (
    GatedMLP,
    GemmaRMSNorm,
    ScaledEmbedding,
    SelfConditioning,
    apply_rope,
    rope_inv_freq,
)
from dlmc.models.diffusion_gemma_moe import GemmaExperts, GemmaRouter
from dlmc.models.layers import fuse_linears

RopeTables = dict[str, tuple[torch.Tensor, torch.Tensor]]


class GemmaAttentionContext(Protocol):
    """What the model needs from the engine: attention of the given tokens over the keys that
    apply to this pass.

    `window` is the layer's sliding window (None on full layers). Encoder (causal) pass: a query
    at position q sees keys j with `q - window < j <= q`. Decoder (canvas) pass: every canvas
    query sees the last `window - 1` cached positions plus the whole canvas (full layers: the
    whole cache plus the canvas). `scale` multiplies q·kᵀ (1.0 for this model).
    """

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        window: int | None, scale: float,
    ) -> torch.Tensor:
        """q `[T, Hq, D]`, k/v `[T, Hkv, D]` of the T given tokens -> output `[T, Hq, D]`."""
        ...


class GemmaAttention(nn.Module):
    """Checkpoint `self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm` (v_norm has no weight).

    Sliding layers: `head_dim`, `num_key_value_heads`, V from `v_proj`. Full layers:
    `global_head_dim`, `num_global_key_value_heads`, no `v_proj`: V is the raw `k_proj` output
    (before k_norm and RoPE). After `fuse_projections`, q, k (and v) are one matrix product.
    """

    def __init__(self, config: DiffusionGemmaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.window = config.layer_window(layer_idx)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.layer_kv_heads(layer_idx)
        self.head_dim = config.layer_head_dim(layer_idx)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = (nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
                       if config.is_sliding(layer_idx) else None)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps)
        self.v_norm = GemmaRMSNorm(self.head_dim, eps, with_scale=False)
        self.register_buffer("qkv_weight", None, persistent=False)  # (`fuse_projections`)

    def fuse_projections(self) -> None:
        """q_proj, k_proj and v_proj (full layers: q_proj and k_proj) as one weight
        (`fuse_linears`); idempotent."""
        if self.qkv_weight is None:
            linears = [self.q_proj, self.k_proj]
            if self.v_proj is not None:
                linears.append(self.v_proj)
            self.qkv_weight = fuse_linears(*linears)

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]`, the raw k and v `[T, Hkv, D]` (v = k on full layers)."""
        tokens, kv = x.shape[0], self.num_kv_heads * self.head_dim
        if self.qkv_weight is not None:
            sizes = [self.num_heads * self.head_dim, kv] + ([] if self.v_proj is None else [kv])
            q, k, *v = F.linear(x, self.qkv_weight).split(sizes, dim=-1)  # [T, Hq*D], [T, Hkv*D]
            v = v[0] if v else k
        else:
            q, k = self.q_proj(x), self.k_proj(x)
            v = k if self.v_proj is None else self.v_proj(x)
        shape = (tokens, self.num_kv_heads, self.head_dim)
        return q.view(tokens, self.num_heads, self.head_dim), k.view(shape), v.view(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: GemmaAttentionContext) -> torch.Tensor:
        tokens = x.shape[0]
        q, k_raw, v = self._projections(x)  # [T, Hq, D], [T, Hkv, D] x 2
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k_raw), cos, sin)
        v = self.v_norm(v)
        out = ctx.attend(self.layer_idx, q, k, v, window=self.window, scale=1.0)  # [T, Hq, D]
        return self.o_proj(out.reshape(tokens, -1))  # [T, H]


class GemmaDecoderLayer(nn.Module):
    """Attention, then the dense MLP and the MoE in parallel (each with its own norms) summed
    before `post_feedforward_layernorm`; `layer_scalar` scales the whole stream."""

    def __init__(self, config: DiffusionGemmaConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = GemmaAttention(config, layer_idx)
        self.mlp = GatedMLP(hidden, config.intermediate_size)
        self.router = GemmaRouter(config)
        self.experts = GemmaExperts(config.num_experts, hidden, config.moe_intermediate_size)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1",
                     "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
            self.add_module(name, GemmaRMSNorm(hidden, eps))
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: GemmaAttentionContext) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, ctx)  # [T, H]
        h = x + self.post_attention_layernorm(attn)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        topk_ids, topk_weights = self.router(h)  # the router reads the un-normed residual
        routed = self.experts(self.pre_feedforward_layernorm_2(h), topk_ids, topk_weights)
        moe = self.post_feedforward_layernorm_2(routed)  # [T, H]
        return (h + self.post_feedforward_layernorm(dense + moe)) * self.layer_scalar


class DiffusionGemmaTextModel(nn.Module):
    """Checkpoint `model.decoder`: `embed_tokens`, `layers`, `norm`, `self_conditioning`."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_conditioning = SelfConditioning(
            config.hidden_size, config.intermediate_size, config.rms_norm_eps)


class DiffusionGemmaModel(nn.Module):
    """Checkpoint `model`: only the shared text weights under `decoder` (the encoder's text
    weights are the same tensors; the vision tower is not part of the text model)."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.decoder = DiffusionGemmaTextModel(config)


class DiffusionGemmaForBlockDiffusion(nn.Module):
    """The full text network: token ids of some positions -> soft-capped fp32 logits `[T, V]`.

    Logits at position i predict the token at i on a canvas (decoder pass) and the next token
    after i in the encoder pass (the causal LM head of the same weights).
    """

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DiffusionGemmaModel(config)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`[V, H]`: the lm_head is the token embedding (tied)."""
        return self.model.decoder.embed_tokens.weight

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos/sin `[T, D]` per layer type (D: that type's head dim) for `positions [T]`
        (`cos_sin_tables`: one `dlmc::rope_tables` launch for bf16 CUDA positions)."""
        cfg = self.config
        heads = {SLIDING: (cfg.sliding_rope, cfg.head_dim), FULL: (cfg.full_rope,
                                                                   cfg.global_head_dim)}
        return {kind: cos_sin_tables(positions, rope_inv_freq(rope, dim, positions.device),
                                     dtype)
                for kind, (rope, dim) in heads.items() if kind in cfg.layer_types}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: GemmaAttentionContext,
        compute_logits: bool = True,
        logits_from: int = 0,
        decoder: bool = False,
        self_conditioning_logits: torch.Tensor | None = None,
        soft_cap: bool = True,
    ) -> torch.Tensor | None:
        """input_ids `[T]` int64, positions `[T]` (absolute, continuing after the cache) ->
        `[T, V]` fp32 (only rows `logits_from:` when set: `[T - logits_from, V]`).
        `soft_cap=False`: the lm_head's output before the final soft cap, in the model dtype
        (for a consumer that caps it itself: `dlmc::canvas_propose`'s `softcap`).

        `decoder`: the canvas pass, whose input is self-conditioned on
        `self_conditioning_logits [T, V]` (the previous step's processed logits; None on the
        first step). The encoder pass takes no self-conditioning logits.
        """
        if self_conditioning_logits is not None and not decoder:
            raise ValueError("self_conditioning_logits are an input of the decoder pass only "
                             "(decoder=True)")
        text = self.model.decoder
        h = text.embed_tokens(input_ids)  # [T, H]
        if decoder:
            h = text.self_conditioning(h, self_conditioning_logits, text.embed_tokens)
        tables = self.rope_tables(positions, h.dtype)
        for layer in text.layers:
            h = layer(h, *tables[layer.layer_type], ctx)
        if not compute_logits:
            return None
        logits = F.linear(text.norm(h[logits_from:]), self.lm_head_weight)  # [T, V]
        if not soft_cap:
            return logits
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits.float() / cap) * cap
