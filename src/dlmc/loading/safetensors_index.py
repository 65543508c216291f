"""Which safetensors file holds which tensor, with its shape and dtype (headers only)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from dlmc.errors import CheckpointError


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "BF16", "U8", "F8_E4M3", "F32"


class SafetensorsIndex:
    """Tensor name -> file, from `model.safetensors.index.json`, else every `*.safetensors`.

    Reads only the files' headers; tensors are read one at a time with `get`.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.tensors: dict[str, TensorInfo] = {}
        self._handles: dict[Path, object] = {}
        index_file = directory / "model.safetensors.index.json"
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(
                    f"{index_file}: expected JSON with a `weight_map` ({exc})"
                ) from None
            files = sorted({directory / f for f in weight_map.values()})
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors files (and no index) found")
        for file in files:
            self._read_header(file)

    def _read_header(self, file: Path) -> None:
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in model.safetensors.index.json but missing")
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                meta = handle.get_slice(name)
                self.tensors[name] = TensorInfo(
                    name, file, tuple(meta.get_shape()), meta.get_dtype()
                )
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
        self._handles[file] = handle

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str):  # -> torch.Tensor
        info = self.tensors[name]
        try:
            return self._handles[info.file].get_tensor(name)  # type: ignore[attr-defined]
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{info.file}: cannot read tensor {name} ({exc})") from None
