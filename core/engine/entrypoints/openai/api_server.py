"""FastAPI app over AsyncLLM: OpenAI completions and chat completions (with SSE streaming), models,
health, metrics, tokenize / detokenize, version."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import engine as engine_pkg
from engine.config import VllmConfig
from engine.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from engine.entrypoints.openai.middleware import ApiKeyMiddleware, RequestGuardMiddleware
from engine.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                TokenizeRequest, error_body, now, random_id)
from engine.errors import EngineDeadError, EngineGenerateError
from engine.outputs import RequestOutput

logger = logging.getLogger("engine.server")


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: Optional[str] = None, err_type: Optional[str] = None):
        super().__init__(message)
        self.status, self.param = status, param
        self.err_type = err_type or ERROR_TYPES.get(status, "InternalServerError")


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
               499: "ClientClosedRequest", 503: "ServiceUnavailableError"}


def _error(message: str, status: int, param: Optional[str] = None, err_type: Optional[str] = None) -> JSONResponse:
    error = APIError(message, status, param, err_type)
    return JSONResponse(error_body(message, error.err_type, param, status), status_code=status)


def served_model_name(config: VllmConfig, model_path: str) -> str:
    if config.model.served_model_name:
        return config.model.served_model_name
    return os.path.basename(model_path.rstrip("/")).removesuffix(".gguf")


def build_app(config: VllmConfig) -> FastAPI:
    """The app; the engine loads in the background so /health can answer 503 meanwhile."""
    from engine.model.model_info import default_model_path

    model_name = served_model_name(config, config.model.model or default_model_path())
    api_key = config.server.api_key or os.environ.get("ENGINE_API_KEY")
    metrics = ServerMetrics(model_name)

    cancel_start = threading.Event()  # set on shutdown: a start-up in progress stops its engine core

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = asyncio.get_running_loop()
        app.state.loader = asyncio.create_task(_load_engine(app))
        yield
        cancel_start.set()
        await asyncio.shield(app.state.loader)  # the start-up thread stops its core before it returns
        if app.state.engine is not None:
            app.state.engine.shutdown()

    async def _load_engine(app: FastAPI) -> None:
        from engine.runtime.async_llm import AsyncLLM

        try:
            app.state.engine = await asyncio.to_thread(AsyncLLM, config, cancel_start)
            logger.info("engine ready: serving %r at http://%s:%d/v1", model_name, config.server.host,
                        config.server.port)
        except BaseException as exc:
            app.state.load_error = f"{type(exc).__name__}: {exc}"
            if not cancel_start.is_set():
                logger.error("engine failed to start: %s", app.state.load_error)
                server = getattr(app.state, "server", None)
                if server is not None:  # `engine serve` exits non-zero instead of answering 503 forever
                    app.state.exit_code = 1
                    server.should_exit = True

    app = FastAPI(title="engine", version=engine_pkg.__version__, lifespan=lifespan)
    app.state.engine = None
    app.state.load_error = None
    app.state.exit_code = 0
    app.state.stopping = False  # SIGTERM came: /health and new requests answer 503
    app.state.draining = asyncio.Event()  # set when requests in flight must end: the server is going down

    def get_engine():
        engine = app.state.engine
        if app.state.stopping:
            raise APIError("the server is shutting down", 503)
        if engine is None:
            raise APIError(app.state.load_error or "the model is still loading", 503)
        if engine.errored:
            raise APIError(f"the engine is dead: {engine.dead_error}", 503, err_type="EngineDeadError")
        return engine

    def check_model(name: Optional[str]) -> None:
        if name is not None and name != model_name:
            raise APIError(f"The model `{name}` does not exist. Served: `{model_name}`", 404, "model",
                           "NotFoundError")

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestGuardMiddleware, max_body_bytes=config.server.max_request_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return JSONResponse(error_body(str(exc), exc.err_type, exc.param, exc.status), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return _error(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", 400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return _error(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(ValueError)
    async def value_error(_, exc: ValueError):
        message = str(exc)
        param = message.split("SamplingParams.", 1)[1].split(" ", 1)[0] if "SamplingParams." in message else None
        return _error(message, 400, param)

    @app.exception_handler(EngineDeadError)
    async def dead_error(_, exc: EngineDeadError):
        return _error(f"the engine is dead: {exc}", 503, err_type="EngineDeadError")

    @app.exception_handler(EngineGenerateError)
    async def generate_error(request: Request, exc: EngineGenerateError):
        logger.error("request %s failed: %s", getattr(request.state, "request_id", "?"), exc)
        return _error(str(exc), 500, err_type="EngineGenerateError")

    # ---- service endpoints -------------------------------------------------------------------
    @app.get("/health")
    async def health():
        engine = app.state.engine
        if engine is None or engine.errored or app.state.stopping:
            return Response(status_code=503)
        try:
            await asyncio.wait_for(engine.check_health(), timeout=10)
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": engine_pkg.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        engine = app.state.engine
        if engine is not None and not engine.errored:
            try:
                metrics.update_from_stats(await asyncio.wait_for(engine.get_stats(), timeout=10))
            except Exception as exc:  # metrics must answer even if the engine cannot
                logger.warning("could not refresh engine stats: %s: %s", type(exc).__name__, exc)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "engine", "max_model_len": get_engine().model_info.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        engine = get_engine()
        check_model(body.model)
        if body.messages is not None:
            tokens = await asyncio.to_thread(_chat_prompt_ids, engine, body.messages, True, None)
        elif body.prompt is not None:
            tokens = await asyncio.to_thread(engine.tokenizer.encode, body.prompt,
                                             add_special_tokens=body.add_special_tokens)
        else:
            raise APIError("give 'prompt' or 'messages'", 400, "prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.model_info.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        engine = get_engine()
        check_model(body.model)
        vocab = engine.model_info.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(f"token ids must lie in [0, {vocab})", 400, "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    # ---- generation --------------------------------------------------------------------------
    async def tokenized(engine, prompts: list) -> list[dict]:
        """Every prompt as token ids; text is tokenized off the event loop (a long prompt must not stall
        the other clients, /health included)."""
        def encode_all() -> list[dict]:
            return [{"prompt_token_ids": engine.tokenizer.encode(p)} if isinstance(p, str) else p for p in prompts]

        if not any(isinstance(p, str) for p in prompts):
            return prompts
        return await asyncio.to_thread(encode_all)

    async def generate(engine, prompt: Any, params, request_id: str, http_request: Request) -> AsyncIterator[RequestOutput]:
        """Outputs of one prompt, measured for the metrics."""
        timer = RequestTimer(metrics, time.monotonic)
        if config.server.log_requests:
            logger.info("request %s: prompt %s, params %s", request_id,
                        prompt if isinstance(prompt, str) else f"{len(prompt['prompt_token_ids'])} tokens", params)
        output = None
        async for output in engine.generate(prompt, params, request_id):
            timer.on_output(sum(len(c.token_ids) for c in output.outputs))
            yield output
        if output is not None:
            timer.on_finish(len(output.prompt_token_ids))

    streams: set[asyncio.Queue] = set()  # the queues of the streams in flight, told when the server drains

    def drain() -> None:
        """End every request in flight with an error: the server is going down."""
        app.state.draining.set()
        for queue in list(streams):
            queue.put_nowait((None, APIError("the server is shutting down", 503)))

    def begin_drain(delay: float) -> None:
        """From the SIGTERM handler: new requests get 503 at once, those in flight ``delay`` seconds more."""
        loop = getattr(app.state, "loop", None)
        if loop is not None and not app.state.stopping:
            app.state.stopping = True
            loop.call_soon_threadsafe(loop.call_later, delay, drain)

    app.state.begin_drain = begin_drain

    async def final_outputs(engine, prompts: list, params, base_id: str, http_request: Request) -> list[RequestOutput]:
        """Non-streaming: run every prompt; a client that goes away, a failed prompt or a shutdown aborts them all."""
        async def last(index: int, prompt) -> RequestOutput:
            final = None
            async for final in generate(engine, prompt, params, f"{base_id}-{index}", http_request):
                pass
            return final

        tasks = [asyncio.create_task(last(i, p)) for i, p in enumerate(prompts)]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
                if not pending or any(t.exception() is not None for t in done):
                    return [t.result() for t in tasks]  # raises the first failure
                if app.state.draining.is_set():
                    raise APIError("the server is shutting down", 503)
                if await http_request.is_disconnected():
                    raise APIError("client disconnected", 499)
        finally:
            for task in tasks:
                task.cancel()  # cancelling a prompt's generator aborts its request in the engine
            await asyncio.gather(*tasks, return_exceptions=True)

    async def merged(engine, prompts: list, params, base_id: str, http_request: Request):
        """Streaming: (prompt index, output) as they come, from every prompt's generator."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, prompt) -> None:
            try:
                async for output in generate(engine, prompt, params, f"{base_id}-{index}", http_request):
                    await queue.put((index, output))
            except BaseException as exc:
                await queue.put((index, exc))
                raise
            finally:
                await queue.put((index, None))

        if app.state.draining.is_set():
            raise APIError("the server is shutting down", 503)
        streams.add(queue)
        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            streams.discard(queue)
            for task in tasks:
                task.cancel()  # a disconnected client: every prompt's request is aborted
            await asyncio.gather(*tasks, return_exceptions=True)

    def usage(outputs: list[RequestOutput]) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def sse_error(exc: Exception, request_id: str) -> str:
        """A stream that fails after its 200 header ends with an OpenAI error event (then ``[DONE]``)."""
        if isinstance(exc, APIError):
            return sse(error_body(str(exc), exc.err_type, exc.param, exc.status))
        if isinstance(exc, EngineDeadError):
            return sse(error_body(f"the engine is dead: {exc}", "EngineDeadError", None, 503))
        if isinstance(exc, EngineGenerateError):
            logger.error("stream %s failed: %s", request_id, exc)
            return sse(error_body(str(exc), "EngineGenerateError", None, 500))
        logger.error("stream %s failed", request_id, exc_info=exc)
        return sse(error_body(f"internal error ({type(exc).__name__}); request id {request_id}",
                              "InternalServerError", None, 500))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http_request: Request):
        engine = get_engine()
        check_model(body.model)
        if body.echo or body.suffix:
            raise APIError("'echo' and 'suffix' are not supported", 400, "echo" if body.echo else "suffix")
        if body.logprobs is not None and body.logprobs > 5:
            raise APIError("logprobs must be at most 5 for completions", 400, "logprobs")
        params = body.sampling_params(body.max_tokens, body.logprobs, 16)
        prompts = await tokenized(engine, _completion_prompts(body.prompt))
        for prompt in prompts:  # validate every prompt before any is started
            engine.input_processor.process("validate", prompt, params)
            engine.input_processor.check_context_length(len(prompt["prompt_token_ids"]), params)
        request_id, created = random_id("cmpl"), now()
        header = {"id": request_id, "object": "text_completion", "created": created, "model": model_name}
        n = params.n

        def choice_logprobs(completion, start: int = 0) -> Optional[dict]:
            if completion.logprobs is None:
                return None
            entries = completion.logprobs[start:]
            tokens = [engine.output_processor.decode_token(t) for t in completion.token_ids[start:]]
            offsets, offset = [], 0
            for token in tokens:
                offsets.append(offset)
                offset += len(token or "")
            return {"tokens": tokens,
                    "token_logprobs": [entry[t].logprob for entry, t in zip(entries, completion.token_ids[start:])],
                    "top_logprobs": [{lp.decoded_token: lp.logprob
                                      for lp in sorted(entry.values(), key=lambda x: -x.logprob)[:body.logprobs]}
                                     for entry in entries],
                    "text_offset": offsets}

        if not body.stream:
            outputs = await final_outputs(engine, prompts, params, request_id, http_request)
            choices = [{"index": i * n + c.index, "text": c.text, "logprobs": choice_logprobs(c),
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                       for i, out in enumerate(outputs) for c in out.outputs]
            return {**header, "choices": choices, "usage": usage(outputs)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def stream():
            sent_text: dict[int, int] = {}
            sent_tokens: dict[int, int] = {}
            finals: dict[int, RequestOutput] = {}
            try:
                async for prompt_index, output in merged(engine, prompts, params, request_id, http_request):
                    finals[prompt_index] = output
                    for c in output.outputs:
                        key = prompt_index * n + c.index
                        text = c.text[sent_text.get(key, 0):]
                        start = sent_tokens.get(key, 0)
                        if not text and c.finish_reason is None and len(c.token_ids) == start:
                            continue
                        sent_text[key], sent_tokens[key] = len(c.text), len(c.token_ids)
                        yield sse({**header, "choices": [{"index": key, "text": text,
                                                          "logprobs": choice_logprobs(c, start),
                                                          "finish_reason": c.finish_reason,
                                                          "stop_reason": c.stop_reason}], "usage": None})
                if include_usage:
                    yield sse({**header, "choices": [], "usage": usage(list(finals.values()))})
            except Exception as exc:  # every failure after the 200 header ends the stream with an error event
                yield sse_error(exc, request_id)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http_request: Request):
        engine = get_engine()
        check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError("top_logprobs must be in [0, 20]", 400, "top_logprobs")
        prompt_ids = await asyncio.to_thread(_chat_prompt_ids, engine, body.messages, body.add_generation_prompt,
                                             body.chat_template)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        default_max = max(1, engine.model_info.max_model_len - len(prompt_ids))
        params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None, default_max)
        prompt = {"prompt_token_ids": prompt_ids, **({"cache_salt": body.cache_salt} if body.cache_salt else {})}
        engine.input_processor.process("validate", prompt, params)
        engine.input_processor.check_context_length(len(prompt_ids), params)
        request_id, created = random_id("chatcmpl"), now()
        header = {"id": request_id, "object": "chat.completion", "created": created, "model": model_name}

        def chat_logprobs(completion, start: int = 0) -> Optional[dict]:
            if completion.logprobs is None:
                return None
            content = []
            for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
                chosen = entry[token_id]
                token = chosen.decoded_token or ""
                content.append({"token": token, "logprob": chosen.logprob, "bytes": list(token.encode()),
                                "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                                                  "bytes": list((lp.decoded_token or "").encode())}
                                                 for lp in sorted(entry.values(), key=lambda x: -x.logprob)
                                                 ][:body.top_logprobs or 0]})
            return {"content": content}

        if not body.stream:
            output = (await final_outputs(engine, [prompt], params, request_id, http_request))[0]
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": chat_logprobs(c), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                       for c in output.outputs]
            return {**header, "choices": choices, "usage": usage([output])}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_header = {**header, "object": "chat.completion.chunk"}

        async def stream():
            sent_text: dict[int, int] = {}
            sent_tokens: dict[int, int] = {}
            final = None
            try:
                for index in range(params.n):
                    yield sse({**chunk_header, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                            "logprobs": None, "finish_reason": None}]})
                async for _, final in merged(engine, [prompt], params, request_id, http_request):
                    for c in final.outputs:
                        text = c.text[sent_text.get(c.index, 0):]
                        start = sent_tokens.get(c.index, 0)
                        if not text and c.finish_reason is None and len(c.token_ids) == start:
                            continue
                        sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                        yield sse({**chunk_header, "choices": [{
                            "index": c.index, "delta": {"content": text} if text else {},
                            "logprobs": chat_logprobs(c, start), "finish_reason": c.finish_reason}], "usage": None})
                if include_usage and final is not None:
                    yield sse({**chunk_header, "choices": [], "usage": usage([final])})
            except Exception as exc:  # every failure after the 200 header ends the stream with an error event
                yield sse_error(exc, request_id)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    app.state.model_name = model_name
    app.state.metrics = metrics
    return app


def _completion_prompts(prompt) -> list:
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


def _chat_prompt_ids(engine, messages, add_generation_prompt: bool, chat_template: Optional[str]) -> list[int]:
    tokenizer = engine.tokenizer
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template)
    except Exception as exc:
        raise APIError(f"cannot apply the chat template: {exc}", 400, "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


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
    """Serve until SIGINT / SIGTERM (uvicorn); the exit status: 0, or 1 when the server could not start."""
    import uvicorn

    host, port = config.server.host, config.server.port
    try:
        sock = bind_socket(host, port)
    except OSError as exc:
        print(f"engine serve: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    app = build_app(config)
    grace = config.server.shutdown_grace_period

    class EngineServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.begin_drain(max(0.0, grace - 1.0))  # streams end with an error event before the cut
            super().handle_exit(sig, frame)

    server = EngineServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace))
    app.state.server = server
    logger.info("starting the API server on http://%s:%d (engine loading)", host, port)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return app.state.exit_code  # the failure itself was logged in one line ("engine failed to start: ...")
