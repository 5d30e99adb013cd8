"""ModelRunner: keeps the workers' copy of each running request, builds the step's input tensors and
attention metadata, runs the model, and samples only at the positions that produce a token."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from engine.config import VllmConfig
from engine.distributed.parallel_state import get_tp_group
from engine.forward_context import set_forward_context
from engine.interfaces.attention import CommonAttentionMetadata
from engine.interfaces.layer_kernels import LayerKernels
from engine.interfaces.logits_processor import LogitsRequestView
from engine.interfaces.sampler import SamplingMetadata
from engine.kv_cache.spec import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from engine.model.layers.attention import Attention
from engine.model.loader import load_model
from engine.model.model_info import ModelInfo
from engine.sample.logprobs import TokenLogprobs, gather_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    """What the worker remembers of a request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt followed by outputs
    sampling_params: SamplingParams
    block_ids: list[list[int]]
    num_computed_tokens: int
    eos_token_id: Optional[int]
    block_id_arrays: list[np.ndarray] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    def refresh_block_arrays(self) -> None:
        self.block_id_arrays = [np.asarray(ids, dtype=np.int64) for ids in self.block_ids]


def step_generator(seed: int, output_index: int, device: torch.device) -> torch.Generator:
    """A generator for one sampling step of a seeded request: independent of batch and preemption."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


class ModelRunner:
    """One rank's model, KV caches, attention metadata builders, logits processors and sampler."""

    def __init__(self, vllm_config: VllmConfig, model_info: ModelInfo, device: torch.device,
                 attention_backend: type, sampler, logits_processors: list,
                 layer_kernels: Optional[LayerKernels] = None):
        self.vllm_config = vllm_config
        self.model_info = model_info
        self.device = device
        self.attention_backend = attention_backend
        self.sampler = sampler
        self.logits_processors = logits_processors
        self.layer_kernels = layer_kernels
        self.block_size = vllm_config.cache.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.model = None
        self.attention_layers: dict[str, Attention] = {}
        self.builders: list = []

    # ---- set-up --------------------------------------------------------------------------------
    def load_model(self) -> None:
        self.model = load_model(self.model_info, self.device, layer_kernels=self.layer_kernels)
        options = self.vllm_config.attention.options
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.bind(self.attention_backend, options)
                self.attention_layers[module.layer_name] = module

    def get_kv_cache_spec(self) -> dict[str, FullAttentionSpec]:
        specs = {}
        for name, layer in self.attention_layers.items():
            common = dict(block_size=self.block_size, num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
                          dtype=self.model_info.dtype)
            specs[name] = (SlidingWindowSpec(**common, sliding_window=layer.sliding_window)
                           if layer.sliding_window else FullAttentionSpec(**common))
        return specs

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the cache tensors in the backend's layout (layers of different groups may share one)
        and make one metadata builder per group."""
        self.builders = []
        own_specs = self.get_kv_cache_spec()  # this rank's heads (ranks may hold different KV-head counts)
        for names in kv_cache_config.shared_tensors():
            own = own_specs[names[0]]
            shape = self.attention_backend.get_kv_cache_shape(kv_cache_config.num_blocks, own.block_size,
                                                              own.num_kv_heads, own.head_size)
            tensor = torch.zeros(shape, dtype=own.dtype, device=self.device)
            for name in names:
                self.attention_layers[name].kv_cache = tensor
        for group_id, group in enumerate(kv_cache_config.groups):
            for name in group.layer_names:
                self.attention_layers[name].kv_cache_group = group_id
            self.builders.append(self.attention_backend.get_builder_cls()(
                self.vllm_config.attention.options, self.device, group.spec.block_size,
                getattr(group.spec, "sliding_window", None)))

    # ---- one step ------------------------------------------------------------------------------
    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            state = CachedRequestState(new.req_id, new.prompt_token_ids,
                                       list(new.prompt_token_ids) + list(new.output_token_ids),
                                       new.sampling_params, [list(ids) for ids in new.block_ids],
                                       new.num_computed_tokens, new.eos_token_id)
            state.refresh_block_arrays()
            self.requests[new.req_id] = state
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.num_computed_tokens = cached.num_computed_tokens
            if any(cached.new_block_ids):
                for ids, new_ids in zip(state.block_ids, cached.new_block_ids):
                    ids.extend(new_ids)
                state.refresh_block_arrays()

    def _prepare_inputs(self, scheduler_output: SchedulerOutput):
        req_ids = list(scheduler_output.num_scheduled_tokens)
        num_scheduled = np.fromiter(scheduler_output.num_scheduled_tokens.values(), dtype=np.int64,
                                    count=len(req_ids))
        states = [self.requests[req_id] for req_id in req_ids]
        computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        seq_lens = computed + num_scheduled
        total = int(query_start_loc[-1])
        # positions of every scheduled token, vectorised over the batch
        positions = np.arange(total, dtype=np.int64) - np.repeat(query_start_loc[:-1] - computed, num_scheduled)
        input_ids = np.concatenate([s.token_ids[c:c + n] for s, c, n in zip(states, computed, num_scheduled)])
        sampling_rows = np.nonzero(seq_lens == np.fromiter((len(s.token_ids) for s in states), dtype=np.int64,
                                                           count=len(states)))[0]
        metadata = []
        for group_id, builder in enumerate(self.builders):
            blocks = [s.block_id_arrays[group_id] for s in states]
            max_blocks = max(len(b) for b in blocks)
            block_table = np.zeros((len(states), max_blocks), dtype=np.int32)
            for row, ids in enumerate(blocks):
                block_table[row, :len(ids)] = ids
            token_rows = np.repeat(np.arange(len(states)), num_scheduled)
            slot_mapping = (block_table[token_rows, positions // self.block_size].astype(np.int64) * self.block_size
                            + positions % self.block_size)
            common = CommonAttentionMetadata(
                query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
                seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
                num_computed_tokens=torch.from_numpy(computed.astype(np.int32)),
                block_table=torch.from_numpy(block_table), slot_mapping=torch.from_numpy(slot_mapping),
                max_query_len=int(num_scheduled.max()), max_seq_len=int(seq_lens.max()),
                query_start_loc_np=query_start_loc, seq_lens_np=seq_lens, num_computed_tokens_np=computed)
            metadata.append(builder.build(common))
        logits_indices = torch.from_numpy(query_start_loc[1:][sampling_rows] - 1)
        return (req_ids, states, torch.from_numpy(input_ids).to(self.device),
                torch.from_numpy(positions).to(self.device), metadata, sampling_rows, logits_indices)

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in params]) if any(p.top_k > 0 for p in params) else None
        top_p = (torch.tensor([p.top_p for p in params], dtype=torch.float32)
                 if any(p.top_p < 1 for p in params) else None)
        generators = {row: step_generator(p.seed, len(s.output_token_ids), self.device)
                      for row, (p, s) in enumerate(zip(params, states)) if p.seed is not None and not p.greedy}
        greedy = [p.greedy for p in params]
        return SamplingMetadata(temperature, top_k, top_p, generators, all(greedy), not any(greedy))

    def _apply_logits_processors(self, logits: torch.Tensor, states: list[CachedRequestState]) -> None:
        for processor in self.logits_processors:
            rows = [row for row, s in enumerate(states) if processor.requested_by(s.sampling_params)]
            if rows:
                views = [LogitsRequestView(states[r].sampling_params, states[r].prompt_token_ids,
                                           states[r].output_token_ids, states[r].eos_token_id) for r in rows]
                processor.apply(logits, torch.tensor(rows), views)

    def _prompt_logprobs(self, hidden_states: torch.Tensor, states: list[CachedRequestState],
                         query_start_loc: np.ndarray) -> dict[str, list[TokenLogprobs]]:
        """Score the prompt tokens this step reaches: position p's logits rate prompt token p + 1."""
        result = {}
        for row, state in enumerate(states):
            k = state.sampling_params.prompt_logprobs
            num_prompt = len(state.prompt_token_ids)
            start, end = state.num_computed_tokens, state.num_computed_tokens + int(
                query_start_loc[row + 1] - query_start_loc[row])
            last = min(end, num_prompt - 1)  # the final prompt position predicts an output token
            if k is None or start >= last:
                continue
            rows = torch.arange(int(query_start_loc[row]), int(query_start_loc[row]) + last - start)
            targets = torch.tensor(state.prompt_token_ids[start + 1:last + 1])
            logprobs = self.model.compute_logits(hidden_states[rows.to(self.device)]).log_softmax(dim=-1)
            result[state.req_id] = gather_logprobs(logprobs.cpu(), targets, [k] * len(targets))
        return result

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput([], [])
        req_ids, states, input_ids, positions, metadata, sampling_rows, logits_indices = \
            self._prepare_inputs(scheduler_output)
        with set_forward_context(metadata):
            hidden_states = self.model(input_ids, positions)
        prompt_logprobs = {}
        if any(s.sampling_params.prompt_logprobs is not None for s in states):
            query_start_loc = np.concatenate([[0], np.cumsum(list(scheduler_output.num_scheduled_tokens.values()))])
            prompt_logprobs = self._prompt_logprobs(hidden_states, states, query_start_loc)
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if len(sampling_rows):
            logits = self.model.compute_logits(hidden_states[logits_indices.to(self.device)])
            sampling_states = [states[row] for row in sampling_rows]
            wants_logprobs = [i for i, s in enumerate(sampling_states) if s.sampling_params.logprobs is not None]
            raw_logprobs = logits[wants_logprobs].log_softmax(dim=-1) if wants_logprobs else None
            self._apply_logits_processors(logits, sampling_states)
            sampled = self.sampler(logits, self._sampling_metadata(sampling_states)).sampled_token_ids
            sampled = get_tp_group().broadcast(sampled.contiguous(), src=0)  # every rank keeps rank 0's tokens
            if wants_logprobs:
                entries = gather_logprobs(raw_logprobs.cpu(), sampled[wants_logprobs].cpu(),
                                          [sampling_states[i].sampling_params.logprobs for i in wants_logprobs])
                logprobs = {sampling_states[i].req_id: [entry] for i, entry in zip(wants_logprobs, entries)}
            for row, state, token_id in zip(sampling_rows, sampling_states, sampled.tolist()):
                state.token_ids.append(token_id)
                sampled_lists[row] = [token_id]
        return ModelRunnerOutput(req_ids, sampled_lists, logprobs, prompt_logprobs)
