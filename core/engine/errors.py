"""Errors the engine raises to its callers."""


class EngineDeadError(RuntimeError):
    """The engine core or one of its workers died; every pending request fails with this."""


class EngineGenerateError(RuntimeError):
    """A request failed inside the engine (the engine itself is still alive)."""
