"""/v1/completions: one or several prompts (text or token ids), n sequences each, streamed or not."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from engine.beam_search import BeamSearchParams
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import CompletionRequest, now, random_id
from engine.entrypoints.openai.serving import OpenAIServing, get_serving
from engine.entrypoints.openai.streaming import stream_choices, usage
from engine.errors import InvalidParameterError

router = APIRouter()


def completion_prompts(prompt) -> list:
    """OpenAI's prompt forms: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", 400, "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [{"prompt_token_ids": p} for p in prompt]
    raise APIError("prompt must be a string, a list of strings, or token ids", 400, "prompt")


def choice_logprobs(engine, completion, num_top: Optional[int], start: int = 0) -> Optional[dict]:
    """The legacy completions logprobs object for the tokens from ``start`` on."""
    if completion.logprobs is None:
        return None
    entries = completion.logprobs[start:]
    token_ids = completion.token_ids[start:]
    tokens = [engine.decode_token(t) for t in token_ids]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token or "")
    return {
        "tokens": tokens,
        "token_logprobs": [entry[t].logprob for entry, t in zip(entries, token_ids)],
        "top_logprobs": [
            {lp.decoded_token: lp.logprob for lp in sorted(entry.values(), key=lambda x: -x.logprob)[:num_top]}
            for entry in entries
        ],
        "text_offset": offsets,
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http_request: Request, serving: OpenAIServing = Depends(get_serving)):
    engine = serving.generating_engine()
    lora_request = await serving.lookup_model(engine, body.model)
    if body.echo or body.suffix:
        raise APIError("'echo' and 'suffix' are not supported", 400, "echo" if body.echo else "suffix")
    if body.logprobs is not None and body.logprobs > 5:
        raise APIError("logprobs must be at most 5 for completions", 400, "logprobs")
    params = body.sampling_params(body.max_tokens, body.logprobs, 16)
    prompts = await serving.tokenized(engine, completion_prompts(body.prompt))
    request_id = random_id("cmpl")
    if body.use_beam_search:
        return await beam_search_completions(body, http_request, serving, engine, prompts, request_id, lora_request)
    prepared = await serving.prepare_off_loop(engine, prompts, params, request_id, lora_request, body.priority)
    serving.admit(prepared)  # 503 with Retry-After when the server is at its admission caps
    model = lora_request.lora_name if lora_request is not None else serving.model_name
    header = {"id": request_id, "object": "text_completion", "created": now(), "model": model}

    if not body.stream:
        outputs = await serving.final_outputs(engine, prepared, http_request)
        choices = [
            {
                "index": i * params.n + c.index,
                "text": c.text,
                "logprobs": choice_logprobs(engine, c, body.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for i, out in enumerate(outputs)
            for c in out.outputs
        ]
        return {**header, "choices": choices, "usage": usage(outputs)}

    def choice(index: int, completion, text: str, start: int) -> dict:
        return {
            "index": index,
            "text": text,
            "logprobs": choice_logprobs(engine, completion, body.logprobs, start),
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    events = stream_choices(serving.merged(engine, prepared), params.n, header, choice, include_usage, request_id)
    return StreamingResponse(events, media_type="text/event-stream")


async def beam_search_completions(
    body: CompletionRequest, http_request: Request, serving: OpenAIServing, engine, prompts, request_id, lora_request
):
    """``use_beam_search``: the best ``n`` beams of each prompt as its ``n`` choices (vLLM's beam search)."""
    for name, refused in (("stream", body.stream), ("logprobs", body.logprobs is not None)):
        if refused:
            raise APIError(f"{name} is not supported with use_beam_search", 400, name)
    try:
        params = BeamSearchParams(
            body.n, body.max_tokens if body.max_tokens is not None else 16, body.ignore_eos, body.length_penalty
        )
    except InvalidParameterError as exc:  # the beam width is the request's n
        raise APIError(str(exc), 400, "n" if exc.param == "beam_width" else exc.param) from None
    # each prompt checked (and reserved in the admission caps) as the one request it would be without beams
    single = body.sampling_params(params.max_tokens, None, 16).for_child(0)
    prepared = await serving.prepare_off_loop(engine, prompts, single, request_id, lora_request, body.priority)
    serving.admit(prepared)
    try:
        for request in prepared:
            serving.admission.started(request.request_id)
        outputs = await serving.watched(
            [
                engine.beam_search(
                    {"prompt_token_ids": request.requests[0].prompt_token_ids},
                    params,
                    request.request_id,
                    lora_request,
                    body.priority,
                )
                for request in prepared
            ],
            http_request,
        )
    finally:
        for request in prepared:
            serving.admission.release(request.request_id)
    choices = [
        {
            "index": i * params.beam_width + j,
            "text": beam.text,
            "logprobs": None,
            "finish_reason": beam.finish_reason,
            "stop_reason": None,
        }
        for i, output in enumerate(outputs)
        for j, beam in enumerate(output.sequences)
    ]
    num_prompt = sum(request.num_prompt_tokens for request in prepared)
    num_completion = sum(len(beam.output_token_ids) for output in outputs for beam in output.sequences)
    model = lora_request.lora_name if lora_request is not None else serving.model_name
    return {
        "id": request_id,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
        },
    }
