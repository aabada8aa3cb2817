"""One logger tree for the package, so users can tune verbosity with ``logging`` alone."""

import logging
import os

_ROOT = "autodeploy"


def get_logger(name: str) -> logging.Logger:
    """Logger under the ``autodeploy`` tree (``name`` is usually ``__name__``)."""
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


def configure_cli_logging(debug: bool = False) -> None:
    """Plain console logging for the CLI; ``AUTODEPLOY_LOG_LEVEL`` overrides the level."""
    level_name = os.environ.get("AUTODEPLOY_LOG_LEVEL", "DEBUG" if debug else "INFO").upper()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[autodeploy %(levelname)s] %(message)s"))
    root = logging.getLogger(_ROOT)
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level_name, logging.INFO))
    root.propagate = False
