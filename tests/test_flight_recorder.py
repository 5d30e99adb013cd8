"""The flight recorder (``observability.flight_recorder``) and ``engine replay``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.engine_core.flight_recorder import (
    AbortRecord,
    RecordingHeader,
    RequestRecord,
    StepRecord,
    read_recording,
    read_segment,
)
from engine.entrypoints.replay import run_replay
from engine.testing.models import random_prompts

MODEL = dict(hidden_size=96, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
PROMPTS = random_prompts(8, (5, 90), seed=31)


def params(index: int, max_tokens: int = 16) -> SamplingParams:
    if index % 3 == 0:
        return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=3, ignore_eos=True)
    if index % 3 == 1:
        return SamplingParams(temperature=0.9, seed=index, max_tokens=max_tokens, logprobs=2)
    return SamplingParams(temperature=0.7, seed=index, max_tokens=max_tokens, n=2)


@pytest.fixture(scope="module")
def model_dir(make_tiny_model) -> str:
    return make_tiny_model(**MODEL)


def record(model_dir: str, folder: Path, prompts=PROMPTS, max_tokens: int = 16, **config) -> list:
    llm = LLM(model_dir, dtype="float32", flight_recorder=str(folder), **config)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [params(i, max_tokens) for i in range(len(prompts))], use_tqdm=False
    )
    llm.shutdown()
    return outputs


def test_a_recording_holds_the_config_the_requests_and_every_step(model_dir, tmp_path):
    outputs = record(model_dir, tmp_path, batch_invariant=True, max_num_batched_tokens=64)
    records = read_recording(tmp_path / "rank0")
    header = records[0]
    assert isinstance(header, RecordingHeader) and header.config["model"]["batch_invariant"] is True
    assert header.config["scheduler"]["max_num_batched_tokens"] == 64
    assert header.plugins["attention"].startswith("cpu") and "engine" in header.versions
    requests = [r for r in records if isinstance(r, RequestRecord)]
    assert len(requests) == sum(p.n for p in (params(i) for i in range(len(PROMPTS))))  # n=2: two core requests
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert [s.step for s in steps] == list(range(len(steps)))
    assert all(sum(s.scheduled.values()) <= 64 for s in steps)
    tokens: dict[str, list[int]] = {}
    for step in steps:
        for output in step.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    produced = sorted(tuple(c.token_ids) for o in outputs for c in o.outputs)
    assert sorted(map(tuple, tokens.values())) == produced


def test_replaying_the_same_config_gives_every_token_and_logprob(model_dir, tmp_path):
    record(model_dir, tmp_path, batch_invariant=True, max_num_batched_tokens=48)
    report = run_replay(str(tmp_path / "rank0"), {}, progress=False)
    assert report["first_divergence"] is None, report
    assert report["identical_requests"] == report["requests"] > len(PROMPTS)
    # free to schedule otherwise: another token budget splits every prompt differently, with the same bits
    free = run_replay(
        str(tmp_path / "rank0"), {"scheduler": {"max_num_batched_tokens": 7}}, progress=False, free_schedule=True
    )
    assert free["first_divergence"] is None, free


@pytest.mark.parametrize(
    "config",
    [
        {"max_num_batched_tokens": 40},  # chunked prefill beside decodes
        {"num_gpu_blocks_override": 20, "block_size": 8, "max_model_len": 160},  # preemption and recompute
        {"async_scheduling": True, "max_num_batched_tokens": 40},
    ],
    ids=["chunked", "preempt", "async"],
)
def test_the_recorded_schedule_replays_exactly_without_batch_invariance(model_dir, tmp_path, config):
    """Forced steps: every batch is the recorded one, so the same bits come back on the default kernels."""
    outputs = record(model_dir, tmp_path, **config)
    records = read_recording(tmp_path / "rank0")
    steps = [r for r in records if isinstance(r, StepRecord) and r.scheduled]
    assert any(len(s.scheduled) > 1 for s in steps) and any(max(s.scheduled.values()) > 1 for s in steps)
    if "num_gpu_blocks_override" in config:
        assert any(s.preempted for s in steps), "the record names the requests each step preempted"
    report = run_replay(str(tmp_path / "rank0"), {}, progress=False)
    assert report["first_divergence"] is None, report
    assert report["identical_requests"] == report["requests"] == sum(len(o.outputs) for o in outputs)
    assert report["steps"] == len(steps)


def test_engine_replay_prints_one_json_line_and_names_the_first_divergence_of_a_swapped_plugin(model_dir, tmp_path):
    """The identical case runs through ``cmd_replay`` in the data-parallel test; here the command itself."""
    record(model_dir, tmp_path, batch_invariant=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    swapped = subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", "replay", str(tmp_path), "--no-progress"]
        + ["--no-batch-invariant", "--attention", "torch", "--layer-kernels", "native"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert swapped.returncode == 1, swapped.stderr[-2000:]
    report = json.loads(swapped.stdout.strip().splitlines()[-1])
    divergence = report["first_divergence"]
    assert divergence is not None and report["identical_requests"] < report["requests"]
    assert set(divergence) == {"step", "request_id", "position", "recorded", "replayed", "logprob_delta"}
    if divergence["recorded"] == divergence["replayed"]:  # the same token, its logprob off in the last bits
        assert divergence["logprob_delta"] is not None and 0 < abs(divergence["logprob_delta"]) < 1e-3


def test_segments_stay_under_the_cap_and_the_newest_replay_alone(model_dir, tmp_path):
    prompts = random_prompts(24, (20, 90), seed=32)
    record(model_dir, tmp_path, prompts, 40, batch_invariant=True, flight_recorder_max_bytes="192KiB")
    folder = tmp_path / "rank0"
    segments = sorted(folder.glob("segment-*.msgpack"))
    assert segments[0].name != "segment-000001.msgpack", "the oldest segments were dropped"
    assert sum(p.stat().st_size for p in segments) <= 192 * 1024 + 64 * 1024  # the cap, plus the segment being written
    for path in segments:
        assert isinstance(next(read_segment(path)), RecordingHeader)  # each segment describes itself
    carried = [r for r in read_recording(folder) if isinstance(r, RequestRecord) and r.output_token_ids]
    assert carried, "requests running across the oldest kept boundary are recorded with their tokens"
    report = run_replay(str(folder), {}, progress=False)
    assert report["first_divergence"] is None, report


def test_a_failed_request_keeps_an_incident_bundle_and_replays(model_dir, tmp_path, caplog):
    from engine.config import VllmConfig
    from engine.engine_core.engine_core import EngineCore
    from engine.messages import EngineCoreRequest

    config = VllmConfig.load(model=model_dir, dtype="float32", batch_invariant=True, flight_recorder=str(tmp_path))
    core = EngineCore(config)
    good = EngineCoreRequest("good", PROMPTS[0], params(0), 2, time.time())
    bad = EngineCoreRequest("bad", PROMPTS[1], params(0), 10**9, time.time())  # an eos id beyond the vocabulary
    dropped = EngineCoreRequest("dropped", PROMPTS[2], params(1, 30), 2, time.time())
    core.add_request(good)
    core.add_request(dropped)
    for _ in range(3):
        core.step()
    core.abort_requests(["dropped"])
    core.add_request(bad)
    while core.has_work():
        core.step()
    core.recorder.flush()
    incidents = list((tmp_path / "rank0" / "incidents").iterdir())
    assert len(incidents) == 1 and "request-bad-failed" in incidents[0].name
    assert (incidents[0] / "WHY").read_text().startswith("request bad failed")
    core.shutdown()
    records = read_recording(incidents[0])
    assert any(isinstance(r, AbortRecord) and r.request_ids == ["dropped"] for r in records)
    report = run_replay(str(incidents[0]), {}, progress=False)
    assert report["first_divergence"] is None and report["identical_requests"] == report["requests"] == 3, report


def test_each_data_parallel_rank_records_its_own_requests_and_the_whole_recording_replays(model_dir, tmp_path):
    from engine.entrypoints.cli import build_parser
    from engine.entrypoints.replay import cmd_replay

    prompts = random_prompts(8, (5, 60), seed=33)
    llm = LLM(model_dir, dtype="float32", batch_invariant=True, flight_recorder=str(tmp_path), data_parallel_size=2)
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts], [params(i) for i in range(8)], use_tqdm=False)
    finally:
        llm.shutdown()
    per_rank = {
        rank: [r.request.request_id for r in read_recording(tmp_path / f"rank{rank}") if isinstance(r, RequestRecord)]
        for rank in (0, 1)
    }
    assert all(per_rank.values()) and not set(per_rank[0]) & set(per_rank[1]), per_rank
    assert read_recording(tmp_path / "rank1")[0].dp_rank == 1
    assert cmd_replay(build_parser().parse_args(["replay", str(tmp_path), "--no-progress"])) == 0


def test_a_script_that_simply_ends_leaves_a_whole_recording(model_dir, tmp_path):
    script = (
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM({model_dir!r}, dtype='float32', flight_recorder={str(tmp_path)!r})\n"
        "llm.generate([{'prompt_token_ids': [5, 6, 7, 8]}] * 3, SamplingParams(max_tokens=9, ignore_eos=True),"
        " use_tqdm=False)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    finished = [
        o for r in read_recording(tmp_path / "rank0") if isinstance(r, StepRecord) for o in r.outputs if o.finish_reason
    ]
    assert len(finished) == 3 and all(o.finish_reason == "length" for o in finished)


def test_a_second_run_on_the_same_folder_moves_the_first_aside(model_dir, tmp_path):
    record(model_dir, tmp_path, PROMPTS[:2], batch_invariant=True)
    record(model_dir, tmp_path, PROMPTS[2:5], batch_invariant=True)
    current = [r for r in read_recording(tmp_path / "rank0") if isinstance(r, RequestRecord)]
    (previous,) = (tmp_path / "rank0" / "previous").iterdir()
    assert len(current) == 4  # the third prompt asks for n=2
    assert len([r for r in read_recording(previous) if isinstance(r, RequestRecord)]) == 2
    assert run_replay(str(previous), {}, progress=False)["first_divergence"] is None


def test_speculative_decoding_replays_its_recorded_drafts(model_dir, tmp_path, oracle):
    from tests.helpers import oracle_spec_config

    prompts = PROMPTS[:4]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(model_dir, dtype="float32")
    reference = {
        ",".join(map(str, p)): o.outputs[0].token_ids
        for p, o in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False))
    }
    llm.shutdown()
    record(model_dir, tmp_path, prompts, speculative_config=oracle_spec_config(oracle, reference))
    steps = [r for r in read_recording(tmp_path / "rank0") if isinstance(r, StepRecord)]
    assert any(s.drafts for s in steps)
    report = run_replay(str(tmp_path / "rank0"), {}, progress=False)
    assert report["first_divergence"] is None and report["identical_requests"] == report["requests"], report


def test_structured_outputs_replay_with_their_grammars(smollm2_gguf, tmp_path):
    from engine import StructuredOutputsParams

    constrained = [
        SamplingParams(max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,8} [0-9]{2}")),
        SamplingParams(
            temperature=0.8, seed=3, max_tokens=30, structured_outputs=StructuredOutputsParams(choice=["red", "blue"])
        ),
        SamplingParams(temperature=0, max_tokens=8),
    ]
    llm = LLM(smollm2_gguf, flight_recorder=str(tmp_path))
    outputs = llm.generate(["The word and number:", "Pick a colour:", "Hello"], constrained, use_tqdm=False)
    llm.shutdown()
    assert outputs[1].outputs[0].text in ("red", "blue")
    report = run_replay(str(tmp_path / "rank0"), {}, progress=False)
    assert report["first_divergence"] is None and report["identical_requests"] == report["requests"] == 3, report


def test_served_traffic_records_and_replays(model_dir, tmp_path):
    """engine serve with the recorder: completions, a stream, a chat and n=2 over HTTP, then the whole recording
    replayed."""
    import httpx

    from tests.helpers import Server

    server = Server(
        "--model", model_dir, "--dtype", "float32", "--flight-recorder", str(tmp_path), "--max-model-len", "512"
    )
    try:
        base = server.url + "/v1"
        assert httpx.post(base + "/completions", json={"prompt": "one two", "max_tokens": 8, "logprobs": 2}).is_success
        body = {"prompt": "three", "max_tokens": 6, "n": 2, "temperature": 0.8, "seed": 4}
        assert httpx.post(base + "/completions", json=body).is_success
        with httpx.stream("POST", base + "/completions", json={"prompt": "four", "max_tokens": 7, "stream": True}) as r:
            assert r.is_success and "[DONE]" in r.read().decode()
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        assert httpx.post(base + "/chat/completions", json=chat).is_success
    finally:
        server.stop()
    records = read_recording(tmp_path / "rank0")
    assert len([r for r in records if isinstance(r, RequestRecord)]) == 5
    report = run_replay(str(tmp_path / "rank0"), {}, progress=False)
    assert report["first_divergence"] is None and report["identical_requests"] == 5, report
