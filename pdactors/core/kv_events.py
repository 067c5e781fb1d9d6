"""Exact prefix routing, sans-IO: which blocks each engine's prefix cache holds, as vLLM says
in its KV events (``--kv-events-config``), and how many leading blocks of a prompt's token ids
an engine holds.

*The wire.* vLLM's ``ZmqEventPublisher`` sends ``(topic, seq, payload)``: ``seq`` an 8-byte
big-endian counter from 0, ``payload`` a msgpack ``KVEventBatch`` — ``[ts, events, dp_rank]``
whose events are maps tagged by ``type``: ``BlockStored`` (the new blocks' hashes, the hash of
the block before the first, their token ids, the block size, LoRA, extra keys, the KV cache
group), ``BlockRemoved`` (hashes) and ``AllBlocksCleared``. :func:`decode_batch` reads them
with structs of our own that take only the fields read here and skip unknown ones, and skips
an event of a type it does not know (a newer vLLM), so version skew costs routing quality, not
a crash. A payload that is not a batch raises :class:`BadBatch`.

*What is indexed.* vLLM's block hashes depend on its hash seed and function, which the proxy
does not share, so a stored block is keyed on what it holds: ``hash((parent key, its token
ids))`` — a chain like vLLM's own, started at 0 for a block without a parent. The key of a
block whose hash includes more than its tokens (a LoRA, multimodal inputs, a cache salt: its
``extra_keys`` or ``lora_name``) includes those too, so a prompt of plain token ids never
matches it (nor its descendants). A block whose parent this index has not seen (stored before
the proxy listened, or lost in a gap) cannot be keyed and is skipped with what follows it in
the event. Blocks are kept per KV cache group; a prompt's match counts the groups of full
attention only (a sliding-window or Mamba group holds no whole prefix), the least of them.

*Never asked to be right.* An index that missed events only routes a request where its prompt
is recomputed. The feed (:mod:`pdactors.proxy._kv_events`) clears an engine's index when it
cannot replay a gap or the engine restarted, and it refills from new events.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

__all__ = [
    "FULL_ATTENTION_KINDS",
    "AllBlocksCleared",
    "BadBatch",
    "BlockRemoved",
    "BlockStored",
    "EngineBlocks",
    "EventBatch",
    "chain_keys",
    "decode_batch",
]

#: The KV cache kinds whose blocks hold a whole prefix (vLLM's ``KVCacheSpecKind`` values;
#: None: the publisher did not say).
FULL_ATTENTION_KINDS: Final = frozenset(
    {None, "full_attention", "mla_attention", "sink_full_attention"}
)

BlockHash = bytes | int


class BlockStored(msgspec.Struct, tag=True):
    """New blocks in an engine's prefix cache: ``len(block_hashes)`` blocks of ``block_size``
    tokens, ``token_ids`` theirs, in order; the first follows ``parent_block_hash``."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    """Blocks evicted from an engine's prefix cache."""

    block_hashes: list[BlockHash]
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    """The engine's prefix cache was emptied (``reset_prefix_cache``)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    """One publish: its time, its events (raw: each decoded alone), its DP rank."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class BadBatch(ValueError):
    """A payload that is not a KV event batch."""


_batch = msgspec.msgpack.Decoder(EventBatch)
_event = msgspec.msgpack.Decoder(Event)  # type: ignore[arg-type]


def decode_batch(payload: bytes) -> tuple[list[Event], int]:
    """The events of one batch, and how many were skipped (of a type this version does not
    know, or malformed). Raises :class:`BadBatch` when the payload is not a batch."""
    try:
        batch = _batch.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadBatch(f"not a KV event batch: {exc}") from None
    events: list[Event] = []
    skipped = 0
    for raw in batch.events:
        try:
            events.append(_event.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError):
            skipped += 1
    return events, skipped


