"""FP8 KV scales end to end: exported per layer, loaded, and applied by the cache to K and to V.

The tiny model's K and V have about the same range, so swapping the two scales would change
only roundings. Here each layer's V is made 16x, 64x and 256x smaller than its K (V rows of
`query_key_value` divided, `dense` multiplied back: the same function, exactly in bf16), and the
scales follow: under V's scale K would be clipped to 1/16 (1/64, 1/256) of its range. The FP8
cache's logits (prefill, then a block over the cached prefix) must equal a reference that
quantizes each tensor with its own scale; with the scales swapped they differ by half their
range. The cache runs its reference attention backend: the Triton kernels' scales are tested
against it per op (tests/custom_ops), and their roundings differ by more than FP8's here.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlmc import LLM, KernelConfig
from dlmc.kv.round_attention import PagedRoundAttention
from dlmc.loading.tiny import write_tiny_checkpoint
from dlmc.quant.export import export_nvfp4

BL, FP8_MAX = 32, 448.0
V_SHRINK = (16.0, 64.0, 256.0)  # per layer: how much smaller V is than K
K_SCALE = 8.0 / FP8_MAX  # |K| < 8 (qk-norm'd keys reach about 4 on this model)
SCALES = {layer: (K_SCALE, K_SCALE / shrink) for layer, shrink in enumerate(V_SHRINK)}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _small_v_checkpoint(directory):
    src = write_tiny_checkpoint(directory / "bf16", seed=4, shards=1)
    path = src / "model.safetensors"
    tensors = load_file(str(path))
    for layer, shrink in enumerate(V_SHRINK):
        prefix = f"model.layers.{layer}.attention."
        qkv = tensors[prefix + "query_key_value.weight"].clone()  # [(Hq + 2 Hkv) D, hidden]
        qkv[-2 * 16:] /= shrink  # V rows: 2 KV heads x head_dim 16
        tensors[prefix + "query_key_value.weight"] = qkv
        tensors[prefix + "dense.weight"] = tensors[prefix + "dense.weight"] * shrink
    save_file(tensors, str(path), metadata={"format": "pt"})
    return src


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8-scales")
    return export_nvfp4(_small_v_checkpoint(base), base / "nvfp4", kv_scales=SCALES)


class _ReferenceAttention:
    """Attention over a prefix's dequantized K/V `{layer: (k, v)}` (fp32) plus the new tokens'
    own K/V, fp32 scores; records the new tokens' K/V. `causal_block`: block-causal among
    them."""

    def __init__(self, prefix=None, causal_block=None):
        self.prefix, self.causal_block, self.kv = prefix or {}, causal_block, {}

    def attend(self, layer, q, k, v):
        self.kv[layer] = (k, v)
        empty = k.new_zeros((0, *k.shape[1:]), dtype=torch.float32)
        pk, pv = self.prefix.get(layer, (empty, empty))
        group = q.shape[1] // k.shape[1]
        keys = torch.cat([pk, k.float()]).repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = torch.cat([pv, v.float()]).repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q.float(), keys) * q.shape[-1] ** -0.5
        if self.causal_block:
            t = torch.arange(q.shape[0], device=q.device) // self.causal_block
            scores[:, :, pk.shape[0]:] = scores[:, :, pk.shape[0]:].masked_fill(
                t[None, :] > t[:, None], float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), values)  # [T, Hq, D]
        return out.to(q.dtype)


def _fp8(x, scale):
    """What an FP8 cache with `scale` gives back for `x`: e4m3(clamp(x / scale)) * scale."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def _reference_logits(model, prompt, block, scales):
    """The block's logits over the prompt's K/V quantized with `scales` {layer: (k, v)}."""
    ids, pos = torch.tensor(prompt, device=DEVICE), torch.arange(len(prompt) + BL, device=DEVICE)
    with torch.inference_mode():
        prefill = _ReferenceAttention(causal_block=BL)
        model(ids, pos[: len(prompt)], prefill, compute_logits=False)
        cached = {layer: (_fp8(k, scales[layer][0]), _fp8(v, scales[layer][1]))
                  for layer, (k, v) in prefill.kv.items()}
        return model(block, pos[len(prompt):], _ReferenceAttention(cached)).float(), prefill.kv


def test_fp8_cache_applies_each_layers_k_and_v_scale(fp8_dir):
    llm = LLM(fp8_dir, device=DEVICE, dtype="bf16", kv_cache_dtype="fp8", mode="eager",
              kernels=KernelConfig(attention_backend="reference"))
    assert llm.kv_cache_dtype == "fp8"
    loaded = list(zip(llm.kv_scales.k, llm.kv_scales.v, strict=True))
    assert loaded == [pytest.approx(SCALES[layer], rel=1e-6) for layer in range(3)]  # fp32
    prompt = [40 + (7 * i) % 200 for i in range(3 * BL)]  # 3 whole blocks, prefilled
    block = torch.tensor([60 + i for i in range(8)] + [llm.special_ids.mask_token_id] * (BL - 8),
                         device=DEVICE)
    dec = llm._decoder
    runner = dec.runner(BL)
    dec.cache.reset()
    dec._prefill(torch.tensor(prompt, device=DEVICE), BL, runner)
    with torch.inference_mode():
        got = llm.model(block, torch.arange(3 * BL, 4 * BL, device=DEVICE),
                        PagedRoundAttention(dec.cache)).float()
    want, kv = _reference_logits(llm.model, prompt, block, SCALES)
    for layer, (k, v) in kv.items():  # the premise: each scale fits its own tensor only
        k_max, v_max = k.float().abs().max().item(), v.float().abs().max().item()
        assert k_max / SCALES[layer][0] < FP8_MAX and v_max / SCALES[layer][1] < FP8_MAX
        assert k_max / SCALES[layer][1] > 4 * FP8_MAX  # K under V's scale: clipped
    swapped, _ = _reference_logits(llm.model, prompt, block,
                                   {layer: (vs, ks) for layer, (ks, vs) in SCALES.items()})
    scale = want.abs().max().item()
    assert (swapped - want).abs().max().item() > 0.2 * scale  # a swap changes the logits
    torch.testing.assert_close(got, want, rtol=0, atol=0.02 * scale)
