"""Prefix caching, host side: KV pages by content and GDN state snapshots by prefix (docs/prefix-caching.md).

A full page p of a sequence is named by a chained key: the hash of page p-1's key and the tokens at positions
p*ps .. (p+1)*ps, one past the page (the lookahead, with an MTP layer). The extra token is there for the MTP
layer, whose KV entry at position t joins the trunk's hidden state at t with the token at t+1: a page is reused
only where its last entry was computed with the same next token. Pages are shared by reference count; a page
nobody holds stays cached until its memory is needed and is evicted least recently used first.

A GDN layer's state summarises a whole prefix, so a prefix of L tokens can be resumed only where the state
after exactly L tokens was kept: a snapshot (every GDN layer's conv window and recurrent state) named by the
key of page L/ps - 1, or, for an L inside a page (where a request finished, or a PD prefill worker exported), by
a tail key: the hash of the last full page's key and the tokens from that page's end to L (plus the lookahead),
which also names the partial page, copied for the request that resumes there. A hit resumes at the longest L
with both the pages for [0, L) and a snapshot at L, and always leaves at least one token to compute (the last
prompt token's logits, a PD prefill worker's export).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

ROOT_KEY = b"jaxgdn-prefix"
COARSE = 4  # every COARSE-th state-interval boundary takes a snapshot even in a prefix nobody shares yet


def page_keys(tokens, page_size: int, lookahead: int = 1) -> list[bytes]:
    """Keys of pages 0, 1, ... of a sequence whose known tokens are `tokens` (page p needs the tokens up to
    position (p+1)*page_size + lookahead - 1)."""
    ids = np.asarray(tokens, np.int64)
    keys, parent, p = [], ROOT_KEY, 0
    while (p + 1) * page_size + lookahead <= len(ids):
        parent = hashlib.blake2b(parent + ids[p * page_size : (p + 1) * page_size + lookahead].tobytes(),
                                 digest_size=16).digest()
        keys.append(parent)
        p += 1
    return keys


def tail_key(keys: list[bytes], tokens, length: int, page_size: int, lookahead: int = 1) -> bytes:
    """The name of the prefix of `length` tokens (not a multiple of page_size) of a sequence whose page keys are
    `keys`: its last full page's key and the tokens after it, plus the lookahead."""
    full = length // page_size
    parent = keys[full - 1] if full else ROOT_KEY
    ids = np.asarray(tokens[full * page_size : length + lookahead], np.int64)
    return hashlib.blake2b(b"tail" + parent + ids.tobytes(), digest_size=16).digest()


class PageCache:
    """The KV page allocator with a content index (FreeList's interface: allocate, free, num_free).

    Page 0 is the null page and never handed out. A page is held by reference count; freed to 0 it goes to
    the free list if it holds no published content, else to the tail of the LRU of cached pages, which
    `allocate` evicts from the head once the free list is empty."""

    def __init__(self, num_pages: int):
        self._free = list(range(num_pages - 1, 0, -1))  # uncached, lowest id handed out first
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, refcount 0
        self.refs = np.zeros(num_pages, np.int32)
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Pages nobody holds that keep published content (free, evicted on demand)."""
        return len(self._lru)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"need {n} KV pages, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                del self.page_of[self.key_of.pop(page)]
                self.num_evicted += 1
            self.refs[page] = 1
            out.append(page)
        return out

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page, last page first (a sequence's tail is evicted before its head)."""
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.key_of:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached pages of the longest prefix of keys."""
        pages = []
        for key in keys:
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: list[int]) -> None:
        """Take a reference to cached pages (a hit)."""
        for page in pages:
            if self.refs[page] == 0:
                del self._lru[page]
            self.refs[page] += 1

    def publish(self, page: int, key: bytes) -> None:
        """Name a held page by its content. A key cached already (another page with the same content) keeps
        its page; this one stays unnamed and is freed as usual."""
        if key not in self.page_of and page not in self.key_of:
            self.page_of[key] = page
            self.key_of[page] = key

    def reset(self) -> None:
        """Forget every name: cached free pages go back to the free list; held pages stay held, unnamed."""
        self._free.extend(sorted(self._lru, reverse=True))
        self._lru.clear()
        self.page_of.clear()
        self.key_of.clear()


class SnapshotIndex:
    """Which device snapshot (1 .. n-1; 0 is the null snapshot padding copies write) holds the state after
    which prefix key; least recently used first out. A snapshot is copied on the device in launch order, so
    one evicted and overwritten after a restore was dispatched never corrupts that restore."""

    def __init__(self, num_snapshots: int):
        self.capacity = max(0, num_snapshots - 1)
        self._free = list(range(num_snapshots - 1, 0, -1))
        self._lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, key: bytes) -> int | None:
        sid = self._lru.get(key)
        if sid is not None:
            self._lru.move_to_end(key)
        return sid

    def add(self, key: bytes) -> int:
        """A snapshot id for key's state (evicting the least recently used when none is free)."""
        if self._free:
            sid = self._free.pop()
        else:
            _, sid = self._lru.popitem(last=False)
        self._lru[key] = sid
        return sid

    def reset(self) -> None:
        self._free.extend(sorted(self._lru.values(), reverse=True))
        self._lru.clear()


