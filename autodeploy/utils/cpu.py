"""What this CPU is: its feature flags (part of the key of every kernel compiled for it), and
whether it computes bfloat16 natively."""

import platform

import torch


def cpu_flags() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` (``-march=native`` code is only valid on a CPU with
    these), or the processor name where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 / AMX), as oneDNN reports it:
    there bf16 GEMMs run several times faster than float32 ones; elsewhere oneDNN emulates bf16,
    slower than torch's own kernels (on one AVX2-only CPU half precision was ~500x slower)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
