"""The pooling endpoints: /v1/embeddings, /pooling, /classify, /v1/score and /rerank (vLLM's), each answering 400
on a generative model (as the generation endpoints do on a pooling model)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Optional, Union

import numpy as np
from fastapi import APIRouter, Depends, Request

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingInput,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from engine.entrypoints.openai.protocol import now, random_id
from engine.entrypoints.openai.routers.completions import completion_prompts
from engine.entrypoints.openai.serving import OpenAIServing, get_serving
from engine.outputs import RequestOutput
from engine.pooling.scoring import cosine_similarity, score_pairs, scores_jointly
from engine.pooling_params import PoolingParams

router = APIRouter()


def pooling_model(engine, task: str):
    """The served model's pooling facts, or a 400 naming what it is."""
    pooling = engine.model_info.pooling
    if pooling is None:
        raise APIError(
            f"{engine.model_info.architecture} is a generative model: it serves /v1/completions and "
            f"/v1/chat/completions, not {task} (serve a pooling model, or set model.runner=pooling)",
            400,
            "model",
        )
    return pooling


def encoded(vector: list[float], encoding_format: str) -> Union[list[float], str]:
    """OpenAI's encodings: the floats, or base64 of their float32 little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


async def run_pooling(
    serving: OpenAIServing,
    engine,
    prompts: list[Any],
    params: PoolingParams,
    base_id: str,
    http_request: Request,
    truncate_prompt_tokens: Optional[int] = None,
) -> list[RequestOutput]:
    """Every prompt validated and tokenized before any starts (a bad one: 400 for the call), admitted, run."""
    prompts = await serving.tokenized(engine, prompts)
    prepared = [
        engine.prepare_pooling(prompt, params, f"{base_id}-{index}", truncate_prompt_tokens)
        for index, prompt in enumerate(prompts)
    ]
    serving.admit(prepared)
    return await serving.final_outputs(engine, prepared, http_request)


async def scores(
    serving: OpenAIServing, engine, pairs: list[tuple[str, str]], base_id: str, http_request: Request, truncate
) -> tuple[list[float], dict[str, int]]:
    """Each pair's relevance: a cross-encoder's score of the pair read jointly, or the cosine similarity of an
    embedding model's two embeddings."""
    pooling_model(engine, "scores")
    if scores_jointly(engine.model_info):
        processor = engine.input_processor
        prompts = await asyncio.to_thread(
            lambda: [{"prompt_token_ids": processor.pair_token_ids(q, d)} for q, d in pairs]
        )
        outputs = await run_pooling(
            serving, engine, prompts, PoolingParams(task="score"), base_id, http_request, truncate
        )
        return [o.pooling_output[0] for o in outputs if o.pooling_output], usage(outputs)
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    outputs = await run_pooling(serving, engine, texts, PoolingParams(task="embed"), base_id, http_request, truncate)
    vectors = {text: o.pooling_output or [] for text, o in zip(texts, outputs)}
    return [cosine_similarity(vectors[q], vectors[d]) for q, d in pairs], usage(outputs)


def _inputs(value: PoolingInput) -> list:
    """OpenAI's input forms as prompts; an empty string is refused, as OpenAI does."""
    if value == "" or (isinstance(value, list) and any(item == "" for item in value)):
        raise APIError("input must not contain empty strings", 400, "input")
    try:
        return completion_prompts(value)
    except APIError as exc:
        raise APIError(str(exc).replace("prompt", "input"), 400, "input") from None


def listing(request_id: str, serving: OpenAIServing, data: list[dict], counts: dict[str, int]) -> dict:
    """The answer of every pooling endpoint but rerank: a list of results with the usage."""
    return {
        "id": request_id,
        "object": "list",
        "created": now(),
        "model": serving.model_name,
        "data": data,
        "usage": counts,
    }


async def vectors(
    serving: OpenAIServing,
    body,
    params: PoolingParams,
    prefix: str,
    object_name: str,
    field: str,
    http_request: Request,
) -> dict:
    """/v1/embeddings and /pooling: one vector per input, as floats or base64."""
    engine = serving.get_engine()
    serving.check_model(body.model)
    pooling_model(engine, "embeddings" if params.task == "embed" else "pooling")
    request_id = random_id(prefix)
    outputs = await run_pooling(
        serving, engine, _inputs(body.input), params, request_id, http_request, body.truncate_prompt_tokens
    )
    data = [
        {"object": object_name, "index": i, field: encoded(o.pooling_output or [], body.encoding_format)}
        for i, o in enumerate(outputs)
    ]
    return listing(request_id, serving, data, usage(outputs))


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, http_request: Request, serving: OpenAIServing = Depends(get_serving)):
    params = PoolingParams(task="embed", dimensions=body.dimensions, normalize=body.normalize)
    return await vectors(serving, body, params, "embd", "embedding", "embedding", http_request)


@router.post("/pooling")
async def pooling(body: PoolingRequest, http_request: Request, serving: OpenAIServing = Depends(get_serving)):
    params = PoolingParams(task=body.task, dimensions=body.dimensions, normalize=body.normalize)
    return await vectors(serving, body, params, "pool", "pooling", "data", http_request)


@router.post("/classify")
async def classify(body: ClassificationRequest, http_request: Request, serving: OpenAIServing = Depends(get_serving)):
    engine = serving.get_engine()
    serving.check_model(body.model)
    pooling_model(engine, "classification")
    request_id = random_id("classify")
    params = PoolingParams(task="classify", activation=body.activation)
    outputs = await run_pooling(
        serving, engine, _inputs(body.input), params, request_id, http_request, body.truncate_prompt_tokens
    )
    labels = getattr(engine.model_info.hf_config, "id2label", None) or {}
    data = []
    for i, o in enumerate(outputs):
        probs = o.pooling_output or []
        best = int(np.argmax(probs)) if probs else 0
        label = labels.get(best, labels.get(str(best), f"LABEL_{best}"))
        data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
    return listing(request_id, serving, data, usage(outputs))


@router.post("/v1/score")
@router.post("/score")
async def score(body: ScoreRequest, http_request: Request, serving: OpenAIServing = Depends(get_serving)):
    engine = serving.get_engine()
    serving.check_model(body.model)
    pairs = score_pairs(body.text_1, body.text_2)
    request_id = random_id("score")
    values, counts = await scores(serving, engine, pairs, request_id, http_request, body.truncate_prompt_tokens)
    return listing(
        request_id, serving, [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)], counts
    )


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, http_request: Request, serving: OpenAIServing = Depends(get_serving)):
    engine = serving.get_engine()
    serving.check_model(body.model)
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    request_id = random_id("rerank")
    values, counts = await scores(
        serving, engine, [(body.query, d) for d in documents], request_id, http_request, body.truncate_prompt_tokens
    )
    order = sorted(range(len(values)), key=lambda i: -values[i])
    if body.top_n is not None:
        order = order[: body.top_n]
    results = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": values[index]}
        if body.return_documents:
            result["document"] = {"text": documents[index]}
        results.append(result)
    return {
        "id": request_id,
        "model": serving.model_name,
        "usage": {"total_tokens": counts["total_tokens"]},
        "results": results,
    }
