"""The OpenAI-compatible server: the app factory and ``engine serve``'s process.

The endpoints live in ``routers/`` (completions, chat, models and tokenizer, health and metrics); what
they share — the engine, prompt preparation, generation and draining — in ``serving.OpenAIServing``;
the SSE helper both generation endpoints use in ``streaming``; errors as OpenAI bodies in ``errors``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from contextlib import asynccontextmanager

from fastapi import FastAPI

import engine as engine_pkg
from engine.config import VllmConfig
from engine.entrypoints.openai.errors import install_exception_handlers
from engine.entrypoints.openai.middleware import ApiKeyMiddleware, RequestGuardMiddleware
from engine.entrypoints.openai.routers import (
    chat,
    completions,
    console,
    engine_status,
    health,
    models,
    pooling,
    responses,
    shadow,
)
from engine.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger("engine.server")


def build_app(config: VllmConfig, remote=None) -> FastAPI:
    """The app; the engine loads in the background so /health can answer 503 meanwhile. With ``remote``
    (a ``RemoteEngines``) it joins engine cores that ``engine serve``'s launcher started."""
    serving = OpenAIServing(config, remote)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        serving.loop = asyncio.get_running_loop()
        loader = asyncio.create_task(_load_engine(app, serving))
        yield
        serving.cancel_start.set()
        await asyncio.shield(loader)  # the start-up thread stops its core before it returns
        await serving.history.stop()
        if serving.shadow is not None:
            await serving.shadow.shutdown()
        if serving.engine is not None:
            serving.engine.shutdown()

    app = FastAPI(title="engine", version=engine_pkg.__version__, lifespan=lifespan)
    app.state.serving = serving
    app.state.exit_code = 0
    api_key = config.server.api_key or os.environ.get("ENGINE_API_KEY")
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestGuardMiddleware, max_body_bytes=int(config.server.max_request_body_bytes))
    install_exception_handlers(app)
    for router in (
        health.router,
        models.router,
        completions.router,
        chat.router,
        responses.router,
        pooling.router,
        shadow.router,
        engine_status.router,
    ):
        app.include_router(router)
    if not config.server.disable_console:
        app.include_router(console.router)
    return app


async def _load_engine(app: FastAPI, serving: OpenAIServing) -> None:
    """Load the engine, then watch it: once it is dead for good (no engine core up and none restarting, or the
    DP coordinator gone), `engine serve` ends with exit status 1 and one line saying why."""
    try:
        await asyncio.to_thread(serving.load_engine)
        logger.info(
            "engine ready: serving %r at http://%s:%d/v1",
            serving.model_name,
            serving.config.server.host,
            serving.config.server.port,
        )
    except BaseException as exc:
        serving.load_error = f"{type(exc).__name__}: {exc}"
        if not serving.cancel_start.is_set():
            logger.error("engine failed to start: %s", serving.load_error)
            server = getattr(app.state, "server", None)
            if server is not None:  # `engine serve` exits non-zero instead of answering 503 forever
                app.state.exit_code = 1
                server.should_exit = True
        return
    engine = serving.engine
    assert engine is not None  # loaded
    serving.start_shadow()  # after the primary: the shadow never delays serving
    serving.history.start(engine)  # the live view's samples (GET /v1/engine/status)
    engine.watch()  # its output handler notices cores dying (and restarts them) even while no request runs
    while not serving.cancel_start.is_set():
        if engine.errored:
            logger.error("the engine cannot serve any more: %s: stopping the server", engine.dead_error)
            server = getattr(app.state, "server", None)
            if server is not None:
                app.state.exit_code = 1
                server.should_exit = True
            return
        await asyncio.sleep(0.25)


def serve_on_socket(config: VllmConfig, sock: socket.socket, remote=None) -> int:
    """Run uvicorn on a bound socket until SIGINT / SIGTERM; 1 when the engine could not start."""
    import uvicorn

    app = build_app(config, remote)
    serving: OpenAIServing = app.state.serving
    grace = config.server.shutdown_grace_period

    class EngineServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            serving.begin_drain(max(0.0, grace - 1.0))  # streams end with an error event before the cut
            super().handle_exit(sig, frame)

    # uvicorn's annotation says int; it waits with asyncio, so a fractional grace period works as given
    server = EngineServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace))  # type: ignore[arg-type]
    app.state.server = server
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it caught again once it has shut down: a normal stop
        pass
    return app.state.exit_code  # the failure itself was logged in one line ("engine failed to start: ...")
