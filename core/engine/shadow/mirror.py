"""ShadowMirror: the shadow engine (an ``AsyncLLM`` of its own, in its own process) and the requests mirrored to it.

The server asks ``track`` about every request it serves. A sampled one (``shadow.fraction``) runs on the primary
as asked, plus the top-2 log-probabilities of each output token, which the client never sees. Once it has
finished, its prompt, tokens and those log-probabilities wait in a bounded queue (a full queue drops it, counted).
One task takes them in turn, and for each the shadow runs

1. the same request for as many tokens as the primary produced (``ignore_eos``), timed as the primary was: time per
   output token after the first (TPOT), the speed comparison;
2. prompt + the primary's tokens as one prompt with ``prompt_logprobs=2``: the shadow's distribution at every
   position the primary sampled, on the primary's own context (teacher-forced), the numerics comparison.

Nothing of the shadow reaches a client: the primary never waits for it, and a shadow that raises or dies is
counted and reported (``errors``, ``state``), never propagated. With ``shadow.schedule=idle`` a run starts only while
the primary has no request in flight, and the shadow's processes run at ``shadow.niceness``: on shared cores the
primary keeps them. A latency pair measured while both engines worked is left out of the speed ratio.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from engine.config import VllmConfig
from engine.errors import EngineDeadError
from engine.frontend.input_processor import PreparedRequest
from engine.model.model_info import ModelInfo
from engine.outputs import PositionLogprobs, RequestOutput
from engine.sampling_params import SamplingParams
from engine.shadow.compare import ShadowComparison
from engine.shadow.tolerance import tolerance_for

logger = logging.getLogger("engine.shadow")

NUM_TOP = 2  # the top-2 of each position: the primary's margin between its first and second token


@dataclass
class PrimaryTicket:
    """One primary request while it runs: whether it is mirrored, what it produced, and when."""

    prepared: PreparedRequest  # what the primary runs (with the forced log-probabilities when mirrored)
    mirrored: bool
    user_logprobs: Optional[int]  # what the client asked for: the rest is cut from what it sees
    contended: bool = False  # the shadow ran while this request did
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    num_tokens: int = 0
    final: Optional[RequestOutput] = None
    trimmed: list[PositionLogprobs] = field(default_factory=list)  # what the client sees of the logprobs so far

    def observe(self, output: RequestOutput, now: float) -> None:
        count = len(output.outputs[0].token_ids) if output.outputs else 0
        if count > self.num_tokens:
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time, self.num_tokens = now, count
        if output.finished:
            self.final = output

    def visible(self, output: RequestOutput) -> RequestOutput:
        """The output as the client asked for it: the forced log-probabilities cut back to its own."""
        if not self.mirrored or (self.user_logprobs is not None and self.user_logprobs >= NUM_TOP):
            return output
        completion = output.outputs[0]  # a mirrored request has one sequence
        logprobs = None
        if completion.logprobs is not None and self.user_logprobs is not None:
            keep = self.user_logprobs  # trim only the positions that are new since the last output
            new = range(len(self.trimmed), len(completion.logprobs))
            self.trimmed += [_trim(completion.logprobs[i], completion.token_ids[i], keep) for i in new]
            logprobs = list(self.trimmed)
        return dataclasses.replace(output, outputs=[dataclasses.replace(completion, logprobs=logprobs)])


def _trim(position: PositionLogprobs, chosen: int, keep: int) -> PositionLogprobs:
    return {t: e for t, e in position.items() if t == chosen or (e.rank is not None and e.rank <= keep)}


def tpot(first: Optional[float], last: Optional[float], num_tokens: int) -> Optional[float]:
    """Seconds per output token after the first (None with fewer than two)."""
    if first is None or last is None or num_tokens < 2:
        return None
    return (last - first) / (num_tokens - 1)


@dataclass
class MirroredRequest:
    """A finished primary request waiting for the shadow."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    sampling_params: SamplingParams
    primary_tpot: Optional[float]
    contended: bool


