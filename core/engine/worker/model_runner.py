"""ModelRunner: keeps the workers' copy of each running request in a persistent input batch, builds the
step's input tensors and attention metadata from it, runs the model, and samples only at the positions
that produce a token."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional, cast

import numpy as np
import torch

from engine.config import VllmConfig
from engine.distributed.parallel_state import get_pp_group, get_tp_group
from engine.forward_context import set_forward_context
from engine.interfaces.attention import CommonAttentionMetadata, resolve_kv_cache_dtype
from engine.interfaces.layer_kernels import CapturedDecodeStep, DecodeCaptureUnsupported, LayerKernels
from engine.interfaces.logits_processor import LogitsBatch
from engine.interfaces.pooler import Pooler, PoolingBatch
from engine.interfaces.proposer import ProposalBatch, Proposer
from engine.interfaces.sampler import SamplingMetadata
from engine.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from engine.lora.model_manager import LoRAModelManager
from engine.model.layers.attention import Attention, MLAAttention
from engine.model.layers.kernels import current_layer_kernels
from engine.model.layers.mamba_state import MambaLayer, MambaMetadataBuilder, MambaStateCache
from engine.model.layers.moe import expert_load
from engine.model.loader import load_model
from engine.model.model_info import ModelInfo
from engine.pooling.head import PoolingHead
from engine.pooling_params import PoolingParams
from engine.sample.logprobs import TokenLogprobs, gather_logprobs
from engine.sample.ops import sampling_probs
from engine.sampling_params import GREEDY_EPS
from engine.scheduler.output import ModelRunnerOutput, SchedulerOutput
from engine.spec_decode.rejection_sampler import rejection_sample
from engine.worker.input_batch import BatchFacts, CachedRequestState, InputBatch

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """What one step runs on, built from the persistent batch and the scheduler's plan (rows: batch rows)."""

    req_ids: list[str]  # the batch's requests, row order
    num_scheduled: np.ndarray  # [rows] tokens each row runs this step
    input_ids: torch.Tensor  # [tokens] on the model's device
    positions: torch.Tensor  # [tokens]
    attn_metadata: list[Any]  # one per KV-cache group, from its backend's builder
    query_start_loc: np.ndarray  # [rows + 1] where each row's tokens start
    sampling_rows: np.ndarray  # rows that produce a token this step (their prompt is complete)
    num_drafts: np.ndarray  # [sampling rows] speculative drafts each verifies
    logits_indices: torch.Tensor  # [positions to sample] token index of each, 1 + drafts per sampling row
    common: Optional[CommonAttentionMetadata] = None  # the first KV-cache group's (encoder-only attention reads it)


