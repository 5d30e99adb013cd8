"""``engine replay DIR``: run a flight recording's requests again on an engine built from its recorded config (any
config flag overrides a key: swap a plugin, a dtype) and compare every token and logprob with the recording.

By default every recorded step is forced: the same requests join before it, and the scheduler is given that step's
plan (the requests, their tokens and drafts), so each batch is the recorded one and a replay on the same config gives
the recorded bits. ``--free-schedule`` lets the engine's own scheduler batch the requests instead (each joins at its
recorded step): identical only when ``model.batch_invariant`` was recorded, since otherwise a request's logprobs can
differ in the last bits wherever its batches differ (the report then says so).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import msgspec

from engine.engine_core.flight_recorder import AbortRecord, RecordingHeader, RequestRecord, StepRecord, read_recording
from engine.messages import EngineCoreRequest


@dataclass
class RecordedRequest:
    """A request as recorded: what was sent and everything it produced, with the step of each token."""

    record: RequestRecord
    tokens: list[int] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)
    logprobs: list[Optional[dict[int, float]]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    aborted: bool = False

    @property
    def cut(self) -> bool:
        """Aborted by its client, or still running when the recording ends (an incident bundle, the newest
        segment): replayed for as many tokens as were recorded."""
        return self.aborted or self.finish_reason is None


@dataclass
class ReplayedRequest:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Optional[dict[int, float]]] = field(default_factory=list)
    finish_reason: Optional[str] = None


def _logprob_maps(output) -> list[Optional[dict[int, float]]]:
    if output.new_logprobs is None:
        return [None] * len(output.new_token_ids)
    return [dict(zip(entry.token_ids, entry.logprobs)) for entry in output.new_logprobs]


def load_requests(records: list) -> tuple[RecordingHeader, dict[str, RecordedRequest], int]:
    """The header, every recorded request with its outputs, and the number of steps recorded."""
    header = records[0]
    if not isinstance(header, RecordingHeader):
        raise ValueError("a recording begins with its header; this one does not")
    requests: dict[str, RecordedRequest] = {}
    steps = 0
    for record in records[1:]:
        if isinstance(record, RequestRecord):
            requests[record.request.request_id] = RecordedRequest(record)
        elif isinstance(record, AbortRecord):
            for request_id in record.request_ids:
                if request_id in requests and requests[request_id].finish_reason is None:
                    requests[request_id].aborted = True
                    requests[request_id].finish_reason = "abort"
        elif isinstance(record, StepRecord):
            steps += bool(record.scheduled)
            for output in record.outputs:
                entry = requests.get(output.request_id)
                if entry is None or entry.aborted:
                    continue
                entry.tokens += output.new_token_ids
                entry.token_steps += [record.step] * len(output.new_token_ids)
                entry.logprobs += _logprob_maps(output)
                if output.finish_reason is not None:
                    entry.finish_reason = output.finish_reason
    return header, requests, steps


def replay_config(header: RecordingHeader, overrides: dict[str, dict[str, Any]]):
    """The recorded config with ``overrides`` (sections of keys) over it, run in this process, unrecorded."""
    from engine.config import VllmConfig

    sections = {name: dict(values) for name, values in header.config.items()}
    for section, values in overrides.items():
        sections.setdefault(section, {}).update(values)
    sections.setdefault("observability", {})["flight_recorder"] = None
    parallel = sections.setdefault("parallel", {})
    parallel.update(data_parallel_size=1, data_parallel_rank=0, engine_core_process=False)
    return VllmConfig.load(None, **sections)


def _engine_request(entry: RecordedRequest) -> EngineCoreRequest:
    request = entry.record.request
    if entry.cut:  # the client hung up, or the recording ends, after these tokens: replay exactly that many
        params = msgspec.structs.replace(request.sampling_params, max_tokens=len(entry.tokens))
        request = msgspec.structs.replace(request, sampling_params=params)
    carried = entry.record.output_token_ids
    if carried:  # running before the oldest segment kept: resumed from the tokens it had
        request = msgspec.structs.replace(request, resumed_output_token_ids=list(carried))
    return request


def run_replay(
    folder: str, overrides: dict[str, dict[str, Any]], progress: bool = True, free_schedule: bool = False
) -> dict:
    """Replay one rank's recording (each recorded step forced, or ``free_schedule``); the report ``engine replay``
    prints."""
    from engine.engine_core.engine_core import EngineCore

    records = read_recording(folder)
    header, recorded, num_steps = load_requests(records)
    config = replay_config(header, overrides)
    if not free_schedule:
        config.scheduler.async_scheduling = False  # one step at a time, each as recorded
    core = EngineCore(config)
    try:
        run = _run_free if free_schedule else _run_forced
        replayed = run(core, records, recorded, num_steps, progress)
    finally:
        core.shutdown()
    return compare(recorded, replayed, num_steps, header, free_schedule)


def _collect(replayed: dict[str, ReplayedRequest], outputs) -> None:
    for output in outputs:
        result = replayed.setdefault(output.request_id, ReplayedRequest())
        result.tokens += output.new_token_ids
        result.logprobs += _logprob_maps(output)
        if output.finish_reason is not None:
            result.finish_reason = output.finish_reason


def _run_forced(core, records: list, recorded: dict[str, RecordedRequest], num_steps: int, progress: bool) -> dict:
    """Every recorded step again: the requests and aborts recorded before it, then the scheduler given that step's
    plan (the same requests, tokens and drafts; preemptions follow from the same block use)."""
    from tqdm import tqdm

    replayed: dict[str, ReplayedRequest] = {}
    scheduler = core.scheduler
    with tqdm(total=num_steps, desc="replay", unit="step", disable=not progress) as bar:
        for record in records[1:]:
            if isinstance(record, RequestRecord):
                entry = recorded[record.request.request_id]
                if entry.record is record and not (entry.cut and not entry.tokens):
                    replayed[record.request.request_id] = ReplayedRequest()
                    core.add_request(_engine_request(entry))
            elif isinstance(record, AbortRecord):
                live = [r for r in record.request_ids if r in scheduler.requests]
                if live:
                    core.abort_requests(live)
            elif isinstance(record, StepRecord) and record.scheduled:
                while scheduler.num_waiting_for_grammar():
                    time.sleep(0.001)  # the recorded step admitted its constrained requests once compiled
                bar.update(1)
                # a request that ended sooner here (it diverged) is left out of the steps recorded after its end
                scheduled = {r: n for r, n in record.scheduled.items() if r in scheduler.requests}
                if not scheduled:
                    continue
                for request_id in scheduled:  # a request carried into the oldest segment first recomputes its tokens
                    request = scheduler.requests[request_id]
                    if recorded[request_id].record.output_token_ids and request not in scheduler.running:
                        scheduled[request_id] = request.num_tokens
                scheduler.forced_step = (scheduled, record.drafts)
                while scheduler.forced_step is not None or core.batch_queue:
                    _collect(replayed, core.step().outputs)
        leftover = list(scheduler.requests)  # requests that ran longer here than recorded: nothing left to force
        if leftover:
            core.abort_requests(leftover)
        _collect(replayed, core.step().outputs)  # requests refused or failed after the last recorded step
    return replayed


def _run_free(core, records: list, recorded: dict[str, RecordedRequest], num_steps: int, progress: bool) -> dict:
    """The requests fed in at their recorded steps; the engine's own scheduler batches them."""
    from tqdm import tqdm

    replayed: dict[str, ReplayedRequest] = {}
    pending = sorted(
        (entry for entry in recorded.values() if not (entry.cut and not entry.tokens)),
        key=lambda entry: entry.record.step,
    )
    step = 0
    with tqdm(total=num_steps, desc="replay", unit="step", disable=not progress) as bar:
        while pending or core.has_work():
            while pending and (pending[0].record.step <= step or not core.has_work()):
                entry = pending.pop(0)
                replayed[entry.record.request.request_id] = ReplayedRequest()
                core.add_request(_engine_request(entry))
            outputs = core.step()
            if outputs.outputs or core.has_work():
                step += 1
                bar.update(1)
            _collect(replayed, outputs.outputs)
    return replayed


