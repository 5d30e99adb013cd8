"""``engine check numerics``: run teacher-forced prompts through the engine as configured, with probes at every layer
boundary and inside each layer, against the engine's reference path (``torch`` attention, ``native`` layer kernels,
no quantization) in float64 on the same weights; report each probe's relative error, the first op whose error
leaves the dtype's tolerance, near-tie-aware token agreement, and then bisect: swap one plugin kind at a time for
its reference and name the plugin whose swap removes the error. The sampler is checked on its own, by a
goodness-of-fit test of many draws (``sampler_check``)."""

from __future__ import annotations

import gc
import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from engine.numerics.probes import ProbeSet
from engine.numerics.sampler_check import check_sampler
from engine.numerics.tolerance import ACTIVATION_BASE, activation_tolerance
from engine.shadow.compare import ShadowComparison
from engine.shadow.tolerance import tolerance_for

logger = logging.getLogger("engine.numerics")

# each kind the oracle bisects over: its config key and its reference implementation
REFERENCE_PLUGINS = {"attention": "torch", "layer_kernels": "native", "quantization": "none"}
REFERENCE_SAMPLER = "default"
REFERENCE_DTYPE = "float64"


@dataclass
class ProbedRun:
    """One engine's probes over the prompts: each probe's rows per prompt, each prompt's logprobs, its plugins."""

    dtype: str
    plugins: dict[str, str]
    probes: dict[str, list[torch.Tensor]]
    order: list[tuple[str, int, str]]  # (probe name, layer, op) in forward order
    prompt_logprobs: list[list[Any]] = field(default_factory=list)


def probed_run(model: str, overrides: dict[str, Any], prompts: list[list[int]]) -> ProbedRun:
    """Load the engine in this process with ``overrides``, score every prompt (``prompt_logprobs=2``) one at a time
    in one step each, and keep what every probe saw."""
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.testing.inspection import inspect

    longest = max(len(p) for p in prompts)
    config = {
        "model": model,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": max(2048, longest),
        "max_model_len": max(longest + 8, 256),
        "kv_cache_memory": "256MiB",
        "data_parallel_size": 1,
        "engine_core_process": False,
        "executor": "uniproc",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        **overrides,
    }
    llm = LLM(**config)
    try:
        parts = inspect(llm)
        plugins = {kind: choice.name for kind, choice in parts.plugins.items() if hasattr(choice, "name")}
        dtype = parts.model_runner.model_info.dtype_name
        probes = ProbeSet(parts.model)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2, detokenize=False)
        run = ProbedRun(
            dtype, plugins, {p.name: [] for p in probes.probes}, [(p.name, p.layer, p.op) for p in probes.probes]
        )
        try:
            for prompt in prompts:
                probes.arm()
                output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
                for probe in probes.probes:
                    if not probe.records:
                        raise RuntimeError(f"probe {probe.name} saw no forward pass (a captured graph ran the prompt?)")
                    run.probes[probe.name].append(probe.records[0][: len(prompt)])
                run.prompt_logprobs.append(output.prompt_logprobs or [])
        finally:
            probes.close()
        return run
    finally:
        llm.shutdown()
        del llm
        gc.collect()


def relative_errors(run: ProbedRun, reference: ProbedRun) -> list[dict]:
    """Each probe's relative error ||run - reference|| / ||reference|| over every prompt's rows, in forward order,
    with the run's dtype's tolerance at that depth."""
    rows = []
    for name, layer, op in reference.order:
        if name not in run.probes:
            continue
        diff = sum(float((a - r).pow(2).sum()) for a, r in zip(run.probes[name], reference.probes[name]))
        norm = sum(float(r.pow(2).sum()) for r in reference.probes[name])
        error = math.sqrt(diff / norm) if norm else 0.0
        rows.append(
            {
                "name": name,
                "layer": layer,
                "op": op,
                "relative_error": error,
                "tolerance": activation_tolerance(run.dtype, layer),
            }
        )
    return rows


def token_agreement(run: ProbedRun, reference: ProbedRun, prompts: list[list[int]]) -> dict:
    """Near-tie-aware top-1 agreement of the run with the reference at every prompt position (the reference's
    margin decides what is a near-tie), and the prompt tokens' log-probability differences."""
    comparison = ShadowComparison(tolerance_for(run.dtype))
    for index, prompt in enumerate(prompts):
        ref, test = reference.prompt_logprobs[index], run.prompt_logprobs[index]
        comparison.add_tokens(f"prompt{index}", prompt[1:], list(ref[1:]), list(test[1:]))
    report = comparison.report()
    return {
        "verdict": report["verdict"],
        "tokens_compared": report["tokens_compared"],
        "top1_agreement": report["top1_agreement"],
        "logprob_delta": {k: v for k, v in report["logprob_delta"].items() if k != "histogram"},
        "first_divergence": report["first_divergence"],
    }


