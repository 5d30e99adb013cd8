"""`engine bench kernels` and the bound in `engine bench throughput`: the linear products chosen by
measurement for a model on this machine, and the fastest a workload could run if every FLOP went at the best
product's rate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.model.layers.product_choice import ROW_BUCKETS, ProductTable, choose_products, model_shapes


@dataclass
class KernelReport:
    layer_kernels: str
    dtype: torch.dtype
    table: ProductTable
    model: torch.nn.Module  # built on the meta device: shapes only, no weights
    hf_config: Any


def measure_products(overrides: dict[str, Any], use_cache: bool = True) -> KernelReport:
    """The product table the engine's layer kernels would use for this config's model (the same candidates,
    shapes, threads and disk cache as a worker loading it)."""
    from engine.config import VllmConfig
    from engine.interfaces.base import SelectionContext
    from engine.model.layers.gemm import cpu_has_half_gemm
    from engine.model.layers.kernels import use_layer_kernels
    from engine.model.loader import _default_dtype, get_model_class
    from engine.model.model_info import resolve_model
    from engine.plugins import get_plugin_manager

    config = VllmConfig.load(**overrides)
    info = resolve_model(config.model)
    if config.device.num_threads:
        torch.set_num_threads(config.device.num_threads)
    chosen = get_plugin_manager().select(
        "layer_kernels", config.get_key("device.layer_kernels"), SelectionContext(config, info)
    )
    kernels = chosen.cls()
    kernels.configure(config)
    if not hasattr(kernels, "product_candidates"):
        raise SystemExit(f"layer kernels '{chosen.name}' do not choose their products by measurement")
    with _default_dtype(info.dtype), torch.device("meta"), use_layer_kernels(kernels):
        model = get_model_class(info.architecture)(info.hf_config)
    widened = info.dtype != torch.float32 and not cpu_has_half_gemm(info.dtype)
    table = choose_products(
        model_shapes(model),
        kernels.product_candidates(info.dtype),
        info.dtype,
        torch.float32 if widened else info.dtype,
        use_cache=use_cache and config.device.kernel_cache,
    )
    return KernelReport(chosen.name, info.dtype, table, model, info.hf_config)


def workload_bound(report: KernelReport, prompt_lens: list[int], output_lens: list[int]) -> dict:
    """FLOPs of a workload through this model (linear layers on every token, the LM head on the sampled
    positions, attention's two products per layer) and the least time they take at the best measured product
    rates: prompt tokens at the prompt-chunk rate, decode tokens at the decode rate. No engine can beat it."""
    from engine.model.layers.linear import linear_layers

    choices = report.table.choices
    layers = [m.weight.shape for m in linear_layers(report.model)]
    prompt_tokens, output_tokens = sum(prompt_lens), sum(output_lens)
    decode_tokens = sum(max(0, o - 1) for o in output_lens)  # the first output token comes from the prompt step
    seconds = flops = 0.0
    for n, k in layers:
        choice = choices[f"{n}x{k}"]
        for tokens, bucket in ((prompt_tokens, "prompt"), (decode_tokens, "decode")):
            flop = 2.0 * n * k * tokens
            flops += flop
            seconds += flop / (choice.best_gflops(bucket) * 1e9)
    head = next((c for c in choices.values() if c.shape.is_head), None)
    if head is not None:
        flop = 2.0 * head.shape.out_features * head.shape.in_features * output_tokens
        flops += flop
        seconds += flop / (head.best_gflops("decode") * 1e9)
    attention = _attention_flops(report.hf_config, prompt_lens, output_lens)
    best = max(c.best_gflops(b.name) for c in choices.values() for b in ROW_BUCKETS if b.name in c.gflops)
    flops += attention
    seconds += attention / (best * 1e9)
    experts = _active_expert_flops(report.model)  # MoE: only the experts each token is routed to
    for tokens, bucket in ((prompt_tokens, "prompt"), (decode_tokens, "decode")):
        rate = max(c.best_gflops(bucket) for c in choices.values() if bucket in c.gflops)
        flops += experts * tokens
        seconds += experts * tokens / (rate * 1e9)
    total_tokens = prompt_tokens + output_tokens
    return {
        "workload_flop": flops,
        "attention_flop": attention,
        "workload_tflop": round(flops / 1e12, 3),
        "attention_tflop": round(attention / 1e12, 3),
        "active_expert_flop_per_token": experts,
        "bound_seconds": seconds,
        "bound_tokens_per_s": round(total_tokens / seconds, 1),
        "best_gflops": round(best, 1),
    }


def _active_expert_flops(model) -> float:
    """FLOPs per token in the routed experts of every MoE layer: each of its top-k experts runs its gate/up and down
    products (3 products of hidden x intermediate); experts a token is not routed to cost nothing."""
    from engine.model.layers.moe import moe_layers

    return sum(
        6.0 * layer.routing.top_k * layer.w2_weight.shape[1] * layer.intermediate_per_rank
        for layer in moe_layers(model)
    )


def _attention_flops(hf, prompt_lens: list[int], output_lens: list[int]) -> float:
    """Two products (scores, weighted values) of 2 * heads * head_size FLOPs per (query, key) pair, causal."""
    heads = hf.num_attention_heads
    head_size = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    pairs = 0
    for p, o in zip(prompt_lens, output_lens):
        pairs += p * (p + 1) // 2  # prompt: each query sees the keys before it
        pairs += sum(p + i for i in range(1, o))  # decode: the i-th new token sees p + i keys
    return 4.0 * heads * head_size * pairs * hf.num_hidden_layers


def print_table(report: KernelReport) -> None:
    rows = report.table.rows()
    names = sorted({k[:-7] for r in rows for k in r if k.endswith("_gflops")})
    header = ["shape", "bucket", "rows", *(f"{n} GFLOP/s" for n in names), "chosen"]
    cells = [
        [
            r["shape"],
            r["bucket"],
            str(r["rows"]),
            *(f"{r.get(n + '_gflops', float('nan')):.1f}" for n in names),
            r["chosen"],
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))
