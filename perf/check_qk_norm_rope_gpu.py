"""Where dlmc::qk_norm_rope and its eager reference differ on the GPU (diagnostic, not a test).

Run on the H200: `python3 perf/check_qk_norm_rope_gpu.py`. Output of session 10:
perf/results/s10/gpu_tests_qk_fix.txt.
"""

import torch

from dlmc.custom_ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference
from dlmc.models.layers import rope_cos_sin

torch.manual_seed(0)
T, NQ, NKV, D, R = 32, 16, 4, 128, 64
qkv = torch.randn(T, (NQ + 2 * NKV) * D, device="cuda").bfloat16()
qw = (1 + 0.1 * torch.randn(D, device="cuda")).bfloat16()
kw = (1 + 0.1 * torch.randn(D, device="cuda")).bfloat16()
positions = torch.randint(0, 30000, (T,), device="cuda")
cos, sin = rope_cos_sin(positions, R, 600000.0, torch.bfloat16)
args = (qkv, qw, kw, cos, sin, NQ, NKV, 1e-6)
got, want = qk_norm_rope(*args), qk_norm_rope_reference(*args)
for name, g, w in zip("qkv", got, want, strict=True):
    diff = (g.float() - w.float()).abs()
    bad = diff > 0
    print(name, "mismatch", bad.float().mean().item(), "max", diff.max().item(),
          "rotary dims", bad[..., :R].float().mean().item(),
          "rest", bad[..., R:].float().mean().item())
# the normalisation alone (no rotation): cos = 1, sin = 0
ones, zeros = torch.ones_like(cos), torch.zeros_like(sin)
plain = (qkv, qw, kw, ones, zeros, NQ, NKV, 1e-6)
print("norm only mismatch",
      (qk_norm_rope(*plain)[0] != qk_norm_rope_reference(*plain)[0]).float().mean().item())
x = qkv.view(T, -1, D)[:, :NQ].float()
mean_square = x.pow(2).mean(-1, keepdim=True) + 1e-6
by_rsqrt = (x * torch.rsqrt(mean_square)).bfloat16()
by_sqrt = (x / torch.sqrt(mean_square)).bfloat16()
print("normed: rsqrt vs 1/sqrt differ in", (by_rsqrt != by_sqrt).float().mean().item())
