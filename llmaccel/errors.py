"""One exception type per kind of user mistake. All are ValueErrors, so callers that only know
Python's built-ins still catch them."""

from __future__ import annotations


class LLMAccelError(ValueError):
    """Base class of every error a user can fix by changing their input."""


class ModelNotFoundError(LLMAccelError):
    """The model path or alias does not exist."""


class UnsupportedModelError(LLMAccelError):
    """The checkpoint is of an architecture or tensor type llmaccel does not run."""


class CorruptCheckpointError(LLMAccelError):
    """The checkpoint exists but cannot be read (truncated, wrong format, missing tensors)."""


class InvalidRequestError(LLMAccelError):
    """A request the engine cannot serve as given (empty prompt, prompt too long, bad token id)."""
