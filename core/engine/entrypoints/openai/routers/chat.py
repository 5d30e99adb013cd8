"""/v1/chat/completions: a conversation through the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import ChatCompletionRequest, now, random_id
from engine.entrypoints.openai.reasoning import ReasoningSplitter, splits_reasoning
from engine.entrypoints.openai.serving import OpenAIServing, get_serving
from engine.entrypoints.openai.streaming import stream_choices, usage
from engine.entrypoints.openai.tool_calls import ToolCallPlan, ToolCallStreamer, select_tool_parser

router = APIRouter()


def chat_logprobs(completion, num_top: int, start: int = 0) -> Optional[dict]:
    """The chat logprobs object (``content``: one entry per token) for the tokens from ``start`` on."""
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
        chosen = entry[token_id]
        token = chosen.decoded_token or ""
        content.append(
            {
                "token": token,
                "logprob": chosen.logprob,
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token or "",
                        "logprob": lp.logprob,
                        "bytes": list((lp.decoded_token or "").encode()),
                    }
                    for lp in sorted(entry.values(), key=lambda x: -x.logprob)
                ][:num_top],
            }
        )
    return {"content": content}


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, http_request: Request, serving: OpenAIServing = Depends(get_serving)
):
    engine = serving.generating_engine()
    lora_request = await serving.lookup_model(engine, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise APIError("top_logprobs must be in [0, 20]", 400, "top_logprobs")
    plan = ToolCallPlan(body, select_tool_parser(serving.config) if body.tools else None)
    constraint = plan.output_constraint(body.constraint(), "response_format or structured_outputs")
    prompt_ids = await asyncio.to_thread(
        serving.chat_prompt_ids,
        engine,
        body.messages,
        body.add_generation_prompt,
        body.chat_template,
        plan.template_tools,
        body.chat_template_kwargs,
    )
    reasoning_cls = engine.input_processor.reasoning_parser_cls if splits_reasoning(constraint) else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    default_max = max(1, engine.model_info.max_model_len - len(prompt_ids))
    params = body.sampling_params(
        max_tokens, (body.top_logprobs or 0) if body.logprobs else None, default_max, constraint
    )
    prompt = {"prompt_token_ids": prompt_ids, **({"cache_salt": body.cache_salt} if body.cache_salt else {})}
    request_id = random_id("chatcmpl")
    prepared = await serving.prepare_off_loop(engine, [prompt], params, request_id, lora_request, body.priority)
    serving.admit(prepared)  # 503 with Retry-After when the server is at its admission caps
    model = lora_request.lora_name if lora_request is not None else serving.model_name
    header = {"id": request_id, "object": "chat.completion", "created": now(), "model": model}
    num_top = body.top_logprobs or 0

    if not body.stream:
        output = (await serving.final_outputs(engine, prepared, http_request))[0]
        choices = []
        for c in output.outputs:
            reasoning, answer = ReasoningSplitter(reasoning_cls, engine.tokenizer).split(c.text)
            message, called = plan.message(answer, engine.tokenizer)
            if reasoning_cls is not None:
                if not message.get("content"):
                    message["content"] = None
                if body.include_reasoning:
                    message["reasoning_content"] = reasoning
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(c, num_top),
                    "finish_reason": plan.finish_reason(c.finish_reason, called),
                    "stop_reason": c.stop_reason,
                }
            )
        return {**header, "choices": choices, "usage": usage([output])}

    streamers: dict[int, ToolCallStreamer] = {}  # choice index -> its ToolCallStreamer
    splitters: dict[int, ReasoningSplitter] = {}  # choice index -> its reasoning / answer split

    def choice(index: int, completion, text: str, start: int) -> dict:
        streamer = streamers.setdefault(index, plan.streamer(engine.tokenizer))
        splitter = splitters.setdefault(index, ReasoningSplitter(reasoning_cls, engine.tokenizer))
        finished = completion.finish_reason is not None
        previous_answer = splitter.answer
        new_reasoning, new_answer = splitter.stream(completion.text, finished)
        delta = streamer.delta(new_answer, previous_answer, splitter.answer, finished) if new_answer or finished else {}
        if new_reasoning and body.include_reasoning:
            delta = {"reasoning_content": new_reasoning, **delta}
        return {
            "index": index,
            "delta": delta,
            "logprobs": chat_logprobs(completion, num_top, start),
            "finish_reason": plan.finish_reason(completion.finish_reason, streamer.called),
        }

    roles = [
        {
            "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ]
        }
        for i in range(params.n)
    ]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    events = stream_choices(
        serving.merged(engine, prepared),
        params.n,
        {**header, "object": "chat.completion.chunk"},
        choice,
        include_usage,
        request_id,
        roles,
    )
    return StreamingResponse(events, media_type="text/event-stream")
