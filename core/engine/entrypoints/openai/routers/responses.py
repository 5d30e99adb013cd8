"""/v1/responses: OpenAI's Responses API over the chat path (template, tools, reasoning parser, structured
outputs), streamed as typed events or answered whole, stored in memory for ``previous_response_id``."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import now
from engine.entrypoints.openai.reasoning import ReasoningSplitter, splits_reasoning
from engine.entrypoints.openai.responses_output import ResponseBuilder, item_id
from engine.entrypoints.openai.responses_protocol import ResponsesRequest, conversation_of, output_messages
from engine.entrypoints.openai.serving import OpenAIServing, get_serving
from engine.entrypoints.openai.tool_calls import ToolCallPlan, ToolFields, select_tool_parser
from engine.errors import InvalidParameterError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

router = APIRouter()

# SamplingParams' field -> the Responses API's name for it, in error messages' ``param``
PARAM_NAMES = {"max_tokens": "max_output_tokens", "structured_outputs": "text.format"}


class ResponseRun:
    """One ``POST /v1/responses``: its conversation, tool plan and sampling settings, and the response object."""

    def __init__(self, body: ResponsesRequest, serving: OpenAIServing, engine, conversation: list[dict[str, Any]]):
        self.body, self.serving, self.engine = body, serving, engine
        self.conversation = conversation
        self.id = item_id("resp")
        self.created_at = now()
        tools = body.chat_tools()
        self.plan = ToolCallPlan(
            ToolFields(tools, body.chat_tool_choice(), body.parallel_tool_calls),
            select_tool_parser(serving.config) if tools else None,
        )
        self.constraint = self.plan.output_constraint(body.constraint(), "text.format or structured_outputs")
        self.reasoning_cls = engine.input_processor.reasoning_parser_cls if splits_reasoning(self.constraint) else None
        self.builder = ResponseBuilder()

    def sampling_params(self, num_prompt_tokens: int) -> SamplingParams:
        body = self.body
        max_tokens = body.max_output_tokens
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                min_p=body.min_p,
                repetition_penalty=body.repetition_penalty,
                seed=body.seed,
                max_tokens=max_tokens
                if max_tokens is not None
                else max(1, self.engine.model_info.max_model_len - num_prompt_tokens),
                structured_outputs=self.constraint,
            )
        except InvalidParameterError as exc:
            raise APIError(str(exc), exc.code, PARAM_NAMES.get(exc.param or "", exc.param)) from None

    # ---- the response object --------------------------------------------------------------------
    def response(self, status: str, output: Optional[RequestOutput] = None, error: Optional[dict] = None) -> dict:
        body = self.body
        tool_choice: Any = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        text_format = (
            body.text.format.model_dump(by_alias=True, exclude_none=True)
            if body.text and body.text.format
            else {"type": "text"}
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.serving.model_name if body.model is None else body.model,
            "output": self.builder.items if output is not None else [],
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": text_format},
            "tool_choice": tool_choice,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": self.usage(output) if output is not None else None,
            "user": body.user,
        }

    def usage(self, output: RequestOutput) -> dict[str, Any]:
        num_input, num_output = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
        reasoning = "".join(item["content"][0]["text"] for item in self.builder.items if item["type"] == "reasoning")
        # the reasoning's token count: its text encoded again (a token may straddle the closing tag)
        num_reasoning = (
            min(num_output, len(self.engine.tokenizer.encode(reasoning, add_special_tokens=False))) if reasoning else 0
        )
        return {
            "input_tokens": num_input,
            "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": num_reasoning},
            "total_tokens": num_input + num_output,
        }

    @staticmethod
    def status_of(finish_reason: Optional[str]) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def finish(self, output: RequestOutput) -> dict:
        """Close the last item; the final response object, stored when ``store`` is set."""
        status = self.status_of(output.outputs[0].finish_reason)
        self.builder.close_item(status)
        response = self.response(status, output)
        if self.body.store and self.serving.responses.max_entries:
            self.serving.responses.put(response, self.conversation + output_messages(response["output"]))
        return response

    # ---- feeding the builder --------------------------------------------------------------------
    def feed_whole(self, text: str) -> None:
        reasoning, answer = ReasoningSplitter(self.reasoning_cls, self.engine.tokenizer).split(text)
        self.builder.reasoning(reasoning or "")
        message, _ = self.plan.message(answer, self.engine.tokenizer)
        self.builder.text(message.get("content") or "")
        for index, call in enumerate(message.get("tool_calls", [])):
            self.builder.call_start(index, call["id"], call["function"]["name"], call["function"]["arguments"])

    async def stream(self, prepared, request_id: str) -> AsyncIterator[str]:
        builder = self.builder
        builder.event("response.created", response=self.response("in_progress"))
        builder.event("response.in_progress", response=self.response("in_progress"))
        for event in builder.take_events():
            yield sse(event)
        splitter = ReasoningSplitter(self.reasoning_cls, self.engine.tokenizer)
        streamer = self.plan.streamer(self.engine.tokenizer)
        final: Optional[RequestOutput] = None
        try:
            async for _, final in self.serving.merged(self.engine, prepared):
                completion = final.outputs[0]
                finished = completion.finish_reason is not None
                previous_answer = splitter.answer
                new_reasoning, new_answer = splitter.stream(completion.text, finished)
                builder.reasoning(new_reasoning)
                if new_answer or finished:
                    delta = streamer.delta(new_answer, previous_answer, splitter.answer, finished)
                    builder.text(delta.get("content") or "")
                    for call in delta.get("tool_calls", []):
                        function = call["function"]
                        if "id" in call:
                            builder.call_start(call["index"], call["id"], function["name"], function["arguments"])
                        else:
                            builder.call_arguments(call["index"], function["arguments"])
                for event in builder.take_events():
                    yield sse(event)
            if final is None:
                raise RuntimeError(f"request {request_id} ended without an output")
            response = self.finish(final)
            for event in builder.take_events():
                yield sse(event)
            # always response.completed (its status says "incomplete" when max_output_tokens cut it), as vLLM: the
            # openai client's stream ends its final response on that event only
            yield sse(builder.event("response.completed", response=response))
        except Exception as exc:
            error = APIError.from_exception(exc, request_id)
            failed = self.response("failed", error={"code": error.err_type, "message": str(error)})
            yield sse(builder.event("response.failed", response=failed))


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, http_request: Request, serving: OpenAIServing = Depends(get_serving)):
    engine = serving.generating_engine()
    lora_request = await serving.lookup_model(engine, body.model)
    conversation: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = serving.responses.get(body.previous_response_id)
        if stored is None:
            raise APIError(
                f"no stored response has the id {body.previous_response_id!r}: it does not exist, was deleted, "
                "expired (server.responses_store_ttl), was made with store=false or by another API server",
                400,
                "previous_response_id",
            )
        conversation = list(stored.conversation)
    conversation += conversation_of(body.input)
    if not conversation:
        raise APIError("input must not be empty", 400, "input")
    run = ResponseRun(body, serving, engine, conversation)
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    prompt_ids = await asyncio.to_thread(
        serving.chat_prompt_ids,
        engine,
        instructions + conversation,
        True,
        None,
        run.plan.template_tools,
        body.template_kwargs(),
    )
    params = run.sampling_params(len(prompt_ids))
    try:
        prepared = await serving.prepare_off_loop(
            engine, [{"prompt_token_ids": prompt_ids}], params, run.id, lora_request, body.priority
        )
    except InvalidParameterError as exc:  # the context-length check names max_tokens: here max_output_tokens
        raise APIError(str(exc), exc.code, PARAM_NAMES.get(exc.param or "", exc.param)) from None
    serving.admit(prepared)  # 503 with Retry-After when the server is at its admission caps
    if body.stream:
        return StreamingResponse(run.stream(prepared, run.id), media_type="text/event-stream")
    output = (await serving.final_outputs(engine, prepared, http_request))[0]
    run.feed_whole(output.outputs[0].text)
    return run.finish(output)


def _stored(serving: OpenAIServing, response_id: str):
    stored = serving.responses.get(response_id)
    if stored is None:
        raise APIError(f"no stored response has the id {response_id!r}", 404, "response_id")
    return stored


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, serving: OpenAIServing = Depends(get_serving)):
    return _stored(serving, response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, serving: OpenAIServing = Depends(get_serving)):
    _stored(serving, response_id)
    serving.responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
