"""Finding and reading checkpoint tensors: safetensors (single or sharded), memory-mapped.

Pickled weights (``pytorch_model.bin``, ``*.pt``) can run arbitrary code when unpickled, so
they are refused unless the user opts in; even then they are read with ``weights_only=True``.
"""

import glob
import json
import os
import pickle
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

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

    def headers(self) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        """Tensor name -> (safetensors dtype name such as "BF16", "F8_E4M3", "U8"; shape), read
        from the file headers only (no tensor data, each file once); empty for pickled checkpoints."""
        if self.format != "safetensors":
            return {}
        out: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
        for path in self.files:
            for name, entry in _safetensors_header(path).items():
                if name in self.weight_map:
                    out[name] = (entry["dtype"], tuple(entry.get("shape", ())))
        return out

    def dtypes(self) -> Dict[str, str]:
        """Tensor name -> safetensors dtype name (see ``headers``)."""
        return {name: dtype for name, (dtype, _) in self.headers().items()}

    def quantized_dtype_tensors(self) -> List[Tuple[str, str]]:
        """(name, dtype) of tensors stored in a floating type that only holds quantized data (FP8, FP4)."""
        return sorted(
            (k, v) for k, v in self.dtypes().items() if v.startswith("F") and v not in SAFETENSORS_FLOAT_DTYPES
        )


def _safetensors_header(path: str) -> Dict[str, Dict]:
    """Tensor name -> its header entry (dtype, shape, offsets) of one safetensors file."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelSourceError(f"cannot read the safetensors header of {path}: {exc}") from None
    return {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict) and "dtype" in v}


def _unreadable_safetensors(path: str, exc: BaseException) -> ModelSourceError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ModelSourceError(
        f"cannot read the safetensors file {path} ({first}); it is corrupted or incomplete (an interrupted "
        "download or copy?): fetch or copy it again"
    )


def _safe_open(path: str) -> Any:
    """``safetensors.safe_open``, with a file that is not valid safetensors (truncated, corrupted)
    reported as the user's to fix, not as an internal error."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise _unreadable_safetensors(path, exc) from None


def _safetensors_keys(path: str) -> List[str]:
    with _safe_open(path) as f:
        return list(f.keys())


def _read_index(index_path: str) -> Dict[str, str]:
    """The ``weight_map`` (tensor name -> file name) of a sharded checkpoint's index file."""
    try:
        with open(index_path) as f:
            index = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(
            f"cannot read the checkpoint index {index_path} ({exc}); it should be the JSON file written with the "
            "shards (restore it, or remove it if the directory holds a single weights file)"
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelSourceError(
            f"the checkpoint index {index_path} has no 'weight_map' mapping tensor names to shard files; restore "
            "the index written with the shards (or remove it if the directory holds a single weights file)"
        )
    return weight_map


def find_checkpoint(directory: str, allow_pickle: bool = False) -> CheckpointIndex:
    """Index the weights in ``directory``; prefers safetensors, refuses pickles by default."""
    index_path = os.path.join(directory, SAFE_INDEX)
    if os.path.exists(index_path):
        weight_map = _read_index(index_path)
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
            weight_map = {k: os.path.join(directory, v) for k, v in _read_index(index_path).items()}
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
    """The tensors of a pickled state dict, read with torch's restricted unpickler
    (``weights_only=True``): only tensors and plain containers, never code. Anything it refuses,
    and files that are not torch checkpoints at all, are the user's to fix (``ModelSourceError``)."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap can only be used" not in str(exc):
                raise
            # Not a zip archive: the format of torch < 1.6 (or not a torch file); it cannot be
            # memory-mapped, so it is read whole.
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ModelSourceError(
            f"refused to load {path}: torch's safe unpickler (weights_only) rejected it ({_refusal_detail(exc)}). "
            "The file holds something other than tensors: code that would run when it is unpickled, or it is not "
            "a torch checkpoint at all. It is never loaded unsafely; use a safetensors checkpoint, or convert the "
            "weights to safetensors in an environment where running the file is safe"
        ) from None
    except (RuntimeError, EOFError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(
            f"cannot read the pickled weights {path} ({first}); the file is corrupted or incomplete: fetch or copy "
            "it again, or use a safetensors checkpoint"
        ) from None
    bad = None if isinstance(state, dict) else type(state).__name__
    if bad is None:
        bad = next((f"'{k}' holds a {type(v).__name__}" for k, v in state.items()
                    if not isinstance(k, str) or not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise ModelSourceError(
            f"{path} is not a state dict of tensors ({bad}); save the model's state_dict() alone (a training "
            "checkpoint bundles it with other state), preferably as safetensors"
        )
    return state


def _refusal_detail(exc: BaseException) -> str:
    """The line of a weights_only refusal that says what was refused ("unsupported GLOBAL
    posix.system", "Unsupported operand 149"), without torch's advice to load unsafely."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    boiler = ("Weights only load failed", "Please file an issue", "Check the documentation")
    detail = [line for line in lines if not line.startswith(boiler)]
    return (detail[0] if detail else "it holds objects other than tensors").rstrip(".")


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
                handle = self._stack.enter_context(_safe_open(path))
            else:
                handle = _load_pickle(path)
            self._handles[path] = handle
        if self.index.format == "safetensors":
            from safetensors import SafetensorError

            try:
                return handle.get_tensor(name)  # type: ignore[attr-defined]
            except SafetensorError as exc:
                raise _unreadable_safetensors(path, exc) from None
        return handle[name]  # type: ignore[index]

    def nbytes(self, name: str) -> Optional[int]:
        return None
