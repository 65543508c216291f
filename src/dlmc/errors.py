"""Errors dlmc raises for bad input: each message names the file, tensor, field or option."""


class DlmcError(Exception):
    """Base class for errors that are the user's to fix (shown without a traceback by the CLI)."""


class CheckpointError(DlmcError):
    """A checkpoint is missing, malformed or of an unsupported kind."""


class ModelNotFoundError(DlmcError):
    """A model id could not be resolved to a local directory."""


class ConfigError(DlmcError, ValueError):
    """An option or setting has an invalid value."""