class ShadowMirror:
    """The shadow of one server: its engine, the queue of mirrored requests, the comparison so far."""

    def __init__(self, config: VllmConfig, primary: ModelInfo):
        """Call in the server's event loop (its queue and event belong to it)."""
        self.settings = config.shadow
        self.shadow_config = config.shadow_config()
        self.primary_dtype = primary.dtype_name
        self.max_model_len = primary.max_model_len
        self.random = random.Random(config.shadow.seed)
        self.queue: asyncio.Queue[MirroredRequest] = asyncio.Queue(maxsize=config.shadow.max_queue)
        self.engine: Any = None  # AsyncLLM, once started
        self.state = "starting"  # running, failed (to start), dead, stopped
        self.reason: Optional[str] = None
        self.comparison: Optional[ShadowComparison] = None
        self.counts = {"seen": 0, "mirrored": 0, "dropped": 0, "not_eligible": 0, "completed": 0}
        self.tickets: dict[int, PrimaryTicket] = {}  # the primary requests in flight
        self.idle = asyncio.Event()
        self.idle.set()
        self.running: Optional[MirroredRequest] = None
        self.paused = False  # the shadow's engine core is stopped (SIGSTOP) while the primary works
        self.tasks: list[asyncio.Task] = []
        self.cancel_start = threading.Event()
        self.starting: Optional[asyncio.Future] = None
        self._ids = itertools.count()

    # ---- the primary's side ---------------------------------------------------------------------
    def track(self, prepared: PreparedRequest) -> tuple[int, PrimaryTicket]:
        """Called as a primary request starts: whether it is mirrored (sampled, one sequence, no adapter, and a
        shadow that can take it), and the request the primary runs."""
        self.counts["seen"] += 1
        params = prepared.requests[0].sampling_params
        request = prepared.requests[0]
        eligible = len(prepared.requests) == 1 and request.lora_request is None and request.pooling_params is None
        mirrored = False
        if self.state in ("starting", "running") and self.random.random() < self.settings.fraction:
            mirrored = eligible
            if not eligible:
                self.counts["not_eligible"] += 1
        run = prepared
        if mirrored and (params.logprobs is None or params.logprobs < NUM_TOP):
            forced = msgspec.structs.replace(params, logprobs=NUM_TOP)
            run = PreparedRequest(
                prepared.request_id,
                prepared.prompt_text,
                [msgspec.structs.replace(prepared.requests[0], sampling_params=forced)],
            )
        ticket = PrimaryTicket(run, mirrored, params.logprobs, contended=self.running is not None)
        if self.running is not None:
            self.running.contended = True
        key = next(self._ids)
        self.tickets[key] = ticket
        self.idle.clear()
        self._pause()
        return key, ticket

    def finish(self, key: int) -> None:
        """Called as a primary request ends (finished, failed or aborted): a finished mirrored one is queued."""
        ticket = self.tickets.pop(key)
        if not self.tickets:
            self.idle.set()
            self._resume()
        final = ticket.final
        if not ticket.mirrored or final is None or final.error is not None or not final.outputs:
            return
        completion = final.outputs[0]
        if completion.finish_reason not in ("stop", "length") or not completion.token_ids or not completion.logprobs:
            return
        item = MirroredRequest(
            final.request_id,
            list(final.prompt_token_ids),
            list(completion.token_ids),
            list(completion.logprobs),
            ticket.prepared.requests[0].sampling_params,
            tpot(ticket.first_token_time, ticket.last_token_time, ticket.num_tokens),
            ticket.contended,
        )
        try:
            self.queue.put_nowait(item)
            self.counts["mirrored"] += 1
        except asyncio.QueueFull:
            self.counts["dropped"] += 1

    # ---- the shadow's side ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the shadow engine in the background (call in the server's event loop, once the primary is up)."""
        self.tasks.append(asyncio.get_running_loop().create_task(self._run()))

    async def _run(self) -> None:
        from engine.frontend.async_llm import AsyncLLM

        def start_engine() -> None:
            self.engine = AsyncLLM(self.shadow_config, self.cancel_start)

        self.starting = asyncio.ensure_future(asyncio.to_thread(start_engine))
        try:
            await asyncio.shield(self.starting)  # shutdown stops a start in progress through cancel_start
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.state, self.reason = "failed", f"the shadow engine did not start: {type(exc).__name__}: {exc}"
            logger.error("%s (the primary serves on)", self.reason)
            self._discard_queue()
            return
        self.comparison = ShadowComparison(tolerance_for(self.primary_dtype, self.engine.model_info.dtype_name))
        self.max_model_len = min(self.max_model_len, self.engine.model_info.max_model_len)
        self.state = "running"
        logger.info(
            "shadow engine up (%s): mirroring %.0f%% of requests", self.describe(), 100 * self.settings.fraction
        )
        self.engine.watch()
        while True:
            item = await self.queue.get()
            if self.settings.schedule == "idle":
                await self.idle.wait()
            item.contended = item.contended or bool(self.tickets)
            for ticket in self.tickets.values():
                ticket.contended = True
            self.running = item
            try:
                await self._compare(item)
                self.counts["completed"] += 1
            except asyncio.CancelledError:
                raise
            except EngineDeadError as exc:
                self.comparison.add_error(f"the shadow engine died: {exc}")
                self.state, self.reason = "dead", f"the shadow engine died: {exc}"
                logger.error("%s (the primary serves on)", self.reason)
                self._discard_queue()
                return
            except Exception as exc:  # the shadow's failure is reported, never the primary's
                self.comparison.add_error(f"request {item.request_id}: {type(exc).__name__}: {exc}")
                logger.warning("shadow failed on request %s: %s", item.request_id, exc)
            finally:
                self.running = None

    async def _compare(self, item: MirroredRequest) -> None:
        assert self.comparison is not None and self.engine is not None
        shadow_id = f"shadow-{item.request_id}"
        count = len(item.token_ids)
        timed = msgspec.structs.replace(
            item.sampling_params,
            n=1,
            max_tokens=count,
            min_tokens=0,
            ignore_eos=True,
            stop=None,
            stop_token_ids=[],
            logprobs=None,
            prompt_logprobs=None,
            structured_outputs=None,
            detokenize=False,  # the text is not compared: no work for the server's event loop
        )
        first = last = None
        produced = 0
        if len(item.prompt_token_ids) + count <= self.max_model_len:  # else the shadow's context cannot time it
            async for output in self.engine.generate({"prompt_token_ids": item.prompt_token_ids}, timed, shadow_id):
                now = time.monotonic()
                produced_now = len(output.outputs[0].token_ids)
                if produced_now > produced:
                    first = now if first is None else first
                    last, produced = now, produced_now
        # the whole sequence as a prompt: position j's distribution, teacher-forced on the primary's tokens
        room = max(0, self.max_model_len - 1 - len(item.prompt_token_ids))
        compared = min(count, room)
        if compared:
            forced = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=NUM_TOP, detokenize=False)
            sequence = item.prompt_token_ids + item.token_ids[:compared]
            scored: list = []
            async for output in self.engine.generate({"prompt_token_ids": sequence}, forced, f"{shadow_id}-forced"):
                scored = output.prompt_logprobs or scored
            start = len(item.prompt_token_ids)
            self.comparison.add_tokens(
                item.request_id,
                item.token_ids[:compared],
                item.logprobs[:compared],
                list(scored[start : start + compared]),
            )
        shadow_tpot = tpot(first, last, produced)
        if item.primary_tpot is not None and shadow_tpot is not None:
            contended = item.contended and self.settings.schedule == "idle"
            self.comparison.add_latency(item.primary_tpot, shadow_tpot, contended)

    def _pause(self) -> None:
        """``schedule=idle``: stop the shadow's engine core (SIGSTOP) while the primary has requests in flight, so
        that not even a step of it competes with the primary for the cores (its executor's workers, if any, wait
        for it). A stopped core still ends with this process: the kernel wakes it when its parent dies."""
        if self.settings.schedule != "idle" or self.paused or self.state != "running":
            return
        self.paused = self._signal(signal.SIGSTOP)

    def _resume(self) -> None:
        if self.paused:
            self._signal(signal.SIGCONT)
            self.paused = False

    def _signal(self, sig: int) -> bool:
        sent = False
        for pid in self.engine.engine_core_pids():
            try:
                os.kill(pid, sig)
                sent = True
            except ProcessLookupError:  # it died: its client reports that
                pass
        return sent

    def _discard_queue(self) -> None:
        while not self.queue.empty():
            self.queue.get_nowait()
            self.counts["dropped"] += 1

    # ---- report and lifetime --------------------------------------------------------------------
    def describe(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.settings.override_map().items())

    def report(self, decode_token=None) -> dict:
        """What ``GET /v1/shadow`` answers: the overrides, the counts and the verdicts so far."""
        comparison = self.comparison.report() if self.comparison is not None else None
        if comparison is not None and comparison["first_divergence"] and decode_token is not None:
            divergence = comparison["first_divergence"]
            divergence["primary_text"] = decode_token(divergence["primary_token"])
            divergence["shadow_text"] = decode_token(divergence["shadow_token"])
        return {
            "overrides": self.settings.override_map(),
            "fraction": self.settings.fraction,
            "schedule": self.settings.schedule,
            "state": self.state,
            "reason": self.reason,
            "primary_dtype": self.primary_dtype,
            "shadow_dtype": self.engine.model_info.dtype_name if self.engine else None,
            "requests": {**self.counts, "queued": self.queue.qsize()},
            "verdict": comparison["verdict"] if comparison else ("fails" if self.state == "failed" else "no data"),
            "speed_verdict": comparison["speed_verdict"] if comparison else "no data",
            "comparison": comparison,
        }

    async def shutdown(self) -> None:
        self.cancel_start.set()
        self._resume()  # a stopped core cannot take its SIGTERM
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.starting is not None:
            await asyncio.gather(self.starting, return_exceptions=True)  # a start in progress stops its core
        if self.engine is not None:
            self.engine.shutdown()  # in the loop's thread: it cancels its output handler task
        if self.state in ("starting", "running"):
            self.state = "stopped"
