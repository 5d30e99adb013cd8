"""Service endpoints: /health, /version, /metrics."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST

import engine as engine_pkg
from engine.entrypoints.openai.serving import OpenAIServing, get_serving

logger = logging.getLogger("engine.server")
router = APIRouter()


@router.get("/health")
async def health(verbose: bool = False, serving: OpenAIServing = Depends(get_serving)):
    """200 while at least one engine core serves (with data parallelism, a dead rank only makes it degraded);
    503 while loading, restarting, stopping or dead. ``?verbose=1``: the same status with a JSON body."""
    engine = serving.engine
    healthy = engine is not None and not engine.errored and not serving.stopping
    if engine is not None and healthy:
        try:
            await asyncio.wait_for(engine.check_health(), timeout=10)
        except Exception as exc:
            healthy = False
            logger.warning("health check failed: %s: %s", type(exc).__name__, exc)
    status = 200 if healthy else 503
    if not verbose:
        return Response(status_code=status)
    if engine is None:
        report = {"status": "loading" if serving.load_error is None else "failed", "reason": serving.load_error}
    else:
        report = engine.health()
    if serving.stopping:
        report["status"] = "stopping"
    return JSONResponse(report, status_code=status)


@router.get("/version")
async def version():
    return {"version": engine_pkg.__version__}


@router.get("/metrics")
async def prometheus_metrics(serving: OpenAIServing = Depends(get_serving)):
    engine = serving.engine
    if engine is not None:
        serving.metrics.update_from_health(engine.health())
    if engine is not None and not engine.errored:
        try:
            serving.metrics.update_from_stats(await asyncio.wait_for(engine.get_stats(), timeout=10))
        except Exception as exc:  # metrics must answer even if the engine cannot
            logger.warning("could not refresh engine stats: %s: %s", type(exc).__name__, exc)
    if serving.shadow is not None:
        serving.metrics.update_from_shadow(serving.shadow.report())
    return Response(serving.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
