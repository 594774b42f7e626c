"""Typed errors shared by every process: the HTTP edge maps each to one OpenAI error body."""


class InvalidParameterError(ValueError):
    """A caller passed a value outside its allowed range; `param` names the field (OpenAI `error.param`)."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code  # e.g. "model_not_found": the HTTP edge answers 404


class ProtocolVersionError(RuntimeError):
    """A peer speaks another PROTOCOL_VERSION; raised at registration."""


class RequestAbortedError(RuntimeError):
    """The engine ended a request on purpose (a drain, a cancel) before it produced its value."""


class EngineDeadError(RuntimeError):
    """The EngineCore process is gone (it sent DEAD, or its process exited)."""
