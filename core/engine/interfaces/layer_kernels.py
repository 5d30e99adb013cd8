"""LayerKernels interface: the kernels of the model layers (norms, activations, RoPE, linear products, the
fused mixture-of-experts operation, the batched LoRA product, Mamba's convolution and selective scan).

The layers call these instead of torch ops so that a device plugin can fuse them: one pass over
each row instead of one per torch op, or a matrix product on weights packed once at load.
``native`` (built in) is the torch code every other implementation is measured against; an
implementation may return new tensors or write in place where the method says it may.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Sequence

import torch

from engine.interfaces.base import Pluggable
from engine.interfaces.moe import ExpertsProduct, ExpertWeights, MoERouting

__all__ = [
    "CapturedDecodeStep",
    "DecodeCaptureUnsupported",
    "ExpertWeights",
    "ExpertsProduct",
    "LayerKernels",
    "MoERouting",
]

if TYPE_CHECKING:
    from engine.config import VllmConfig
    from engine.lora.mapping import LoRAMapping
    from engine.model.quant_formats import QuantizedExperts


class DecodeCaptureUnsupported(Exception):
    """Why a model's decode step cannot be captured (it then runs eagerly)."""


class CapturedDecodeStep:
    """A model's pure-decode step captured once and replayed without Python between its kernels (the role of
    CUDA graphs): the same kernels in the same order as the eager model, so the same bits."""

    max_batch_size: int = 0  # the most requests (one token each) a replay takes
    # True: the capture's attention also runs rows with a few query tokens past a computed context (as one decode
    # row per token, each seeing its causal prefix), so the runner offers it speculative decoding's verification
    # steps of up to max_batch_size tokens in all; it still returns None for any step it does not take
    takes_short_queries: bool = False
    # True (contract 1.14): the capture also replays steps whose tokens run LoRA adapters, adding each token's
    # adapter product as the eager layers' add_lora does (it reads the step's mapping from the layers' LoRALinear);
    # False: the runner runs such steps eagerly
    takes_lora_steps: bool = False

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: list[Any]
    ) -> Optional[torch.Tensor]:
        """The final hidden states of a step whose every token is a decode token, or None when this step is not
        one the capture takes (the runner then runs the model eagerly)."""
        raise NotImplementedError


