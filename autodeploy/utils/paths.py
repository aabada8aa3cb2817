"""Where autodeploy keeps what it writes for later runs."""

import os


def cache_root() -> str:
    """``$AUTODEPLOY_CACHE``, default ``~/.cache/autodeploy``: presets, traced patterns,
    inductor's compile cache."""
    return os.environ.get("AUTODEPLOY_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "autodeploy"))
