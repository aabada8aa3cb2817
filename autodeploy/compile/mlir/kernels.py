"""Build, cache and run the generated element-wise kernels; the op that calls them.

Build: ``g++ -O3 -march=native -fopenmp -fno-math-errno -std=c++17 -fPIC -shared`` (``$CXX``
first), once per source: each kernel lives in ``<cache dir>/<key>/`` (``kernel.cpp``,
``kernel.json``, ``kernel.so``) where the key hashes the source, the flags, the compiler's
version and this CPU's feature flags (``-march=native`` code must not be served to another
CPU from a shared cache). A second build of the same source finds ``kernel.so`` and compiles
nothing (``STATS`` counts both, for tests and logs). Compiles go to a temporary file renamed
into place, so concurrent builds each see a whole library.

The cache dir is the transform's ``cache_dir`` field, else ``$AUTODEPLOY_KERNEL_CACHE``, else
``$AUTODEPLOY_CACHE/kernels`` (default ``~/.cache/autodeploy/kernels``).

Run: ``torch.ops.autodeploy.cpu_fused_elementwise(inputs, kernel_dir, num_outputs)`` loads the
library with ctypes on first use in a process (rebuilding it from ``kernel.cpp`` if the
``.so`` is gone), checks each input against the access pattern the kernel was generated for
and calls it. Its fake kernel gives the outputs' shape (the inputs broadcast together,
float32), so graphs with it still export and shape-propagate. OpenMP: the library links
``libgomp`` by soname, the runtime torch's CPU wheel already loaded (one thread pool).
"""

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ...utils.cpu import cpu_flags
from ...utils.logging import get_logger
from ...utils.paths import cache_root
from .partition import Access

logger = get_logger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c++17", "-fPIC", "-shared")
ENV_DIR = "AUTODEPLOY_KERNEL_CACHE"
SYMBOL = "ad_ew_kernel"  # every generated kernel's entry point (cpp.py emits it)
STATS: Dict[str, int] = {"compiles": 0, "cache_hits": 0}

_lock = threading.Lock()
_version: Dict[str, str] = {}


@dataclass
class _Kernel:
    fn: Any  # the ctypes function, called with one int64 array (no argtypes: no conversion)
    access: Tuple[Access, ...]
    num_outputs: int
    full: int  # an input read whole (its shape is the output's), -1 if none
    local: threading.local  # per thread, the int64 argument array (ctypes drops the GIL in the call)

    def args(self) -> Any:
        arr = getattr(self.local, "arr", None)
        if arr is None:
            arr = self.local.arr = (ctypes.c_int64 * (3 + len(self.access) + self.num_outputs))()
        return arr


_loaded: Dict[str, _Kernel] = {}


def default_cache_dir() -> str:
    return os.environ.get(ENV_DIR) or os.path.join(cache_root(), "kernels")


def compiler() -> Optional[str]:
    """The C++ compiler: ``$CXX``, ``g++`` or ``c++`` (None when there is none)."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def kernel_key(source: str, cxx: str) -> str:
    if cxx not in _version:
        _version[cxx] = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(source.encode())
    digest.update(" ".join(FLAGS).encode() + _version[cxx].encode() + cpu_flags().encode())
    return digest.hexdigest()[:20]


class KernelBuildError(RuntimeError):
    """The C++ compiler refused or failed on a generated kernel."""


def _compile(cxx: str, source_path: str, target: str) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    cmd = [cxx, *FLAGS, source_path, "-o", tmp, "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        os.unlink(tmp)
        raise KernelBuildError(f"{' '.join(cmd)} could not run: {err}") from err
    if done.returncode != 0:
        os.unlink(tmp)
        raise KernelBuildError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    os.replace(tmp, target)
    STATS["compiles"] += 1


def _write_atomic(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def build_kernel(source: str, access: Sequence[Access], num_outputs: int, cache_dir: Optional[str] = None) -> str:
    """The directory of the compiled kernel for ``source`` (compiled now unless cached)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found for the generated kernels (install g++ or set CXX)")
    directory = os.path.join(os.path.abspath(cache_dir or default_cache_dir()), kernel_key(source, cxx))
    target = os.path.join(directory, "kernel.so")
    with _lock:
        if os.path.exists(target):
            STATS["cache_hits"] += 1
            return directory
        os.makedirs(directory, exist_ok=True)
        _write_atomic(os.path.join(directory, "kernel.cpp"), source)
        _write_atomic(os.path.join(directory, "kernel.json"), json.dumps({"access": [a.value for a in access],
                                                                           "outputs": num_outputs}))
        logger.debug("compiling generated element-wise kernel %s", directory)
        _compile(cxx, os.path.join(directory, "kernel.cpp"), target)
    return directory


