"""Suffix decoding: propose what followed the longest earlier match of the context's suffix.

A `SuffixIndex` holds token sequences (earlier requests' prompts and outputs,
or one request's own growing history) and finds, for a context, its longest
suffix that occurred before, up to `MAX_MATCH` tokens. What followed up to
`OCCURRENCES` of those occurrences (the most recent first) is merged into a
trie with counts; a proposal follows the most frequent continuation while its
estimated probability (count / occurrences) stays at or above `min_prob`, and
at most as many tokens as the match is long (`factor`): a long match earns a
long proposal, a one-token match a short one. As a token tree it takes the
trie's most probable nodes.

The index keeps, per n-gram size in `SIZES`, a dict from the n-gram's hash to
its latest end and a chain of earlier ends (`_prev`), so indexing costs
O(sizes) per token and a lookup O(sizes + occurrences * depth), whatever the
history's length. A hash collision can only cost acceptance: every proposal is
verified by the target, and the occurrences are checked against the context.

Memory is bounded: `SuffixCache` keeps each tenant's index and evicts the
oldest sequences (of any tenant) once the total passes `max_tokens`; an index
whose evicted prefix outgrows its live part is rebuilt without it (compacted).
One tenant's sequences are never matched for another.

The work can be done a step at a time (`SuffixCache.adding`, a generator):
each step indexes at most `chunk` tokens, adding or compacting, and the index
changes only between steps (a compaction swaps its rebuilt index in at its
last step), so matches made between steps see a consistent index. A server
runs one such generator at a time on its event loop, a step per turn of the
loop: adding a 2,048-token turn once held the loop ~14 ms, and compacting a
full tenant's index (100,000 tokens) for seconds.
"""
from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # n-gram sizes indexed (a longest match is found among them)
MAX_MATCH = SIZES[-1]  # a match is measured back this far
OCCURRENCES = 16  # continuations merged per proposal (the most recent occurrences)
WALK = 32  # occurrences of the longest indexed n-gram measured for the longest match
_END = -1  # between sequences: no continuation crosses it
CHUNK = 256  # tokens indexed per step of SuffixCache.adding (about 2 ms of work)
FREE = 8192  # entries of a dropped index freed per step (a million at once hold the loop ~0.2 s)


@dataclass(frozen=True)
class Match:
    """The context's longest earlier suffix match: its length and the ends of its occurrences."""

    length: int
    ends: tuple[int, ...]  # positions just after each occurrence, the most recent first