class ModelRunner:
    """One rank's model, KV caches, attention metadata builders, logits processors and sampler."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        model_info: ModelInfo,
        device: torch.device,
        attention_backend: Any,
        sampler: Any,
        logits_processors: list[Any],
        layer_kernels: Optional[LayerKernels] = None,
        quantization: Any = None,
        proposer: Optional[Proposer] = None,
        pooler: Optional[Pooler] = None,
    ):
        """``pooler``: a pooling model's pooling method (then nothing is sampled: requests end with their prompt)."""
        self.vllm_config = vllm_config
        self.model_info = model_info
        self.device = device
        self.attention_backend = attention_backend
        self.sampler = sampler
        self.logits_processors = logits_processors
        self.layer_kernels = layer_kernels
        self.quantization = quantization
        self.proposer = proposer  # speculative decoding; only rank 0's proposes
        self.pooler = pooler
        self.pooling_head: Optional[PoolingHead] = None  # made with the model
        self.pooling_params: dict[str, PoolingParams] = {}  # the pooling requests this worker holds
        self.pooling_parts: dict[str, list[torch.Tensor]] = {}  # hidden states of a prompt's earlier chunks
        self.num_speculative_tokens = vllm_config.speculative.num_speculative_tokens
        self.block_size = vllm_config.cache.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch: Optional[InputBatch] = None  # made with the KV caches (it needs their block sizes)
        self.model: Optional[torch.nn.Module] = None
        self.attention_layers: dict[str, Attention | MLAAttention] = {}
        self.mamba_layers: dict[str, MambaLayer] = {}
        self.builders: list[Any] = []
        self.lora_manager: Optional[LoRAModelManager] = None  # with lora.enable_lora: the adapters' slots
        self.decode_step: Optional[CapturedDecodeStep] = None  # the captured decode step, unless enforce_eager
        self.num_captured_steps = 0  # steps the capture ran (the rest ran eagerly)
        # the last step's sampling metadata, with the batch facts and the rows it was made for
        self._kept_sampling_metadata: Optional[tuple[BatchFacts, np.ndarray, SamplingMetadata]] = None

    @property
    def batch(self) -> InputBatch:
        """The persistent input batch (there once the KV caches are initialised)."""
        if self.input_batch is None:
            raise RuntimeError("the model runner has no input batch before initialize_kv_cache")
        return self.input_batch

    @property
    def loaded_model(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("the model runner has no model before load_model")
        return self.model

    # ---- set-up --------------------------------------------------------------------------------
    def load_model(self) -> None:
        self.model = load_model(
            self.model_info, self.device, layer_kernels=self.layer_kernels, quantization=self.quantization
        )
        if self.vllm_config.lora.enable_lora:
            self.lora_manager = LoRAModelManager(
                self.model,
                self.model_info.hf_config,
                self.vllm_config.lora,
                self.layer_kernels or current_layer_kernels(),
                self.device,
            )
        options = self.vllm_config.attention.options
        for module in self.model.modules():
            if isinstance(module, (Attention, MLAAttention)):
                module.bind(self.attention_backend, options)
                self.attention_layers[module.layer_name] = module
            elif isinstance(module, MambaLayer):
                self.mamba_layers[module.layer_name] = module
        if self.proposer is not None:
            self.proposer.load(self)
        if self.pooler is not None:
            assert self.model_info.pooling is not None
            self.pooling_head = PoolingHead(self.model, self.model_info.pooling, self.vllm_config.pooler)

    def product_tables(self) -> dict[str, Any]:
        """The linear products the layer kernels chose by measurement, as JSON: the float weights' table under
        ``float``, each quantized format's under its name (empty when the kernels measure none)."""
        kernels = self.layer_kernels or current_layer_kernels()
        tables: dict[str, Any] = {}
        table = getattr(kernels, "product_table", None)
        if table is not None:
            tables["float"] = table.to_json()
        for fmt, quantized in getattr(kernels, "quantized_tables", {}).items():
            tables[fmt] = quantized.to_json()
        return json.loads(json.dumps(tables, default=str))  # plain values only (a key holds torch's version)

    def expert_load(self) -> dict[int, list[int]]:
        """MoE models: tokens routed to each expert since start, per MoE layer of this rank (empty when dense)."""
        return expert_load(self.loaded_model)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """What the attention layers' caches hold (cache.kv_cache_dtype; auto: the model's dtype)."""
        return resolve_kv_cache_dtype(self.vllm_config.cache.kv_cache_dtype, self.model_info.dtype)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        specs: dict[str, KVCacheSpec] = {}
        for name, layer in self.attention_layers.items():
            shape = (self.block_size, layer.num_kv_heads, layer.head_size, self.kv_cache_dtype)
            if isinstance(layer, MLAAttention):
                specs[name] = MLAAttentionSpec(*shape)
            elif layer.sliding_window:
                specs[name] = SlidingWindowSpec(*shape, sliding_window=layer.sliding_window)
            else:
                specs[name] = FullAttentionSpec(*shape)
        for name, mamba in self.mamba_layers.items():
            specs[name] = MambaSpec(self.block_size, mamba.state_shapes(), mamba.state_dtype)
        return specs

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the cache tensors in the backend's layout (layers of different groups may share one)
        and make one metadata builder per group."""
        self.builders = []
        own_specs = self.get_kv_cache_spec()  # this rank's heads (ranks may hold different KV-head counts)
        group_specs = {name: group.spec for group in kv_cache_config.groups for name in group.layer_names}
        num_blocks = kv_cache_config.num_blocks
        for shared in kv_cache_config.shared_tensors():
            names = [name for name in shared if name in own_specs]  # a pipeline stage holds its layers' caches only
            if not names:
                continue
            tensor, block_dim = self._allocate_cache_tensor(names, own_specs, group_specs, num_blocks)
            for name in names:
                if name in self.mamba_layers:
                    spec = cast(MambaSpec, own_specs[name])
                    self.mamba_layers[name].state = MambaStateCache(tensor, block_dim, spec.shapes, spec.dtype)
                else:
                    self.attention_layers[name].kv_cache = tensor
        for group_id, group in enumerate(kv_cache_config.groups):
            for name in group.layer_names:
                layer: Any = self.attention_layers.get(name) or self.mamba_layers.get(name)
                if layer is not None:
                    layer.kv_cache_group = group_id
            builder_cls = (
                MambaMetadataBuilder if isinstance(group.spec, MambaSpec) else self.attention_backend.get_builder_cls()
            )
            builder = builder_cls(
                self.vllm_config.attention.options,
                self.device,
                group.spec.block_size,
                getattr(group.spec, "sliding_window", None),
            )
            builder.batch_invariant = self.vllm_config.model.batch_invariant
            self.builders.append(builder)
        self.input_batch = InputBatch(
            self.vllm_config.scheduler.max_num_seqs,
            self.model_info.max_model_len,
            [group.spec.block_size for group in kv_cache_config.groups],
            len(self.logits_processors),
        )
        self.decode_step = self._capture_decode_step()

    def _allocate_cache_tensor(
        self,
        names: list[str],
        own_specs: dict[str, KVCacheSpec],
        group_specs: dict[str, KVCacheSpec],
        num_blocks: int,
    ) -> tuple[torch.Tensor, int]:
        """One cache tensor for layers that share it, in the attention backend's layout of its first attention
        layer (at the group's block size, which a hybrid model raises), and the dimension that indexes blocks (the
        one that grows with the block count); Mamba layers view their pages in it. A tensor of Mamba layers only is
        plain pages."""
        attention = [name for name in names if name in self.attention_layers]
        if not attention:
            spec = cast(MambaSpec, group_specs[names[0]])
            elements = -(-spec.page_size_bytes // spec.dtype.itemsize)
            return torch.zeros((num_blocks, elements), dtype=spec.dtype, device=self.device), 0
        own = cast(FullAttentionSpec, own_specs[attention[0]])
        block_size = group_specs[attention[0]].block_size
        backend = self.attention_backend

        def shape_of(blocks: int) -> tuple[int, ...]:
            if isinstance(own, MLAAttentionSpec):
                return tuple(backend.get_mla_kv_cache_shape(blocks, block_size, own.head_size))
            return tuple(backend.get_kv_cache_shape(blocks, block_size, own.num_kv_heads, own.head_size))

        shape = shape_of(num_blocks)
        block_dim = next(d for d, (a, b) in enumerate(zip(shape, shape_of(num_blocks + 1))) if a != b)
        return torch.zeros(shape, dtype=own.dtype, device=self.device), block_dim

    def _capture_decode_step(self) -> Optional[CapturedDecodeStep]:
        """The layer kernels' capture of the pure-decode step over the caches just allocated (None: eager)."""
        if self.vllm_config.model.enforce_eager or self.layer_kernels is None or self.pooler is not None:
            return None  # (a pooling model never decodes)
        if get_pp_group().world_size > 1:
            logger.info("decode step not captured (it runs eagerly): a pipeline stage runs a slice of the model")
            return None
        try:
            step = self.layer_kernels.capture_decode_step(self.loaded_model, self.attention_layers)
        except DecodeCaptureUnsupported as reason:
            logger.info("decode step not captured (it runs eagerly): %s", reason)
            return None
        logger.info(
            "decode step captured by the '%s' layer kernels (pure decode steps of up to %d requests)",
            self.layer_kernels.name,
            step.max_batch_size,
        )
        return step

    def _run_model(self, inputs: StepInputs) -> Any:
        """The final hidden states: the captured decode step where it takes this step, else the eager model
        (also for a step where a token runs with a LoRA adapter, unless the capture takes such steps).
        A pipeline stage receives the previous stage's tensors first; all but the last return theirs."""
        lora = self.lora_manager
        if lora is None:
            return self._forward(inputs, use_capture=True)
        mapping = lora.set_step(self.batch.lora_int_id[: len(inputs.req_ids)], inputs.num_scheduled)
        try:
            takes_lora = self.decode_step is not None and self.decode_step.takes_lora_steps
            return self._forward(inputs, use_capture=mapping is None or takes_lora)
        finally:
            lora.clear_step()

    def _forward(self, inputs: StepInputs, use_capture: bool) -> Any:
        input_ids, positions, metadata = inputs.input_ids, inputs.positions, inputs.attn_metadata
        model: Any = self.loaded_model
        pp = get_pp_group()
        if pp.world_size > 1:
            intermediate = (
                None
                if pp.is_first_rank
                else pp.recv_tensor_dict(
                    model.make_empty_intermediate_tensors(len(positions), self.model_info.dtype, self.device)
                )
            )
            with set_forward_context(metadata, inputs.common):
                return model(input_ids, positions, intermediate)
        step = self.decode_step if use_capture else None
        if (
            step is not None
            and len(input_ids) <= step.max_batch_size
            and (int(inputs.num_scheduled.max()) == 1 or step.takes_short_queries)
        ):
            hidden_states = step(input_ids, positions, metadata)
            if hidden_states is not None:
                self.num_captured_steps += 1
                return hidden_states
        with set_forward_context(metadata, inputs.common):
            return model(input_ids, positions)

    # ---- one step ------------------------------------------------------------------------------
    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diff to the persistent batch: O(requests that changed) row writes."""
        batch = self.batch
        if self.proposer is not None and scheduler_output.finished_req_ids:
            self.proposer.finished([r for r in scheduler_output.finished_req_ids if r in self.requests])
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.pooling_params.pop(req_id, None)
            self.pooling_parts.pop(req_id, None)
            batch.remove_request(req_id)
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in batch.req_id_to_index.keys() - scheduled.keys():  # running, but not in this step
            batch.remove_request(req_id, self.requests[req_id])
        for new in scheduler_output.scheduled_new_reqs:
            batch.remove_request(new.req_id)  # a new-request record replaces whatever this worker held
            params = new.sampling_params
            state = CachedRequestState(
                new.req_id,
                new.prompt_token_ids,
                list(new.prompt_token_ids) + list(new.output_token_ids),
                params,
                [list(ids) for ids in new.block_ids],
                new.num_computed_tokens,
                new.eos_token_id,
                [p.requested_by(params) for p in self.logits_processors],
                new.lora_request.lora_int_id if new.lora_request is not None else 0,
            )
            self.pooling_parts.pop(new.req_id, None)  # a preempted prompt runs again from its start
            if new.pooling_params is not None:
                self.pooling_params[new.req_id] = new.pooling_params
            if new.lora_request is not None:
                if self.lora_manager is None:
                    raise ValueError(f"request {new.req_id} names a LoRA adapter but this worker has LoRA off")
                self.lora_manager.add_request(new.lora_request)
            self.requests[new.req_id] = state
            batch.add_request(state)
        for cached in scheduler_output.scheduled_cached_reqs:
            row = batch.req_id_to_index.get(cached.req_id)
            if row is None:  # back in the batch after a step without it
                state = self.requests[cached.req_id]
                for ids, new_ids in zip(state.block_ids, cached.new_block_ids):
                    ids.extend(new_ids)
                state.num_computed_tokens = cached.num_computed_tokens
                row = batch.add_request(state)
            else:
                batch.num_computed_tokens[row] = cached.num_computed_tokens
                if any(cached.new_block_ids):
                    batch.append_block_ids(row, cached.new_block_ids)
            if cached.new_token_ids:  # pipeline parallelism: tokens sampled by the last stage
                unseen = cached.num_computed_tokens + len(cached.new_token_ids) - int(batch.num_tokens[row])
                if unseen > 0:
                    batch.append_tokens(row, cached.new_token_ids[-unseen:])
        batch.condense()
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            batch.write_drafts(batch.req_id_to_index[req_id], drafts)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        batch = self.batch
        num_reqs = batch.num_reqs
        req_ids = cast(list[str], batch.req_ids[:num_reqs])  # the rows below num_reqs are filled (condensed)
        computed = batch.num_computed_tokens[:num_reqs]
        # every scheduled row runs at least one token, so as many tokens as rows is a pure decode step
        if scheduler_output.total_num_scheduled_tokens == num_reqs:  # row i's one token at its computed length
            num_scheduled = np.ones(num_reqs, dtype=np.int64)
            max_query_len = 1
            query_start_loc = np.arange(num_reqs + 1, dtype=np.int64)
            token_rows, positions = query_start_loc[:-1], computed.copy()  # the batch's counts move on after the step
            seq_lens = positions + 1
        else:
            num_scheduled = np.fromiter(
                map(scheduler_output.num_scheduled_tokens.__getitem__, req_ids), dtype=np.int64, count=num_reqs
            )
            max_query_len = int(num_scheduled.max())
            seq_lens = computed + num_scheduled
            query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
            np.cumsum(num_scheduled, out=query_start_loc[1:])
            token_rows = np.repeat(np.arange(num_reqs), num_scheduled)
            positions = np.arange(int(query_start_loc[-1]), dtype=np.int64) - np.repeat(
                query_start_loc[:-1] - computed, num_scheduled
            )
        input_ids = batch.token_ids[token_rows, positions].astype(np.int64)
        sampling_rows = np.nonzero(seq_lens >= batch.num_tokens[:num_reqs])[0]
        common_tensors = dict(
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            num_computed_tokens=torch.from_numpy(computed.astype(np.int32)),
        )
        metadata = []
        first_common: Optional[CommonAttentionMetadata] = None
        for builder, table in zip(self.builders, batch.block_tables):
            common = CommonAttentionMetadata(
                **common_tensors,
                block_table=torch.from_numpy(table.table(num_reqs)),
                slot_mapping=torch.from_numpy(table.slot_mapping(token_rows, positions)),
                max_query_len=max_query_len,
                max_seq_len=int(seq_lens.max()),
                query_start_loc_np=query_start_loc,
                seq_lens_np=seq_lens,
                num_computed_tokens_np=computed.copy(),
            )
            metadata.append(builder.build(common))
            first_common = first_common or common
        # a row with drafts samples at its last known token and at each draft: 1 + drafts positions
        spec = scheduler_output.scheduled_spec_decode_tokens
        num_drafts = (
            np.array([len(spec.get(req_ids[r], ())) for r in sampling_rows], dtype=np.int64)
            if spec
            else np.zeros(len(sampling_rows), dtype=np.int64)
        )
        ends = query_start_loc[1:][sampling_rows]
        if spec:
            logits_indices = np.repeat(ends, num_drafts + 1) - _counting_down(num_drafts + 1)
        else:
            logits_indices = ends - 1
        return StepInputs(
            req_ids,
            num_scheduled,
            torch.from_numpy(input_ids).to(self.device),
            torch.from_numpy(positions).to(self.device),
            metadata,
            query_start_loc,
            sampling_rows,
            num_drafts,
            torch.from_numpy(logits_indices),
            first_common,
        )

    def _sampling_metadata(self, rows: np.ndarray, offsets: Optional[np.ndarray] = None) -> SamplingMetadata:
        """The sampling rows' settings, sliced from the batch's persistent arrays (``offsets``: a logits row's
        position among its request's verified positions, with speculative decoding). Kept from the step before
        while the batch's requests and the rows are the same and no row is seeded (as vLLM's input batch keeps its
        sampling metadata): samplers read it and never write to it."""
        batch = self.batch
        facts = batch.facts()
        kept = self._kept_sampling_metadata
        reusable = offsets is None and not facts.any_seeded
        if reusable and kept is not None and kept[0] is facts and np.array_equal(kept[1], rows):
            return kept[2]
        metadata = self._new_sampling_metadata(rows, offsets)
        self._kept_sampling_metadata = (facts, rows.copy(), metadata) if reusable else None
        return metadata

    def _new_sampling_metadata(self, rows: np.ndarray, offsets: Optional[np.ndarray]) -> SamplingMetadata:
        batch = self.batch
        column = lambda name: batch.sampling_column(name)[rows]
        temperature = column("temperature")
        top_k, top_p = column("top_k"), column("top_p")
        greedy = temperature < GREEDY_EPS
        seeded = batch.seeded[rows]
        any_seeded = bool(seeded.any())
        return SamplingMetadata(
            temperature=torch.from_numpy(temperature),
            top_k=torch.from_numpy(top_k) if (top_k > 0).any() else None,
            top_p=torch.from_numpy(top_p) if (top_p < 1).any() else None,
            all_greedy=bool(greedy.all()),
            all_random=not greedy.any(),
            req_ids=[batch.req_ids[r] for r in rows],
            seeds=torch.from_numpy(batch.seeds[rows]) if any_seeded else None,
            seeded=torch.from_numpy(seeded) if any_seeded else None,
            output_index=torch.from_numpy(
                batch.num_tokens[rows] - batch.num_prompt_tokens[rows] + (0 if offsets is None else offsets)
            )
            if any_seeded
            else None,
        )

    def _apply_logits_processors(
        self, logits: torch.Tensor, rows: np.ndarray, offsets: Optional[np.ndarray] = None
    ) -> None:
        batch = self.batch
        if not self.logits_processors:
            return
        uses = batch.uses_processor[:, rows]  # [processors, rows]: one gather for all of them
        num_tokens = None if offsets is None else batch.num_tokens[rows] + offsets
        for index in np.flatnonzero(uses.any(axis=1)).tolist():  # only the processors some row asked for
            asked = np.nonzero(uses[index])[0]
            self.logits_processors[index].apply(
                logits,
                LogitsBatch(
                    torch.from_numpy(asked), batch, rows[asked], None if num_tokens is None else num_tokens[asked]
                ),
            )

    @staticmethod
    def _apply_grammar_bitmask(
        logits: torch.Tensor,
        scheduler_output: SchedulerOutput,
        req_ids: list[str],
        position_rows: np.ndarray,
        offsets: Optional[np.ndarray],
    ) -> None:
        """Structured outputs: -inf for the tokens a constrained row's grammar does not allow (only those rows
        are touched; tokens past the bitmask's vocabulary are never allowed). A request's logits row at draft
        offset i takes bitmask row first + i (its grammar after accepting the first i drafts)."""
        first_row_of = scheduler_output.structured_output_request_ids
        assert scheduler_output.grammar_bitmask is not None
        logit_rows, mask_rows = [], []
        for index, row in enumerate(position_rows.tolist()):
            first_row = first_row_of.get(req_ids[row])
            if first_row is not None:
                logit_rows.append(index)
                mask_rows.append(first_row + (int(offsets[index]) if offsets is not None else 0))
        if not logit_rows:
            return
        words = torch.from_numpy(np.ascontiguousarray(scheduler_output.grammar_bitmask[mask_rows]))
        bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.reshape(len(mask_rows), -1).bool()
        vocab = logits.shape[-1]
        if allowed.shape[1] < vocab:
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
        rows = torch.tensor(logit_rows, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab].to(logits.device), float("-inf"))

    def _prompt_logprobs(
        self, hidden_states: torch.Tensor, query_start_loc: np.ndarray
    ) -> dict[str, list[TokenLogprobs]]:
        """Score the prompt tokens this step reaches: position p's logits rate prompt token p + 1."""
        batch = self.batch
        model: Any = self.loaded_model
        result = {}
        for row in np.nonzero(batch.num_prompt_logprobs[: batch.num_reqs] >= 0)[0].tolist():
            state = self.requests[cast(str, batch.req_ids[row])]
            num_prompt = len(state.prompt_token_ids)
            start = int(batch.num_computed_tokens[row])
            end = start + int(query_start_loc[row + 1] - query_start_loc[row])
            last = min(end, num_prompt - 1)  # the final prompt position predicts an output token
            if start >= last:
                continue
            rows = torch.arange(int(query_start_loc[row]), int(query_start_loc[row]) + last - start)
            targets = torch.tensor(state.prompt_token_ids[start + 1 : last + 1])
            logprobs = model.compute_logits(hidden_states[rows.to(self.device)]).log_softmax(dim=-1)
            k = int(batch.num_prompt_logprobs[row])
            result[state.req_id] = gather_logprobs(logprobs.cpu(), targets, [k] * len(targets))
        return result

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """One step: the sampled tokens (and drafts, logprobs) of every scheduled request; None on a pipeline
        stage before the last, which hands its hidden states on instead."""
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput([], [])
        batch = self.batch
        inputs = self._prepare_inputs(scheduler_output)
        req_ids, sampling_rows, num_drafts = inputs.req_ids, inputs.sampling_rows, inputs.num_drafts
        hidden_states = self._run_model(inputs)
        if not get_pp_group().is_last_rank:  # hand the residual stream on; the last stage samples
            get_pp_group().send_tensor_dict(hidden_states)
            batch.num_computed_tokens[: len(req_ids)] += inputs.num_scheduled
            return None
        if self.pooler is not None:
            pooled = self._pool(inputs, hidden_states)
            batch.num_computed_tokens[: len(req_ids)] += inputs.num_scheduled
            return ModelRunnerOutput(req_ids, [[] for _ in req_ids], pooler_output=pooled)
        facts = batch.facts()
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        if facts.any_prompt_logprobs and (batch.num_prompt_logprobs[: len(req_ids)] >= 0).any():
            prompt_logprobs = self._prompt_logprobs(hidden_states, inputs.query_start_loc)
        batch.num_computed_tokens[: len(req_ids)] += inputs.num_scheduled
        if not len(sampling_rows):
            return ModelRunnerOutput(req_ids, [[] for _ in req_ids], {}, prompt_logprobs)
        model: Any = self.loaded_model
        # one logits row per sampled position: row i of sampling_rows owns 1 + num_drafts[i] of them
        speculating = bool(num_drafts.any())
        position_rows = np.repeat(sampling_rows, num_drafts + 1) if speculating else sampling_rows
        offsets = (
            (np.arange(len(position_rows)) - np.repeat(np.cumsum(num_drafts + 1) - num_drafts - 1, num_drafts + 1))
            if speculating
            else None
        )
        # the sampled positions rise strictly: as many as the tokens is every token (a pure decode step), no gather
        sampled_states = (
            hidden_states
            if len(inputs.logits_indices) == len(hidden_states)
            else hidden_states[inputs.logits_indices.to(self.device)]
        )
        logits = model.compute_logits(sampled_states)
        raw_logprobs = None
        if facts.any_logprobs:
            num_logprobs = batch.num_logprobs[position_rows]
            wants_logprobs = np.nonzero(num_logprobs >= 0)[0]
            if len(wants_logprobs):
                raw_logprobs = logits[torch.from_numpy(wants_logprobs)].log_softmax(dim=-1).cpu()
        if facts.any_processor:
            self._apply_logits_processors(logits, position_rows, offsets)
        if scheduler_output.grammar_bitmask is not None:
            self._apply_grammar_bitmask(logits, scheduler_output, req_ids, position_rows, offsets)
        sampling_metadata = self._sampling_metadata(position_rows, offsets)
        if speculating:
            assert offsets is not None
            emitted = self._verify_drafts(
                logits,
                sampling_metadata,
                position_rows,
                offsets,
                sampling_rows,
                num_drafts,
                scheduler_output.scheduled_spec_decode_tokens,
            )
        else:
            sampled = self.sampler(logits, sampling_metadata).sampled_token_ids
            sampled = get_tp_group().broadcast(sampled.contiguous(), src=0)  # every rank keeps rank 0's tokens
            sampled_ids = (sampled if sampled.device.type == "cpu" else sampled.cpu()).numpy()
            batch.append_sampled(sampling_rows, sampled_ids)
            emitted = [[token] for token in sampled_ids.tolist()]
        logprobs = (
            self._sampled_logprobs(raw_logprobs, wants_logprobs, num_logprobs, position_rows, emitted, num_drafts)
            if raw_logprobs is not None
            else {}
        )
        sampled_lists: list[list[int]]
        if len(sampling_rows) == len(req_ids):
            sampled_lists = emitted
        else:
            sampled_lists = [[] for _ in req_ids]
            for row, tokens in zip(sampling_rows.tolist(), emitted):
                sampled_lists[row] = tokens
        spec_token_ids = self._propose(sampling_rows) if self.proposer is not None else {}
        return ModelRunnerOutput(req_ids, sampled_lists, logprobs, prompt_logprobs, spec_token_ids)

    def _pool(self, inputs: StepInputs, hidden_states: torch.Tensor) -> dict[str, list[float]]:
        """Pooling requests: keep the hidden states the pooler reads from each prompt chunk; for every request whose
        prompt ends in this step, pool them and apply the head."""
        assert self.pooler is not None and self.pooling_head is not None
        batch = self.batch
        num_rows = len(inputs.req_ids)
        starts = batch.num_computed_tokens[:num_rows]
        ends_here = starts + inputs.num_scheduled >= batch.num_prompt_tokens[:num_rows]
        finished = np.nonzero(ends_here)[0]
        qsl = inputs.query_start_loc
        if self.pooler.positions == "last":  # one gather: each finished prompt's last position
            rows = torch.from_numpy(qsl[finished + 1] - 1).to(hidden_states.device)
            states = list(hidden_states[rows].unsqueeze(1))
        else:  # every chunk (all) or the first (first) kept until the prompt ends
            whole = self.pooler.positions == "all"
            for row in range(num_rows) if whole else np.nonzero(starts == 0)[0].tolist():
                chunk = hidden_states[qsl[row] : qsl[row] + (inputs.num_scheduled[row] if whole else 1)]
                # a prompt that goes on keeps a copy: a later step may reuse this step's buffer
                self.pooling_parts.setdefault(inputs.req_ids[row], []).append(
                    chunk if ends_here[row] else chunk.clone()
                )
            states = [torch.cat(self.pooling_parts.pop(inputs.req_ids[row])) for row in finished.tolist()]
        if not len(finished):
            return {}
        req_ids = [inputs.req_ids[row] for row in finished.tolist()]
        prompt_lens = batch.num_prompt_tokens[finished].tolist()
        pooled = self.pooler.pool(PoolingBatch(req_ids, states, prompt_lens))
        results = self.pooling_head(pooled, [self.pooling_params[req_id] for req_id in req_ids])
        return dict(zip(req_ids, results))

    def _verify_drafts(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        position_rows: np.ndarray,
        offsets: np.ndarray,
        sampling_rows: np.ndarray,
        num_drafts: np.ndarray,
        spec_tokens: dict[str, list[int]],
    ) -> list[list[int]]:
        """The rejection sampler over every row's drafts; appends the kept tokens to the batch and rolls the
        rows' computed-token counts back past the rejected drafts."""
        batch = self.batch
        num_rows, max_drafts = len(sampling_rows), int(num_drafts.max())
        starts = np.cumsum(num_drafts + 1) - num_drafts - 1
        # [rows, K + 1] logits row of each position; padding repeats the row's last (bonus) position
        index = torch.from_numpy(starts[:, None] + np.minimum(np.arange(max_drafts + 1)[None, :], num_drafts[:, None]))
        draft_ids = torch.full((num_rows, max_drafts), -1, dtype=torch.int64)
        for i, row in enumerate(sampling_rows.tolist()):
            drafts = spec_tokens.get(batch.req_ids[row], ())
            draft_ids[i, : len(drafts)] = torch.tensor(drafts, dtype=torch.int64)
        greedy = metadata.temperature[torch.from_numpy(starts)] < GREEDY_EPS
        # the sampler runs where its token can be emitted: every position of a greedy row (its argmax), the
        # bonus position of a sampled row (the others draw from the rejection rule)
        greedy_positions = batch.sampling_column("temperature")[position_rows] < GREEDY_EPS
        if self.vllm_config.model.batch_invariant:
            # coupled rule: every position draws as plain sampling would (its own counter), and drafts are kept
            # while they equal those draws: for drafts that are guesses (q a point mass) this keeps d with
            # probability p(d) and otherwise emits a draw of p without d, the rejection rule's law exactly, and
            # the tokens are those of the same request sampled without speculation
            greedy_positions = np.ones(len(position_rows), dtype=bool)
            greedy = torch.ones_like(greedy)
        wanted = np.nonzero(greedy_positions | (offsets == np.repeat(num_drafts, num_drafts + 1)))[0]
        sampled = torch.full((len(position_rows),), -1, dtype=torch.int64)
        sampled[torch.from_numpy(wanted)] = self.sampler(
            logits[torch.from_numpy(wanted).to(logits.device)],
            self._sampling_metadata(position_rows[wanted], offsets[wanted]),
        ).sampled_token_ids.cpu()
        target_probs: Any = None
        uniform: Optional[torch.Tensor] = None
        if not bool(greedy.all()):

            def target_probs_at(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
                at = index[rows, positions]
                settings = SimpleNamespace(
                    temperature=metadata.temperature[at],
                    top_k=None if metadata.top_k is None else metadata.top_k[at],
                    top_p=None if metadata.top_p is None else metadata.top_p[at],
                )
                return sampling_probs(logits[at.to(logits.device)], settings).cpu()

            target_probs = target_probs_at
            uniform = metadata.uniform(3)[:, 1:][index[:, :max_drafts]]
        emitted = rejection_sample(
            draft_ids, torch.from_numpy(num_drafts), sampled[index], greedy, target_probs, None, uniform
        )
        # every rank keeps rank 0's tokens: [rows, K + 1], -1 past each row's end
        padded = torch.full((num_rows, max_drafts + 1), -1, dtype=torch.int64)
        for i, tokens in enumerate(emitted):
            padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        padded = get_tp_group().broadcast(padded, src=0)
        emitted = [[t for t in tokens if t >= 0] for tokens in padded.tolist()]
        for row, tokens, drafted in zip(sampling_rows.tolist(), emitted, num_drafts.tolist()):
            batch.append_tokens(row, tokens)
            batch.num_computed_tokens[row] -= drafted - (len(tokens) - 1)
        return emitted

    def _sampled_logprobs(
        self,
        raw_logprobs: torch.Tensor,
        wants_logprobs: np.ndarray,
        num_logprobs: np.ndarray,
        position_rows: np.ndarray,
        emitted: list[list[int]],
        num_drafts: np.ndarray,
    ) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of every emitted token, from the raw logits of the position that produced it."""
        batch = self.batch
        starts = np.cumsum(num_drafts + 1) - num_drafts - 1
        raw_index = np.full(len(position_rows), -1, dtype=np.int64)
        raw_index[wants_logprobs] = np.arange(len(wants_logprobs))
        picks, tokens, counts, owners = [], [], [], []
        for i, row_tokens in enumerate(emitted):
            if raw_index[starts[i]] < 0:
                continue
            owners.append((batch.req_ids[position_rows[starts[i]]], len(row_tokens)))
            for j, token in enumerate(row_tokens):
                picks.append(raw_index[starts[i] + j])
                tokens.append(token)
                counts.append(int(num_logprobs[starts[i]]))
        entries = gather_logprobs(
            raw_logprobs[torch.from_numpy(np.array(picks, dtype=np.int64))],
            torch.tensor(tokens, dtype=torch.int64),
            counts,
        )
        logprobs: dict[str, list[TokenLogprobs]] = {}
        at = 0
        for req_id, count in owners:
            logprobs[req_id] = entries[at : at + count]
            at += count
        return logprobs

    def _propose(self, sampling_rows: np.ndarray) -> dict[str, list[int]]:
        """Drafts for the next step of the rows that sampled (rank 0 only: the scheduler sends them to all)."""
        if get_tp_group().rank != 0 or self.proposer is None:
            return {}
        batch = self.batch
        num_tokens = batch.num_tokens[sampling_rows]
        limit = np.minimum(self.num_speculative_tokens, self.model_info.max_model_len - num_tokens - 1)
        for i, row in enumerate(sampling_rows.tolist()):
            max_tokens = batch.params[row].max_tokens
            if max_tokens is not None:
                limit[i] = min(limit[i], max_tokens - (num_tokens[i] - batch.num_prompt_tokens[row]) - 1)
        req_ids = [batch.req_ids[row] for row in sampling_rows.tolist()]
        proposal = ProposalBatch(
            req_ids,
            batch.num_prompt_tokens[sampling_rows],
            np.maximum(limit, 0),
            batch.token_ids,
            sampling_rows,
            num_tokens,
        )
        drafts = self.proposer.propose(proposal)
        return {
            req_id: [int(t) for t in tokens[: int(cap)]]
            for req_id, tokens, cap in zip(req_ids, drafts, proposal.max_num_drafts)
            if len(tokens) and cap > 0
        }


def _counting_down(counts: np.ndarray) -> np.ndarray:
    """For counts [2, 3]: [2, 1, 3, 2, 1] (each group's distance from its end)."""
    total = int(counts.sum())
    group_ends = np.repeat(np.cumsum(counts), counts)
    return group_ends - np.arange(total)