class LayerKernels(Pluggable):
    """Kernels for RMSNorm, SiLU-and-multiply, rotary embeddings and the linear layers' products;
    chosen by ``device.layer_kernels``."""

    # why these kernels cannot keep a row's results independent of the other rows of a product (model.batch_invariant;
    # selection refuses them with this reason when the setting is on); None: they can, once configure() read it
    batch_invariant_unsupported_reason: ClassVar[Optional[str]] = "they do not declare batch-invariant kernels"

    @classmethod
    def serves_packed_weights(cls) -> bool:
        """Whether products on packed quantized weights run here about as fast as on float ones for batches and
        faster for a single stream (measured by the implementation's author, stated in its docs): ``auto``
        quantization then keeps a quantized checkpoint (GGUF) packed instead of de-quantizing it at load."""
        return False

    def configure(self, vllm_config: VllmConfig) -> None:
        """Read the engine's settings (the worker calls it once, before loading; ``device.kernel_cache`` says
        whether measured kernel choices may be read from the disk cache)."""

    def process_weights_after_loading(self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        """Prepare the loaded model's weights for these kernels (the loader calls it once, after every weight
        is loaded). By default every linear product goes through ``pack_linear``; a device's policy (such as
        keeping 16-bit weights in float32 on CPUs without 16-bit GEMMs) belongs in an override."""
        from engine.model.layers.packing import pack_linear_layers, pack_moe_layers

        pack_linear_layers(model, self.pack_linear)
        pack_moe_layers(model, self.pack_experts, self.pack_quantized_experts)

    def pack_linear(
        self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
    ) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """The product ``x @ weight.T + bias`` prepared once, at load, for this device (a weight
        reordered into the layout of a GEMM kernel), as a callable returning x's dtype; or None to
        keep the plain ``F.linear``. ``process_weights_after_loading`` calls it for every linear layer
        and the LM head; the layer keeps its plain weight beside the packed one."""
        return None

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * x / rms(x)`` over the last dimension, in float32, rounded to x's dtype before
        the weight product (Hugging Face's LlamaRMSNorm)."""

    @abstractmethod
    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``; x and residual may be overwritten."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` where ``x = [gate | up]`` on the last dimension."""

    @abstractmethod
    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        head_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """GPT-NeoX rotary embedding of query ``[T, H * D]`` and key ``[T, Hkv * D]``.

        ``cos`` and ``sin`` are ``[max_position, rotary_dim]`` float32 tables, ``sin`` carrying
        rotate_half's sign (``-sin`` on its first half); values past ``rotary_dim`` pass through.
        query and key may be rotated in place (they may be views of one fused QKV output).
        """

    def select_experts(
        self, router_logits: torch.Tensor, routing: MoERouting, correction_bias: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``routing.top_k`` experts from its router logits ``[T, E]``: ``(weights, ids)``, float32
        and int64, ``[T, top_k]``. The default is the torch reference every kernel is checked against."""
        from engine.model.layers.moe_reference import select_experts

        return select_experts(router_logits, routing, correction_bias)

    def pack_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> Optional[ExpertsProduct]:
        """The routed experts' products prepared once, at load (as ``pack_linear`` prepares a linear layer's): a
        callable ``(x, topk_weights, topk_ids, expert_map) -> [T, hidden]`` doing what ``fused_moe`` does, or None
        to keep the default. ``process_weights_after_loading`` calls it for every MoE layer, then releases the layer's
        plain expert weights (the product must hold what it reads)."""
        return None

    def pack_quantized_experts(self, w13: QuantizedExperts, w2: QuantizedExperts) -> ExpertsProduct:
        """The routed experts' products on packed quantized weights (``FusedMoE.quant_w13`` / ``quant_w2``, set by a
        quantization method such as ``int8``), as ``pack_experts`` prepares float ones. The default de-quantizes
        them once into float32 and packs those (``pack_experts``, else the torch reference); a kernel that reads
        the packed blocks overrides it."""
        from engine.model.layers.moe_reference import dequantize_experts, dequantized_experts_product

        w13_float, w2_float = dequantize_experts(w13), dequantize_experts(w2)
        return self.pack_experts(w13_float, w2_float) or dequantized_experts_product(w13_float, w2_float)

    def fused_moe(
        self, x: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' output ``[T, hidden]`` in x's dtype: for each token, the sum over its chosen experts
        held on this rank of ``weight x down(silu(gate(x)) * up(x))``, added in the order of the experts' ids (the
        caller all-reduces it over the ranks that share the experts). Through ``experts.packed`` where
        ``pack_experts`` made one; else the torch reference (tokens grouped by expert)."""
        if experts.packed is not None:
            return experts.packed(x, topk_weights, topk_ids, experts.expert_map)
        from engine.model.layers.moe_reference import fused_experts

        return fused_experts(x, experts.w13_weight, experts.w2_weight, topk_weights, topk_ids, experts.expert_map)

    def add_lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        mapping: LoRAMapping,
        out_slices: Optional[Sequence[tuple[int, int]]] = None,
    ) -> torch.Tensor:
        """The batched LoRA product (vLLM's punica shrink and expand) added to a linear layer's output: for every
        token ``t`` that runs with adapter slot ``s``, ``y[t] += lora_b[:, s] @ (lora_a[s] @ x[t])``. ``x`` ``[T, in]``,
        ``y`` ``[T, out]`` (may be updated in place; returned), ``lora_a`` ``[slots, R, in]`` and ``lora_b``
        ``[out, slots, R]`` (so that the first S slots of each are one matrix, ``[S * R, in]`` and ``[out, S * R]``;
        the scaling folded into B; a merged layer's slices side by side in R, B block-diagonal),
        ``mapping`` the step's tokens grouped by slot (:class:`~engine.lora.mapping.LoRAMapping`; tokens of the base
        model are in no group). ``out_slices`` (contract 1.14), where given: a merged layer's output slices
        ``(offset, size)``, slice ``i`` taking only B's columns ``i * R' .. (i + 1) * R'`` with
        ``R' = R / len(out_slices)`` (B is zero elsewhere in those rows), so that a kernel may skip B's zero blocks;
        None: B is dense. The default is the torch reference: one shrink and one expand per slot in use."""
        from engine.model.layers.lora_reference import add_lora

        return add_lora(y, x, lora_a, lora_b, mapping)

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        conv_state: torch.Tensor,
        query_start_loc: Sequence[int],
        activation: Optional[str] = "silu",
    ) -> torch.Tensor:
        """Mamba's causal depthwise convolution over requests laid end to end: x ``[T, C]``, weight ``[C, K]``,
        ``conv_state [R, C, K - 1]`` each request's last K - 1 inputs before its tokens (zeros for a request that
        starts), overwritten with its last K - 1 inputs after them. Returns ``[T, C]`` in x's dtype. The default
        is the torch reference."""
        from engine.model.layers.mamba_reference import causal_conv1d

        return causal_conv1d(x, weight, bias, conv_state, query_start_loc, activation)

    def mamba2_scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
        dt_bias: torch.Tensor,
        dt_limit: tuple[float, float],
        ssm_state: torch.Tensor,
        query_start_loc: Sequence[int],
        chunk_size: int,
    ) -> torch.Tensor:
        """Mamba2's selective scan over requests laid end to end: x ``[T, H, P]``, dt ``[T, H]`` (before
        ``softplus(dt + dt_bias)`` clamped to ``dt_limit``), A, D, dt_bias ``[H]``, B and C ``[T, G, N]``,
        ``ssm_state [R, H, P, N]`` each request's state (zeros for one that starts), overwritten with the state after
        its last token. Returns y ``[T, H, P]`` in float32 (``D * x`` included). A request of one token is the
        single-step update (decode), a longer one the chunked scan of ``chunk_size`` (prefill). The default is the
        torch reference."""
        from engine.model.layers.mamba_reference import mamba2_scan

        return mamba2_scan(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, query_start_loc, chunk_size)

    def selective_scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
        z: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_state: torch.Tensor,
        query_start_loc: Sequence[int],
    ) -> torch.Tensor:
        """Mamba1's selective scan (Jamba) over requests laid end to end: x, z and dt ``[T, D]`` (dt before
        ``softplus(dt + dt_bias)``), A ``[D, N]``, B and C ``[T, N]``, ``ssm_state [R, D, N]`` (zeros for a request that
        starts; overwritten with the state after its last token). Returns ``(h C + D x) * silu(z)`` ``[T, D]`` in
        float32. The default is the torch reference."""
        from engine.model.layers.mamba_reference import selective_scan

        return selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, query_start_loc)

    def capture_decode_step(self, model: torch.nn.Module, attention_layers: dict[str, Any]) -> CapturedDecodeStep:
        """The model's decode step captured for replay (after its KV caches are allocated, once per allocation),
        or ``DecodeCaptureUnsupported`` saying why not; the runner replays it unless ``model.enforce_eager``.
        By default the layers run eagerly."""
        raise DecodeCaptureUnsupported(f"the '{self.name}' layer kernels run the decode step eagerly")
