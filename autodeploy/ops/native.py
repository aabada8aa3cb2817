"""autodeploy's own CPU kernels (``ops/csrc/*.c``): built on first use, loaded with ctypes.

Why C and not torch ops: at decode sizes a step is hundreds of small ops, and on CPU the cost
of several of them is their dispatch and their extra passes, not their arithmetic (a six-op
RMSNorm over one row of 768; attention that must first copy every sequence's cache pages into
one padded tensor because torch has no paged attention). A few plain loops do these in one call.

How: the sources are compiled once per machine with the C compiler found (``$CC``, ``cc`` or
``gcc``), ``-O3 -march=native -fopenmp``, into ``$AUTODEPLOY_CACHE/native/<key>/``; the key
hashes the sources, the flags, the compiler's version and this CPU's feature flags, so a cache
shared between machines never serves one CPU's build to another. The library links OpenMP by
its soname, which resolves to the ``libgomp`` torch already loaded: one thread pool, sized by
``torch.get_num_threads()`` on every call. If a second OpenMP runtime would be loaded (a torch
built with Intel's), the kernels are not used: two thread pools spinning on the same cores
(the ``blas`` linear backend measured 3.7x slower that way).

Nothing is required: without a compiler, on a failed build or with
``AUTODEPLOY_NATIVE_KERNELS=0``, ``load()`` returns None once with a logged reason and every
caller keeps its torch path. Each wrapper below checks its inputs (CPU, float32, contiguous)
and returns None for anything else, so callers fall back per call as well.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..utils.cpu import cpu_flags
from ..utils.logging import get_logger
from ..utils.paths import cache_root

logger = get_logger(__name__)

ENV_SWITCH = "AUTODEPLOY_NATIVE_KERNELS"
SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
_LIB_NAME = "libautodeploy_kernels.so"

_lock = threading.Lock()
@dataclass
class _State:
    loaded: bool = False  # load() ran (once per process)
    lib: Optional[ctypes.CDLL] = None
    reason: str = ""  # why lib is None
    off: bool = False  # inside native.disabled()


_state = _State()


def _sources() -> List[str]:
    return sorted(os.path.join(SOURCE_DIR, f) for f in os.listdir(SOURCE_DIR) if f.endswith((".c", ".h")))


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build_key(cc: str) -> str:
    digest = hashlib.sha256()
    for path in _sources():
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest.update(" ".join(FLAGS).encode() + version.encode() + cpu_flags().encode())
    return digest.hexdigest()[:16]


def _build(cc: str, target: str) -> None:
    """Compile into a temporary file and rename it into place: concurrent builds (several
    ranks, parallel tests) each produce a whole library and the last rename wins."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    sources = [p for p in _sources() if p.endswith(".c")]
    cmd = [cc, *FLAGS, "-I", SOURCE_DIR, *sources, "-o", tmp, "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, target)


def _openmp_runtimes() -> List[str]:
    """Distinct OpenMP runtime files mapped into this process."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if "/" in line else ""
                if any(name in os.path.basename(path) for name in ("libgomp", "libiomp", "libomp")):
                    found.add(os.path.realpath(path))
    except OSError:
        pass
    return sorted(found)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    n = ctypes.c_int
    lib.ad_paged_decode_attention_f32.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, f32, i64,
                                                  p, i64, p, i64, p, n]
    lib.ad_paged_decode_attention_f32.restype = ctypes.c_int
    lib.ad_rmsnorm_f32.argtypes = [p, i64, p, i64, p, p, p, i64, i64, f32, n]
    lib.ad_rmsnorm_f32.restype = None
    lib.ad_rmsnorm_bf16.argtypes = [p, i64, p, i64, p, p, p, i64, i64, f32, n]
    lib.ad_rmsnorm_bf16.restype = None
    lib.ad_gemv_f32.argtypes = [p, p, i64, p, p, i64, i64, n]
    lib.ad_gemv_f32.restype = None
    lib.ad_silu_and_mul_f32.argtypes = [p, i64, p, i64, i64, n]
    lib.ad_silu_and_mul_f32.restype = None
    lib.ad_rope_f32.argtypes = [p, i64, i64, i64, p, p, p, i64, i64, i64, i64, n]
    lib.ad_rope_f32.restype = None
    # state_step_f32.c: (..., state, num_slots, cu, rows, slots, carry, y, n, ...)
    lib.ad_mamba2_step_f32.argtypes = [p, i64, p, i64, p, i64, p, i64, p, p, p, i64, p, i64, p, p, p, i64, i64, i64,
                                       i64, i64, n]
    lib.ad_mamba_step_f32.argtypes = [p, i64, p, i64, p, i64, p, i64, p, p, p, i64, p, i64, p, p, p, i64, i64, i64, n]
    lib.ad_conv_step_f32.argtypes = [p, i64, p, i64, p, i64, p, p, p, p, n, p, i64, i64, i64, n]
    lib.ad_fast_weight_step_f32.argtypes = [p, i64, p, i64, p, i64, p, i64, p, i64, i64, p, i64, p, i64, p, p, p,
                                            i64, i64, i64, i64, i64, f32, n, n]
    lib.ad_diagonal_recurrence_f32.argtypes = [p, i64, p, i64, p, i64, p, i64, p, p, p, i64, i64, n]
    lib.ad_wkv_f32.argtypes = [p, p, p, i64, p, i64, p, i64, p, i64, p, p, p, i64, i64, n]
    lib.ad_mlstm_f32.argtypes = [p, i64, p, i64, p, i64, p, i64, p, i64, p, i64, p, i64, p, p, p, i64, i64, i64, i64,
                                 f32, n]
    for name in ("ad_mamba2_step_f32", "ad_mamba_step_f32", "ad_conv_step_f32", "ad_fast_weight_step_f32",
                 "ad_diagonal_recurrence_f32", "ad_wkv_f32", "ad_mlstm_f32"):
        getattr(lib, name).restype = ctypes.c_int


def _load() -> Tuple[Optional[ctypes.CDLL], str]:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return None, f"{ENV_SWITCH}={os.environ[ENV_SWITCH]}"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc)"
    before = _openmp_runtimes()
    target = os.path.join(cache_root(), "native", _build_key(cc), _LIB_NAME)
    if not os.path.exists(target):
        logger.info("building autodeploy's CPU kernels with %s (once per machine) into %s", cc, os.path.dirname(target))
        try:
            _build(cc, target)
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            return None, f"building them failed: {err}"
    try:
        lib = ctypes.CDLL(target)
    except OSError as err:
        return None, f"loading {target} failed: {err}"
    runtimes = _openmp_runtimes()
    if before and len(runtimes) > len(before):
        return None, f"they would run a second OpenMP runtime beside torch's ({', '.join(runtimes)})"
    _declare(lib)
    return lib, ""


def load() -> Optional[ctypes.CDLL]:
    """The kernel library, or None (with the reason logged once) when it cannot be used."""
    if _state.off:
        return None
    if not _state.loaded:
        with _lock:
            if not _state.loaded:
                lib, reason = _load()
                if lib is None:
                    logger.warning("autodeploy's CPU kernels are off: %s; using torch's ops instead", reason)
                else:
                    logger.debug("autodeploy's CPU kernels: %s", lib._name)
                _state.lib, _state.reason, _state.loaded = lib, reason, True
    return _state.lib


@contextmanager
def disabled() -> Iterator[None]:
    """Within this block every wrapper returns None (callers take their torch path): for tests
    of those paths and for A/B measurements in one process."""
    before = _state.off
    _state.off = True
    try:
        yield
    finally:
        _state.off = before


def loaded() -> Optional[ctypes.CDLL]:
    """``load()`` without its lock once loaded: for wrappers called per layer of a decode step."""
    return _state.lib if _state.loaded and not _state.off else load()


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str:
    """Why ``load()`` returns None ("" when it does not)."""
    if _state.off:
        return "switched off by native.disabled()"
    load()
    return _state.reason


def _f32_cpu(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _rows_of_heads(t: Tensor, batch: int, heads: int, dim: int) -> Optional[int]:
    """Token stride of ``t`` viewed as ``[batch, heads, dim]`` rows whose heads are contiguous
    (the k/v slices of a fused QKV output are), or None when it is not laid out that way."""
    if t.dtype != torch.float32 or t.numel() != batch * heads * dim:
        return None
    rows = t.reshape(batch, heads, dim)
    if rows.stride(2) != 1 or rows.stride(1) != dim:
        return None
    return rows.stride(0)


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, input_pos: Tensor,
                           seq_len: Tensor, scale: float, sliding_window: Optional[int],
                           new_kv: Optional[Tuple[Tensor, Tensor, Tensor]] = None) -> Optional[Tensor]:
    """``[B, Hq, Dv]`` attention of each sequence's one new query (``q [B, Hq, D]``) over its
    cached positions, read in place from the pages. ``new_kv = (k, v, slots)`` first writes the
    step's keys/values into those cache slots (else they must already be there). None, with
    nothing written, when the kernel cannot take these inputs."""
    lib = load()
    if lib is None or q.dim() != 3 or not _f32_cpu(q, k_cache, v_cache):
        return None
    if page_table.dtype != torch.int32 or input_pos.dtype != torch.int32 or seq_len.dtype != torch.int32:
        return None
    batch, n_q, d = q.shape
    n_kv, d_v = k_cache.shape[2], v_cache.shape[3]
    if batch == 0 or n_q % n_kv or k_cache.shape[3] != d or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    k_ptr = v_ptr = slots_ptr = None
    ldk = ldv = 0
    if new_kv is not None:
        k, v, slots = new_kv
        ldk, ldv = _rows_of_heads(k, batch, n_kv, d), _rows_of_heads(v, batch, n_kv, d_v)
        if ldk is None or ldv is None or slots.dtype != torch.int64 or slots.numel() != batch:
            return None
        slots = slots.contiguous()
        k_ptr, v_ptr, slots_ptr = k.data_ptr(), v.data_ptr(), slots.data_ptr()
    q = q.contiguous()
    page_table, input_pos, seq_len = page_table.contiguous(), input_pos.contiguous(), seq_len.contiguous()
    out = q.new_empty(batch, n_q, d_v)
    rc = lib.ad_paged_decode_attention_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), page_table.data_ptr(), input_pos.data_ptr(),
        seq_len.data_ptr(), out.data_ptr(), batch, n_q, n_kv, d, d_v, k_cache.shape[1], page_table.shape[1], scale,
        sliding_window or 0, k_ptr, ldk, v_ptr, ldv, slots_ptr, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("paged decode attention: a sequence has no cached position or runs past its page table "
                           "(the step's metadata does not match the cache)")
    return out


def rmsnorm(x: Tensor, weight: Tensor, eps: float, residual: Optional[Tensor] = None
            ) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """``(rmsnorm(x [+ residual]), x + residual or None)`` over the last dim; None when the
    kernel cannot take these inputs (contiguous CPU tensors of one shape, all float32 or all
    bfloat16: ``rmsnorm_bf16.c`` rounds where the reference does). Lean on purpose: at one row
    the whole call is a few microseconds, so every check here counts."""
    lib = load()
    dtype = x.dtype
    if lib is None or dtype not in _RMSNORM or weight.dtype != dtype or x.device.type != "cpu":
        return None
    hidden = x.shape[-1]
    if not x.is_contiguous() or not weight.is_contiguous() or weight.shape != (hidden,):
        return None
    summed = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != dtype or not residual.is_contiguous():
            return None
        summed = torch.empty_like(x)
    out = torch.empty_like(x)
    getattr(lib, _RMSNORM[dtype])(x.data_ptr(), hidden, residual.data_ptr() if residual is not None else None,
                                  hidden, weight.data_ptr(), out.data_ptr(),
                                  summed.data_ptr() if summed is not None else None,
                                  x.numel() // hidden if hidden else 0, hidden, eps, torch.get_num_threads())
    return out, summed


_RMSNORM = {torch.float32: "ad_rmsnorm_f32", torch.bfloat16: "ad_rmsnorm_bf16"}


def gemv(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Optional[Tensor]:
    """``x @ weight.T + bias`` for an ``x`` of one row (any leading shape of one element), read
    from the plain row-major float32 ``weight [N, K]``; None when the kernel cannot take these
    inputs (not one row, not contiguous float32 CPU tensors, a packed weight). It runs once per
    linear of a batch-1 decode step (~50 times a step), so it checks with the cheapest tensor
    properties (``is_cpu``, not ``device.type``)."""
    lib = loaded()
    f32 = torch.float32
    if lib is None or x.dtype != f32 or weight.dtype != f32 or not x.is_cpu or weight.is_mkldnn:
        return None
    n, k = weight.shape
    if weight.stride(1) != 1 or x.numel() != k or not x.is_contiguous():
        return None
    if bias is not None and (bias.dtype != f32 or bias.numel() != n or not bias.is_contiguous()):
        return None
    out = x.new_empty(x.shape[:-1] + (n,))
    lib.ad_gemv_f32(x.data_ptr(), weight.data_ptr(), weight.stride(0), None if bias is None else bias.data_ptr(),
                    out.data_ptr(), n, k, torch.get_num_threads())
    return out


def silu_and_mul(x: Tensor) -> Optional[Tensor]:
    """``silu(x[..., :d]) * x[..., d:]`` for float32 CPU rows of width 2d whose last dim is
    contiguous; None when the kernel cannot take ``x``."""
    lib = load()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() == 0:
        return None
    width = x.shape[-1]
    if width % 2 or x.numel() == 0:
        return None
    rows = x.reshape(-1, width)  # a view for the layouts a graph produces (else a copy, still correct)
    if rows.stride(1) != 1:
        return None
    d = width // 2
    out = x.new_empty(*x.shape[:-1], d)
    lib.ad_silu_and_mul_f32(rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], d, torch.get_num_threads())
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Optional[Tensor]:
    """Rotate-half RoPE of ``x [B, S, H, D]`` (bsnd; any strides with the last dim contiguous)
    with ``cos``/``sin [B, S, D]`` (broadcast over heads), as a new contiguous tensor; None when
    the kernel cannot take these inputs. Equal to torch's ``x * cos + rotate_half(x) * sin``."""
    lib = load()
    if lib is None or x.dim() != 4 or not _f32_cpu(x, cos, sin) or x.stride(3) != 1:
        return None
    B, S, H, D = x.shape
    if D % 2 or cos.shape != (B, S, D) or sin.shape != (B, S, D) or x.numel() == 0:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = x.new_empty(B, S, H, D)
    lib.ad_rope_f32(x.data_ptr(), x.stride(0), x.stride(1), x.stride(2), cos.data_ptr(), sin.data_ptr(),
                    out.data_ptr(), B, S, H, D, torch.get_num_threads())
    return out
