"""Errors as OpenAI error bodies: ``{"error": {"message", "type", "param", "code"}}``, never plain text."""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.entrypoints.openai.protocol import error_body
from engine.errors import EngineDeadError, EngineGenerateError, EngineUnavailableError

logger = logging.getLogger("engine.server")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    499: "ClientClosedRequest",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error the server answers with: the HTTP status, the OpenAI error type and the parameter at fault."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None, err_type: Optional[str] = None):
        super().__init__(message)
        self.status, self.param = status, param
        self.headers: dict[str, str] = {}  # sent with the error (Retry-After on a 503 of an overloaded server)
        self.err_type = err_type or ERROR_TYPES.get(status, "InternalServerError")

    @classmethod
    def from_exception(cls, exc: BaseException, request_id: str = "?") -> APIError:
        """What a failure means to a client: bad input (400, with its ``param``), a dead engine (503), a request
        that failed inside the engine (500) or an internal error (500, logged with its traceback)."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, ValueError):  # InvalidParameterError names its parameter; a plain ValueError does not
            return cls(str(exc), getattr(exc, "code", 400), getattr(exc, "param", None))
        if isinstance(exc, EngineUnavailableError):
            error = cls(str(exc), 503)
            error.headers["Retry-After"] = str(max(1, round(exc.retry_after)))
            return error
        if isinstance(exc, EngineDeadError):
            return cls(f"the engine is dead: {exc}", 503, err_type="EngineDeadError")
        if isinstance(exc, EngineGenerateError):
            logger.error("request %s failed: %s", request_id, exc)
            return cls(str(exc), 500, err_type="EngineGenerateError")
        logger.error("request %s failed", request_id, exc_info=exc)
        return cls(
            f"internal error ({type(exc).__name__}); request id {request_id}", 500, err_type="InternalServerError"
        )

    def body(self) -> dict:
        return error_body(str(self), self.err_type, self.param, self.status)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", "?")


def install_exception_handlers(app: FastAPI) -> None:
    """Every failure a handler raises becomes an OpenAI error body."""

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return APIError(
                f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
            ).response()
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        if first.get("type") == "extra_forbidden":
            return APIError(
                f"unknown field '{param}': not a parameter of this endpoint on this server", 400, param
            ).response()
        detail = f"{first['msg']} (got {first['input']!r})" if first.get("type") == "literal_error" else first["msg"]
        return APIError(f"{param}: {detail}" if param else detail, 400, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return APIError(str(exc.detail), exc.status_code).response()

    for exc_type in (APIError, ValueError, EngineDeadError, EngineGenerateError, EngineUnavailableError):

        async def known_error(request: Request, exc: Exception):
            return APIError.from_exception(exc, _request_id(request)).response()

        app.add_exception_handler(exc_type, known_error)
