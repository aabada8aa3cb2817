"""A graph's parameters and buffers in one safetensors file, with their aliasing kept.

Tensors are stored by the memory behind them, not one by one: every storage the graph's tensors
view becomes one ``U8`` entry of the file (the byte span its tensors cover), and each tensor is
a view into it (dtype, offset, shape, stride) in the manifest. So two names of one tensor (a head
tied to its embedding), views of one fused weight and non-contiguous tensors come back as views
of one storage, exactly as they were, and nothing is stored twice.

Tensors packed for oneDNN (``torch._mkldnn`` layout, opaque: no storage to read) are stored as
their plain values and packed again on load with the same call that packed them
(``torch.ops.mkldnn._reorder_linear_weight``). When a plain tensor of the graph already holds the
same values (``select_linear_backend`` keeps the unpacked weight as the batch-1 GEMV copy), the
packed tensor is recorded as "packed from" it and its values are not stored again.

Each storage span is padded to 4 KiB in the file, and the loader reads the whole data section
with one ``readinto`` into one anonymous mapping (2 MiB-aligned, advised for transparent huge
pages once filled: see ``_read_blobs``), so every tensor lands 4 KiB-aligned without a second
copy. The file stays a valid safetensors file.
"""

import json
import mmap
import os
import struct
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from ..utils.hugepages import HUGE_PAGE
from .graph_codec import Unserializable, dtype_from_name, dtype_name

_ALIGN = 4096


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """Byte range ``[start, end)`` of ``t``'s storage that ``t`` reads."""
    size = t.element_size()
    start = t.storage_offset() * size
    if t.numel() == 0:
        return start, start
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * size


