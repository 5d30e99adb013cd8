"""``GET /v1/shadow``: the shadow A/B so far (``engine serve --shadow KEY=VALUE,...``)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.serving import OpenAIServing, get_serving

router = APIRouter()


@router.get("/v1/shadow")
async def shadow_report(serving: OpenAIServing = Depends(get_serving)):
    """The overrides, the counts (seen, mirrored, dropped, completed) and the verdicts: ``verdict`` (equivalent,
    diverges, fails, no data) with the first divergence, ``speed_verdict`` (faster, slower, same speed), each with
    its 95% interval and the number of tokens or requests behind it."""
    if serving.shadow is None:
        if serving.config.shadow.enabled:
            raise APIError("the shadow starts once the model has loaded", 503)
        raise APIError("no shadow is configured: start engine serve with --shadow KEY=VALUE[,...]", 404)
    engine = serving.engine
    return serving.shadow.report(engine.decode_token if engine is not None else None)
