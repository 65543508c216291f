"""Stream a checkpoint's safetensors onto a model built on the meta device.

Every parameter and buffer the model declares must be in the checkpoint with the declared
shape and a floating dtype (expert_bias may be absent: zeros). Routed experts are stacked:
checkpoint tensor `...mlp.experts.E.<proj>.<suffix>` fills slot E of
`...mlp.experts.<proj>_<suffix>`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import nullcontext

import torch
from torch import nn

from dlmc.errors import CheckpointError
from dlmc.loading.safetensors_index import SafetensorsIndex

log = logging.getLogger(__name__)

FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# Buffers of quantized modules keep their declared dtype and accept only the matching one.
EXACT_DTYPES = {torch.uint8: {"U8": torch.uint8},
                torch.float8_e4m3fn: {"F8_E4M3": torch.float8_e4m3fn}}
STACKED_RE = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>[a-z_]+_proj)_(?P<suffix>[a-z_0-9]+)$"
)
# Read elsewhere (FP8 KV scales) or not needed (rotary tables are recomputed).
IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$|\.attention\.(?:[\w.]*\.)?[kv]_scale$")
OPTIONAL_ZERO = re.compile(r"\.mlp\.gate\.expert_bias$")


def model_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def assign_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[leaf] = tensor


def fetch(
    index: SafetensorsIndex, name: str, shape: tuple[int, ...], allowed: dict[str, torch.dtype]
) -> torch.Tensor:
    """Read tensor `name`, checking it exists with `shape` and a dtype in `allowed`.

    A scalar slot (shape `[]`) also accepts a `[1]` tensor, as exports write both."""
    info = index.tensors.get(name)
    if info is None:
        raise CheckpointError(
            f"{index.directory}: tensor {name} is missing (expected shape {list(shape)})"
        )
    if tuple(shape) == () and info.shape == (1,):
        return index.get(name).reshape(())
    if info.shape != tuple(shape):
        raise CheckpointError(
            f"{info.file.name}: tensor {name} has shape {list(info.shape)}, expected {list(shape)}"
        )
    if info.dtype not in allowed:
        raise CheckpointError(
            f"{info.file.name}: tensor {name} has dtype {info.dtype}, expected one of "
            f"{', '.join(allowed)}"
        )
    return index.get(name)


def load_weights(
    model: nn.Module,
    index: SafetensorsIndex,
    device: torch.device,
    dtype: torch.dtype,
    num_experts: int,
    tie_word_embeddings: bool = False,
    show_progress: bool = False,
) -> set[str]:
    """Fill every meta tensor of `model` from `index`; returns the checkpoint names consumed."""
    used: set[str] = set()
    targets = list(model_tensors(model))
    progress = progress_bar(show_progress, len(targets))
    with progress as bar:
        task = bar.add_task("loading weights", total=len(targets)) if bar else None
        buffers = {name for name, _ in model.named_buffers()}
        for name, meta in targets:
            # Parameters take the model dtype; buffers (router weight and expert bias, quantized
            # experts) their own.
            target_dtype = meta.dtype if name in buffers else dtype
            allowed = EXACT_DTYPES.get(meta.dtype, FLOAT_DTYPES)
            stacked = STACKED_RE.match(name)
            if stacked:
                if meta.shape[0] != num_experts:  # e.g. a model fused before loading
                    raise CheckpointError(
                        f"{index.directory}: model tensor {name} stacks {meta.shape[0]} experts, "
                        f"the checkpoint's config has {num_experts} (fuse shared experts only "
                        "after loading)"
                    )
                tensor = torch.empty(meta.shape, dtype=target_dtype, device=device)
                for expert in range(num_experts):
                    src = f"{stacked['prefix']}.{expert}.{stacked['proj']}.{stacked['suffix']}"
                    if src not in index and name.endswith("_input_scale"):
                        tensor[expert] = 1.0  # W4A4 activation scale absent: unused in W4A16
                        continue
                    tensor[expert].copy_(fetch(index, src, tuple(meta.shape[1:]), allowed))
                    used.add(src)
            elif name not in index and OPTIONAL_ZERO.search(name):
                tensor = torch.zeros(meta.shape, dtype=target_dtype, device=device)
            elif name == "lm_head.weight" and tie_word_embeddings and name not in index:
                src = "model.word_embeddings.weight"
                tensor = fetch(index, src, tuple(meta.shape), FLOAT_DTYPES).to(device, target_dtype)
                used.add(src)
            else:
                tensor = fetch(index, name, tuple(meta.shape), FLOAT_DTYPES).to(
                    device, target_dtype
                )
                used.add(name)
            assign_tensor(model, name, tensor)
            if bar:
                bar.advance(task)
    unused = [n for n in index.tensors if n not in used and not IGNORED_RE.search(n)]
    if unused:
        log.warning(
            "%s: %d checkpoint tensor(s) not used by the model, e.g. %s",
            index.directory,
            len(unused),
            ", ".join(unused[:3]),
        )
    return used


def progress_bar(enabled: bool, total: int):  # -> context manager yielding a rich Progress or None
    if not enabled or total < 200:
        return nullcontext(None)
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn(), transient=True
    )
