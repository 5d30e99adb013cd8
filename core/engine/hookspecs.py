"""The plugin contract: one hookspec per pluggable kind (pluggy project name ``engine``).

A plugin is a module registered under the ``engine.plugins`` entry-point group. It declares the
contract version it was built for (``ENGINE_CONTRACT_VERSION = "1.12"``; a different major version is
refused, an older 1.x minor keeps working through adapters) and implements any of the hooks below with
``@engine.hookimpl``. Each class hook returns a list of implementation classes; every class carries a
unique ``name``, a ``priority`` used by ``auto``, and a classmethod ``unavailable_reasons(ctx)`` that says
why it cannot run here (empty when it can).

Each kind is declared once, by the ``@plugin_kind`` on its hookspec: the hook, the base class, the config
key that chooses an implementation, and how and in which process an implementation is constructed.
Registration, selection (``engine.plugins``), the config field and its flags (``engine.config``),
``engine plugins`` and the generated reference (docs/config.md) all read ``KINDS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import pluggy

_Spec = TypeVar("_Spec", bound=Callable[..., Any])

PROJECT_NAME = "engine"
CONTRACT_VERSION = "1.17"  # 1.1 added register_models, 1.2 engine_layer_kernels, 1.3 tensor views for
# logits processors and samplers (1.x ones run through adapters, engine.interfaces.legacy), 1.4
# engine_quantization_methods and LayerKernels.quantized_product_candidates, 1.5
# LayerKernels.capture_decode_step, 1.6 engine_spec_proposers, 1.7 engine_structured_output_backends and
# engine_tool_parsers, 1.8 the fused mixture-of-experts operation (LayerKernels.select_experts, pack_experts,
# fused_moe), 1.9 multi-head latent attention (AttentionBackend.get_mla_impl_cls, get_mla_kv_cache_shape,
# MLAAttentionImpl), 1.10 Mamba's state-space kernels (LayerKernels.causal_conv1d, mamba2_scan, selective_scan),
# 1.11 quantized experts (LayerKernels.pack_quantized_experts, FusedMoE.quant_w13 / quant_w2), 1.12
# LayerKernels.serves_packed_weights (auto quantization keeps a GGUF file packed), 1.13 LayerKernels.add_lora (the
# batched LoRA product) and engine_lora_resolvers, 1.14 LayerKernels.add_lora's out_slices (B's zero blocks in a merged
# layer, for kernels that skip them) and CapturedDecodeStep.takes_lora_steps, 1.15 engine_poolers and the encoder-only
# attention type (AttentionBackend.supports_encoder_only, AttentionImpl.forward_encoder_only), 1.16
# engine_reasoning_parsers, 1.17 AttentionBackend.supported_kv_cache_dtypes (cache.kv_cache_dtype)

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True)
class PluginKind:
    """One pluggable kind, declared once."""

    name: str  # as `engine plugins` lists it
    hook: str  # the hookspec's name
    base: str  # "module:Class" every implementation subclasses
    config_key: Optional[str]  # dotted key that chooses one implementation; None: every available one is active
    flags: tuple[str, ...]  # flat config names / CLI flags for the key, besides the field's own
    process: str  # where implementations are constructed
    construction: str  # how the engine constructs and uses an implementation
    choice_help: str  # the config field's description (what ``auto`` picks)
    returns_classes: bool = True  # False: the hook fills a registry instead (model families, loaded lazily)
    off_value: Optional[str] = None  # a config value that turns the kind off (no implementation is selected)
    # False: chosen when first needed, not when the engine starts (an engine without any structured-output
    # backend installed serves every other request; a constrained one is refused with the reason)
    selected_at_start: bool = True
    runner: Optional[str] = None  # chosen only for models of this runner ("pooling"); None: for every model


KINDS: dict[str, PluginKind] = {}


def plugin_kind(
    name: str,
    *,
    base: str,
    process: str,
    construction: str,
    config_key: Optional[str] = None,
    flags: tuple[str, ...] = (),
    choice_help: str = "",
    returns_classes: bool = True,
    off_value: Optional[str] = None,
    selected_at_start: bool = True,
    runner: Optional[str] = None,
) -> Callable[[_Spec], _Spec]:
    """Declare the kind whose hookspec this decorates (and mark the function as a hookspec)."""

    def declare(function: _Spec) -> _Spec:
        KINDS[name] = PluginKind(
            name,
            function.__name__,
            base,
            config_key,
            flags,
            process,
            construction,
            choice_help,
            returns_classes,
            off_value,
            selected_at_start,
            runner,
        )
        return hookspec(function)

    return declare


@plugin_kind(
    "attention",
    base="engine.interfaces.attention:AttentionBackend",
    process="worker",
    config_key="attention.backend",
    flags=("attention", "attention_backend"),
    construction="used as a class (static methods); each model layer builds "
    "get_impl_cls()(num_heads, head_size, scale, num_kv_heads, ...) and each KV-cache group "
    "get_builder_cls()(attention.options, device, block_size, sliding_window)",
    choice_help="AttentionBackend plugin; auto = first available by priority",
)
def engine_attention_backends() -> list[type]:
    """Return AttentionBackend subclasses (``engine.interfaces.attention``).

    Chosen by ``attention.backend``; ``auto`` takes the available one with the highest priority. The
    class itself is the backend: a worker asks it for the KV-cache shape, a metadata builder per KV-cache
    group (``builder_cls(attention.options, device, block_size, sliding_window)``, ``build`` once per step)
    and an impl per attention layer (``impl_cls(num_heads, head_size, scale, num_kv_heads, ...)``).
    """


@plugin_kind(
    "executor",
    base="engine.interfaces.executor:Executor",
    process="engine core",
    config_key="parallel.executor",
    flags=("executor", "distributed_executor_backend"),
    construction="cls(vllm_config, plugin_choices) once, in the engine-core process; it creates one "
    "engine.worker.Worker(vllm_config, plugin_choices, rank, distributed_init_method) per rank",
    choice_help="Executor plugin; auto = uniproc for one rank, multiproc otherwise",
)
def engine_executors() -> list[type]:
    """Return Executor subclasses (``engine.interfaces.executor``).

    Chosen by ``parallel.executor``; ``auto`` takes the available one with the highest priority (uniproc
    declares itself unavailable for more than one rank). Constructed once in the engine-core process as
    ``cls(vllm_config, plugin_choices)``; it creates a ``Worker(vllm_config, plugin_choices, rank,
    distributed_init_method)`` per rank, calls ``init_device`` then ``load_model`` on each, and answers
    ``collective_rpc(method, args)`` with one result per rank, rank 0 first.
    """


@plugin_kind(
    "kv_cache_coordinator",
    base="engine.interfaces.kv_cache:KVCacheCoordinator",
    process="engine core",
    config_key="cache.kv_cache_coordinator",
    construction="cls(kv_cache_config, block_pool, enable_caching, max_model_len) once, by the "
    "scheduler's KVCacheManager in the engine-core process",
    choice_help="KVCacheCoordinator plugin; auto derives it from the model and prefix caching",
)
def engine_kv_cache_coordinators() -> list[type]:
    """Return KVCacheCoordinator subclasses (``engine.interfaces.kv_cache``).

    Chosen by ``cache.kv_cache_coordinator``; ``auto`` takes the highest-priority available one whose
    ``preferred_for(ctx)`` holds for the model's KV-cache groups and the prefix-caching setting.
    Constructed once by the scheduler's KVCacheManager, in the engine-core process, as
    ``cls(kv_cache_config, block_pool, enable_caching, max_model_len)``.
    """


@plugin_kind(
    "sampler",
    base="engine.interfaces.sampler:Sampler",
    process="worker",
    config_key="sampler.name",
    flags=("sampler",),
    construction="cls(vllm_config) once per worker; called as sampler(logits, SamplingMetadata) "
    "every step that samples",
    choice_help="Sampler plugin; auto = highest priority available",
)
def engine_samplers() -> list[type]:
    """Return Sampler subclasses (``engine.interfaces.sampler``).

    Chosen by ``sampler.name``. Constructed once per worker as ``cls(vllm_config)``; called every step that
    samples as ``sampler(logits, metadata)`` with ``SamplingMetadata`` tensors (contract 1.3).
    """


@plugin_kind(
    "pooler",
    base="engine.interfaces.pooler:Pooler",
    process="worker",
    config_key="pooler.pooling_type",
    flags=("pooling_type",),
    runner="pooling",
    construction="cls(vllm_config) once per worker of a pooling model; pool(PoolingBatch) every step in which "
    "requests finish their prompt, with the hidden states of the positions its ``positions`` asks for",
    choice_help="Pooler plugin (last, mean, cls...): how a pooling model turns a prompt's hidden states into one "
    "vector; auto = the checkpoint's (sentence-transformers' pooling config; cls for encoders, last for decoders)",
)
def engine_poolers() -> list[type]:
    """Return Pooler subclasses (``engine.interfaces.pooler``): pooling methods of pooling models (embeddings,
    classifiers, rerankers).

    Chosen by ``pooler.pooling_type``; ``auto`` takes the highest-priority available one whose ``preferred_for(ctx)``
    holds (the built-in named by the checkpoint). Constructed once per worker of a pooling model as
    ``cls(vllm_config)``; ``pool(batch)`` gets, for each request that finished its prompt in the step, the hidden
    states of the positions the pooler's ``positions`` names (``last``, ``first`` or ``all``) and returns one vector
    per request. The engine then applies the model's head: an embedding's Matryoshka truncation and normalisation,
    or a classifier and its activation.
    """


@plugin_kind(
    "logits_processor",
    base="engine.interfaces.logits_processor:LogitsProcessor",
    process="worker",
    construction="cls(vllm_config) once per worker, every available one; requested_by(params) once per "
    "request, apply(logits, LogitsBatch) every step on the rows that asked",
)
def engine_logits_processors() -> list[type]:
    """Return LogitsProcessor subclasses (``engine.interfaces.logits_processor``).

    All available ones are active, in priority order; each acts only on the requests whose SamplingParams
    ask for it. Constructed once per worker as ``cls(vllm_config)``; ``requested_by(params)`` is asked once
    per request and ``apply(logits, batch)`` runs every step with a ``LogitsBatch`` (contract 1.3).
    """


@plugin_kind(
    "layer_kernels",
    base="engine.interfaces.layer_kernels:LayerKernels",
    process="worker",
    config_key="device.layer_kernels",
    flags=("layer_kernels",),
    construction="cls() once per worker, before the weights load; the model layers call its kernels",
    choice_help="LayerKernels plugin (fused RMSNorm / SiLU-mul / RoPE, packed GEMMs); "
    "auto = highest priority available, native = torch ops",
)
def engine_layer_kernels() -> list[type]:
    """Return LayerKernels subclasses (``engine.interfaces.layer_kernels``): fused RMSNorm,
    SiLU-and-multiply and RoPE for the model layers, and packed linear products.

    Chosen by ``device.layer_kernels``; ``auto`` takes the available one with the highest priority (the
    built-in ``native`` torch ops run everywhere). Constructed once per worker as ``cls()``, before the
    weights load (``prepare_weights`` and ``pack_linear`` see every weight).
    """


@plugin_kind(
    "quantization",
    base="engine.interfaces.quantization:QuantizationMethod",
    process="worker",
    config_key="model.quantization",
    flags=("quantization",),
    construction="cls() once per worker, before the weights load; packed_checkpoint_formats(model_info) "
    "says which checkpoint tensors load packed, process_weights_after_loading(model) makes "
    "the quantized weights, and the layer kernels' quantized_product_candidates run them",
    choice_help="QuantizationMethod plugin (how linear weights are stored): none = float weights (a GGUF "
    "file de-quantized at load), gguf = a GGUF file's Q4_0/Q4_1/Q8_0 blocks kept packed, int8 = "
    "weight-only int8 made at load; auto = gguf for a GGUF file under layer kernels that serve packed weights "
    "(cpu), none otherwise",
)
def engine_quantization_methods() -> list[type]:
    """Return QuantizationMethod subclasses (``engine.interfaces.quantization``).

    Chosen by ``model.quantization``; ``auto`` takes the highest-priority available one whose ``preferred_for(ctx)``
    holds (of the built-ins ``gguf`` for a GGUF file where the layer kernels serve packed weights
    (``LayerKernels.serves_packed_weights``), else ``none``; ``int8`` is chosen by name). Constructed once per
    worker as ``cls()``: the loader keeps the checkpoint tensors of ``packed_checkpoint_formats(model_info)``
    packed, then calls ``process_weights_after_loading(model)``, which sets ``module.quant_weight`` on the layers
    it quantizes.
    """


@plugin_kind(
    "proposer",
    base="engine.interfaces.proposer:Proposer",
    process="worker",
    config_key="speculative.method",
    flags=("speculative_method",),
    off_value="none",
    construction="cls(vllm_config) once per worker (rank 0 proposes; the scheduler sends its drafts to every "
    "rank); load(model_runner) after the target model loads; propose(ProposalBatch) after "
    "each step that samples, finished(req_ids) when requests leave the batch",
    choice_help="speculative-decoding Proposer plugin (ngram, suffix, draft_model...); none = no "
    "speculative decoding; auto = highest priority available",
)
def engine_spec_proposers() -> list[type]:
    """Return Proposer subclasses (``engine.interfaces.proposer``): ways of drafting tokens that the target
    model then verifies in one forward pass (speculative decoding).

    Chosen by ``speculative.method`` (``none``: off). Constructed once per worker as ``cls(vllm_config)``;
    ``load(model_runner)`` runs after the target model has loaded (a draft model loads its weights there).
    After every step that samples, rank 0's runner calls ``propose(batch)`` with each sampling row's tokens
    and gets up to ``batch.max_num_drafts[i]`` draft tokens per row back; the scheduler schedules them
    with the next step and the runner's rejection sampler keeps the ones the target model agrees with.
    """


@plugin_kind(
    "structured_output",
    base="engine.interfaces.structured_output:StructuredOutputBackend",
    process="api server and engine core",
    config_key="structured_outputs.backend",
    flags=("structured_outputs_backend", "guided_decoding_backend"),
    selected_at_start=False,
    construction="validate(params) (a classmethod) in the front end for every constrained request; "
    "cls(vllm_config, tokenizer, vocab_size, eos_token_id) once in the engine core, on the first "
    "constrained request; compile_grammar(params) on a worker thread, once per distinct "
    "constraint; new_matcher(compiled) per request",
    choice_help="structured-output backend plugin (xgrammar, guidance...) for json / regex / choice / "
    "grammar constraints; auto = highest priority available (xgrammar)",
)
def engine_structured_output_backends() -> list[type]:
    """Return StructuredOutputBackend subclasses (``engine.interfaces.structured_output``): grammar engines
    that constrain a request's output to a JSON schema, a regex, a choice or a grammar.

    Chosen by ``structured_outputs.backend`` when a constrained request first arrives (an engine without a
    backend serves unconstrained requests and refuses constrained ones with the reason). ``validate(params)``
    runs in the front end; in the engine core the class is constructed once as ``cls(vllm_config, tokenizer,
    vocab_size, eos_token_id)``, ``compile_grammar(params)`` runs on a worker thread (results are cached per
    distinct constraint) and ``new_matcher(compiled)`` gives each request its matcher, which fills the token
    bitmask applied before sampling and accepts the sampled tokens.
    """


@plugin_kind(
    "tool_parser",
    base="engine.interfaces.tool_parser:ToolParser",
    process="api server",
    config_key="server.tool_call_parser",
    flags=("tool_call_parser",),
    off_value="none",
    selected_at_start=False,
    construction="cls(tokenizer) per chat request with tool_choice 'auto'; extract_tool_calls(text) on the "
    "finished text, extract_tool_calls_streaming(previous_text, current_text, delta_text) per "
    "streamed delta",
    choice_help="tool-call parser plugin (hermes...) that turns the model's text into tool_calls for "
    "tool_choice 'auto'; none = 'auto' is refused (named and 'required' tool choices need no "
    "parser)",
)
def engine_tool_parsers() -> list[type]:
    """Return ToolParser subclasses (``engine.interfaces.tool_parser``): parsers that find tool calls in the
    text a model writes when it may call a tool (``tool_choice: "auto"``).

    Chosen by ``server.tool_call_parser`` (``none``: off). Constructed in the API server per chat request as
    ``cls(tokenizer)``; ``extract_tool_calls(text)`` splits a finished answer into content and tool calls,
    ``extract_tool_calls_streaming`` turns each streamed text delta into a content or tool-call delta.
    """


@plugin_kind(
    "reasoning_parser",
    base="engine.interfaces.reasoning_parser:ReasoningParser",
    process="api server",
    config_key="server.reasoning_parser",
    flags=("reasoning_parser",),
    off_value="none",
    selected_at_start=False,
    construction="cls(tokenizer) per chat or Responses request; extract_reasoning(text) on the finished text, "
    "extract_reasoning_streaming(current_text, finished) per streamed delta",
    choice_help="reasoning parser plugin (deepseek_r1, qwen3...) that splits a reasoning model's output into "
    "reasoning_content and content; none = the output is all content",
)
def engine_reasoning_parsers() -> list[type]:
    """Return ReasoningParser subclasses (``engine.interfaces.reasoning_parser``): parsers that split what a
    reasoning model writes into its reasoning and its answer (vLLM's ``--reasoning-parser``).

    Chosen by ``server.reasoning_parser`` (``none``: off). Constructed in the API server per request as
    ``cls(tokenizer)``; ``extract_reasoning(text)`` splits a finished output, ``extract_reasoning_streaming``
    turns the growing output into reasoning and answer deltas. ``start_text`` / ``end_text`` are the tags a
    thinking budget uses.
    """


@plugin_kind(
    "lora_resolver",
    base="engine.interfaces.lora_resolver:LoRAResolver",
    process="api server",
    construction="cls(vllm_config) once per API server, every available one; await resolve_lora(base_model_name, "
    "lora_name) in priority order for a request naming an adapter that is not loaded, until one answers",
)
def engine_lora_resolvers() -> list[type]:
    """Return LoRAResolver subclasses (``engine.interfaces.lora_resolver``): ways of finding a LoRA adapter by name
    when a request names one the server has not loaded (vLLM's ``lora_resolver`` plugins).

    Every available one is active (the built-in ``filesystem`` resolver when ``lora.lora_dir`` is set), asked in
    priority order. Constructed once per API server as ``cls(vllm_config)``; ``await resolve_lora(base_model_name,
    lora_name)`` returns a ``LoRARequest`` or None. The server checks what a resolver found (rank, shapes, allowed
    folders) like any adapter before serving it.
    """


@plugin_kind(
    "model",
    base="torch.nn:Module",
    process="worker",
    returns_classes=False,
    construction="registered by architecture (config.json's architectures); the worker's loader "
    "builds cls(hf_config) and calls load_weights(weights), which returns the loaded names",
)
def register_models(registry: Any) -> None:
    """Register model families: ``registry.register_model("Arch", cls_or_"package.module:Class")``.

    The architecture is matched on config.json's ``architectures``; a path is imported only when a model
    of that architecture loads. Plugins register after the built-ins, so they may override one. (The
    contract 1.0 form, ``engine_models`` returning a dict, is gone since 1.3.)
    """


REMOVED_HOOKS = {"engine_models": "removed in contract 1.3; register model families with register_models(registry)"}