def _check_plain(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise Unserializable(f"get_attr '{name}' is a {type(t).__name__}, not a tensor")
    if type(t) not in (torch.Tensor, nn.Parameter):
        raise Unserializable(f"tensor '{name}' is a {type(t).__name__} (a tensor subclass)")
    if t.is_quantized or t.is_sparse or t.is_nested or t.is_meta:
        raise Unserializable(f"tensor '{name}' has layout {t.layout} / quantized / meta")


def _pack_source(name: str, dense: torch.Tensor, plain: Dict[str, torch.Tensor]) -> Any:
    """A plain tensor of the graph with exactly ``dense``'s values (by name first, then any)."""
    owner, _, leaf = name.rpartition(".")
    prefix = f"{owner}." if owner else ""
    hints = [f"{prefix}{leaf}_gemv", f"{prefix}{leaf.removesuffix('_onednn')}",
             f"{prefix}{leaf.removesuffix('_onednn')}_gemv"]
    rest = [n for n, t in plain.items() if tuple(t.shape) == tuple(dense.shape) and n not in hints]
    for candidate in [h for h in hints if h in plain] + rest:
        t = plain[candidate]
        if t.dtype == dense.dtype and tuple(t.shape) == tuple(dense.shape) and torch.equal(t.cpu(), dense):
            return candidate
    return None


def save_tensors(tensors: Dict[str, Tuple[torch.Tensor, bool]], path: str) -> Dict[str, Any]:
    """Write ``{name: (tensor, is_parameter)}`` to the safetensors file ``path``; returns the manifest
    (how to rebuild each tensor from the file) for ``load_tensors``."""
    plain = {n: t for n, (t, _) in tensors.items() if not t.is_mkldnn}
    for n, t in plain.items():
        _check_plain(n, t)
    storages: Dict[Tuple[str, int], List[str]] = {}
    manifest: Dict[str, Any] = {}
    extra_blobs: Dict[str, torch.Tensor] = {}
    for name, (t, is_param) in tensors.items():
        entry: Dict[str, Any] = {"parameter": is_param}
        if t.is_mkldnn:
            if t.device.type != "cpu":
                raise Unserializable(f"oneDNN tensor '{name}' on {t.device}")
            dense = t.to_dense()
            source = _pack_source(name, dense, plain)
            if source is None:
                source = f"__dense__.{name}"
                extra_blobs[source] = dense.contiguous()
                storages.setdefault(("blob", len(storages)), []).append(source)
            entry.update(pack_from=source)
            manifest[name] = entry
            continue
        key = (str(t.device), t.untyped_storage().data_ptr()) if t.numel() else ("empty", len(storages))
        storages.setdefault(key, []).append(name)
        manifest[name] = entry
    views = {**plain, **extra_blobs}
    blobs: Dict[str, torch.Tensor] = {}
    for i, names in enumerate(storages.values()):
        blob_name = f"storage_{i}"
        spans = [_span(views[n]) for n in names]
        lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
        first = views[names[0]]
        raw = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage(), lo, (hi - lo,), (1,))
        blobs[blob_name] = raw.detach().cpu()
        for n, (start, _) in zip(names, spans):
            t = views[n]
            rel = start - lo
            if rel % t.element_size():
                raise Unserializable(f"tensor '{n}' is not aligned to its dtype within its storage")
            view = {"storage": blob_name, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                    "stride": list(t.stride()), "offset": rel // t.element_size(), "device": str(t.device)}
            if n in manifest:
                manifest[n].update(view)
            else:  # a dense copy of a packed tensor
                manifest[n] = {"parameter": False, "internal": True, **view}
    _write_safetensors(path, blobs)
    return manifest


def _write_safetensors(path: str, blobs: Dict[str, torch.Tensor]) -> None:
    """``blobs`` (1-D uint8) as safetensors, each padded to 4 KiB and in name order (the order the
    format keeps for entries of one dtype)."""
    header: Dict[str, Any] = {}
    offset = 0
    order = sorted(blobs)
    for name in order:
        n = -(-blobs[name].numel() // _ALIGN) * _ALIGN
        header[name] = {"dtype": "U8", "shape": [n], "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)  # the data section starts 4 KiB-aligned in the file
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            blob = blobs[name]
            f.write(blob.numpy().data)
            f.write(b"\0" * (header[name]["shape"][0] - blob.numel()))


def _read_blobs(path: str) -> Dict[str, torch.Tensor]:
    """The file's entries as uint8 views of one huge-page-advised anonymous mapping; any
    inconsistency (short file, overlapping or non-U8 entries) raises ``ValueError``."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("weights file shorter than its header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size, 100 << 20):
            raise ValueError("weights file header length is larger than the file")
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        entries = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
        total, expect = 0, 0
        for start, end, k in entries:
            if header[k]["dtype"] != "U8" or start != expect or end < start or header[k]["shape"] != [end - start]:
                raise ValueError(f"weights file entry '{k}' is malformed")
            expect = end
        total = expect
        if size != 8 + n + total:
            raise ValueError(f"weights file has {size} bytes, its header describes {8 + n + total}")
        # populated up front: one bulk fault instead of one per 4 KiB page during the read (-20%)
        populate = getattr(mmap, "MAP_POPULATE", 0)
        arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        raw = torch.frombuffer(arena, dtype=torch.uint8)
        start = -raw.data_ptr() % HUGE_PAGE
        view = memoryview(arena)[start:start + total]
        done = 0
        while done < total:
            got = f.readinto(view[done:])
            if not got:
                raise ValueError("weights file ended early")
            done += got
        view.release()
    # Advised after the read, not before: faulting fresh huge pages in (with the kernel's direct
    # compaction) made the read of small's 478 MiB take 1.1 s instead of 0.25 s here; advised now,
    # khugepaged may still move the weights onto huge pages in the background.
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            arena.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return {k: raw[start + a:start + b] for a, b, k in entries}


def load_tensors(path: str, manifest: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The tensors ``save_tensors`` stored, each on the device it was on: each storage once, views
    into it, packed tensors packed again. Raises on anything inconsistent."""
    blobs = _read_blobs(path)
    moved: Dict[Tuple[str, str], torch.Tensor] = {}

    def blob_on(name: str, device: str) -> torch.Tensor:
        if (name, device) not in moved:
            moved[name, device] = blobs[name] if device == "cpu" else blobs[name].to(device)
        return moved[name, device]

    out: Dict[str, torch.Tensor] = {}
    same: Dict[Tuple, torch.Tensor] = {}
    for name, e in manifest.items():
        if "pack_from" in e:
            continue
        blob = blob_on(e["storage"], e["device"])
        dtype = dtype_from_name(e["dtype"])
        size = torch.empty((), dtype=dtype).element_size()
        shape, stride, offset = tuple(e["shape"]), tuple(e["stride"]), int(e["offset"])
        last = sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else -1
        if offset < 0 or (offset + last + 1) * size > blob.numel() or blob.storage_offset() % size:
            raise ValueError(f"tensor '{name}' lies outside its storage in the weights file")
        key = (e["storage"], e["dtype"], shape, stride, offset, e["parameter"])
        if key not in same:
            t = torch.empty(0, dtype=dtype, device=blob.device).set_(
                blob.untyped_storage(), blob.storage_offset() // size + offset, shape, stride)
            same[key] = nn.Parameter(t, requires_grad=False) if e["parameter"] else t
        out[name] = same[key]
    for name, e in manifest.items():
        if "pack_from" in e:
            out[name] = torch.ops.mkldnn._reorder_linear_weight(out[e["pack_from"]].detach())
    return {n: t for n, t in out.items() if not manifest[n].get("internal")}