def compare(
    recorded: dict[str, RecordedRequest],
    replayed: dict[str, ReplayedRequest],
    num_steps: int,
    header=None,
    free_schedule: bool = False,
) -> dict:
    """``{"requests", "steps", "identical_requests", "first_divergence"}``: the divergence at the earliest recorded
    step (a token or a logprob that differs, or a request that ends otherwise)."""
    identical = 0
    first: Optional[dict] = None
    for request_id, entry in recorded.items():
        result = replayed.get(request_id, ReplayedRequest())
        divergence = _first_difference(request_id, entry, result)
        if divergence is None:
            identical += 1
        elif first is None or divergence["step"] < first["step"]:
            first = divergence
    report: dict[str, Any] = {
        "requests": len(recorded),
        "steps": num_steps,
        "identical_requests": identical,
        "first_divergence": first,
    }
    invariant = header is not None and header.config.get("model", {}).get("batch_invariant")
    if free_schedule and header is not None and first is not None and not invariant:
        report["note"] = (
            "recorded without model.batch_invariant: a request's bits may depend on the batch it ran in, which a "
            "replay does not reproduce"
        )
    return report


def _first_difference(request_id: str, entry: RecordedRequest, result: ReplayedRequest) -> Optional[dict]:
    carried = len(entry.record.output_token_ids)  # tokens of a resumed request before the recording
    replayed_tokens, replayed_logprobs = result.tokens, result.logprobs
    for position, token in enumerate(entry.tokens):
        step = entry.token_steps[position]
        if position >= len(replayed_tokens):
            return _divergence(step, request_id, carried + position, token, None, None)
        want, got = entry.logprobs[position], replayed_logprobs[position]
        if replayed_tokens[position] != token or (want is not None and want != got):
            delta = None
            if want is not None and got is not None and token in want and token in got:
                delta = got[token] - want[token]
            return _divergence(step, request_id, carried + position, token, replayed_tokens[position], delta)
    if len(replayed_tokens) > len(entry.tokens) or (not entry.cut and result.finish_reason != entry.finish_reason):
        step = entry.token_steps[-1] if entry.token_steps else entry.record.step
        extra = replayed_tokens[len(entry.tokens)] if len(replayed_tokens) > len(entry.tokens) else None
        return _divergence(step, request_id, carried + len(entry.tokens), None, extra, None)
    return None


