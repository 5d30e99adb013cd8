"""The ``suffix`` proposer (suffix decoding, as Snowflake's Arctic Inference does it): match the request's
latest tokens in suffix trees of its own prompt and output and of recent requests' outputs, and draft the
most frequent continuation, as long as the match and the continuation's frequency justify."""

from __future__ import annotations

import math
from collections import OrderedDict

from engine.hookspecs import hookimpl
from engine.interfaces.proposer import ProposalBatch, Proposer
from engine.spec_decode.suffix_tree import SuffixNode, SuffixTrie, draft_from


class _RequestIndex:
    """One request's own trie, the open suffixes of its tokens in it and in the global trie."""

    def __init__(self, max_depth: int):
        self.trie = SuffixTrie(max_depth)
        self.active: list[SuffixNode] = [self.trie.root]
        self.global_active: list[SuffixNode] = []
        self.global_version = -1
        self.num_prompt_tokens = 0
        self.tokens: list[int] = []


class SuffixProposer(Proposer):
    """Drafts from the best of two matches: the request's own tokens, and the outputs of up to
    ``suffix_max_cached_requests`` recent requests (repetitive, agent-style traffic). A match of m tokens
    drafts at most ``suffix_max_spec_factor * m + suffix_max_spec_offset`` tokens."""

    name = "suffix"
    priority = 10

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        spec = vllm_config.speculative
        self.max_depth = spec.suffix_max_tree_depth
        self.max_cached_requests = spec.suffix_max_cached_requests
        self.spec_factor = spec.suffix_max_spec_factor
        self.spec_offset = spec.suffix_max_spec_offset
        self.min_token_prob = spec.suffix_min_token_prob
        self.requests: dict[str, _RequestIndex] = {}
        self.global_trie = SuffixTrie(self.max_depth)
        self.cached_outputs: OrderedDict[str, list[int]] = OrderedDict()

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        return [
            self._propose_one(
                batch.req_ids[i], batch.token_ids(i), int(batch.num_prompt_tokens[i]), int(batch.max_num_drafts[i])
            )
            for i in range(len(batch))
        ]

    def _propose_one(self, req_id: str, tokens, num_prompt_tokens: int, max_num_drafts: int) -> list[int]:
        index = self.requests.get(req_id)
        if index is None:
            index = self.requests[req_id] = _RequestIndex(self.max_depth)
            index.num_prompt_tokens = num_prompt_tokens
        new_tokens = tokens[len(index.tokens) :].tolist()
        for token in new_tokens:
            index.active = index.trie.extend(index.active, token)
        index.tokens.extend(new_tokens)
        self._follow_global(index, new_tokens)
        if max_num_drafts <= 0:
            return []
        longest_match = self.max_depth - min(max_num_drafts, self.num_speculative_tokens)
        best, best_score = [], 0.0
        for nodes in (index.active, index.global_active):
            for node in reversed(nodes):  # deepest first
                if node.depth == 0 or node.depth > longest_match or node.best is None:
                    continue
                limit = min(
                    max_num_drafts,
                    self.num_speculative_tokens,
                    math.floor(self.spec_factor * node.depth + self.spec_offset),
                )
                drafts, score = draft_from(node, limit, self.min_token_prob)
                if score > best_score:
                    best, best_score = drafts, score
                break  # the deepest match with a continuation speaks for this trie
        return best

    def _follow_global(self, index: _RequestIndex, new_tokens: list[int]) -> None:
        if not self.max_cached_requests:
            return
        if index.global_version != self.global_trie.version:  # outputs were added or dropped: match anew
            index.global_active = self.global_trie.match(index.tokens, self.max_depth - 1)
            index.global_version = self.global_trie.version
            return
        for token in new_tokens:
            following = [self.global_trie.root]
            for node in index.global_active:
                child = node.child(token)
                if child is not None and child.depth < self.max_depth:
                    following.append(child)
            index.global_active = following

    def finished(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            index = self.requests.pop(req_id, None)
            if index is None or not self.max_cached_requests:
                continue
            output = index.tokens[index.num_prompt_tokens :]
            if len(output) < 2:
                continue
            previous = self.cached_outputs.pop(req_id, None)  # preempted before: its longer output replaces it
            if previous is not None:
                self.global_trie.add_sequence(previous, delta=-1)
            self.cached_outputs[req_id] = output
            self.global_trie.add_sequence(output)
            while len(self.cached_outputs) > self.max_cached_requests:
                _, oldest = self.cached_outputs.popitem(last=False)
                self.global_trie.add_sequence(oldest, delta=-1)


@hookimpl
def engine_spec_proposers():
    return [SuffixProposer]
