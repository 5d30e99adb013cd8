"""Errors the engine raises to its callers."""


class EngineDeadError(RuntimeError):
    """The engine core or one of its workers died; every pending request fails with this."""


class EngineGenerateError(RuntimeError):
    """A request failed inside the engine (the engine itself is still alive)."""


class InvalidParameterError(ValueError):
    """A request parameter that cannot be used. ``param`` names it as the request spells it (OpenAI's error
    ``param``); ``code`` is the HTTP status the server answers with (400)."""

    def __init__(self, message: str, param: str | None = None, code: int = 400):
        super().__init__(message)
        self.param = param
        self.code = code
