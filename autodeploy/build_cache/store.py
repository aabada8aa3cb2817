"""Cache entries on disk: one directory per key, written atomically, read back with checks.

An entry (``$AUTODEPLOY_CACHE/builds/<key>/``) holds ``build.json`` (the graph as data, the
tensor manifest, the cache interface's settings, the pipeline decisions later stages read, and
the key's inputs, to tell why two keys differ) and ``weights.safetensors``. It is written into a
temporary directory beside it and renamed into place, so a reader sees a whole entry or none.
Entries are used least-recently first out when the directory grows past
``AUTODEPLOY_BUILD_CACHE_MAX_GB`` (default 20) GiB; ``rm -rf $AUTODEPLOY_CACHE/builds`` clears it.
"""

import dataclasses
import importlib
import json
import os
import shutil
import tempfile
import time
from typing import Any, Dict, Optional, Tuple

import torch
from torch import fx, nn

from ..cache import CachedSequenceInterface
from ..cache.resources import ResourceHandler, StateHandler, TokenBufferHandler
from ..compile.mlir import missing_kernels
from ..transform.interface import PipelineContext, TransformInfo
from ..utils.logging import get_logger
from ..utils.paths import cache_root
from .graph_codec import Unserializable, decode_arg, decode_graph, encode_arg, encode_graph
from .key import CACHE_FORMAT_VERSION
from .tensors import load_tensors, save_tensors

logger = get_logger(__name__)

GRAPH_FILE = "build.json"
WEIGHTS_FILE = "weights.safetensors"
_HANDLER_BASES = (ResourceHandler, StateHandler, TokenBufferHandler)
# gm.meta entries that belong to the pipeline run, not to the graph
_RUN_META = ("autodeploy_history", "autodeploy_last_info")
_STALE_TMP_S = 3600


def builds_dir() -> str:
    return os.path.join(cache_root(), "builds")


def max_bytes() -> int:
    return int(float(os.environ.get("AUTODEPLOY_BUILD_CACHE_MAX_GB", "20")) * 2**30)


# ---- the cache interface's settings ---------------------------------------------------------------
def encode_cache_settings(cache: Any) -> Dict[str, Any]:
    """The cache interface as ``insert_cached_*`` left it (before any allocation): its geometry and
    one entry per cache input (the handler's class and fields)."""
    if type(cache) is not CachedSequenceInterface:
        raise Unserializable(f"the cache interface is a {type(cache).__name__}")
    handlers = []
    for name, h in cache.handlers.items():
        cls = type(h)
        if not dataclasses.is_dataclass(h) or not cls.__module__.startswith("autodeploy."):
            raise Unserializable(f"cache handler {cls.__name__} of '{name}' is not an autodeploy dataclass")
        fields = {f.name: getattr(h, f.name) for f in dataclasses.fields(h)}
        if set(vars(h)) - set(fields):
            raise Unserializable(f"cache handler {cls.__name__} holds state besides its fields")
        handlers.append({"name": name, "class": f"{cls.__module__}:{cls.__qualname__}", "fields": encode_arg(fields)})
    state = {}
    for attr, value in vars(cache).items():
        if attr in ("handlers", "caches"):
            continue
        if attr == "captured_layers":
            value = [[int(k), v] for k, v in value.items()]
        state[attr] = encode_arg(value)
    if cache.caches:
        raise Unserializable("the caches were allocated before initialize_cache")
    return {"handlers": handlers, "state": state}


def _handler_class(ref: str) -> type:
    module, _, name = ref.partition(":")
    if not module.startswith("autodeploy.") or "." in name:
        raise ValueError(f"cache handler class '{ref}' is not an autodeploy class")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, _HANDLER_BASES) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"'{ref}' is not a cache handler")
    return cls


def decode_cache_settings(data: Dict[str, Any]) -> CachedSequenceInterface:
    state = {k: decode_arg(v, {}) for k, v in data["state"].items()}
    cache = CachedSequenceInterface(page_size=state["page_size"], max_batch_size=state["_max_batch_size"],
                                    max_seq_len=state["max_seq_len"], max_num_tokens=state["max_num_tokens"],
                                    device=state["device"])
    state["captured_layers"] = {int(k): v for k, v in state.get("captured_layers", [])}
    for attr, value in state.items():
        if attr not in vars(cache):
            raise ValueError(f"the cache interface has no setting '{attr}'")
        setattr(cache, attr, value)
    for h in data["handlers"]:
        cache.add_cache(h["name"], _handler_class(h["class"])(**decode_arg(h["fields"], {})))
    return cache


# ---- writing ---------------------------------------------------------------------------------------
def _graph_tensors(gm: fx.GraphModule) -> Dict[str, Tuple[torch.Tensor, bool]]:
    out = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target in out:
            continue
        owner_path, _, leaf = str(node.target).rpartition(".")
        try:
            owner = gm.get_submodule(owner_path) if owner_path else gm
            value = getattr(owner, leaf)
        except AttributeError:
            raise Unserializable(f"get_attr '{node.target}' names nothing") from None
        if not isinstance(value, torch.Tensor):
            raise Unserializable(f"get_attr '{node.target}' is a {type(value).__name__}, not a tensor")
        out[str(node.target)] = (value, isinstance(value, nn.Parameter))
    return out