def _load(directory: str) -> _Kernel:
    kernel = _loaded.get(directory)
    if kernel is not None:
        return kernel
    with _lock:
        target = os.path.join(directory, "kernel.so")
        source = os.path.join(directory, "kernel.cpp")
        if not os.path.exists(target):
            cxx = compiler()
            if not os.path.exists(source) or cxx is None:
                raise RuntimeError(f"generated kernel {target} is missing and cannot be rebuilt (no kernel.cpp or "
                                   "no C++ compiler); rebuild the engine with mlir_elementwise_fusion")
            _compile(cxx, source, target)
        with open(os.path.join(directory, "kernel.json")) as f:
            meta = json.load(f)
        access = tuple(Access(a) for a in meta["access"])
        fn = getattr(ctypes.CDLL(target), SYMBOL)
        fn.restype = None
        full = next((k for k, a in enumerate(access) if a is Access.FULL), -1)
        kernel = _loaded[directory] = _Kernel(fn, access, int(meta["outputs"]), full, threading.local())
    return kernel


def _misfit(t: Tensor, access: Access, shape: Sequence[int], outer: int, inner: int, k: int) -> ValueError:
    return ValueError(f"cpu_fused_elementwise: input {k} ({tuple(t.shape)}, {t.dtype}, {t.device}) does not fit "
                      f"the kernel's '{access.value}' access over output {tuple(shape)} (float32 or bool on CPU); "
                      "the graph changed after mlir_elementwise_fusion generated it")


_F32, _BOOL = torch.float32, torch.bool


def reads_as(t: Tensor, access: Access, shape: Sequence[int], outer: int, inner: int) -> bool:
    """Whether a kernel reading ``t`` with ``access`` over the ``[outer, inner]`` output view
    reads all of it and only it (both backends' input check)."""
    if access is Access.FULL:
        return t.shape == shape
    if access is Access.ROW:
        return t.numel() == inner  # [D] or [1, .., D]: a tensor broadcastable to shape
    return t.numel() == (outer if access is Access.COL else 1)


def _fits(t: Tensor, access: Access, shape: Sequence[int], outer: int, inner: int) -> bool:
    if not t.is_cpu or (t.dtype is not _F32 and t.dtype is not _BOOL):
        return False
    return reads_as(t, access, shape, outer, inner)


@torch.library.custom_op("autodeploy::cpu_fused_elementwise", mutates_args=())
def cpu_fused_elementwise(inputs: List[Tensor], kernel: str, num_outputs: int) -> List[Tensor]:
    """A fused element-wise subgraph through its generated C++ kernel (``kernel``: its directory).

    Kept lean: at decode sizes this call replaces a few aten ops of ~1-3 us each, so its own
    Python cost decides whether fusing pays (measured in benchmarks/bench_mlir_fusion.py)."""
    k = _loaded.get(kernel) or _load(kernel)
    if len(inputs) != len(k.access):
        raise ValueError(f"cpu_fused_elementwise: {len(inputs)} inputs for a kernel of {len(k.access)} ({kernel})")
    if k.full >= 0:
        like = inputs[k.full]
        shape = like.shape
        outs = [torch.empty_like(like, dtype=_F32, memory_format=torch.contiguous_format) for _ in range(num_outputs)]
    else:
        shape = torch.broadcast_shapes(*(t.shape for t in inputs))
        outs = [torch.empty(shape, dtype=_F32) for _ in range(num_outputs)]
    numel = outs[0].numel()
    if numel == 0:
        return outs
    inner = shape[-1] if len(shape) else 1
    outer = numel // inner
    args = k.args()
    args[0], args[1], args[2] = outer, inner, torch.get_num_threads()
    slot, copies = 3, []
    for t, access in zip(inputs, k.access):
        if not _fits(t, access, shape, outer, inner):
            raise _misfit(t, access, shape, outer, inner, slot - 3)
        if not t.is_contiguous():
            t = t.contiguous()
            copies.append(t)  # alive until the kernel ran
        args[slot] = t.data_ptr()
        slot += 1
    for t in outs:
        args[slot] = t.data_ptr()
        slot += 1
    k.fn(args)
    return outs


@cpu_fused_elementwise.register_fake
def _cpu_fused_elementwise_fake(inputs: List[Tensor], kernel: str, num_outputs: int) -> List[Tensor]:
    shape = torch.broadcast_shapes(*(t.shape for t in inputs))
    return [inputs[0].new_empty(shape, dtype=torch.float32) for _ in range(num_outputs)]
