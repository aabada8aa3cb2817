"""One logger tree for the package, so users can tune verbosity with ``logging`` alone."""

import logging
import os
import sys

_ROOT = "autodeploy"


def get_logger(name: str) -> logging.Logger:
    """Logger under the ``autodeploy`` tree (``name`` is usually ``__name__``)."""
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time.

    A plain ``StreamHandler`` keeps the stream it was created with; when the CLI runs in-process
    (tests, notebooks) and ``sys.stderr`` is later swapped and closed, it would then fail.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_cli_logging(debug: bool = False) -> None:
    """Plain console logging for the CLI; ``AUTODEPLOY_LOG_LEVEL`` overrides the level."""
    level_name = os.environ.get("AUTODEPLOY_LOG_LEVEL", "DEBUG" if debug else "INFO").upper()
    handler = _CurrentStderrHandler()
    handler.setFormatter(logging.Formatter("[autodeploy %(levelname)s] %(message)s"))
    root = logging.getLogger(_ROOT)
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level_name, logging.INFO))
    root.propagate = False
