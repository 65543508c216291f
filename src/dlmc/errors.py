"""Errors dlmc raises for bad input: each message names the file, tensor, field or option."""


class DlmcError(Exception):
    """Base class for errors that are the user's to fix (shown without a traceback by the CLI)."""


class CheckpointError(DlmcError):
    """A checkpoint is missing, malformed or of an unsupported kind."""


class ModelNotFoundError(DlmcError):
    """A model id could not be resolved to a local directory."""


class ConfigError(DlmcError, ValueError):
    """An option or setting has an invalid value."""


class TokenizerError(CheckpointError):
    """A checkpoint has no usable tokenizer: text cannot be encoded (token ids still can).

    `directory`: the checkpoint; `reason`: what is missing or failed. The message advises the
    Python API's `prompt_token_ids`; the command line gives its own advice from the two."""

    def __init__(self, directory: object, reason: str) -> None:
        self.directory, self.reason = directory, reason
        super().__init__(f"{directory}: no usable tokenizer ({reason}); pass prompt_token_ids "
                         "instead of text")