def chain_keys(token_ids: Sequence[int], block_size: int, limit: int) -> list[int]:
    """The chained keys of the whole blocks of ``token_ids`` (at most ``limit``): the keys
    :class:`EngineBlocks` gives the same blocks stored without extra keys."""
    keys: list[int] = []
    key = 0
    end = min(len(token_ids) // block_size, limit) * block_size
    for start in range(0, end, block_size):
        key = hash((key, tuple(token_ids[start : start + block_size])))
        keys.append(key)
    return keys


@dataclass
class _Group:
    """One KV cache group of an engine: vLLM's block hash -> our chain key, and how many of
    its hashes hold each key (two hashes may hold equal blocks: a medium, a seed change)."""

    full: bool = True
    keys: dict[BlockHash, int] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)


class EngineBlocks:
    """What one engine's prefix cache holds, from its KV events (sans-IO)."""

    def __init__(self) -> None:
        self.groups: dict[int, _Group] = {}
        self.block_size: int | None = None  # of its first stored block (tokens per block)
        self.unchained = 0  # stored blocks skipped: their parent was never seen here

    def __len__(self) -> int:
        """Blocks held, over every group."""
        return sum(len(g.keys) for g in self.groups.values())

    def clear(self) -> None:
        self.groups.clear()

    def apply(self, events: Sequence[Event]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                group = self.groups.get(event.group_idx or 0)
                if group is not None:
                    for h in event.block_hashes:
                        self._drop(group, h)
            else:
                self.clear()

    def matched(self, keys_of: dict[int, list[int]], token_ids: Sequence[int], limit: int) -> int:
        """How many leading tokens of ``token_ids`` this engine holds in whole blocks (0 when
        it holds no group of full attention). ``keys_of`` caches the prompt's keys by block
        size across engines."""
        size = self.block_size
        full = [g for g in self.groups.values() if g.full]
        if size is None or not full:
            return 0
        keys = keys_of.get(size)
        if keys is None:
            keys = keys_of[size] = chain_keys(token_ids, size, limit)
        return min(_leading(g.held, keys) for g in full) * size

    def _stored(self, event: BlockStored) -> None:
        group = self.groups.setdefault(event.group_idx or 0, _Group())
        group.full = event.kv_cache_spec_kind in FULL_ATTENTION_KINDS
        size = event.block_size
        if size < 1 or len(event.token_ids) != size * len(event.block_hashes):
            return  # not blocks of that size: nothing to key them on
        if event.parent_block_hash is None:
            key = 0
        elif (parent := group.keys.get(event.parent_block_hash)) is not None:
            key = parent
        else:
            self.unchained += len(event.block_hashes)
            return
        if self.block_size is None:
            self.block_size = size
        extras = _extras(event)
        for i, h in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * size : (i + 1) * size])
            extra = next(extras)
            key = hash((key, tokens)) if extra is None else hash((key, tokens, extra))
            if size != self.block_size:  # a partial block: held, never matched by a prompt
                key = hash((key, "partial"))
            self._drop(group, h)
            group.keys[h] = key
            group.held[key] = group.held.get(key, 0) + 1

    @staticmethod
    def _drop(group: _Group, h: BlockHash) -> None:
        key = group.keys.pop(h, None)
        if key is None:
            return
        left = group.held[key] - 1
        if left:
            group.held[key] = left
        else:
            del group.held[key]


def _extras(event: BlockStored) -> Iterator[Any]:
    """Each block's keys beyond its tokens, hashable (None: none)."""
    extra = event.extra_keys or ()
    for i in range(len(event.block_hashes)):
        mine = extra[i] if i < len(extra) else None
        if event.lora_name is not None:
            yield (event.lora_name, _frozen(mine))
        else:
            yield None if mine is None else _frozen(mine)


def _frozen(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):  # (ordered by key text alone: values may not compare)
        return tuple(sorted(((str(k), _frozen(v)) for k, v in value.items()), key=_first))
    return value


def _first(pair: tuple[str, Any]) -> str:
    return pair[0]


def _leading(held: dict[int, int], keys: Sequence[int]) -> int:
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n
