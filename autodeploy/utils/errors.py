"""Errors users can act on. The CLI prints them as one line and exits with code 2."""


class AutoDeployError(Exception):
    """Base of user-facing errors: the message says what is wrong and how to fix it."""


class ConfigError(AutoDeployError):
    """Bad configuration: unknown key, bad field, bad YAML, conflicting options."""


class ModelSourceError(AutoDeployError):
    """The model cannot be found or loaded as asked (missing path, pickled weights, remote code)."""


class ExportError(AutoDeployError):
    """torch.export failed; the message names the module and op that failed."""


class RankFailure(AutoDeployError):
    """A rank of a tensor-parallel deployment died, hung or failed a step: the group cannot go on.
    The CLI prints it as one line and exits with code 1 (it is no bad input)."""
