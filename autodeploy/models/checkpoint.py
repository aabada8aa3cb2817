"""Finding and reading checkpoint tensors: safetensors (single or sharded), memory-mapped.

Pickled weights (``pytorch_model.bin``, ``*.pt``) can run arbitrary code when unpickled, so
they are refused unless the user opts in; even then they are read with ``weights_only=True``.
"""

import glob
import json
import os
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..utils.errors import ModelSourceError

SAFE_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")
# safetensors dtype names of ordinary floating tensors; other "F*" types (F8_E4M3, F8_E5M2, F8_E8M0,
# F4, ...) only hold quantized data.
SAFETENSORS_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass
class CheckpointIndex:
    directory: str
    weight_map: Dict[str, str]  # tensor name -> absolute file path
    format: str  # "safetensors" | "pickle"

    @property
    def files(self) -> List[str]:
        return sorted(set(self.weight_map.values()))

    def total_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)

    def dtypes(self) -> Dict[str, str]:
        """Tensor name -> safetensors dtype name ("BF16", "F8_E4M3", "U8", ...), read from the file
        headers only (no tensor data); empty for pickled checkpoints."""
        if self.format != "safetensors":
            return {}
        out: Dict[str, str] = {}
        for path in self.files:
            out.update(safetensors_header_dtypes(path))
        return {k: v for k, v in out.items() if k in self.weight_map}

    def quantized_dtype_tensors(self) -> List[Tuple[str, str]]:
        """(name, dtype) of tensors stored in a floating type that only holds quantized data (FP8, FP4)."""
        return sorted(
            (k, v) for k, v in self.dtypes().items() if v.startswith("F") and v not in SAFETENSORS_FLOAT_DTYPES
        )


def safetensors_header_dtypes(path: str) -> Dict[str, str]:
    """Tensor name -> dtype name from a safetensors file's JSON header."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelSourceError(f"cannot read the safetensors header of {path}: {exc}") from None
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict) and "dtype" in v}


def _safetensors_keys(path: str) -> List[str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        return list(f.keys())


def find_checkpoint(directory: str, allow_pickle: bool = False) -> CheckpointIndex:
    """Index the weights in ``directory``; prefers safetensors, refuses pickles by default."""
    index_path = os.path.join(directory, SAFE_INDEX)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        resolved = {k: os.path.join(directory, v) for k, v in weight_map.items()}
        missing = sorted({p for p in resolved.values() if not os.path.exists(p)})
        if missing:
            raise ModelSourceError(f"checkpoint index {index_path} names missing shard files: {missing[:3]}")
        return CheckpointIndex(directory, resolved, "safetensors")
    safe_files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if safe_files:
        weight_map = {}
        for path in safe_files:
            for key in _safetensors_keys(path):
                weight_map[key] = path
        return CheckpointIndex(directory, weight_map, "safetensors")
    pickle_files = sorted({p for pat in PICKLE_PATTERNS for p in glob.glob(os.path.join(directory, pat))})
    if pickle_files:
        if not allow_pickle:
            names = ", ".join(os.path.basename(p) for p in pickle_files[:3])
            raise ModelSourceError(
                f"{directory} holds only pickled weights ({names}); unpickling can execute code. "
                "Convert them to safetensors, or opt in with allow_pickle=True (CLI: --allow-pickle) "
                "if you trust the file"
            )
        index_path = os.path.join(directory, PICKLE_INDEX)
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = {k: os.path.join(directory, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            weight_map = {}
            for path in pickle_files:
                for key in _load_pickle(path):
                    weight_map[key] = path
        return CheckpointIndex(directory, weight_map, "pickle")
    raise ModelSourceError(
        f"no weights found in {directory}: expected model.safetensors, sharded *.safetensors with "
        f"{SAFE_INDEX}, or (with allow_pickle) pytorch_model.bin"
    )


def _load_pickle(path: str) -> Dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


class CheckpointReader:
    """Opens each file once and serves tensors by name; safetensors tensors are mmap views."""

    def __init__(self, index: CheckpointIndex):
        self.index = index
        self._stack = ExitStack()
        self._handles: Dict[str, object] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    def keys(self) -> List[str]:
        return list(self.index.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.index.weight_map

    def get(self, name: str) -> torch.Tensor:
        path = self.index.weight_map[name]
        handle = self._handles.get(path)
        if handle is None:
            if self.index.format == "safetensors":
                from safetensors import safe_open

                handle = self._stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            else:
                handle = _load_pickle(path)
            self._handles[path] = handle
        if self.index.format == "safetensors":
            return handle.get_tensor(name)  # type: ignore[attr-defined]
        return handle[name]  # type: ignore[index]

    def nbytes(self, name: str) -> Optional[int]:
        return None