class SuffixIndex:
    """Sequences of token ids, indexed for suffix matches (see the module docstring)."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._prev: dict[int, list[int]] = {n: [] for n in SIZES}  # per size: earlier end, by end
        self._last: dict[int, dict[int, int]] = {n: {} for n in SIZES}  # per size: hash -> latest end
        self._open = 0  # start of the sequence being extended (its last token has no successor yet)
        self.base = 0  # tokens before this were evicted (ends below it are not followed)

    def __len__(self) -> int:
        """Tokens held (separators included), evicted ones not."""
        return len(self._tokens) - self.base

    def add(self, tokens: Sequence[int]) -> None:
        """A finished sequence: every n-gram with a successor in it is indexed."""
        self.extend(tokens)
        self.close()

    def extend(self, tokens: Sequence[int]) -> None:
        """Grow the open sequence; n-grams are indexed once a token follows them."""
        toks = self._tokens
        start = len(toks)
        toks.extend(int(t) for t in tokens)
        for end in range(max(start, self._open + 1), len(toks)):
            self._index(end)

    def close(self) -> None:
        """End the open sequence: nothing continues across it."""
        if len(self._tokens) > self._open:
            self._tokens.append(_END)
            for n in SIZES:
                self._prev[n].append(-1)
        self._open = len(self._tokens)

    def _index(self, end: int) -> None:
        """Index the n-grams ending just before `end` (the token at `end` follows them)."""
        toks, first = self._tokens, self._open
        for n in SIZES:
            prev = self._prev[n]
            while len(prev) < end:  # positions with no n-gram of this size ending there
                prev.append(-1)
            if end - n < first:
                prev.append(-1)
                continue
            key = hash(tuple(toks[end - n: end]))
            last = self._last[n]
            prev.append(last.get(key, -1))
            last[key] = end

    def match(self, context: Sequence[int], *, limit: int = OCCURRENCES) -> Match | None:
        """The longest suffix of `context` that occurred here (None: not even its last token)."""
        found = None
        for n in SIZES:
            if n > len(context):
                break
            end = self._last[n].get(hash(tuple(context[-n:])), -1)
            if end < self.base:
                break
            found = n
        if found is None:
            return None
        # The occurrences of the longest indexed size, the most recent first (at most WALK), each
        # measured up to the next size (which did not occur): the longest match is theirs, and its
        # occurrences are the ones continued.
        tail = list(context[-found:])
        upto = SIZES[SIZES.index(found) + 1] - 1 if found != SIZES[-1] else found
        measured: list[tuple[int, int]] = []
        end, walked = self._last[found][hash(tuple(tail))], 0
        walk = WALK if upto > found else limit  # no gap to measure: every occurrence is as long
        while end >= self.base and walked < walk:
            walked += 1
            if end - found >= self.base and self._tokens[end - found: end] == tail:
                measured.append((self._measure(context, end, found, upto), end))
            end = self._prev[found][end]
        if not measured:
            return None
        length = max(n for n, _ in measured)
        return Match(length, tuple(end for n, end in measured if n == length)[:limit])

    def _measure(self, context: Sequence[int], end: int, known: int, upto: int) -> int:
        """How far back the context matches the tokens before `end`: `known` tokens are known to,
        and it is measured no further than `upto`."""
        toks, n = self._tokens, known
        while n < upto and n < len(context) and end - n - 1 >= self.base:
            token = toks[end - n - 1]
            if token == _END or token != context[-n - 1]:
                break
            n += 1
        return n

    def continuations(self, ends: Sequence[int], depth: int) -> list[list[int]]:
        """What followed each end, up to `depth` tokens, never across a sequence's end."""
        toks, out = self._tokens, []
        for end in ends:
            run = toks[end: end + depth]
            if _END in run:
                run = run[: run.index(_END)]
            out.append(run)
        return out

    def evict(self, tokens: int, *, compact: bool = True) -> None:
        """Forget the oldest `tokens` held; with `compact`, the store is compacted at once when
        most of it is dead (else the caller runs `compacting` when `stale`)."""
        self.base = min(len(self._tokens), self.base + tokens)
        if compact and self.stale:
            for _ in self.compacting(len(self._tokens), per_step=None):
                pass

    @property
    def stale(self) -> bool:
        """Most of the store is evicted tokens: time to compact."""
        return self.base > len(self._tokens) // 2

    def compacting(self, chunk: int = CHUNK, per_step: int | None = FREE) -> Iterator[None]:
        """Rebuild the index without its evicted prefix, `chunk` tokens a step. This index is
        unchanged until the last step, which swaps the rebuilt one in; nothing else may change it
        meanwhile."""
        live = self._tokens[self.base:]
        fresh = SuffixIndex()
        for at in range(0, len(live), max(1, chunk)):
            piece = live[at: at + max(1, chunk)]
            start = 0
            for i, token in enumerate(piece):
                if token == _END:  # a finished sequence ends here
                    fresh.extend(piece[start:i])
                    fresh.close()
                    start = i + 1
            fresh.extend(piece[start:])  # continued in the next piece, or the open sequence
            if at + chunk < len(live):
                yield
        dropped = self.containers()
        self.__dict__.update(fresh.__dict__)
        yield
        yield from free(dropped, per_step)

    def containers(self) -> list:
        """The index's big containers (what `free` takes apart)."""
        return [self._tokens, *self._prev.values(), *self._last.values()]


def free(containers: list, per_step: int | None = FREE) -> Iterator[None]:
    """Empty containers nobody else holds, `per_step` entries a step (None: all at once): freeing a
    dropped index's millions of entries at once would hold the event loop for a fifth of a second."""
    while containers:
        box = containers[-1]
        if per_step is None or per_step >= len(box):
            box.clear()
        elif isinstance(box, dict):
            for _ in range(min(per_step, len(box))):
                box.popitem()
        else:
            del box[-per_step:]
        if not box:
            containers.pop()
        yield


def propose(index: SuffixIndex, context: Sequence[int], k: int, *, min_prob: float = 0.1,
            factor: float = 1.0) -> tuple[list[int], int]:
    """The most frequent continuation of the context's longest match (a chain), and the match's
    length (0: none). At most min(k, factor * match length) tokens; each kept token's estimated
    probability (the share of occurrences that continue that way) is >= min_prob."""
    found = index.match(context) if k > 0 else None
    if found is None:
        return [], 0
    depth = min(k, max(1, int(factor * found.length)))
    alive = index.continuations(found.ends, depth)
    total, tokens = len(alive), []
    for d in range(depth):
        column = [run[d] for run in alive if len(run) > d]
        if not column:
            break
        token = column[0]
        count = column.count(token)
        if count * 2 <= len(column):  # not a majority: the most frequent (ties: the most recent)
            token, count = Counter(column).most_common(1)[0]
        if count < min_prob * total:
            break
        tokens.append(token)
        alive = [run for run in alive if len(run) > d and run[d] == token]
    return tokens, found.length


