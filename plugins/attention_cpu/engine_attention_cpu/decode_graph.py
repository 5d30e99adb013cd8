"""The ``cpu`` layer kernels' captured decode step: a Llama-shaped model's decoder-layer loop handed once to C++
(``csrc/decode_graph.cpp``, module ``_graph``) and replayed there for every pure-decode step, whatever its number of
requests, with no Python between the kernels: one graph per row bucket of the product choice
(``engine.model.layers.product_choice.ROW_BUCKETS``), each holding the products that bucket's rows run.

The capture records the tensors the eager layers use (packed products as chosen for each row bucket, norm
weights, RoPE tables, KV caches) and the graph calls the same C++ kernels in the same order, so a replayed step
gives the eager step's bits. Anything the C++ loop does not do as the eager layers do (another model family,
tensor parallelism, a product or attention backend outside this plugin) is refused with the reason, and the
step stays eager.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Callable, Optional

import torch

from engine.distributed.parallel_state import get_tp_group
from engine.interfaces.layer_kernels import CapturedDecodeStep, DecodeCaptureUnsupported
from engine.lora.mapping import PunicaWrapper
from engine.model.layers.activation import SiluAndMul
from engine.model.layers.norm import RMSNorm
from engine.model.layers.product_choice import ROW_BUCKETS, BucketedProduct
from engine.model.layers.rotary import RotaryEmbedding
from engine.model.layers.vocab import VocabParallelEmbedding
from engine.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from engine_attention_cpu.attention import CpuAttentionImpl, CpuAttentionMetadata
from engine_attention_cpu.gemm import CpuPackedLinear
from engine_attention_cpu.quant import QuantDotProduct, row_lookup

UNBOUNDED_ROWS = 2**31 - 1  # the last row bucket's graph takes a step of any size


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise DecodeCaptureUnsupported(reason)


def _same_forward(module: Any, reference: Any) -> bool:
    """The module runs ``reference``'s forward (a subclass may change only what the capture reads as data)."""
    return type(module).forward is reference.forward


def product_spec(name: str, product, rows: tuple[float, float] = (0, ROW_BUCKETS[0].max_rows)) -> tuple:
    """The C++ description of the product a linear layer runs at more than ``rows[0]`` and at most ``rows[1]`` rows
    (a product from outside this plugin, such as torch's where it measured faster on a shape, is called back in
    Python)."""
    if isinstance(product, BucketedProduct):
        low, high = rows
        # past the last entry's rows the dispatch keeps the last product
        max_rows, product = next(((m, p) for m, p in product.products if m > low), (math.inf, product.products[-1][1]))
        _require(max_rows >= high, f"{name}: its product changes between {low + 1} and {high} rows")
    if isinstance(product, CpuPackedLinear):
        return ("gemm", product.panels, product.bias, product.out_features, product.variant_id)
    if isinstance(product, QuantDotProduct):
        return (
            "quant",
            product.data,
            product.scales,
            product.bias,
            product.format_id,
            product.variant_id,
            product.out_features,
        )
    _require(product is not None, f"{name} has no packed product (the plain torch product runs in the layer)")
    return ("python", product)  # a product measured faster than this plugin's: the graph calls it back


def _check_layer(index: int, layer: Any, kernels: Any) -> None:
    where = f"layer {index}"
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    _require(_same_forward(layer, LlamaDecoderLayer), f"{where} is a {type(layer).__name__}, not a Llama layer")
    _require(
        attn is not None and _same_forward(attn, LlamaAttention) and attn.qk_norm_cls is None,
        f"{where}'s attention is not Llama's (q/k norms or another forward)",
    )
    _require(
        mlp is not None and _same_forward(mlp, LlamaMLP) and type(mlp.act_fn) is SiluAndMul,
        f"{where}'s MLP is not Llama's SiLU-gated MLP",
    )
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        _require(
            _same_forward(norm, RMSNorm) and norm.kernels is kernels,
            f"{where}'s norms are not RMSNorms on these layer kernels",
        )
    _require(
        _same_forward(attn.rotary_emb, RotaryEmbedding) and attn.rotary_emb.kernels is kernels,
        f"{where}'s rotary embedding is not RotaryEmbedding on these layer kernels",
    )
    impl = attn.attn.impl
    _require(
        type(impl).forward is CpuAttentionImpl.forward,
        f"{where}'s attention backend is {type(impl).__name__}, not this plugin's 'cpu' backend",
    )
    _require(
        attn.attn.kv_cache is not None and attn.attn.kv_cache_group == 0,
        f"{where}'s KV cache is not in the first cache group (sliding-window groups stay eager)",
    )


