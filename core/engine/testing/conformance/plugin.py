"""pytest options of the conformance kit (registered through the ``pytest11`` entry point of ``engine``).

Light on purpose: it is loaded by every pytest run in an environment where ``engine`` is installed, so it
imports nothing heavy and only parametrizes the kit's own tests.
"""

from __future__ import annotations

import json

OPTIONS = {  # fixture name -> (option, what it names)
    "attention_name": ("--engine-attention", "an attention backend"),
    "sampler_name": ("--engine-sampler", "a sampler"),
    "logits_processor_name": ("--engine-logits-processor", "a logits processor"),
    "executor_name": ("--engine-executor", "an executor"),
    "kv_cache_coordinator_name": ("--engine-kv-cache-coordinator", "a KV-cache coordinator"),
    "layer_kernels_name": ("--engine-layer-kernels", "a layer-kernels implementation"),
    "quantization_name": ("--engine-quantization", "a quantization method"),
    "proposer_name": ("--engine-proposer", "a speculative-decoding proposer"),
    "model_path": ("--engine-model", "a Hugging Face model folder served by a model-family plugin"),
}


def pytest_addoption(parser) -> None:
    group = parser.getgroup("engine", "engine plugin conformance kit (engine.testing.conformance)")
    for option, what in OPTIONS.values():
        group.addoption(
            option,
            action="append",
            default=[],
            metavar="NAME",
            help=f"check {what} against the plugin contract (repeatable)",
        )
    group.addoption(
        "--engine-logits-processor-params",
        default=None,
        metavar="JSON",
        help="SamplingParams keywords that make the named logits processors act, e.g. "
        '\'{"extra_args": {"force_token": 5}}\' (built-ins need none)',
    )
    group.addoption(
        "--engine-tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="ranks for the executor check (default 1)",
    )


def pytest_generate_tests(metafunc) -> None:
    for fixture, (option, _what) in OPTIONS.items():
        if fixture in metafunc.fixturenames:
            names = metafunc.config.getoption(option.lstrip("-").replace("-", "_"))
            metafunc.parametrize(fixture, names or [None], ids=[str(n) for n in names] or [f"no {option}"])


def logits_processor_params(config) -> dict | None:
    raw = config.getoption("engine_logits_processor_params")
    return json.loads(raw) if raw else None
