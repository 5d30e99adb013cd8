"""A depth-bounded suffix trie with occurrence counts: the index behind the ``suffix`` proposer.

Every substring of the indexed token sequences up to ``max_depth`` tokens long is a path from the root;
a node counts how often its substring occurred and knows its most frequent continuation, so drafting
from a matched suffix follows the likeliest next tokens in O(1) per token.
"""

from __future__ import annotations

from typing import Optional


class SuffixNode:
    __slots__ = ("count", "child_total", "best", "children", "depth")

    def __init__(self, depth: int):
        self.count = 0  # occurrences of this node's substring
        self.child_total = 0  # occurrences followed by another token (sum of the children's counts)
        self.best: Optional[int] = None  # the child token with the highest count
        self.children: Optional[dict[int, SuffixNode]] = None
        self.depth = depth

    def child(self, token: int) -> Optional[SuffixNode]:
        return self.children.get(token) if self.children else None


class SuffixTrie:
    """Substrings of up to ``max_depth`` tokens of the sequences added, with their counts."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = SuffixNode(0)
        self.version = 0  # changes whenever a whole sequence is added or removed

    def extend(self, active: list[SuffixNode], token: int, delta: int = 1) -> list[SuffixNode]:
        """Account for ``token`` following the sequence whose open suffixes are ``active`` (nodes shallower
        than max_depth, the root first); returns the open suffixes after it."""
        extended = [self.root]
        for node in active:
            children = node.children
            if children is None:
                if delta < 0:
                    continue
                children = node.children = {}
            child = children.get(token)
            if child is None:
                if delta < 0:
                    continue
                child = children[token] = SuffixNode(node.depth + 1)
            child.count += delta
            node.child_total += delta
            if delta > 0:
                if node.best is None or (node.best != token and child.count > children[node.best].count):
                    node.best = token
            else:
                if child.count <= 0:
                    del children[token]
                if node.best == token:
                    node.best = max(children, key=lambda t: children[t].count) if children else None
            if child.depth < self.max_depth and child.count > 0:
                extended.append(child)
        return extended

    def add_sequence(self, tokens, delta: int = 1) -> None:
        """Index (``delta=1``) or forget (``delta=-1``) every substring of ``tokens``."""
        active = [self.root]
        for token in tokens:
            active = self.extend(active, int(token), delta)
        self.version += 1

    def match(self, tokens, max_length: int) -> list[SuffixNode]:
        """The nodes of the suffixes of ``tokens`` (up to ``max_length`` long) that occur in the trie, the
        root first (it matches the empty suffix)."""
        found = [self.root]
        total = len(tokens)
        for length in range(1, min(max_length, total) + 1):
            node: Optional[SuffixNode] = self.root
            for token in tokens[total - length :]:
                node = node.child(int(token)) if node is not None else None
                if node is None:
                    break
            if node is not None:
                found.append(node)
        return found


def draft_from(node: SuffixNode, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
    """Follow the most frequent continuation from ``node``: up to ``max_tokens`` tokens, stopping when the
    product of their frequencies among the continuations falls below ``min_token_prob``. Returns the
    tokens and their expected number of accepted tokens (the sum of those products)."""
    tokens: list[int] = []
    probability, score = 1.0, 0.0
    while len(tokens) < max_tokens and node.best is not None and node.child_total > 0:
        assert node.children is not None  # a node with a best continuation has children
        child = node.children[node.best]
        probability *= child.count / node.child_total
        if probability < min_token_prob:
            break
        tokens.append(node.best)
        score += probability
        node = child
    return tokens, score
