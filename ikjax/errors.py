"""Errors users see: each carries one line that names the problem (file, tensor, option)."""


class IkjaxError(Exception):
    """Base of every error ikjax raises on bad input."""


class ModelFileError(IkjaxError, ValueError):
    """A GGUF file that is truncated, foreign, malformed or lacks a tensor."""


class OptionError(IkjaxError, ValueError):
    """An unknown option, a bad value, or a combination that cannot run."""


class DoesNotFitError(IkjaxError, MemoryError):
    """The memory plan exceeds what the target device or host has."""


class ContextFullError(OptionError):
    """A prompt longer than the context (-c) holds: `ikjax chat` drops that turn and goes on."""

    def __init__(self, message: str, tokens: int, ctx: int):
        super().__init__(message)
        self.tokens, self.ctx = tokens, ctx