@dataclasses.dataclass
class PrefixHit:
    """Where a request resumes: the cached pages of its first `num_tokens` tokens and the snapshot of the
    state after them (0: no GDN layers, no snapshot needed)."""

    pages: list[int]
    num_tokens: int
    snapshot: int
    tail_page: int | None = None  # num_tokens inside a page: the cached page to copy for the one it ends in


@dataclasses.dataclass
class PrefixCacheStats:
    """Counts since start-up, in tokens: looked up (the prompts of admitted requests) and hit."""

    queries: int = 0
    hits: int = 0
    computed: int = 0  # prompt tokens computed (prefill rows' tokens)
    snapshots_saved: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


class PrefixCache:
    """The host's view of the cache for one engine: pages (`pages`, the scheduler's allocator), snapshots, the
    keys of each request's known tokens, and what each dispatched row publishes.

    state_interval: snapshots are taken where a prefill chunk ends at a multiple of it inside a prefix another
    request computed already, and at every COARSE-th multiple (the scheduler cuts chunks there when the snapshot
    is not cached yet); 0 with no GDN layers (any page boundary resumes).
    lookahead: tokens past a page its key reads (1 with an MTP layer, else 0)."""

    def __init__(self, num_pages: int, page_size: int, num_snapshots: int, state_interval: int, enabled: bool,
                 lookahead: int = 1):
        self.pages = PageCache(num_pages)
        self.snapshots = SnapshotIndex(num_snapshots if enabled else 0)
        self.page_size = page_size
        self.state_interval = state_interval
        self.coarse = COARSE
        self.lookahead = lookahead
        self.enabled = enabled
        self.stats = PrefixCacheStats()
        self._keys: dict[int, tuple[int, list[bytes]]] = {}  # request id -> (prefill_len, page keys) of its computation
        self._resume: dict[int, PrefixHit] = {}  # request id -> the hit it starts on, until its first launch (take)

    @staticmethod
    def known_tokens(req) -> list[int]:
        """The tokens the request's current computation prefills, and the one after them where known (a PD
        prefill worker's next prompt token)."""
        known = req.token_slice(0, req.prefill_len)
        if req.prefill_only:
            known = known + [req.next_prompt_token]
        return known

    def keys(self, req) -> list[bytes]:
        """The request's page keys (made once per computation: a preempted request prefills more tokens)."""
        made = self._keys.get(req.request_id)
        if made is None or made[0] != req.prefill_len:
            made = self._keys[req.request_id] = (req.prefill_len, page_keys(self.known_tokens(req), self.page_size,
                                                                            self.lookahead))
        return made[1]

    def forget(self, req) -> None:
        """A request's pages and slot are freed (finished, preempted): drop what is kept for it."""
        self._keys.pop(req.request_id, None)
        self._resume.pop(req.request_id, None)

    def take(self, req) -> PrefixHit | None:
        """The hit an admitted request starts on, once (its snapshot to restore and tail page to copy before its
        first launch), or None."""
        return self._resume.pop(req.request_id, None)

    def match(self, req) -> PrefixHit | None:
        """The longest resumable prefix of a request about to start from its first token, or None (also for a
        request that asks for prompt logprobs: those of cached tokens are not kept)."""
        if not self.enabled or req.num_computed or req.sampling_params.prompt_logprobs is not None:
            return None
        keys = self.keys(req)
        pages = self.pages.lookup(keys)
        tail = self._tail_hit(req, keys, pages)
        if tail is not None:
            return tail
        n = min(len(pages), (req.prefill_len - 1) // self.page_size)  # at least one token left to compute
        while n > 0:
            if not self.state_interval:
                return PrefixHit(pages[:n], n * self.page_size, 0)
            sid = self.snapshots.get(keys[n - 1])
            if sid is not None:
                return PrefixHit(pages[:n], n * self.page_size, sid)
            n -= 1
        return None

    def _tail_hit(self, req, keys: list[bytes], pages: list[int]) -> PrefixHit | None:
        """The longest cached tail inside the page after the full pages found, or None."""
        ps, full = self.page_size, len(pages)
        known = self.known_tokens(req)
        last = min((full + 1) * ps - 1, req.prefill_len - 1, len(known) - self.lookahead)
        for length in range(last, full * ps, -1):
            key = tail_key(keys, known, length, ps, self.lookahead)
            page = self.pages.page_of.get(key)
            sid = None if page is None else self.snapshots.get(key) if self.state_interval else 0
            if sid is not None:
                return PrefixHit(pages[:full], length, sid, tail_page=page)
        return None

    def hold(self, req) -> PrefixHit | None:
        """For a request about to start: its longest hit, its pages held (the scheduler gives them to the request,
        or frees them if it does not start after all), or None."""
        hit = self.match(req)
        if hit is not None:
            self.pages.acquire(hit.pages)
        return hit

    def admit(self, req, hit: PrefixHit | None) -> int | None:
        """A request starts (after `hold`): count its lookup and keep its hit for `take`. Returns the prompt tokens
        it found cached (None: not looked up: caching off, or its state arrived computed)."""
        if not self.enabled or (req.num_computed and hit is None):
            return None
        self.stats.queries += req.prefill_len
        if hit is not None:
            self._resume[req.request_id] = hit
            self.stats.hits += hit.num_tokens
        return hit.num_tokens if hit else 0

    def _due(self, key: bytes, boundary: int, shared: bool) -> bool:
        """Whether a snapshot at this state-interval boundary is wanted: not cached yet, and either inside a
        prefix another request computed already (prompts share it) or at every COARSE-th boundary (so a second
        request can resume where a first one went, at the cost of cutting a first prompt's chunks there)."""
        return key not in self.snapshots and (shared or boundary % (self.coarse * self.state_interval) == 0)

    def chunk_end(self, req, end: int) -> int:
        """Where a prefill chunk from req.num_computed to `end` stops: at the first state-interval boundary past
        num_computed where a snapshot is due (`_due`), if it comes before `end`."""
        if not (self.enabled and self.state_interval):
            return end
        step = self.state_interval
        boundary = (req.num_computed // step + 1) * step
        keys = self.keys(req)
        while boundary < end and boundary // self.page_size <= len(keys):
            key = keys[boundary // self.page_size - 1]
            if self._due(key, boundary, key in self.pages.page_of):  # its page is another request's
                return boundary
            boundary += step
        return end

    def publish(self, req, start: int, end: int) -> bytes | None:
        """A dispatched prefill row computed tokens [start, end): name its full pages with their keys; returns the
        key of the snapshot to save after it (None: none)."""
        if not self.enabled:
            return None
        keys = self.keys(req)
        ps = self.page_size
        due = None
        if self.state_interval and end % self.state_interval == 0 and 0 < end // ps <= len(keys):
            key, own = keys[end // ps - 1], req.pages[end // ps - 1]
            if self._due(key, end, self.pages.page_of.get(key, own) != own):  # shared: another request's page
                due = key
        for p in range(start // ps, min(end // ps, len(keys))):
            self.pages.publish(req.pages[p], keys[p])
        return due

    def finished(self, req, length: int, tokens: list[int]) -> bytes | None:
        """A request's slot holds the state after exactly `length` tokens of `tokens` (a finished request, a PD
        prefill worker's export), its pages their KV: name its full pages and, for a length inside a page, that
        page by its tail key. Returns the key of the snapshot to save (None: cached already, or no room in the
        tokens for the lookahead)."""
        if (not (self.enabled and self.state_interval) or length < 1 or length + self.lookahead > len(tokens)
                or len(req.pages) * self.page_size < length):
            return None
        ps = self.page_size
        keys = page_keys(tokens[: length + self.lookahead], ps, self.lookahead)
        for p in range(length // ps):
            self.pages.publish(req.pages[p], keys[p])
        if length % ps:
            key = tail_key(keys, tokens, length, ps, self.lookahead)
            self.pages.publish(req.pages[length // ps], key)
        else:
            key = keys[length // ps - 1]
        return None if key in self.snapshots else key

    def reset(self) -> None:
        self.pages.reset()
        self.snapshots.reset()
