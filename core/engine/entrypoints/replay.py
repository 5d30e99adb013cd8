"""``engine replay DIR``: run a flight recording's requests again on an engine built from its recorded config (any
config flag overrides a key: swap a plugin, a dtype) and compare every token and logprob with the recording.

The replay schedules freely: requests join at the step they joined in the recording, and the engine's own scheduler
batches them. With ``model.batch_invariant`` recorded, each request's bits do not depend on its batch, so a replay
on the same config gives the recorded bits whatever the schedule; without it, a request's logprobs can differ in
the last bits wherever its batches differ, which can change a sampled token (the report says so).
"""

from __future__ import annotations

import argparse
import json
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


def run_replay(folder: str, overrides: dict[str, dict[str, Any]], progress: bool = True) -> dict:
    """Replay one rank's recording; the report ``engine replay`` prints."""
    from tqdm import tqdm

    from engine.engine_core.engine_core import EngineCore

    header, recorded, num_steps = load_requests(read_recording(folder))
    core = EngineCore(replay_config(header, overrides))
    replayed: dict[str, ReplayedRequest] = {}
    pending = sorted(
        (entry for entry in recorded.values() if not (entry.cut and not entry.tokens)),
        key=lambda entry: entry.record.step,
    )
    step = 0
    try:
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
                for output in outputs.outputs:
                    result = replayed.setdefault(output.request_id, ReplayedRequest())
                    result.tokens += output.new_token_ids
                    result.logprobs += _logprob_maps(output)
                    if output.finish_reason is not None:
                        result.finish_reason = output.finish_reason
    finally:
        core.shutdown()
    return compare(recorded, replayed, num_steps, header)


def compare(
    recorded: dict[str, RecordedRequest], replayed: dict[str, ReplayedRequest], num_steps: int, header=None
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
    if header is not None and first is not None and not header.config.get("model", {}).get("batch_invariant"):
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
    reports = [run_replay(str(folder), overrides, progress=not args.no_progress) for folder in rank_folders(args.dir)]
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
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")
    replay.add_argument("-v", "--verbose", action="store_true", help="log the engine's start-up")
    add_config_flags(replay)
    replay.set_defaults(func=cmd_replay)

