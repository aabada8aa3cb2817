"""The build cache's key: a sha256 over everything that decides the built graph.

* the model's files: ``config.json``, ``generation_config.json`` and the safetensors index in
  full; each weight file by its size, modification time (ns) and a hash of its first and last
  MiB. Hashing the whole of every weight file would cost seconds per GB on every start, more than
  the build the cache saves; a file rewritten in place gets a new mtime, and one replaced by
  another of the same size and mtime (a restored backup) would also have to match in both ends
  to be mistaken for it. With ``trust_remote_code`` the checkpoint's ``*.py`` files too.
* the whole resolved ``DeployConfig`` (as JSON; ``build_cache`` itself left out);
* autodeploy's version and a hash of its own source files (``.py``, ``.yaml``, C/C++ sources and
  headers): a code change must never load a graph the old code built;
* the torch and transformers versions, the Python version, the device (and on CUDA the GPU's name
  and compute capability), the CPU's feature flags (kernels and packed layouts depend on them),
  torch's thread count (build-time measurements depend on it);
* world size and rank (each rank builds its own shard).
"""

import functools
import hashlib
import json
import os
import sys
from typing import Any, Dict

import torch

from ..utils.cpu import cpu_flags

CACHE_FORMAT_VERSION = 1
_MIB = 1 << 20
_SOURCE_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".h", ".hpp", ".c", ".cc", ".cpp", ".txt")
_MODEL_JSON_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
                     "pytorch_model.bin.index.json")


def _file_sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _ends_sha(path: str, size: int) -> str:
    """sha256 of the first and the last MiB (the whole file when it is at most 2 MiB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= 2 * _MIB:
            h.update(f.read())
        else:
            h.update(f.read(_MIB))
            f.seek(size - _MIB)
            h.update(f.read(_MIB))
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over autodeploy's own source files (path and content), computed once per process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(_SOURCE_SUFFIXES):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                h.update(_file_sha(path).encode())
    return h.hexdigest()


def model_fingerprint(factory: Any) -> Dict[str, Any]:
    """What identifies the model's files (see the module docstring)."""
    directory = factory.directory
    out: Dict[str, Any] = {}
    for name in _MODEL_JSON_FILES:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            out[name] = _file_sha(path)
    weights = {}
    for path in factory.checkpoint_index().files:
        st = os.stat(path)
        weights[os.path.relpath(path, directory)] = [st.st_size, st.st_mtime_ns, _ends_sha(path, st.st_size)]
    out["weights"] = weights
    if getattr(factory, "trust_remote_code", False):
        out["code"] = {n: _file_sha(os.path.join(directory, n)) for n in sorted(os.listdir(directory))
                       if n.endswith(".py")}
    return out


def torch_version() -> str:
    return torch.__version__


def device_description(device: str) -> Dict[str, Any]:
    dev = torch.device(device)
    out: Dict[str, Any] = {"type": dev.type, "cpu_flags": cpu_flags(), "threads": torch.get_num_threads()}
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        out.update(gpu=torch.cuda.get_device_name(index), capability=list(torch.cuda.get_device_capability(index)))
    return out


def key_inputs(config: Any, factory: Any, world_size: int, rank: int) -> Dict[str, Any]:
    """Everything the key hashes, as one JSON-able mapping (also stored in the entry, to say why
    two keys differ)."""
    import transformers

    from .._version import __version__

    settings = config.model_dump(mode="json")
    # settings of the engine, not the build
    for runtime_only in ("build_cache", "enable_prefix_caching", "prefix_state_snapshots", "chat_template",
                         "scheduling_policy"):
        settings.pop(runtime_only, None)
    return {
        "format": CACHE_FORMAT_VERSION,
        "autodeploy": __version__,
        "source": source_hash(),
        "torch": torch_version(),
        "transformers": transformers.__version__,
        "python": list(sys.version_info[:3]),
        "device": device_description(config.device),
        "world_size": world_size,
        "rank": rank,
        "config": settings,
        "model": model_fingerprint(factory),
    }


def build_key(inputs: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()
