"""Attention backend interface: a backend class, a metadata builder and an implementation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import numpy as np
import torch

from engine.interfaces.base import Pluggable, SelectionContext

if TYPE_CHECKING:
    from engine.model.model_info import ModelInfo

_KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_kv_cache_dtype(requested: str, model_dtype: torch.dtype) -> torch.dtype:
    """``cache.kv_cache_dtype`` as a torch dtype: ``auto`` is the model's."""
    return model_dtype if requested == "auto" else _KV_CACHE_DTYPES[requested]


@dataclass
class CommonAttentionMetadata:
    """The batch as every backend sees it, built once per step by the model runner.

    Requests are laid out one after another in the flattened token dimension; request ``i`` owns
    query tokens ``query_start_loc[i]:query_start_loc[i+1]`` whose positions end at ``seq_lens[i]-1``.
    """

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: computed-before + scheduled now
    num_computed_tokens: torch.Tensor  # [B] int32: tokens already in the cache before this step
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    max_query_len: int
    max_seq_len: int
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    num_computed_tokens_np: np.ndarray

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_np)

    @property
    def num_actual_tokens(self) -> int:
        return int(self.query_start_loc_np[-1])


class AttentionMetadataBuilder(ABC):
    """Turns the common metadata into the backend's own tensors, once per step.

    ``batch_invariant`` (set by the model runner after construction when ``model.batch_invariant`` is on, on backends
    that support it): every query token must then be attended by the same computation whatever the step holds (no
    prompt path beside the decode path, no split of the context that depends on the batch)."""

    batch_invariant: bool = False

    def __init__(
        self, options: dict[str, Any], device: torch.device, block_size: int, sliding_window: Optional[int] = None
    ):
        self.options = options
        self.device = device
        self.block_size = block_size
        self.sliding_window = sliding_window

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Return the metadata object the implementation's ``forward`` receives."""