def check_cacheable(mod: Any, ctx: PipelineContext) -> fx.GraphModule:
    """``mod`` if the build cache can store it as data, else ``Unserializable`` saying why."""
    if not isinstance(mod, fx.GraphModule):
        raise Unserializable(f"the model is a {type(mod).__name__}, not one graph")
    if "autodeploy_recompute" in mod.meta or ctx.cache_mode == "recompute":
        raise Unserializable("the model runs in recompute mode")
    if ctx.uncached_graph is not None or ctx.hf_attention_layers is not None:
        raise Unserializable("the pipeline keeps a second model beside the graph")
    for name, sub in mod.named_modules():
        if sub is not mod and type(sub) is not nn.Module:
            raise Unserializable(f"submodule '{name}' is a {type(sub).__name__}")
    hooks = [*mod._forward_hooks.values(), *mod._forward_pre_hooks.values()]
    # torch.export's own bookkeeping around module-typed inputs (none here) is dropped; any other hook is state
    if any(getattr(h, "__module__", None) != "torch.export._unlift" for h in hooks):
        raise Unserializable("the graph module has forward hooks")
    return mod


def save_entry(entry: str, gm: fx.GraphModule, cache_settings: Dict[str, Any], context: Dict[str, Any],
               inputs: Dict[str, Any]) -> None:
    """Write the entry atomically; ``Unserializable`` (nothing written) if the graph cannot be stored."""
    graph = encode_graph(gm.graph)
    tensors = _graph_tensors(gm)
    gm_meta = {}
    for key, value in gm.meta.items():
        if key in _RUN_META:
            continue
        try:
            gm_meta[key] = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            logger.debug("build cache: gm.meta[%r] is not JSON data; not stored", key)
    parent = os.path.dirname(entry)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        manifest = save_tensors(tensors, os.path.join(tmp, WEIGHTS_FILE))
        record = {"format": CACHE_FORMAT_VERSION, "created": time.time(), "key_inputs": inputs, "graph": graph,
                  "tensors": manifest, "gm_meta": gm_meta, "cache": cache_settings, "context": context}
        with open(os.path.join(tmp, GRAPH_FILE), "w") as f:
            json.dump(record, f)
        try:
            os.rename(tmp, entry)
        except OSError:  # another process stored the same key first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(parent, keep=entry)


def _entry_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


def prune(parent: str, keep: Optional[str] = None) -> int:
    """Remove least-recently-used entries (and abandoned temporary directories) until the cache
    fits ``max_bytes()``; never ``keep``. Returns how many entries were removed."""
    now, entries = time.time(), []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        try:
            mtime = os.path.getmtime(path)
        except OSError:
            continue
        if name.startswith(".tmp-"):
            if now - mtime > _STALE_TMP_S:
                shutil.rmtree(path, ignore_errors=True)
            continue
        entries.append((mtime, path, _entry_bytes(path)))
    total, removed = sum(e[2] for e in entries), 0
    for _, path, size in sorted(entries):
        if total <= max_bytes():
            break
        if keep is not None and os.path.abspath(path) == os.path.abspath(keep):
            continue
        shutil.rmtree(path, ignore_errors=True)
        total -= size
        removed += 1
        logger.info("build cache: removed least recently used entry %s (%.1f MiB)", os.path.basename(path)[:12],
                    size / 2**20)
    return removed


# ---- reading ---------------------------------------------------------------------------------------
def _set_tensor(root: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    owner = root
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    if isinstance(value, nn.Parameter):
        owner.register_parameter(leaf, value)
    else:
        owner.register_buffer(leaf, value)


def load_entry(entry: str, ctx: PipelineContext) -> fx.GraphModule:
    """The stored graph with its weights, ``ctx`` set as the skipped transforms left it. Raises on a
    malformed or inconsistent entry (the caller discards it)."""
    with open(os.path.join(entry, GRAPH_FILE)) as f:
        record = json.load(f)
    if record.get("format") != CACHE_FORMAT_VERSION:
        raise ValueError(f"entry format {record.get('format')} is not {CACHE_FORMAT_VERSION}")
    graph = decode_graph(record["graph"])
    gone = missing_kernels(graph)
    if gone:
        raise ValueError(f"{len(gone)} generated kernel(s) the graph calls are gone from disk, e.g. {gone[0]}")
    tensors = load_tensors(os.path.join(entry, WEIGHTS_FILE), record["tensors"])
    attrs = {str(n.target) for n in graph.nodes if n.op == "get_attr"}
    if attrs != set(tensors):
        raise ValueError(f"the graph reads {len(attrs)} tensors, the entry holds {len(tensors)}")
    root = nn.Module()
    for name, value in tensors.items():
        _set_tensor(root, name, value)
    gm = fx.GraphModule(root, graph)
    gm.meta.update(record["gm_meta"])
    # shapes are not stored: a later transform that needs them propagates them again
    gm.meta["autodeploy_last_info"] = TransformInfo(is_clean=True, has_valid_shapes=False)
    cache = decode_cache_settings(record["cache"])
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    if placeholders != cache.input_names:
        raise ValueError("the graph's inputs do not match its cache interface")
    c = record["context"]
    ctx.cache = cache
    ctx.max_batch_size, ctx.max_seq_len = int(c["max_batch_size"]), int(c["max_seq_len"])
    ctx.cache_mode, ctx.recompute_reason = c["cache_mode"], c["recompute_reason"]
    os.utime(entry)  # least recently used goes first
    return gm
