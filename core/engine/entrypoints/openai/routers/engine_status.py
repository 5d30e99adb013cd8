"""GET /v1/engine/status: the live view's JSON (the console polls it every second; scripts may too)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends

import engine as engine_pkg
from engine.entrypoints.openai.engine_status import status_body
from engine.entrypoints.openai.serving import OpenAIServing, get_serving

router = APIRouter()


@router.get("/v1/engine/status")
async def engine_status(serving: OpenAIServing = Depends(get_serving)):
    """Requests running and waiting, token rates, KV-cache usage and prefix-cache hit rate, each DP rank's load,
    the steps of the last minutes, speculative decoding's acceptance, the plugins and the product tables."""
    engine = serving.get_engine()
    stats = await asyncio.wait_for(engine.get_stats(), timeout=10)
    if serving.descriptions is None:
        serving.descriptions = await asyncio.wait_for(engine.describe(), timeout=60)
    descriptions = serving.descriptions or []
    return status_body(
        serving.model_name,
        engine_pkg.__version__,
        time.monotonic() - serving.started_at,
        stats,
        serving.history,
        descriptions,
        sorted(serving.adapters.adapters),
        serving.shadow.report() if serving.shadow is not None else None,
    )