def token_embedding(decoder: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The step's embedding: a quantized table (GGUF's) looked up in one C++ call, which gives the eager lookup's
    bits (its rows de-quantized) without its torch operations, each slow in a step whose weight reads have just
    evicted the interpreter's caches; any other table, the decoder's own ``embed``."""
    table: Any = getattr(decoder, "embed_tokens", None)
    quant = getattr(table, "quant_weight", None)
    if (
        quant is None
        or type(decoder).embed is not LlamaModel.embed
        or type(table).forward is not VocabParallelEmbedding.forward
        or type(table)._lookup is not VocabParallelEmbedding._lookup
    ):
        return decoder.embed
    lookup, dtype = row_lookup(quant), table.weight.dtype
    if dtype == torch.float32:
        return lookup
    return lambda ids: lookup(ids).to(dtype)


class CpuCapturedDecodeStep(CapturedDecodeStep):
    """The decoder-layer loop of one model in C++, one graph per row bucket; embedding in Python before it (one
    call). With LoRA layers, a step whose tokens run adapters replays too: the graph adds each token's adapter
    product after each base product, with the LoRA kernel the eager layers call (``csrc/lora.cpp``)."""

    takes_short_queries = True  # the cpu attention metadata runs a short query as one decode row per token
    takes_lora_steps = True

    def __init__(self, model: Any, graphs: list[tuple[float, Any]], punica: Optional[PunicaWrapper] = None):
        self.model = model
        self.graphs = graphs  # (most rows, graph), ascending
        self.max_batch_size = int(min(graphs[-1][0], UNBOUNDED_ROWS))
        self.punica = punica  # the step's LoRA mapping, shared with the layers (None: no LoRA layers)
        self.embed = token_embedding(model.model)

    def __call__(self, input_ids, positions, attn_metadata) -> Optional[torch.Tensor]:
        if len(attn_metadata) != 1:
            return None
        metadata = attn_metadata[0]
        if not isinstance(metadata, CpuAttentionMetadata) or not metadata.all_decode:
            return None  # the runner checked the token count; all_decode: every token runs as a decode row
        rows = len(input_ids)
        graph = next((g for max_rows, g in self.graphs if rows <= max_rows), None)
        if graph is None:
            return None
        mapping = self.punica.mapping if self.punica is not None else None
        hidden_states = self.embed(input_ids).contiguous()
        return graph.run(
            hidden_states,
            positions,
            metadata.slot_mapping,
            metadata.decode_block_table,
            metadata.decode_seq_lens,
            None if mapping is None else mapping.token_slots,
        )


def capture_decode_step(kernels: Any, model: Any, attention_layers: dict[str, Any]) -> CpuCapturedDecodeStep:
    """The C++ decode graph of ``model`` over its current KV caches; DecodeCaptureUnsupported with the reason
    where its decode step is not one the graph runs as the eager layers do."""
    _require(
        importlib.util.find_spec("engine_attention_cpu._graph") is not None,
        "the decode graph is not built (pip install --no-build-isolation plugins/attention_cpu)",
    )
    _require(get_tp_group().world_size == 1, "tensor-parallel ranks all-reduce between the products")
    _require(
        _same_forward(model, LlamaForCausalLM)
        and isinstance(getattr(model, "model", None), torch.nn.Module)
        and _same_forward(model.model, LlamaModel),
        f"{type(model).__name__} is not a Llama-shaped model (Llama, SmolLM2, Mistral, Qwen2)",
    )
    decoder = model.model
    _require(
        _same_forward(decoder.norm, RMSNorm) and decoder.norm.kernels is kernels,
        "the final norm is not an RMSNorm on these layer kernels",
    )
    _require(len(attention_layers) == len(decoder.layers), "attention layers outside the decoder layers")
    for index, layer in enumerate(decoder.layers):
        _check_layer(index, layer, kernels)
        _require(
            layer.input_layernorm.eps == layer.post_attention_layernorm.eps,
            f"layer {index}'s two norms differ in epsilon",
        )
    punica = _lora_punica(decoder, kernels)
    graphs, low = [], 0.0
    for bucket in ROW_BUCKETS:
        graphs.append((bucket.max_rows, _decode_graph(decoder, (low, bucket.max_rows))))
        low = bucket.max_rows
    return CpuCapturedDecodeStep(model, graphs, punica)


def _lora_layers(layer: Any) -> list[Any]:
    """The LoRA layers (LoRALinear or None) of a decoder layer's four products, in the graph's order."""
    attn, mlp = layer.self_attn, layer.mlp
    return [getattr(module, "lora", None) for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]


def _lora_punica(decoder: Any, kernels: Any) -> Optional[PunicaWrapper]:
    """The mapping holder the model's LoRA layers share (None without LoRA), once the graph can add their products
    as the eager layers do: through this plugin's LoRA kernel."""
    loras = [lora for layer in decoder.layers for lora in _lora_layers(layer) if lora is not None]
    if not loras:
        return None
    _require(kernels.lora_kernel_built(), "the LoRA kernel (_lora) is not built: LoRA layers run eagerly")
    _require(all(lora.kernels is kernels for lora in loras), "LoRA layers on other layer kernels")
    _require(all(lora.punica is loras[0].punica for lora in loras), "LoRA layers with several step mappings")
    return loras[0].punica


def _lora_spec(lora: Any) -> Optional[tuple]:
    if lora is None:
        return None
    return (lora.lora_a, lora.lora_b, [offset for offset, _ in lora.out_slices], [size for _, size in lora.out_slices])


def _decode_graph(decoder: Any, rows: tuple[float, float]) -> Any:
    """The C++ graph of the decoder's layers with the products that steps of ``rows`` (low, high] rows run."""
    from engine_attention_cpu import _graph

    graph = _graph.DecodeGraph()
    for index, layer in enumerate(decoder.layers):
        attn, mlp = layer.self_attn, layer.mlp
        products = [
            product_spec(f"layer {index}'s {name}", module.packed, rows)
            for name, module in (
                ("qkv_proj", attn.qkv_proj),
                ("o_proj", attn.o_proj),
                ("gate_up_proj", mlp.gate_up_proj),
                ("down_proj", mlp.down_proj),
            )
        ]
        inner = attn.attn
        graph.add_layer(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            float(layer.input_layernorm.eps),
            products,
            attn.o_proj.bias,
            mlp.down_proj.bias,
            inner.num_heads,
            inner.num_kv_heads,
            inner.head_size,
            float(inner.scale),
            float(inner.logits_soft_cap or 0.0),
            int(inner.sliding_window or 0),
            attn.rotary_emb.table.cos,
            attn.rotary_emb.table.sin,
            inner.kv_cache,
            [_lora_spec(lora) for lora in _lora_layers(layer)],
        )
    graph.set_final_norm(decoder.norm.weight, float(decoder.norm.eps))
    return graph