class AttentionImpl(ABC):
    """Computes attention for one layer and writes the new K/V into the paged cache."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
        options: Optional[dict[str, Any]] = None,
    ):
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.options = options or {}

    @abstractmethod
    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        """query [T, Hq*D], key/value [T, Hkv*D] -> output [T, Hq*D]; new K/V go into ``kv_cache``."""

    def forward_encoder_only(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, common: CommonAttentionMetadata
    ) -> torch.Tensor:
        """Encoder-only (bidirectional) attention, contract 1.15: every query token of a request attends to every
        token of that request, all of them in this step (``common.num_computed_tokens`` is 0: an encoder's prompt
        runs whole), with no KV cache. Shapes as ``forward``. Backends that implement it set
        ``AttentionBackend.supports_encoder_only``."""
        raise NotImplementedError(f"{type(self).__name__} has no encoder-only attention")


class MLAAttentionImpl(ABC):
    """Multi-head latent attention (DeepSeek-V2/V3) for one layer over a cache of one latent vector per token.

    The cache row of a token is ``kv_c_normed`` (``kv_lora_rank`` values) followed by its rotated ``k_pe``
    (``qk_rope_head_dim``). ``kv_b_weight`` [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] is this rank's
    slice of the layer's ``kv_b_proj``: it expands a latent into the per-head key (nope part) and value, or is
    absorbed into the query and output (decode).
    """

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_b_weight: torch.Tensor,
        options: Optional[dict[str, Any]] = None,
    ):
        self.num_heads = num_heads
        self.scale = scale
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_b_weight = kv_b_weight
        self.options = options or {}

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:
        """query [T, H, nope + rope] (rotated), kv_c_normed [T, kv_lora_rank], k_pe [T, rope] (rotated)
        -> output [T, H * v_head_dim]; the new latents go into ``kv_cache``."""


class AttentionBackend(Pluggable):
    """A named attention implementation: what it supports and the classes that do the work.

    A backend serves MLA models (DeepSeek-V2/V3) when ``get_mla_impl_cls`` returns an implementation; the same
    metadata builder serves both kinds. ``mla_unsupported_reason`` says why one does not.
    """

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    # cache dtypes (cache.kv_cache_dtype) this backend stores and reads under a float32 model, besides float32 itself;
    # every backend takes a cache of the model's own dtype
    supported_kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    supported_head_sizes: ClassVar[Optional[tuple[int, ...]]] = None  # None: any
    supported_block_sizes: ClassVar[Optional[tuple[int, ...]]] = None
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    mla_unsupported_reason: ClassVar[str] = "it has no MLA implementation"
    # encoder-only (bidirectional) attention for BERT-like pooling models: the impl's forward_encoder_only
    supports_encoder_only: ClassVar[bool] = False
    encoder_only_unsupported_reason: ClassVar[str] = "it implements causal (decoder) attention only"
    # why this backend cannot attend a token the same way in any batch (model.batch_invariant; selection refuses it
    # with this reason when the setting is on); None: it can
    batch_invariant_unsupported_reason: ClassVar[Optional[str]] = "it does not declare batch-invariant attention"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache; default: K and V stacked, [2, blocks, block_size, heads, dim]."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_mla_kv_cache_shape(num_blocks: int, block_size: int, head_size: int) -> tuple[int, ...]:
        """Shape of one MLA layer's cache: one latent row (kv_lora_rank + rope dims) per token."""
        return (num_blocks, block_size, head_size)

    @staticmethod
    def get_mla_impl_cls() -> Optional[type[MLAAttentionImpl]]:
        """The multi-head latent attention implementation; None: this backend cannot serve MLA models."""
        return None

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @classmethod
    def library_reasons(cls) -> list[str]:
        """Reasons tied to the environment (a missing library, no CUDA); override in plugins."""
        return []

    @classmethod
    def kv_cache_dtype_reason(cls, requested: str, info: ModelInfo) -> Optional[str]:
        """Why this backend cannot keep the model's K/V in ``requested`` (cache.kv_cache_dtype); None: it can."""
        cache_dtype = resolve_kv_cache_dtype(requested, info.dtype)
        if cache_dtype == info.dtype:
            return None
        name = f"cache.kv_cache_dtype={requested} under a {info.dtype_name} model"
        if info.dtype != torch.float32 and cache_dtype == torch.float32:
            return f"{name} unsupported: a wider cache than the model's K/V (auto keeps the model's dtype)"
        if info.dtype != torch.float32:
            return f"{name} unsupported: a 16-bit cache needs a float32 model (auto keeps the model's dtype)"
        if info.use_mla:
            return f"{name} unsupported: an MLA latent cache keeps the model's dtype"
        if cache_dtype not in cls.supported_kv_cache_dtypes:
            kept = ", ".join(str(d).removeprefix("torch.") for d in (torch.float32, *cls.supported_kv_cache_dtypes))
            return f"{name} unsupported (supports {kept})"
        return None

    @classmethod
    def unavailable_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = list(cls.library_reasons())
        if ctx.device not in cls.supported_devices:
            reasons.append(f"device {ctx.device} unsupported (supports {', '.join(cls.supported_devices)})")
        block_size = ctx.config.cache.block_size
        if cls.supported_block_sizes is not None and block_size not in cls.supported_block_sizes:
            reasons.append(f"block size {block_size} unsupported (supports {cls.supported_block_sizes})")
        info = ctx.model_info
        if info is not None:
            if info.dtype not in cls.supported_dtypes:
                reasons.append(f"dtype {info.dtype} unsupported")
            reason = cls.kv_cache_dtype_reason(ctx.config.cache.kv_cache_dtype, info)
            if reason:
                reasons.append(reason)
            if info.use_mla:
                if cls.get_mla_impl_cls() is None:
                    reasons.append(f"MLA (multi-head latent attention) unsupported: {cls.mla_unsupported_reason}")
            elif cls.supported_head_sizes is not None and info.head_size not in cls.supported_head_sizes:
                reasons.append(f"head size {info.head_size} unsupported (supports {cls.supported_head_sizes})")
            if info.is_encoder_only and not cls.supports_encoder_only:
                reasons.append(
                    f"encoder-only attention ({info.architecture}) unsupported: {cls.encoder_only_unsupported_reason}"
                )
            if info.sliding_window and not cls.supports_sliding_window:
                reasons.append("sliding-window attention unsupported")
            if info.attn_logit_softcapping and not cls.supports_logits_soft_cap:
                reasons.append("logits soft-capping unsupported")
        return reasons
