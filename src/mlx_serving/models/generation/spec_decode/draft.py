"""Draft-model proposals (vLLM's ``draft_model`` method; Leviathan et al. 2023, Chen et al. 2023):
a smaller model sharing the target's tokenizer proposes each speculating row's k tokens.

The draft runs through the engine's own parts: the shared decoder's ragged forward
(:func:`~...decoder.layers.forward`) over a paged KV cache of its own
(:func:`~...decoder.kv_cache.init_paged_kv_cache`, as many blocks as the target's pool, so every
target position has a draft one) with its own :class:`~..kv_cache_manager.KVCacheManager` (no
prefix cache) and one block table per row. :meth:`DraftModel.propose` runs, for all the step's
speculating rows at once, k batched forwards: the first feeds each row's tokens the draft has not
seen (its whole prompt the first time; after a verify the accepted drafts and the bonus token,
or after a rejection the tokens past the agreed prefix: the draft's K/V beyond it is simply
written over), each later one the previous draft token. A greedy row's draft is the argmax of the
draft's logits with the row's processors applied; a sampled row's is drawn from q, the row's
chain applied to the draft's logits (:func:`~.verify.chain_probs`), kept for the verify's
rejection sampler (``SpecState.draft_probs``). A row's draft blocks are freed with its row
(finish, cancellation, preemption: :meth:`DraftModel.release`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

import mlx.core as mx
import numpy as np

from ...decoder import layers
from ...decoder.attention import Rows, packing
from ...decoder.kv_cache import init_paged_kv_cache
from ...loader import load
from ...sources import resolve
from ..kv_cache_manager import KVCacheManager, SeqBlocks
from ..logits import Chain, RowInput, process
from ..sampling import draw_unsorted, greedy
from .adaptive import SpecState
from .verify import chain_probs

__all__ = ["DraftModel", "DraftModelError", "DraftRow"]

_EMPTY = np.zeros(0, dtype=np.int32)


class DraftModelError(ValueError):
    """``speculative_config.model`` cannot serve as the draft: not loadable, or its tokenizer is
    not the target's (the message names the field and says which)."""


class DraftRow(Protocol):
    """What a proposal reads of a request (:class:`~..request.Request`)."""

    spec: SpecState | None
    chain: Chain
    rng: np.random.Generator

    @property
    def num_sampled(self) -> int: ...

    def tokens(self) -> np.ndarray: ...


@dataclass
class _Slot:
    """A row's draft KV: its block table and the tokens whose K/V it holds at positions 0.."""

    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    fed: np.ndarray = field(default_factory=lambda: _EMPTY)


@dataclass
class _Live:
    """A row proposing this step: ``k`` tokens after its ``stream`` (prompt + output), whose
    first ``common`` tokens the draft's K/V already holds."""

    row: DraftRow
    k: int
    stream: np.ndarray
    common: int
    slot: _Slot
    tokens: list[mx.array] = field(default_factory=list)  # (1,) int32 per draft position
    probs: list[mx.array] = field(default_factory=list)  # (V,) float32 per position (sampled rows)