def _divergence(step, request_id, position, recorded, replayed, delta) -> dict:
    return {
        "step": step,
        "request_id": request_id,
        "position": position,
        "recorded": recorded,
        "replayed": replayed,
        "logprob_delta": delta,
    }


def rank_folders(directory: str) -> list[Path]:
    """The rank folders of a recording (``DIR/rank*``), or DIR itself when it holds segments (a rank's folder or an
    incident bundle)."""
    root = Path(directory)
    if any(root.glob("segment-*.msgpack")):
        return [root]
    ranks = sorted(p for p in root.glob("rank*") if p.is_dir())
    if not ranks:
        raise FileNotFoundError(f"{directory}: no flight recording here (rank*/segment-*.msgpack)")
    return ranks


def cmd_replay(args: argparse.Namespace) -> int:
    from engine.entrypoints.config_flags import config_overrides_from_args

    overrides = config_overrides_from_args(args)
    reports = [
        run_replay(str(folder), overrides, not args.no_progress, args.free_schedule)
        for folder in rank_folders(args.dir)
    ]
    if len(reports) == 1:
        report = reports[0]
    else:
        firsts = [r["first_divergence"] for r in reports if r["first_divergence"] is not None]
        report = {
            "requests": sum(r["requests"] for r in reports),
            "steps": sum(r["steps"] for r in reports),
            "identical_requests": sum(r["identical_requests"] for r in reports),
            "first_divergence": min(firsts, key=lambda d: d["step"]) if firsts else None,
            "ranks": reports,
        }
    print(json.dumps(report), flush=True)
    return 0 if report["identical_requests"] == report["requests"] else 1


def add_replay_command(sub) -> None:
    from engine.entrypoints.config_flags import add_config_flags

    replay = sub.add_parser(
        "replay",
        help="run a flight recording (--flight-recorder DIR) again and compare every token and logprob; any "
        "config flag overrides the recorded key",
    )
    replay.add_argument("dir", help="the recording's folder (rank*/ inside), one rank's folder or an incident folder")
    replay.add_argument(
        "--free-schedule",
        action="store_true",
        help="let the engine's scheduler batch the requests (each joins at its recorded step) instead of forcing "
        "every recorded step; identical only for recordings made with model.batch_invariant",
    )
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")
    replay.add_argument("-v", "--verbose", action="store_true", help="log the engine's start-up")
    add_config_flags(replay)
    replay.set_defaults(func=cmd_replay)
