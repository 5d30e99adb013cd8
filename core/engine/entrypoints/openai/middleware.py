"""Pure ASGI middleware of the OpenAI server.

Pure ASGI (not ``@app.middleware("http")``): Starlette's BaseHTTPMiddleware replaces the ``receive``
channel, so a handler behind it never sees ``http.disconnect`` and an abandoned non-streaming request
would run to the end.
"""

from __future__ import annotations

import json
import logging
import secrets
import uuid
from typing import Any, Awaitable, Callable, Optional

from engine.entrypoints.openai.protocol import error_body

logger = logging.getLogger("engine.server")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_json_error(
    send: Send, message: str, status: int, err_type: str, headers: Optional[list[tuple[bytes, bytes]]] = None
) -> None:
    """An OpenAI-style error response, straight over ASGI."""
    body = json.dumps(error_body(message, err_type, None, status)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` on ``/v1/*`` (the scheme in any case, the key compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            await send_json_error(
                send, "invalid or missing API key", 401, "AuthenticationError", [(b"www-authenticate", b"Bearer")]
            )
            return
        await self.app(scope, receive, send)


class RequestGuardMiddleware:
    """Per request: an id (the client's ``X-Request-Id`` or a new one, echoed back), a bound on the body size
    (413), and a last line of defence: an exception no handler caught becomes a logged JSON 500, never a
    plain-text one."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    @staticmethod
    def _header(scope: Scope, wanted: bytes) -> Optional[bytes]:
        for name, value in scope.get("headers", ()):
            if name == wanted:
                return value
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = self._header(scope, b"x-request-id")
        request_id = given.decode("latin-1")[:128] if given else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        id_header = (b"x-request-id", request_id.encode("latin-1"))
        length = self._header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await send_json_error(
                send,
                f"the request body has {int(length)} bytes; the limit is "
                f"{self.max_body_bytes} (server.max_request_body_bytes)",
                413,
                "RequestTooLargeError",
                [id_header],
            )
            return
        received = 0
        started = answered = False

        async def limited_receive() -> Message:
            """Past the limit: answer 413 here, and tell the app the client left (it stops reading)."""
            nonlocal received, answered
            if answered:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    if not started:
                        await send_json_error(
                            send,
                            f"the request body exceeds {self.max_body_bytes} bytes (server.max_request_body_bytes)",
                            413,
                            "RequestTooLargeError",
                            [id_header],
                        )
                    answered = True
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if answered:
                return  # the 413 is the answer
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), id_header]}
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except Exception as exc:
            if answered:
                return
            logger.exception("request %s %s %s failed: %s", request_id, scope.get("method"), scope.get("path"), exc)
            if not started:
                await send_json_error(
                    send,
                    f"internal error ({type(exc).__name__}); request id {request_id}",
                    500,
                    "InternalServerError",
                    [id_header],
                )
