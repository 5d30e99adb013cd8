"""Errors the engine raises to its callers."""


class EngineDeadError(RuntimeError):
    """The engine core or one of its workers died; every pending request fails with this."""


class EngineUnavailableError(RuntimeError):
    """No engine core can take this request now (its core died and is restarting, or none is up yet); the
    engine is not dead: retrying after ``retry_after`` seconds can succeed."""

    def __init__(self, message: str, retry_after: float = 5.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineGenerateError(RuntimeError):
    """A request failed inside the engine (the engine itself is still alive)."""


class InvalidParameterError(ValueError):
    """A request parameter that cannot be used. ``param`` names it as the request spells it (OpenAI's error
    ``param``); ``code`` is the HTTP status the server answers with (400)."""

    def __init__(self, message: str, param: str | None = None, code: int = 400):
        super().__init__(message)
        self.param = param
        self.code = code
