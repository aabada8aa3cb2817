"""Keep, load and launch the generated Triton element-wise kernels; the op that calls them.

Keep: each kernel's Python source lives in ``<cache dir>/triton-<key>/kernel.py`` with
``kernel.json`` (the inputs' access patterns and dtypes, the outputs' dtypes); the key hashes
the source and Triton's version. Triton compiles the kernel on its first launch and keeps the
binary in its own cache (``$TRITON_CACHE_DIR``), keyed by the source, the GPU and the argument
types, so a second process reuses it too. ``STATS`` counts sources written and found, as for
the C++ kernels.

Run: ``torch.ops.autodeploy.triton_fused_elementwise(inputs, kernel_dir, out_dtypes)`` imports
the kernel module on first use in a process, checks each input against the access pattern and
dtype it was generated for, and launches one program per ``BLOCK`` output elements on the
inputs' stream (so CUDA-graph capture records it like any kernel). ``out_dtypes`` names the
outputs' dtypes ("bfloat16,float32"), which the fake kernel needs without reading the disk.

On CPU tensors Triton runs only in its interpreter (``TRITON_INTERPRET=1``, set before the
kernel module is first imported): that is how the tests check the generated kernels on a
machine without a GPU; anything else gets an error saying so.
"""

import functools
import hashlib
import importlib.util
import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from .kernels import STATS, _write_atomic, default_cache_dir, reads_as
from .partition import Access

SYMBOL = "ad_ew_kernel"  # every generated kernel's entry point (triton_emit.py emits it)
BLOCK = 1024  # output elements per program
_lock = threading.Lock()
_DTYPES: Dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                                   "bool": torch.bool}


def triton_missing() -> str:
    """'' when Triton imports, else the reason (for the transform's one skip line)."""
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"triton is not installed ({err}); it comes with the CUDA builds of torch"
    return ""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class _Kernel:
    fn: Any  # the @triton.jit function
    access: Tuple[Access, ...]
    in_dtypes: Tuple[torch.dtype, ...]
    full: int  # an input read whole (its shape is the output's), -1 if none


_loaded: Dict[str, _Kernel] = {}


def build_triton_kernel(source: str, access: Sequence[Access], in_dtypes: Sequence[torch.dtype],
                        out_dtypes: Sequence[torch.dtype], cache_dir: str = "") -> str:
    """The directory holding ``source`` as a kernel module (written now unless already there)."""
    import triton

    digest = hashlib.sha256(source.encode() + triton.__version__.encode()).hexdigest()[:20]
    directory = os.path.join(os.path.abspath(cache_dir or default_cache_dir()), f"triton-{digest}")
    path = os.path.join(directory, "kernel.py")
    with _lock:
        if os.path.exists(path):
            STATS["cache_hits"] += 1
            return directory
        os.makedirs(directory, exist_ok=True)
        _write_atomic(os.path.join(directory, "kernel.json"), json.dumps({
            "access": [a.value for a in access], "inputs": [dtype_name(d) for d in in_dtypes],
            "outputs": [dtype_name(d) for d in out_dtypes]}))
        _write_atomic(path, source)  # last: its presence means the entry is whole
        STATS["compiles"] += 1
    return directory


def _load(directory: str) -> _Kernel:
    kernel = _loaded.get(directory)
    if kernel is not None:
        return kernel
    with _lock:
        path = os.path.join(directory, "kernel.py")
        if not os.path.exists(path):
            raise RuntimeError(f"generated Triton kernel {path} is missing; rebuild the engine with "
                               "mlir_elementwise_fusion")
        with open(os.path.join(directory, "kernel.json")) as f:
            meta = json.load(f)
        name = "autodeploy_triton_" + os.path.basename(directory).replace("-", "_")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # a file we wrote ourselves, named by its hash
        access = tuple(Access(a) for a in meta["access"])
        full = next((k for k, a in enumerate(access) if a is Access.FULL), -1)
        kernel = _loaded[directory] = _Kernel(getattr(module, SYMBOL), access,
                                              tuple(_DTYPES[d] for d in meta["inputs"]), full)
    return kernel


@functools.lru_cache(maxsize=None)
def _out_dtypes(spec: str) -> Tuple[torch.dtype, ...]:
    """The dtypes named in ``spec`` (parsed once per distinct string: the op runs every step)."""
    return tuple(_DTYPES[d] for d in spec.split(","))


@torch.library.custom_op("autodeploy::triton_fused_elementwise", mutates_args=())
def triton_fused_elementwise(inputs: List[Tensor], kernel: str, out_dtypes: str) -> List[Tensor]:
    """A fused element-wise subgraph through its generated Triton kernel (``kernel``: its directory)."""
    k = _loaded.get(kernel) or _load(kernel)
    if len(inputs) != len(k.access):
        raise ValueError(f"triton_fused_elementwise: {len(inputs)} inputs for a kernel of {len(k.access)} ({kernel})")
    device = inputs[k.full].device if k.full >= 0 else inputs[0].device
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"triton_fused_elementwise: inputs on {device}; the generated Triton kernels run on CUDA "
                           "(on CPU only in Triton's interpreter, TRITON_INTERPRET=1)")
    shape = inputs[k.full].shape if k.full >= 0 else torch.broadcast_shapes(*(t.shape for t in inputs))
    outs = [torch.empty(shape, dtype=d, device=device) for d in _out_dtypes(out_dtypes)]
    numel = outs[0].numel()
    if numel == 0:
        return outs
    inner = shape[-1] if len(shape) else 1
    outer = numel // inner
    args = []
    for slot, (t, access, dtype) in enumerate(zip(inputs, k.access, k.in_dtypes)):
        if t.dtype != dtype or t.device != device or not reads_as(t, access, shape, outer, inner):
            raise ValueError(f"triton_fused_elementwise: input {slot} ({tuple(t.shape)}, {t.dtype}, {t.device}) does "
                             f"not fit the kernel's '{access.value}' access of {dtype} over output {tuple(shape)} on "
                             f"{device}; the graph changed after mlir_elementwise_fusion generated it")
        args.append(t.contiguous())
    grid = ((numel + BLOCK - 1) // BLOCK,)
    k.fn[grid](*args, *outs, numel, inner, BLOCK=BLOCK)
    return outs


@triton_fused_elementwise.register_fake
def _triton_fused_elementwise_fake(inputs: List[Tensor], kernel: str, out_dtypes: str) -> List[Tensor]:
    shape = torch.broadcast_shapes(*(t.shape for t in inputs))
    return [inputs[0].new_empty(shape, dtype=d) for d in _out_dtypes(out_dtypes)]
