"""`engine serve`: bind the port, then serve in this process or launch several API-server processes on it."""

from __future__ import annotations

import logging
import socket
import sys

from engine.config import VllmConfig
from engine.entrypoints.openai.api_server import serve_on_socket
from engine.entrypoints.openai.launcher import run_api_servers

logger = logging.getLogger("engine.server")


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything else starts (OSError when the address is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_server(config: VllmConfig) -> int:
    """Serve until SIGINT / SIGTERM (uvicorn); the exit status: 0, or 1 when the server could not start.

    With ``server.api_server_count`` > 1 this process only launches: the engine cores, the DP coordinator and
    that many API-server processes sharing the listening socket (``entrypoints.openai.launcher``)."""
    host, port = config.server.host, config.server.port
    try:
        sock = bind_socket(host, port)
    except OSError as exc:
        print(f"engine serve: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        if config.server.api_server_count > 1:
            return run_api_servers(config, sock)
        logger.info("starting the API server on http://%s:%d (engine loading)", host, port)
        return serve_on_socket(config, sock)
    finally:
        sock.close()