def propose_tree(index: SuffixIndex, context: Sequence[int], k: int, *, nodes: int, width: int,
                 min_prob: float = 0.1, factor: float = 1.0) -> tuple[list[int], list[int], int]:
    """(tokens, parents, match length): the continuation trie's most probable nodes, at most
    `nodes`, `width` children per node, min(k, factor * match length) deep; parents first, each
    parent an earlier index or -1 (the context's last token)."""
    if width <= 1:  # a chain
        tokens, length = propose(index, context, min(k, nodes), min_prob=min_prob, factor=factor)
        return tokens, list(range(-1, len(tokens) - 1)), length
    found = index.match(context) if k > 0 and nodes > 0 else None
    if found is None:
        return [], [], 0
    depth = min(k, max(1, int(factor * found.length)))
    trie: dict[tuple[int, int], list] = {}  # (parent node, token) -> [count, node]
    kids: dict[int, list[tuple[int, int]]] = {}
    count = 0
    for run in index.continuations(found.ends, depth):
        parent = -1
        for token in run:
            entry = trie.get((parent, token))
            if entry is None:
                entry = trie[(parent, token)] = [0, len(trie)]
                kids.setdefault(parent, []).append((parent, token))
            entry[0] += 1
            parent = entry[1]
        count += 1
    # Best-first over the trie: a child is no likelier than its parent, so parents come first.
    tokens: list[int] = []
    parents: list[int] = []
    heap = [(-trie[key][0], trie[key][1], key, -1) for key in _widest(kids.get(-1, []), trie, width)]
    heapq.heapify(heap)
    while heap and len(tokens) < nodes:
        negative, _, key, out_parent = heapq.heappop(heap)
        if -negative / count < min_prob:
            break
        node = len(tokens)
        tokens.append(key[1])
        parents.append(out_parent)
        for child in _widest(kids.get(trie[key][1], []), trie, width):
            heapq.heappush(heap, (-trie[child][0], trie[child][1], child, node))
    return tokens, parents, found.length


def _widest(keys: list[tuple[int, int]], trie: dict, width: int) -> list[tuple[int, int]]:
    return sorted(keys, key=lambda key: -trie[key][0])[:width]


class SuffixCache:
    """Each tenant's earlier sequences, at most `max_tokens` in all (the oldest evicted first)."""

    def __init__(self, max_tokens: int = 200_000) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._tenants: OrderedDict[str, SuffixIndex] = OrderedDict()
        self._order: deque[tuple[str, int]] = deque()  # (tenant, tokens held), oldest first
        self.tokens = 0

    def index(self, tenant: str) -> SuffixIndex | None:
        return self._tenants.get(tenant)

    def add(self, tenant: str, tokens: Sequence[int]) -> None:
        """Remember a finished sequence for `tenant`; the oldest go while over the budget."""
        for _ in self.adding(tenant, tokens, chunk=max(1, len(tokens), self.max_tokens), per_step=None):
            pass

    def adding(self, tenant: str, tokens: Sequence[int], chunk: int = CHUNK,
               per_step: int | None = FREE) -> Iterator[None]:
        """`add`, a step at a time: each step indexes at most `chunk` tokens, or frees at most
        `per_step` entries of what eviction dropped (see the module docstring). Run one such
        generator at a time on a cache."""
        size = len(tokens) + 1  # its separator
        if not tokens or size > self.max_tokens:
            return
        index = self._tenants.get(tenant)
        if index is None:
            index = self._tenants[tenant] = SuffixIndex()
        for at in range(0, len(tokens), chunk):
            index.extend(tokens[at: at + chunk])
            yield
        index.close()
        self._order.append((tenant, size))
        self.tokens += size
        while self.tokens > self.max_tokens:
            old, held = self._order.popleft()
            self.tokens -= held
            index = self._tenants[old]
            index.evict(held, compact=False)
            if not len(index):
                del self._tenants[old]
                yield from free(index.containers(), per_step)
            elif index.stale:
                yield from index.compacting(chunk, per_step)

    def __len__(self) -> int:
        return len(self._tenants)
