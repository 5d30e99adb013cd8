"""Service endpoints: /health, /version, /metrics."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

import engine as engine_pkg
from engine.entrypoints.openai.serving import OpenAIServing, get_serving

logger = logging.getLogger("engine.server")
router = APIRouter()


@router.get("/health")
async def health(serving: OpenAIServing = Depends(get_serving)):
    engine = serving.engine
    if engine is None or engine.errored or serving.stopping:
        return Response(status_code=503)
    try:
        await asyncio.wait_for(engine.check_health(), timeout=10)
    except Exception:
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/version")
async def version():
    return {"version": engine_pkg.__version__}


@router.get("/metrics")
async def prometheus_metrics(serving: OpenAIServing = Depends(get_serving)):
    engine = serving.engine
    if engine is not None and not engine.errored:
        try:
            serving.metrics.update_from_stats(await asyncio.wait_for(engine.get_stats(), timeout=10))
        except Exception as exc:  # metrics must answer even if the engine cannot
            logger.warning("could not refresh engine stats: %s: %s", type(exc).__name__, exc)
    return Response(generate_latest(serving.metrics.registry), media_type=CONTENT_TYPE_LATEST)
