"""Errors that cross layer boundaries.

`ParameterError` names the offending field so that the HTTP layer can answer
400 with OpenAI's `param` and the offline API can say exactly what to fix.
"""


class ParameterError(ValueError):
    """A request or configuration field holds a value outside its allowed range."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class EngineDeadError(RuntimeError):
    """The engine core stopped; requests cannot be served any more."""
