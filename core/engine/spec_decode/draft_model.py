"""The ``draft_model`` proposer: a smaller model with the target's vocabulary, run by the same worker with a
paged KV cache of its own, drafts ``num_speculative_tokens`` tokens per request autoregressively (greedy)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import ConfigError, ModelConfig
from engine.forward_context import set_forward_context
from engine.hookspecs import hookimpl
from engine.interfaces.attention import CommonAttentionMetadata, resolve_kv_cache_dtype
from engine.interfaces.proposer import ProposalBatch, Proposer
from engine.model.layers.attention import Attention
from engine.model.loader import load_model
from engine.model.model_info import resolve_model
from engine.sample.ops import greedy_tokens

logger = logging.getLogger(__name__)


@dataclass
class _DraftState:
    """One request in the draft model's cache: its blocks and how many of its tokens have draft KV."""

    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


class DraftModelProposer(Proposer):
    """Drafts with ``speculative.draft_model`` (a Hugging Face folder or GGUF file sharing the target's
    vocabulary). Each proposal first feeds the draft model the request's tokens it has not seen (the whole
    prompt the first time, then the tokens accepted since), then takes its argmax token by token; drafts are
    point-mass guesses to the rejection sampler. Its KV cache (``speculative.draft_kv_cache_memory``) is
    paged like the target's; a request that finds no free block gets no drafts that step."""

    name = "draft_model"
    priority = 0

    @classmethod
    def unavailable_reasons(cls, ctx) -> list[str]:
        spec = ctx.config.speculative
        reasons = []
        if not spec.draft_model:
            reasons.append(
                "speculative.draft_model names no model (a Hugging Face folder or .gguf file with the "
                "target's vocabulary)"
            )
        if ctx.config.parallel.tensor_parallel_size > 1:
            reasons.append("the draft model runs unsharded on rank 0: parallel.tensor_parallel_size must be 1")
        return reasons

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self.states: dict[str, _DraftState] = {}
        self.free_blocks: list[int] = []
        self.model = None

    def load(self, model_runner) -> None:
        spec = self.vllm_config.speculative
        target = model_runner.model_info
        info = resolve_model(
            ModelConfig(
                model=spec.draft_model,
                dtype=str(target.dtype).removeprefix("torch."),
                max_model_len=target.max_model_len,
            )
        )
        if info.vocab_size != target.vocab_size:
            raise ConfigError(
                f"speculative.draft_model: {spec.draft_model} has a vocabulary of {info.vocab_size} "
                f"tokens, the target model {target.vocab_size}; a draft model must share the "
                "target's tokenizer"
            )
        self.device = model_runner.device
        self.model = load_model(info, self.device, layer_kernels=model_runner.layer_kernels)
        self.block_size = model_runner.block_size
        backend = model_runner.attention_backend
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if any(layer.sliding_window for layer in layers):
            raise ConfigError(
                f"speculative.draft_model: {spec.draft_model} has sliding-window layers; the draft "
                "model's cache is one full-attention group"
            )
        requested = self.vllm_config.cache.kv_cache_dtype
        reason = backend.kv_cache_dtype_reason(requested, info)
        if reason:
            raise ConfigError(f"cache.kv_cache_dtype: the draft model {spec.draft_model}: {reason}")
        cache_dtype = resolve_kv_cache_dtype(requested, info.dtype)
        first = layers[0]
        block_bytes = 2 * self.block_size * first.num_kv_heads * first.head_size * cache_dtype.itemsize * len(layers)
        num_blocks = spec.draft_kv_cache_memory // block_bytes
        needed = -(-target.max_model_len // self.block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"speculative.draft_kv_cache_memory={spec.draft_kv_cache_memory} holds {num_blocks} "
                f"blocks; the draft model needs at least {needed} for one request of "
                f"{target.max_model_len} tokens"
            )
        shape = backend.get_kv_cache_shape(num_blocks, self.block_size, first.num_kv_heads, first.head_size)
        for layer in layers:
            layer.bind(backend, self.vllm_config.attention.options)
            layer.kv_cache = torch.zeros(shape, dtype=cache_dtype, device=self.device)
            layer.kv_cache_group = 0
        self.builder = backend.get_builder_cls()(self.vllm_config.attention.options, self.device, self.block_size, None)
        self.builder.batch_invariant = self.vllm_config.model.batch_invariant
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        logger.info("draft model %s loaded: %d KV blocks of its own", spec.draft_model, num_blocks)

    # ---- proposing ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in range(len(batch))]
        rows = [i for i in range(len(batch)) if batch.max_num_drafts[i] > 0 and self._reserve(batch, i)]
        if not rows:
            return drafts
        # the tokens each row's draft KV lacks (the prompt on first sight, the accepted tokens since), then greedy
        inputs = []
        for i in rows:
            state = self.states[batch.req_ids[i]]
            tokens = batch.token_ids(i)
            inputs.append((state.num_computed, tokens[state.num_computed :]))
            state.num_computed = len(tokens)
        next_tokens = self._forward(rows, batch, inputs)
        remaining = {i: int(batch.max_num_drafts[i]) for i in rows}
        while rows:
            for i, token in zip(rows, next_tokens):
                drafts[i].append(token)
            rows = [i for i in rows if len(drafts[i]) < remaining[i]]
            if not rows:
                break
            inputs = [(len(batch.token_ids(i)) + len(drafts[i]) - 1, np.array(drafts[i][-1:])) for i in rows]
            next_tokens = self._forward(rows, batch, inputs)
        return drafts

    def _reserve(self, batch: ProposalBatch, i: int) -> bool:
        """Blocks for the row's tokens and drafts; False (no drafts this step) when the draft cache is full."""
        state = self.states.setdefault(batch.req_ids[i], _DraftState())
        needed = -(-(len(batch.token_ids(i)) + int(batch.max_num_drafts[i])) // self.block_size)
        missing = needed - len(state.block_ids)
        if missing > len(self.free_blocks):
            return False
        state.block_ids.extend(self.free_blocks.pop() for _ in range(max(0, missing)))
        return True

    def _forward(self, rows: list[int], batch: ProposalBatch, inputs: list[tuple[int, np.ndarray]]) -> list[int]:
        """One draft-model pass: row r feeds ``inputs[r] = (first position, tokens)``; its argmax at the last."""
        query_lens = np.array([len(tokens) for _, tokens in inputs], dtype=np.int64)
        computed = np.array([start for start, _ in inputs], dtype=np.int64)
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        seq_lens = computed + query_lens
        positions = np.concatenate([np.arange(start, start + len(tokens)) for start, tokens in inputs])
        tables = [self.states[batch.req_ids[i]].block_ids for i in rows]
        table = np.zeros((len(rows), max(len(t) for t in tables)), dtype=np.int32)
        for r, ids in enumerate(tables):
            table[r, : len(ids)] = ids
        token_rows = np.repeat(np.arange(len(rows)), query_lens)
        slots = (
            table[token_rows, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            num_computed_tokens=torch.from_numpy(computed.astype(np.int32)),
            block_table=torch.from_numpy(table),
            slot_mapping=torch.from_numpy(slots),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_np=query_start_loc,
            seq_lens_np=seq_lens,
            num_computed_tokens_np=computed,
        )
        input_ids = torch.from_numpy(np.concatenate([tokens for _, tokens in inputs]).astype(np.int64)).to(self.device)
        with set_forward_context([self.builder.build(common)]):
            hidden_states = self.model(input_ids, torch.from_numpy(positions).to(self.device))
        logits = self.model.compute_logits(hidden_states[torch.from_numpy(query_start_loc[1:] - 1).to(self.device)])
        return greedy_tokens(logits).cpu().tolist()

    def finished(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            state = self.states.pop(req_id, None)
            if state is not None:
                self.free_blocks.extend(state.block_ids)


@hookimpl
def engine_spec_proposers():
    return [DraftModelProposer]
