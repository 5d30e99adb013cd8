"""The served model and its tokenizer: /v1/models, /tokenize, /detokenize."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import (
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    now,
)
from engine.entrypoints.openai.serving import OpenAIServing, get_serving

router = APIRouter()


@router.get("/v1/models")
async def models(serving: OpenAIServing = Depends(get_serving)):
    max_model_len = serving.get_engine().model_info.max_model_len
    return {
        "object": "list",
        "data": [
            {
                "id": serving.model_name,
                "object": "model",
                "created": now(),
                "owned_by": "engine",
                "max_model_len": max_model_len,
            },
            *({**entry, "created": now(), "max_model_len": max_model_len} for entry in serving.adapters.models()),
        ],
    }


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(
    body: LoadLoRAAdapterRequest, request: Request, serving: OpenAIServing = Depends(get_serving)
):
    """Serve a PEFT adapter folder under a name (vLLM's endpoint; needs --enable-lora-runtime-updates, and a folder
    inside --lora-dir or --allowed-lora-paths)."""
    engine = serving.get_engine()
    client = request.client.host if request.client else "?"
    await serving.adapters.load(body.lora_name, body.lora_path, engine.input_processor.lora_checker, client)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request, serving: OpenAIServing = Depends(get_serving)
):
    """Stop serving an adapter to new requests (vLLM's endpoint); the requests running with it finish with it."""
    serving.get_engine()
    client = request.client.host if request.client else "?"
    await serving.adapters.unload(body.lora_name, client)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, serving: OpenAIServing = Depends(get_serving)):
    engine = serving.get_engine()
    serving.check_model(body.model)
    if body.messages is not None:
        tokens = await asyncio.to_thread(serving.chat_prompt_ids, engine, body.messages, True, None)
    elif body.prompt is not None:
        tokens = await asyncio.to_thread(
            engine.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
        )
    else:
        raise APIError("give 'prompt' or 'messages'", 400, "prompt")
    return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.model_info.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, serving: OpenAIServing = Depends(get_serving)):
    engine = serving.get_engine()
    serving.check_model(body.model)
    vocab = engine.model_info.vocab_size
    if any(t < 0 or t >= vocab for t in body.tokens):
        raise APIError(f"token ids must lie in [0, {vocab})", 400, "tokens")
    return {"prompt": engine.tokenizer.decode(body.tokens)}
