"""What this CPU is: its feature flags, part of the key of every kernel compiled for it."""

import platform


def cpu_flags() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` (``-march=native`` code is only valid on a CPU with
    these), or the processor name where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()