class DraftModel:
    """A loaded draft model ``state`` with a KV pool of ``num_blocks`` blocks of ``block_size``
    tokens (the state loaded by :meth:`load_state`)."""

    def __init__(self, state: layers.State, num_blocks: int, block_size: int):
        self.state = state
        self.kv = KVCacheManager(num_blocks, block_size, prefix_caching=False)
        self.cache = init_paged_kv_cache(state, num_blocks, block_size)
        self._slots: dict[DraftRow, _Slot] = {}

    @staticmethod
    def load_state(name: str, target: layers.State) -> layers.State:
        """The draft ``name`` (what ``--model`` takes) loaded in the target's dtype. Raises
        DraftModelError naming ``speculative_config.model`` when it cannot be resolved or loaded,
        or when its vocabulary or tokenizer (tokenizer.json's vocabulary and added tokens) is not
        the target's."""
        try:
            state = load(resolve(name).path, dtype=target.dtype)
        except (OSError, ValueError, KeyError) as e:
            raise DraftModelError(f"speculative_config.model {name!r} cannot be loaded: {e}") from e
        check_same_tokenizer(target, state, name)
        return state

    @property
    def num_rows(self) -> int:
        """Rows holding draft KV blocks."""
        return len(self._slots)

    def release(self, row: DraftRow) -> None:
        """Free ``row``'s draft blocks (its row is finished, cancelled or preempted)."""
        slot = self._slots.pop(row, None)
        if slot is not None:
            self.kv.free(slot.blocks)

    def close(self) -> None:
        """Free every row's blocks and drop the KV arrays."""
        for row in list(self._slots):
            self.release(row)
        self.cache.keys.clear()
        self.cache.values.clear()

    def propose(self, rows: Sequence[tuple[DraftRow, int]]) -> list[np.ndarray]:
        """Drafts ``(k_i,)`` int32 for ``rows`` ``(row, k_i)`` (each row's last token landed), in
        k batched draft forwards; a row with ``k_i`` < 1, or whose draft blocks the pool cannot
        hold, gets an empty one. Sets each proposing row's ``spec.draft_probs`` (its q for a
        sampled row, else None)."""
        live = [x for row, k in rows if k >= 1 and (x := self._live(row, k)) is not None]
        if live:
            self._run(live)
        drafts = {id(x.row): x for x in live}
        out = []
        for row, _ in rows:
            x = drafts.get(id(row))
            out.append(np.array(mx.concatenate(x.tokens)) if x is not None else _EMPTY)
        return out

    def _live(self, row: DraftRow, k: int) -> _Live | None:
        stream = row.tokens()
        slot = self._slots.setdefault(row, _Slot())
        if not self.kv.ensure(slot.blocks, len(stream) + k - 1):
            return None
        n = min(len(slot.fed), len(stream) - 1)
        diff = np.flatnonzero(slot.fed[:n] != stream[:n])
        return _Live(row, k, stream, int(diff[0]) if diff.size else n, slot)

    def _run(self, live: list[_Live]) -> None:
        feeds = [x.stream[x.common :] for x in live]
        starts = [x.common for x in live]
        self._choose(live, self._forward(feeds, starts, [x.slot for x in live]), 0)
        for j in range(1, max(x.k for x in live)):
            group = [x for x in live if x.k > j]
            tokens = mx.concatenate([x.tokens[-1] for x in group])
            starts = [len(x.stream) - 1 + j for x in group]
            self._choose(group, self._forward(tokens, starts, [x.slot for x in group]), j)
        mx.eval([t for x in live for t in x.tokens], [q for x in live for q in x.probs],
                self.cache.keys, self.cache.values)
        for x in live:
            x.slot.fed = np.concatenate([x.stream, np.array(mx.concatenate(x.tokens[:-1]))]).astype(np.int32) \
                if x.k > 1 else x.stream
            spec = x.row.spec
            if spec is not None:
                spec.draft_probs = mx.stack(x.probs) if x.probs else None

    def _forward(self, feeds: list[np.ndarray] | mx.array, starts: list[int], slots: list[_Slot]) -> mx.array:
        """One draft forward: row i feeds ``feeds[i]`` at positions ``starts[i]..`` (``feeds``:
        ragged host arrays, or ``(B,)`` device tokens, one per row); logits ``(B, V)`` at each
        row's last token."""
        b = len(starts)
        if isinstance(feeds, mx.array):
            tokens, n_valid = feeds[:, None], np.ones(b, dtype=np.int32)
        else:
            n_valid = np.array([len(f) for f in feeds], dtype=np.int32)
            host = np.zeros((b, int(n_valid.max())), dtype=np.int32)
            for i, f in enumerate(feeds):
                host[i, : len(f)] = f
            tokens = mx.array(host)
        t = tokens.shape[1]
        start = np.array(starts, dtype=np.int32)
        kv_len = int((start + n_valid).max())
        width = -(-kv_len // self.kv.block_size)
        table = np.zeros((b, width), dtype=np.int32)
        for i, slot in enumerate(slots):
            blocks = slot.blocks.blocks[:width]
            table[i, : len(blocks)] = blocks
        dense = b == 1 and int(n_valid[0]) == t
        packed, unpacked = packing(n_valid, t) if t > 1 and not dense else (None, None)
        rows = Rows(tokens, mx.array(start), mx.array(n_valid), kv_len, mx.array(n_valid - 1), mx.array(table),
                    dense=dense, packed=packed, unpacked=unpacked)
        return layers.forward(self.state, self.cache, rows)

    def _choose(self, group: list[_Live], logits: mx.array, j: int) -> None:
        """Each row's draft token at its position ``j`` from the draft's ``logits`` ``(B, V)``:
        greedy rows the argmax of their processed logits, sampled rows a draw from their q."""
        inputs = [RowInput(x.row.chain, 0, x.row.num_sampled + j, None, x.row.rng) for x in group]
        z = process(logits, inputs)
        tokens = greedy(z)
        sampled = [i for i, x in enumerate(group) if not x.row.chain.greedy]
        if sampled:
            idx = mx.array(sampled, dtype=mx.int32)
            q = chain_probs(z[idx], [inputs[i] for i in sampled])
            u = mx.array([group[i].row.rng.random() for i in sampled], dtype=mx.float32)
            tokens[idx] = draw_unsorted(q, u)
            for n, i in enumerate(sampled):
                group[i].probs.append(q[n])
        for i, x in enumerate(group):
            x.tokens.append(tokens[i : i + 1])


def check_same_tokenizer(target: layers.State, draft: layers.State, name: str) -> None:
    """DraftModelError naming ``speculative_config.model`` unless ``draft`` has the target's
    vocabulary size and, where both checkpoints have a tokenizer.json, the same vocabulary and
    added tokens."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise DraftModelError(f"speculative_config.model {name!r} has a vocabulary of {draft.config.vocab_size} "
                              f"tokens, the target {target.config.vocab_size}: the draft must share the "
                              "target's tokenizer")
    mine, theirs = _vocabulary(target.path), _vocabulary(draft.path)
    if mine is not None and theirs is not None and mine != theirs:
        raise DraftModelError(f"speculative_config.model {name!r} has a different tokenizer (tokenizer.json "
                              "vocabulary or added tokens) than the target: the draft must share the target's "
                              "tokenizer")


def _vocabulary(path: Path | None) -> tuple[object, object] | None:
    """tokenizer.json's ``model.vocab`` and added tokens ``(id, content)`` of a checkpoint (None:
    no path or no tokenizer.json)."""
    if path is None or not (path / "tokenizer.json").is_file():
        return None
    data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or ())
    return (data.get("model") or {}).get("vocab"), added
