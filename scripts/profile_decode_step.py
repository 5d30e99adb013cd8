"""Where a decode step's time goes at 64 running requests: the model, the sampler, and the runner's own
Python (input preparation, sampling metadata, output lists) around them.

Runs SmolLM2 (the default model) through ``LLM`` in this process, 64 requests of 128 prompt tokens and
128 output tokens at temperature 0.6 (W1's setting; ``--temperature 0``: greedy, as ``engine bench latency``
decodes), and times every ``ModelRunner.execute_model`` call in which all 64 requests decode one token. Prints
JSON, medians in milliseconds per step:
``total`` (execute_model), ``model`` (forward), ``logits`` (LM head), ``sampler``, ``runner_python``
(total minus those three: the runner's own Python and the logits processors), and the scheduler's
``schedule`` and ``update`` around the step. ``--seeded`` and ``--penalties`` give every request a
seed and presence / repetition penalties (the per-request paths of the runner). ``model`` counts the captured
decode step where the layer kernels made one (``--enforce-eager`` to time the eager model instead).

    python scripts/profile_decode_step.py [--dtype float32] [--steps-json out.json]
    python scripts/profile_decode_step.py --num-requests 1 --quantization gguf [--enforce-eager]  # one stream
    python scripts/profile_decode_step.py --num-requests 1 --quantization gguf --phases  # + the captured step's phases

``--phases``: the captured step's time by phase (norms, each product, RoPE, KV write, attention, activation), in
milliseconds per decode step over the measured steps, as ``phases`` (the ``cpu`` layer kernels' graph only).

Run it against another checkout of the engine with PYTHONPATH=<checkout>/core to compare before/after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# engine before torch: it sets OMP_WAIT_POLICY=PASSIVE before OpenMP starts (imported after torch, OpenMP's threads
# spin after every torch operation and take the core from the kernels' pool)
from engine import LLM, SamplingParams

# isort: split
import torch


class Timer:
    """Wraps a callable; sums its wall time into ``bucket`` of the current step."""

    def __init__(self, fn, step: dict, bucket: str):
        self.fn, self.step, self.bucket = fn, step, bucket

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.step[self.bucket] = self.step.get(self.bucket, 0.0) + time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seeded", action="store_true", help="give every request its own seed")
    parser.add_argument(
        "--penalties",
        action="store_true",
        help="every request asks for presence and repetition penalties (a logits processor)",
    )
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--temperature", type=float, default=0.6, help="0: greedy (as `engine bench latency` decodes)")
    parser.add_argument("--enforce-eager", action="store_true", help="time the eager model, not the captured step")
    parser.add_argument("--steps-json", help="also write every measured step")
    parser.add_argument("--prompt-len", type=int, default=128, help="16: as `engine bench latency`'s tg (depth 0)")
    parser.add_argument("--phases", action="store_true", help="the captured step's time by phase (cpu kernels)")
    args = parser.parse_args()

    llm = LLM(
        dtype=args.dtype,
        max_num_seqs=max(256, args.num_requests),
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
    )
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    steps: list[dict] = []
    current: dict = {}
    runner.model.forward = Timer(runner.model.forward, current, "model")
    if runner.decode_step is not None:
        runner.decode_step = Timer(runner.decode_step, current, "model")
        runner.decode_step.max_batch_size = runner.decode_step.fn.max_batch_size
        runner.decode_step.takes_short_queries = runner.decode_step.fn.takes_short_queries
    runner.model.compute_logits = Timer(runner.model.compute_logits, current, "logits")
    runner.sampler = Timer(runner.sampler, current, "sampler")
    execute = runner.execute_model

    def timed_execute(scheduler_output):
        schedule_time = current.get("schedule_next", 0.0)
        current.clear()
        start = time.perf_counter()
        output = execute(scheduler_output)
        total = time.perf_counter() - start
        decode = (
            len(scheduler_output.num_scheduled_tokens) == args.num_requests
            and scheduler_output.total_num_scheduled_tokens == args.num_requests
        )
        if decode:
            inside = current.get("model", 0) + current.get("logits", 0) + current.get("sampler", 0)
            steps.append(
                {
                    "total": total,
                    **current,
                    "runner_python": total - inside,
                    "schedule": schedule_time,
                    "update": None,
                    "step_id": id(scheduler_output),
                }
            )
        return output

    runner.execute_model = timed_execute
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def timed_schedule():
        start = time.perf_counter()
        output = schedule()
        current["schedule_next"] = time.perf_counter() - start
        return output

    def timed_update(scheduler_output, runner_output):
        start = time.perf_counter()
        outputs = update(scheduler_output, runner_output)
        if steps and steps[-1].get("update") is None and steps[-1]["step_id"] == id(scheduler_output):
            steps[-1]["update"] = time.perf_counter() - start
        return outputs

    scheduler.schedule, scheduler.update_from_output = timed_schedule, timed_update
    generator = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(100, 20000, (args.prompt_len,), generator=generator).tolist()}
        for _ in range(args.num_requests)
    ]
    extra = dict(presence_penalty=0.5, repetition_penalty=1.1) if args.penalties else {}
    params = [
        SamplingParams(
            temperature=args.temperature, max_tokens=128, ignore_eos=True, seed=i if args.seeded else None, **extra
        )
        for i in range(args.num_requests)
    ]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    warm_captured = runner.num_captured_steps
    graphs = [graph for _, graph in getattr(runner.decode_step.fn, "graphs", [])] if runner.decode_step else []
    if args.phases and not graphs:
        raise SystemExit("--phases: no captured decode graph of the cpu layer kernels in this engine")
    for graph in graphs if args.phases else []:
        graph.set_profiling(True)
    steps.clear()
    llm.generate(prompts, params, use_tqdm=False)
    keys = ["total", "model", "logits", "sampler", "runner_python", "schedule", "update"]
    summary = {key: round(statistics.median(s.get(key) or 0.0 for s in steps) * 1e3, 3) for key in keys}
    summary.update(
        decode_steps=len(steps),
        captured_steps=runner.num_captured_steps,
        dtype=args.dtype,
        quantization=args.quantization,
        temperature=args.temperature,
        seeded=args.seeded,
        penalties=args.penalties,
        threads=torch.get_num_threads(),
        isa=torch.backends.cpu.get_cpu_capability(),
    )
    if args.phases:
        phases: dict[str, float] = {}
        for graph in graphs:
            for name, seconds in graph.phase_seconds().items():
                phases[name] = phases.get(name, 0.0) + seconds
        # per replayed step (steps with a prompt run eagerly and add nothing to the phases)
        replayed = max(1, runner.num_captured_steps - warm_captured)
        summary["phases"] = {name: round(seconds / replayed * 1e3, 3) for name, seconds in phases.items()}
    print(json.dumps(summary))
    if args.steps_json:
        with open(args.steps_json, "w") as f:
            json.dump(steps, f)
    llm.shutdown()


if __name__ == "__main__":
    main()
