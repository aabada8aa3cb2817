"""The runtime's request error (its own module so that every part of the runtime can raise it)."""

from typing import Optional

from ..utils.errors import AutoDeployError


class InvalidRequestError(AutoDeployError, ValueError):
    """A request the engine cannot serve (bad parameter, empty or too-long prompt). ``code`` is a
    machine-readable reason where one exists (``context_length_exceeded``), as OpenAI's API has."""

    def __init__(self, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.code = code
