"""OpenAIServing: what every endpoint shares — the engine (loaded in the background), the served model's
name, metrics, prompt preparation, running prompts to completion or as a stream, and draining on shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import AsyncIterator, Optional

from fastapi import Request

from engine.config import VllmConfig
from engine.entrypoints.openai.admission import AdmissionControl
from engine.entrypoints.openai.engine_status import StatusHistory
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.lora_adapters import ServedAdapters
from engine.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from engine.entrypoints.openai.responses_store import ResponseStore
from engine.frontend.input_processor import PreparedRequest
from engine.lora_request import LoRARequest
from engine.outputs import RequestOutput

logger = logging.getLogger("engine.server")


def served_model_name(config: VllmConfig, model_path: str) -> str:
    if config.model.served_model_name:
        return config.model.served_model_name
    return os.path.basename(model_path.rstrip("/")).removesuffix(".gguf")


class OpenAIServing:
    """The server's state, handed to every router through ``get_serving``."""

    def __init__(self, config: VllmConfig, remote=None):
        from engine.model.model_info import default_model_path

        self.config = config
        self.remote = remote  # RemoteEngines: join the engine cores another process started
        self.model_name = served_model_name(config, config.model.model or default_model_path())
        self.adapters = ServedAdapters(config, self.model_name)
        self.metrics = ServerMetrics(self.model_name, remote.client_index if remote is not None else 0)
        servers = config.server.api_server_count  # each API server holds its share of the admission caps
        self.admission = AdmissionControl(
            None if config.server.max_waiting_requests is None else -(-config.server.max_waiting_requests // servers),
            None if config.server.max_waiting_tokens is None else -(-config.server.max_waiting_tokens // servers),
            on_refused=lambda reason: self.metrics.requests_refused.labels(self.model_name, reason).inc(),
        )
        self.responses = ResponseStore(config.server.responses_store_max_entries, config.server.responses_store_ttl)
        self.history = StatusHistory()  # the live view's samples, taken once the engine is up
        self.descriptions: Optional[list[dict]] = None  # the engine cores' plugins and product tables, once asked
        self.started_at = time.monotonic()
        self.engine = None  # AsyncLLM, once loaded
        self.shadow = None  # ShadowMirror, when shadow.overrides are set (started once the engine is up)
        self.load_error: Optional[str] = None
        self.cancel_start = threading.Event()  # set on shutdown: a start-up in progress stops its engine core
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.stopping = False  # SIGTERM came: /health and new requests answer 503
        self.draining = asyncio.Event()  # set when requests in flight must end: the server is going down
        self.streams: set[asyncio.Queue] = set()  # queues of the streams in flight, told when the server drains

    # ---- engine ---------------------------------------------------------------------------------
    def load_engine(self):
        from engine.frontend.async_llm import AsyncLLM

        self.engine = AsyncLLM(self.config, self.cancel_start, self.remote)
        return self.engine

    def start_shadow(self) -> None:
        """Start the shadow (``shadow.overrides``) once the engine is up; in the event loop."""
        if self.config.shadow.enabled and self.engine is not None:
            from engine.shadow.mirror import ShadowMirror

            self.shadow = ShadowMirror(self.config, self.engine.model_info)
            self.shadow.start()

    def get_engine(self):
        """The engine, or a 503 saying why there is none to use."""
        engine = self.engine
        if self.stopping:
            raise APIError("the server is shutting down", 503)
        if engine is None:
            raise APIError(self.load_error or "the model is still loading", 503)
        if engine.errored:
            raise APIError(f"the engine is dead: {engine.dead_error}", 503, err_type="EngineDeadError")
        return engine

    def generating_engine(self):
        """The engine of a generation endpoint: a 400 when the served model is a pooling model."""
        engine = self.get_engine()
        engine.input_processor.check_generates()  # before a chat template, which an encoder may lack
        return engine

    def check_model(self, name: Optional[str]) -> None:
        """404 unless ``name`` is the served model or one of its loaded LoRA adapters (or None)."""
        if not self.adapters.known(name):
            served = [self.model_name, *self.adapters.adapters]
            raise APIError(f"The model `{name}` does not exist. Served: {served}", 404, "model", "NotFoundError")

    async def lookup_model(self, engine, name: Optional[str]) -> Optional[LoRARequest]:
        """The LoRA adapter a request's ``model`` names (None: the base model); an adapter not loaded is asked of
        the resolver plugins; 404 when nothing serves the name."""
        return await self.adapters.lookup(name, getattr(engine.input_processor, "lora_checker", None))

    # ---- prompts --------------------------------------------------------------------------------
    async def tokenized(self, engine, prompts: list) -> list[dict]:
        """Every prompt as token ids; text is tokenized off the event loop (a long prompt must not stall
        the other clients, /health included)."""

        def encode_all() -> list[dict]:
            return [{"prompt_token_ids": engine.tokenizer.encode(p)} if isinstance(p, str) else p for p in prompts]

        if not any(isinstance(p, str) for p in prompts):
            return prompts
        return await asyncio.to_thread(encode_all)

    @staticmethod
    def chat_prompt_ids(
        engine,
        messages,
        add_generation_prompt: bool,
        chat_template: Optional[str],
        tools: Optional[list[dict]] = None,
        template_kwargs: Optional[dict] = None,
    ) -> list[int]:
        """The conversation (ChatMessages or plain dicts) through the chat template, which decides how ``tools``
        and tool messages show; ``template_kwargs`` are extra template variables (``enable_thinking``...)."""
        tokenizer = engine.tokenizer
        conversation = [
            m if isinstance(m, dict) else {**(m.model_extra or {}), "role": m.role, "content": m.text()}
            for m in messages
        ]
        reserved = {"conversation", "tokenize", "add_generation_prompt", "chat_template", "tools"}
        clash = sorted(reserved & set(template_kwargs or {}))
        if clash:
            raise APIError(f"chat_template_kwargs may not set {clash}", 400, "chat_template_kwargs")
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
                **(template_kwargs or {}),
            )
        except Exception as exc:
            raise APIError(f"cannot apply the chat template: {exc}", 400, "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def prepare(
        engine,
        prompts: list[dict],
        params,
        base_id: str,
        lora_request: Optional[LoRARequest] = None,
        priority: int = 0,
    ) -> list[PreparedRequest]:
        """Every prompt of a call validated and tokenized (with the context-length check) before any starts;
        prompt ``i`` runs as request ``{base_id}-{i}``, with ``lora_request``'s adapter when one is named."""
        return [
            engine.prepare(
                prompt,
                params,
                f"{base_id}-{index}",
                check_context_length=True,
                lora_request=lora_request,
                priority=priority,
            )
            for index, prompt in enumerate(prompts)
        ]

    async def prepare_off_loop(
        self,
        engine,
        prompts: list[dict],
        params,
        base_id: str,
        lora_request: Optional[LoRARequest] = None,
        priority: int = 0,
    ) -> list[PreparedRequest]:
        """``prepare``; a constrained request's check (its backend parses the schema or grammar) runs on a
        thread, so that a large constraint does not stall the other clients."""
        if params.structured_outputs is None:
            return self.prepare(engine, prompts, params, base_id, lora_request, priority)
        return await asyncio.to_thread(self.prepare, engine, prompts, params, base_id, lora_request, priority)

    # ---- generation -----------------------------------------------------------------------------
    def admit(self, prepared: list[PreparedRequest]) -> None:
        """Bounded admission (``admission.py``): every prompt of a call reserved, or a 503 with Retry-After for
        the call; each prompt's ``generate`` then releases its reservation."""
        self.admission.admit([(p.request_id, p.num_prompt_tokens) for p in prepared])

    async def generate(self, engine, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one prepared prompt, measured for the metrics."""
        self.admission.started(prepared.request_id)
        shadow = self.shadow
        key, ticket = shadow.track(prepared) if shadow is not None else (None, None)
        try:
            async for output in self._generate(engine, ticket.prepared if ticket is not None else prepared):
                self.admission.first_output(prepared.request_id)
                if ticket is not None:  # a mirrored request: its tokens and times for the shadow
                    ticket.observe(output, time.monotonic())
                    output = ticket.visible(output)
                yield output
        finally:
            self.admission.release(prepared.request_id)
            if shadow is not None:
                shadow.finish(key)

    async def _generate(self, engine, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        timer = RequestTimer(self.metrics, time.monotonic)
        if self.config.server.log_requests:
            logger.info(
                "request %s: prompt %d tokens, params %s",
                prepared.request_id,
                prepared.num_prompt_tokens,
                prepared.requests[0].sampling_params,
            )
        output = None
        async for output in engine.generate(prepared):
            timer.on_output(sum(len(c.token_ids) for c in output.outputs))
            yield output
        if output is not None:
            timer.on_finish(len(output.prompt_token_ids))
            adapter = prepared.requests[0].lora_request
            if adapter is not None:
                self.metrics.adapter_finished(
                    adapter.lora_name, len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs)
                )

    async def final_outputs(
        self, engine, prepared: list[PreparedRequest], http_request: Request
    ) -> list[RequestOutput]:
        """Non-streaming: run every prompt; a client that goes away, a failed prompt or a shutdown aborts them all."""

        async def last(request: PreparedRequest) -> RequestOutput:
            final: Optional[RequestOutput] = None
            async for final in self.generate(engine, request):  # noqa: B007 (the last one)
                pass
            if final is None:
                raise RuntimeError(f"request {request.request_id} ended without an output")
            return final

        return await self.watched([last(request) for request in prepared], http_request)

    async def watched(self, coroutines: list, http_request: Request) -> list:
        """Run ``coroutines`` to their results; a client that goes away, a failure or a shutdown cancels them all
        (a cancelled generation aborts its request in the engine)."""
        tasks = [asyncio.create_task(coroutine) for coroutine in coroutines]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
                if not pending or any(t.exception() is not None for t in done):
                    return [t.result() for t in tasks]  # raises the first failure
                if self.draining.is_set():
                    raise APIError("the server is shutting down", 503)
                if await http_request.is_disconnected():
                    raise APIError("client disconnected", 499)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def merged(self, engine, prepared: list[PreparedRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Streaming: (prompt index, output) as they come, from every prompt's generator."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, request: PreparedRequest) -> None:
            try:
                async for output in self.generate(engine, request):
                    await queue.put((index, output))
            except BaseException as exc:
                await queue.put((index, exc))
                raise
            finally:
                await queue.put((index, None))

        if self.draining.is_set():
            raise APIError("the server is shutting down", 503)
        self.streams.add(queue)
        tasks = [asyncio.create_task(pump(i, request)) for i, request in enumerate(prepared)]
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
            self.streams.discard(queue)
            for task in tasks:
                task.cancel()  # a disconnected client: every prompt's request is aborted
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- shutdown -------------------------------------------------------------------------------
    def drain(self) -> None:
        """End every request in flight with an error: the server is going down."""
        self.draining.set()
        for queue in list(self.streams):
            queue.put_nowait((None, APIError("the server is shutting down", 503)))

    def begin_drain(self, delay: float) -> None:
        """From the SIGTERM handler: new requests get 503 at once, those in flight ``delay`` seconds more."""
        if self.loop is not None and not self.stopping:
            self.stopping = True
            self.loop.call_soon_threadsafe(self.loop.call_later, delay, self.drain)


def get_serving(request: Request) -> OpenAIServing:
    """FastAPI dependency: the server state of the app handling ``request``."""
    return request.app.state.serving
