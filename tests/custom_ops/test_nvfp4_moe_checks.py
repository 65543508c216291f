"""`nvfp4_moe_checks`: `nvfp4_moe`'s bad arguments fail with errors that name the tensor."""

from __future__ import annotations

import pytest
import torch

from dlmc.custom_ops.nvfp4_moe import nvfp4_moe
from tests.custom_ops.nvfp4_cases import (
    DEVICE,
    op_args,
    random_experts,
    random_routing,
    shared_expert,
)


def test_shared_expert_weights_are_checked() -> None:
    gen = torch.Generator().manual_seed(10)
    experts = random_experts(gen, 2, 32, 16)
    x = torch.randn(2, 32, generator=gen).bfloat16().to(DEVICE)
    ids, w = random_routing(gen, 2, 2, 1, skew=False)
    shared = shared_expert(gen, x, x, 32, 16)
    args = op_args(x, ids, w, experts)
    with pytest.raises(ValueError, match="shared_down is missing"):
        nvfp4_moe(*args, shared_gate=shared["shared_gate"], shared_up=shared["shared_up"])
    with pytest.raises(ValueError, match=r"shared_up must be bf16 \(16, 32\)"):
        nvfp4_moe(*args, **shared | {"shared_up": shared["shared_up"].float()})
    with pytest.raises(ValueError, match="shared_gate must be bf16"):
        nvfp4_moe(*args, **shared | {"shared_gate": shared["shared_gate"][:8]})


def test_rejects_bad_shapes() -> None:
    experts = random_experts(torch.Generator().manual_seed(4), 2, 32, 16)
    x = torch.randn(2, 32).bfloat16().to(DEVICE)
    ids, w = random_routing(torch.Generator(), 2, 2, 1, skew=False)
    experts["down_weight_scale"] = experts["down_weight_scale"][:, :-1].contiguous()
    with pytest.raises(ValueError, match="down_weight_scale"):
        nvfp4_moe(*op_args(x, ids, w, experts))
    with pytest.raises(ValueError, match="topk_weights"):
        nvfp4_moe(*op_args(x, ids, w.double(), experts))
