"""The generation core's one scheduler (vLLM v1's ``Scheduler`` shape): it alone owns the waiting
and running requests, admission, the per-step token budget, preemption and prefix sharing.

:meth:`Scheduler.schedule` returns a frozen :class:`SchedulerOutput`, the step's plan as a value;
the model runner (:mod:`.model_runner`) turns it into forwards, and :meth:`Scheduler.update`
advances each planned request's two counters (:class:`~.request.Request`). KV memory is behind a
:class:`~.kv_cache_manager.KVCacheManager` (block tables, prefix lookup, frees).

A step admits waiting requests on free rows in the policy's order while the step's token budget
has room for them (``max_step_tokens``, less one token per decoding request and the chunks the
prefilling ones ask for: vLLM's ``max_num_batched_tokens``) and the blocks of their first
prefill chunk are free (their longest cached prefix is reused), gives every decoding request one
token and the prefilling ones a chunk of up to ``prefill_chunk`` tokens each (in start order, within
``max_step_tokens``), and reserves the blocks those tokens need, oldest request first; when the pool
runs dry, the policy's victim is preempted: its blocks and row are freed and it waits again, to
recompute its tokens later. A preempted request whose last sampled token is still in flight waits
until that token lands (one step) before it can restart, so its recomputed tokens are all known.

With a :class:`~.spec_decode.Speculator`, a decoding request whose last token has landed may get a
draft of k tokens: it is planned as a :class:`VerifyRow` of k + 1 tokens (its last token and the
draft) instead of a :class:`DecodeRow`, counts k + 1 tokens of the step budget and reserves blocks
for all of them (when the pool is short it drops the draft before anyone is preempted). Its
counters advance only when its outcome lands (:meth:`Scheduler.advance`, one call per emitted
token); the blocks past its accepted tokens stay in its table and are written over by its next
steps (the prefix cache only ever registers full blocks of known tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kv_cache_manager import KVCacheManager
from .policy import Policy
from .request import Request
from .spec_decode import Speculator

__all__ = ["DecodeRow", "PrefillChunk", "Scheduler", "SchedulerOutput", "VerifyRow"]


@dataclass(frozen=True)
class PrefillChunk:
    """``tokens`` (n,) int32 of ``request``'s prompt (or recomputed stream) at positions
    ``start .. start + n - 1``, in batch row ``row``; ``sample``: the chunk ends a new request's
    prefill, so its last token's logits give its first token (a request recomputed after a
    preemption samples nothing here: its last token is decoded next)."""

    request: Request
    row: int
    start: int
    tokens: np.ndarray
    sample: bool


@dataclass(frozen=True)
class DecodeRow:
    """One decode token of ``request`` in batch row ``row`` at cache position ``position`` (its
    token is the row's last sampled one, already in the runner's row token array)."""

    request: Request
    row: int
    position: int


@dataclass(frozen=True)
class VerifyRow:
    """A speculating decode row: ``tokens`` (k + 1,) int32, ``request``'s last sampled token (on
    the host) then its k draft tokens, at positions ``start .. start + k`` in batch row ``row``;
    every position is sampled (:mod:`.spec_decode.verify`)."""

    request: Request
    row: int
    start: int
    tokens: np.ndarray

    @property
    def draft(self) -> np.ndarray:
        """The k draft tokens, (k,) int32."""
        return self.tokens[1:]


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. ``prefills``, ``decodes`` and ``verifies``: what the forwards compute;
    ``started``: requests given a row this step (the runner resets the row's per-request state);
    ``preempted``: requests sent back to waiting this step."""

    prefills: tuple[PrefillChunk, ...] = ()
    decodes: tuple[DecodeRow, ...] = ()
    started: tuple[Request, ...] = ()
    preempted: tuple[Request, ...] = ()
    verifies: tuple[VerifyRow, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the step computes (decode rows count one each, verify rows k + 1)."""
        return len(self.decodes) + sum(len(c.tokens) for c in self.prefills) + sum(len(v.tokens) for v in self.verifies)

    @property
    def empty(self) -> bool:
        """Nothing to compute this step (no prefill chunk, no decode or verify row)."""
        return not self.prefills and not self.decodes and not self.verifies


class Scheduler:
    """Rows, the waiting queue (``policy``) and the KV blocks (``kv``) of one engine.

    ``rows``: requests running at once; ``prefill_chunk``: most prompt tokens per request per step;
    ``max_step_tokens``: the per-step token budget shared by decode rows (one each, always
    scheduled) and prefill chunks (from what is left), or None (every prefill gets its chunk).
    ``whole_chunks``: the budget never cuts a chunk short (a chunk that does not fit waits for a
    later step, and the oldest prefilling request always gets its chunk, so prefill progresses),
    so chunks start only at multiples of ``prefill_chunk`` (or a prefix-cache hit): the few
    prefill shapes a GPU warms up at start (:mod:`.model_runner`). ``speculator``: drafts for the
    decoding requests that speculate (None: no speculative decoding).
    """

    def __init__(self, rows: int, kv: KVCacheManager, policy: Policy, prefill_chunk: int,
                 max_step_tokens: int | None = None, *, whole_chunks: bool = False,
                 speculator: Speculator | None = None):
        self.kv, self.waiting = kv, policy
        self.running: list[Request | None] = [None] * rows
        self.prefill_chunk, self.max_step_tokens = prefill_chunk, max_step_tokens
        self.whole_chunks = whole_chunks
        self.speculator = speculator
        self._arrivals = self._starts = 0

    @property
    def free_rows(self) -> int:
        """Rows no request holds."""
        return sum(r is None for r in self.running)

    def add(self, request: Request) -> None:
        """Queue a new request (it starts at a later :meth:`schedule`)."""
        self._arrivals += 1
        request.arrival = self._arrivals
        self.waiting.push(request)

    def finish(self, request: Request) -> None:
        """Drop a request (finished or cancelled): its row and blocks are free at once."""
        request.finished = True
        if request.row >= 0:
            self._release(request)
        else:
            self.waiting.remove(request)

    def _release(self, request: Request) -> None:
        self.running[request.row] = None
        self.kv.free(request.kv)
        if self.speculator is not None:
            self.speculator.release(request)
        request.row = -1

    # ---- schedule ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """This step's plan (see the module docstring)."""
        started = self._admit()
        running = self._by_order()
        drafts = self._drafts(running)
        chunks = self._chunks(running, drafts)
        preempted = self._reserve(running, chunks, drafts)  # removes the preempted from running
        decodes, prefills, verifies = [], [], []
        for r in running:
            if r.decoding and r in drafts:
                tokens = np.concatenate([r.output[-1:], drafts[r]]).astype(np.int32)
                verifies.append(VerifyRow(r, r.row, r.num_computed_tokens, tokens))
            elif r.decoding:
                decodes.append(DecodeRow(r, r.row, r.num_computed_tokens))
            elif chunks.get(r, 0) > 0:
                start, n = r.num_computed_tokens, chunks[r]
                sample = start + n == r.prefill_end and r.num_sampled == 0  # a resumed one decodes next
                prefills.append(PrefillChunk(r, r.row, start, r.tokens()[start : start + n], sample))
        live = tuple(r for r in started if not r.finished and r.row >= 0)
        return SchedulerOutput(tuple(prefills), tuple(decodes), live, tuple(preempted), tuple(verifies))

    def _drafts(self, running: list[Request]) -> dict[Request, np.ndarray]:
        """The draft of each decoding request of ``running`` that speculates, proposes at this
        step (:meth:`~.spec_decode.SpecState.tick`) and has one (its last token landed; at most
        ``max_new_tokens`` emitted by the verify)."""
        if self.speculator is None:
            return {}
        ready = [r for r in running if r.spec is not None and r.decoding and r.spec.tick() and not r.in_flight]
        out = self.speculator.drafts([(r, r.params.max_new_tokens - r.num_sampled - 1) for r in ready])
        return {r: draft for r, draft in zip(ready, out) if draft.size}

    def _by_order(self) -> list[Request]:
        return sorted((r for r in self.running if r is not None), key=lambda r: r.order)

    def _admit(self) -> list[Request]:
        started: list[Request] = []
        room, prefilling = self._room()
        for row, occupant in enumerate(self.running):
            if not self.waiting or (room <= 0 and (prefilling or not self.whole_chunks)):
                break  # no tokens left this step (the oldest prefilling request of whole chunks always runs)
            if occupant is not None:
                continue
            r = self.waiting.peek()
            if r.in_flight or (r.prefill_end > self.kv.prefix_align and self._prefilling_elsewhere(r)):
                break  # its last token lands this step / a running request is prefilling its prefix
            tokens = r.tokens()[: r.prefill_end]
            reused = self.kv.admit(r.kv, tokens, self.prefill_chunk)
            if reused is None:
                break  # the head waits for blocks
            self.waiting.pop()
            self._starts += 1
            r.row, r.order, r.num_computed_tokens = row, self._starts, reused
            if r.num_cached_tokens is None:
                r.num_cached_tokens = reused
            self.running[row] = r
            started.append(r)
            room, prefilling = room - self._wants(r), True
        return started

    def _room(self) -> tuple[int, bool]:
        """The step's token budget left after the running requests' tokens (one per decoding
        request, its next chunk per prefilling one; unbounded without ``max_step_tokens``), and
        whether any running request is prefilling."""
        running = [r for r in self.running if r is not None]
        budget = 1 << 62 if self.max_step_tokens is None else self.max_step_tokens
        return budget - sum(self._wants(r) for r in running), any(r.prefilling for r in running)

    def _wants(self, r: Request) -> int:
        """Tokens ``r`` asks of this step: its next prefill chunk, else one when decoding."""
        if r.prefilling:
            return min(self.prefill_chunk, r.prefill_end - r.num_computed_tokens)
        return int(r.decoding)

    def _prefilling_elsewhere(self, r: Request) -> bool:
        """A running request is prefilling the first block of ``r``'s prompt that the prefix cache
        lacks: ``r`` waits until that block is committed and starts with a prefix hit, so n
        completions of one prompt added together prefill it once."""
        prefilling = (o.kv for o in self.running if o is not None and o.prefilling)
        return self.kv.prefix.prefilling_elsewhere(r.kv, r.tokens()[: r.prefill_end], prefilling)

    def _chunks(self, running: list[Request], drafts: dict[Request, np.ndarray]) -> dict[Request, int]:
        """Prefill tokens per prefilling request of ``running`` (in start order): decode rows first,
        one token each (and each draft's tokens), then chunks in start order from what
        ``max_step_tokens`` leaves."""
        budget = self.max_step_tokens if self.max_step_tokens is not None else 1 << 62
        budget -= sum(r.decoding for r in running) + sum(len(d) for d in drafts.values())
        chunks: dict[Request, int] = {}
        for r in running:
            if not r.prefilling:
                continue
            n = self._wants(r)
            if self.whole_chunks and n > budget:
                if not chunks:  # the oldest prefilling request always progresses
                    chunks[r] = n
                break
            if budget <= 0:
                break
            chunks[r] = min(n, budget)
            budget -= chunks[r]
        return chunks

    def _reserve(self, running: list[Request], chunks: dict[Request, int],
                 drafts: dict[Request, np.ndarray]) -> list[Request]:
        """Blocks for the tokens of this step of every request of ``running`` (in start order),
        oldest first; a draft the pool cannot hold is dropped (``drafts``), then the policy's
        victim is preempted while the pool is short, removing it from ``running``. Returns the
        preempted requests."""
        preempted: list[Request] = []
        i = 0
        while i < len(running):
            r = running[i]
            need = r.num_computed_tokens + (chunks.get(r, 0) if r.prefilling else int(r.decoding))
            if r in drafts and not self.kv.ensure(r.kv, need + len(drafts[r])):
                del drafts[r]
            if self.kv.ensure(r.kv, need):
                i += 1
                continue
            victim = self.waiting.victim(running)
            self._preempt(victim)
            preempted.append(victim)
            at = running.index(victim)
            del running[at]
            i -= at < i
        return preempted

    def _preempt(self, r: Request) -> None:
        self._release(r)
        r.num_computed_tokens = 0
        self.waiting.requeue(r)
        self.kv.preemptions += 1

    # ---- update ------------------------------------------------------------------------

    def update(self, plan: SchedulerOutput) -> None:
        """Advance the counters of every request the runner has enqueued ``plan`` for."""
        for c in plan.prefills:
            c.request.num_computed_tokens += len(c.tokens)
            c.request.num_tokens += c.sample
        for d in plan.decodes:
            d.request.num_computed_tokens += 1
            d.request.num_tokens += 1

    def advance(self, request: Request) -> None:
        """One token a verify row emitted landed: its position (the previous token's) is computed
        and it is sampled (a verify row's counters advance only as its outcome lands)."""
        request.num_computed_tokens += 1
        request.num_tokens += 1

    def commit_blocks(self) -> None:
        """Offer every running request's full blocks whose tokens are known (landed) and whose K/V
        is written to the prefix cache."""
        bs = self.kv.block_size
        for r in self.running:
            if r is None or r.num_computed_tokens // bs <= r.kv.committed:
                continue
            n = min(len(r.prompt) + len(r.output), r.num_computed_tokens) // bs
            if n > r.kv.committed:
                self.kv.prefix.commit(r.kv, n, r.tokens)
