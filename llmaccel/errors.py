"""One exception type per kind of user mistake. All are ValueErrors, so callers that only know
Python's built-ins still catch them."""

from __future__ import annotations


class LLMAccelError(ValueError):
    """Base class of every error a user can fix by changing their input. `param` names the request
    field at fault, when one is (the server's 400 carries it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(LLMAccelError):
    """The model path or alias does not exist."""


class UnsupportedModelError(LLMAccelError):
    """The checkpoint is of an architecture or tensor type llmaccel does not run."""


class CorruptCheckpointError(LLMAccelError):
    """The checkpoint exists but cannot be read (truncated, wrong format, missing tensors)."""


class InvalidRequestError(LLMAccelError):
    """A request the engine cannot serve as given (empty prompt, prompt too long, bad token id)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit the context window."""


class ContentFilterError(InvalidRequestError):
    """A safety rule with the action `block` matched the prompt (HTTP 400, code content_filter)."""

    def __init__(self, message: str, rule_id: str, param: str | None = None) -> None:
        super().__init__(message, param)
        self.rule_id = rule_id


# Serving conditions: not the caller's input, so not ValueErrors.
class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later (HTTP 429)."""


class RequestTimeoutError(TimeoutError):
    """The request passed its deadline and was aborted (HTTP 504)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a crash or a shutdown); no request can be served (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """The engine could not compute this request (a bug, not the caller's input): it was ended with
    finish reason "error", and the engine went on with the others (HTTP 500 naming the request; the
    reason is in the log, never in the message)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"internal error while generating request {request_id}")
        self.request_id = request_id