def transformers_cross_check(model: str, reference: ProbedRun, prompts: list[list[int]]) -> dict:
    """The reference itself against transformers in float64 where it loads the checkpoint: every layer's output
    (the residual stream) and the final norm, as relative errors; what a correct float64 path differs by is
    summation order only (about 1e-15)."""
    import os

    if not os.path.isdir(model):
        return {"skipped": "transformers is compared on Hugging Face folders only (this is a GGUF file)"}
    try:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64).eval()
    except Exception as exc:  # a family transformers does not know, a custom architecture
        return {"skipped": f"transformers cannot load it: {type(exc).__name__}: {exc}"}
    layer_outputs = [name for name, _, op in reference.order if op == "output"]
    diff = dict.fromkeys([*layer_outputs, "final_norm"], 0.0)
    norm = dict.fromkeys(diff, 0.0)
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            hidden = hf_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
            # hidden[i + 1]: after layer i; the last one has the final norm applied
            pairs = [(name, hidden[i + 1][0]) for i, name in enumerate(layer_outputs[:-1])]
            pairs.append(("final_norm", hidden[-1][0]))
            for name, theirs in pairs:
                if name in reference.probes:
                    ours = reference.probes[name][index]
                    diff[name] += float((ours - theirs).pow(2).sum())
                    norm[name] += float(theirs.pow(2).sum())
    del hf_model
    gc.collect()
    errors = {name: math.sqrt(diff[name] / norm[name]) for name in diff if norm[name]}
    return {"max_relative_error": max(errors.values(), default=0.0), "relative_errors": errors}


def first_failure(errors: list[dict]) -> Optional[dict]:
    """The first probe in forward order whose error exceeds its tolerance."""
    return next((row for row in errors if row["relative_error"] > row["tolerance"]), None)


def teacher_forced_prompts(
    vocab_size: int, count: int, seed: int = 0, low: int = 24, high: int = 96
) -> list[list[int]]:
    """Random token prompts: the oracle compares the model's arithmetic, which any tokens exercise."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(low, high))] for _ in range(count)]


def check_numerics(
    model: str,
    overrides: dict[str, Any],
    num_prompts: int = 4,
    prompts: Optional[list[list[int]]] = None,
    sampler_draws: int = 400_000,
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    """The whole check: the JSON report ``engine check numerics`` prints (``verdict``: pass or fail)."""
    from engine.config import VllmConfig
    from engine.model.model_info import resolve_model

    config = VllmConfig.load(model=model, **overrides)
    info = resolve_model(config.model)
    prompts = prompts or teacher_forced_prompts(info.hf_config.vocab_size, num_prompts)
    reference_overrides = {
        **{k: v for k, v in overrides.items() if k not in ("dtype", *REFERENCE_PLUGINS)},
        **REFERENCE_PLUGINS,
        "dtype": REFERENCE_DTYPE,
        "batch_invariant": False,
    }
    progress("reference: torch attention, native layer kernels, no quantization, float64")
    reference = probed_run(model, reference_overrides, prompts)
    progress("reference against transformers (float64)")
    cross_check = transformers_cross_check(model, reference, prompts)
    progress("under test: " + (", ".join(f"{k}={v}" for k, v in overrides.items()) or "the default config"))
    run = probed_run(model, overrides, prompts)
    errors = relative_errors(run, reference)
    failure = first_failure(errors)
    tokens = token_agreement(run, reference, prompts)
    report: dict[str, Any] = {
        "model": model,
        "dtype": run.dtype,
        "config": overrides,
        "plugins": run.plugins,
        "reference": {"plugins": reference.plugins, "dtype": reference.dtype, "transformers": cross_check},
        "num_prompts": len(prompts),
        "num_tokens": sum(len(p) for p in prompts),
        "tolerance": {
            "activation_base": ACTIVATION_BASE[run.dtype],
            "activation_rule": "base x sqrt(layer + 1)",
            "token": tolerance_for(run.dtype).as_dict(),
        },
        "probes": [{**row, "within": row["relative_error"] <= row["tolerance"]} for row in errors],
        "first_failure": failure,
        "tokens": tokens,
        "bisect": [],
        "guilty": [],
    }
    if failure is not None or tokens["verdict"] == "diverges":
        for kind, reference_name in REFERENCE_PLUGINS.items():
            chosen = run.plugins.get(kind)
            if chosen is None or chosen == reference_name:
                continue
            progress(f"bisect: {kind} {chosen} -> {reference_name}")
            swapped = probed_run(model, {**overrides, kind: reference_name}, prompts)
            swapped_errors = relative_errors(swapped, reference)
            swapped_failure = first_failure(swapped_errors)
            swapped_tokens = token_agreement(swapped, reference, prompts)
            fixes = swapped_failure is None and swapped_tokens["verdict"] != "diverges"
            report["bisect"].append(
                {
                    "kind": kind,
                    "plugin": chosen,
                    "swapped_to": reference_name,
                    "first_failure": swapped_failure,
                    "token_verdict": swapped_tokens["verdict"],
                    "max_relative_error": max((r["relative_error"] for r in swapped_errors), default=0.0),
                    "probes": swapped_errors,
                    "fixes": fixes,
                }
            )
            if fixes:
                report["guilty"].append({"kind": kind, "plugin": chosen, "first_failure": failure})
        if not report["guilty"]:
            report["unexplained"] = (
                "no single plugin swap removes the error: the reference path itself at this dtype leaves the table, "
                "or several plugins are wrong together"
            )
    sampler_name = run.plugins.get("sampler", REFERENCE_SAMPLER)
    progress(f"sampler: {sampler_draws} draws through {sampler_name}")
    report["sampler"] = check_sampler(config, sampler_name, sampler_draws)
    if not report["sampler"]["passes"]:
        report["guilty"].append(
            {"kind": "sampler", "plugin": sampler_name, "first_failure": report["sampler"]["worst"]}
        )
    report["verdict"] = (
        "pass" if failure is None and tokens["verdict"] != "diverges" and report["sampler"]["passes"] else "fail"
    )
    return report


__all__ = ["ACTIVATION_BASE", "check_numerics", "probed_run", "relative_errors", "token_agreement"]
