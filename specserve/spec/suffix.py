"""Suffix speculation (after SuffixDecoding, Arctic): draft from a trie of the suffixes of
earlier text, whose nodes count how often each continuation occurred.

Two tries serve a request: one over its own prompt and output (grown as tokens arrive), and
one per tenant over that tenant's recently finished requests. A tenant is the request's
`SamplingParams.tenant` (the server takes the OpenAI `user` field); a request without one
drafts from its own text alone, so one user's text never drafts another's. A tenant's trie
holds at most `tenant_tokens` tokens of finished requests (the oldest leave first, their
counts taken back) and at most `max_tenants` tenants are kept (the least recently used leaves).

A draft starts at the node matching the longest suffix of the text (at most `max_pattern`
tokens) found in either trie, and follows the continuations by estimated probability (a
child's count over its siblings', multiplied down the path): the most likely child at each
depth for a chain, the most likely nodes overall for a tree (parents always before children).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque

MAX_DEPTH = 16  # tokens each suffix is kept to: pattern plus continuation
MAX_PATTERN = 8  # longest text ending matched


class _Node:
    __slots__ = ("children", "count", "token")

    def __init__(self, token: int = -1):
        self.token = token
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts of every substring of at most `depth` tokens of the texts added."""

    def __init__(self, depth: int = MAX_DEPTH):
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Add (sign 1) or take back (sign -1, a text added before) every suffix's first `depth` tokens."""
        for start in range(len(tokens)):
            node = self.root
            for tok in tokens[start : start + self.depth]:
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = _Node(tok)
                child.count += sign
                if child.count <= 0:
                    del node.children[tok]
                    break
                node = child

    def match(self, text: list[int], max_pattern: int) -> tuple[_Node | None, int]:
        """The node of the longest ending of `text` (at most max_pattern tokens) that has a continuation,
        and that ending's length; (None, 0) where none has."""
        for n in range(min(max_pattern, len(text), self.depth - 1), 0, -1):
            node = self.root
            for tok in text[len(text) - n :]:
                node = node.children.get(tok)
                if node is None:
                    break
            if node is not None and node.children:
                return node, n
        return None, 0


class _Growing:
    """A sequence's own trie, grown with its tokens: the open suffixes' nodes extend by each new token."""

    def __init__(self):
        self.trie = SuffixTrie()
        self.open: deque[_Node] = deque()
        self.upto = 0

    def extend(self, tokens: list[int]) -> None:
        t = self.trie
        for tok in tokens[self.upto :]:
            self.open.append(t.root)
            if len(self.open) > t.depth:
                self.open.popleft()
            for i, node in enumerate(self.open):
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = _Node(tok)
                child.count += 1
                self.open[i] = child
        self.upto = len(tokens)


def _ranked(start: _Node, K: int, N: int) -> list[tuple[int, int, int]]:
    """The N most likely nodes under `start` within depth K, parents first: (token, parent row: 0 for
    `start`, j + 1 for the list's node j, depth)."""
    out: list[tuple[int, int, int]] = []
    heap = [(-1.0, 0, 0, 0, start)]  # (-probability, tie-break, parent row, depth, node)
    tie = 1
    while heap and len(out) < N:
        neg, _, parent, depth, node = heapq.heappop(heap)
        row = 0
        if depth:
            out.append((node.token, parent, depth))
            row = len(out)
        if depth == K or not node.children:
            continue
        total = sum(c.count for c in node.children.values())
        for child in node.children.values():
            heapq.heappush(heap, (neg * child.count / total, tie, row, depth + 1, child))
            tie += 1
    return out


class SuffixProposer:
    def __init__(self, tenant_tokens: int = 1 << 14, max_tenants: int = 64, max_pattern: int = MAX_PATTERN):
        self.tenant_tokens, self.max_tenants, self.max_pattern = tenant_tokens, max_tenants, max_pattern
        self.own: dict[int, _Growing] = {}  # Sequence.serial -> its own trie
        self.tenants: OrderedDict[str, tuple[SuffixTrie, deque[list[int]], list[int]]] = OrderedDict()

    def _start(self, seq) -> _Node | None:
        """The node drafts start from: the longer match of the text's ending in its own trie and its
        tenant's (its own on a tie: the request's own text predicts it best)."""
        text = seq.prompt_ids + seq.output_ids
        own = self.own.get(seq.serial)
        if own is None:
            own = self.own[seq.serial] = _Growing()
        own.extend(text)
        node, n = own.trie.match(text, self.max_pattern)
        tenant = self.tenants.get(seq.params.tenant) if seq.params.tenant is not None else None
        if tenant is not None:
            self.tenants.move_to_end(seq.params.tenant)
            other, m = tenant[0].match(text, self.max_pattern)
            if m > n:
                node = other
        return node

    def propose(self, seq, K: int) -> list[int]:
        """A chain of up to K tokens: the most frequent continuation at each depth."""
        node, out = self._start(seq), []
        while node is not None and node.children and len(out) < K:
            tok, node = max(node.children.items(), key=lambda kv: kv[1].count)
            out.append(tok)
        return out

    def propose_tree(self, seq, K: int, N: int) -> list[tuple[int, int, int]]:
        """Up to N nodes (token, parent row: 0 the root, j + 1 node j; depth 1..K), parents first."""
        node = self._start(seq)
        return _ranked(node, K, N) if node is not None else []

    def forget(self, seq) -> None:
        self.own.pop(seq.serial, None)

    def finished(self, seq) -> None:
        """A request ended: its text joins its tenant's trie (none without a tenant)."""
        self.forget(seq)
        name = seq.params.tenant
        if name is None:
            return
        text = (seq.prompt_ids + seq.output_ids)[-self.tenant_tokens :]
        if name not in self.tenants:
            self.tenants[name] = (SuffixTrie(), deque(), [0])
            if len(self.tenants) > self.max_tenants:
                self.tenants.popitem(last=False)
        trie, texts, size = self.tenants[name]
        self.tenants.move_to_end(name)
        trie.add(text)
        texts.append(text)
        size[0] += len(text)
        while size[0] > self.tenant_tokens:
            old = texts.popleft()
            trie.add(old, sign=-1)
            size[0] -= len(old)
