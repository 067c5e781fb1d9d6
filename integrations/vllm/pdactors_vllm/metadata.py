"""What the scheduler side hands every worker each step (:class:`PdActorsMetadata`), and how
one of vLLM's KV-cache groups moves (:class:`KVGroup`, :func:`prompt_blocks`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from pdactors.wire import BlockIds

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = [
    "NULL_BLOCK",
    "KVGroup",
    "PdActorsMetadata",
    "PullSpec",
    "SendSpec",
    "prompt_blocks",
    "traceparent",
]

#: vLLM's null block: a placeholder in block tables (out of a window, padding), never moved.
NULL_BLOCK = 0


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One of vLLM's KV-cache groups as the connector moves it: its ``block_size``, its
    sliding ``window`` in tokens (0: full attention), the ``retained`` tokens vLLM keeps past
    the window (speculative decoding's), and whether it is transferred at all."""

    block_size: int
    window: int = 0
    retained: int = 0
    transfer: bool = True
    state: bool = False  # recurrent state pages (Mamba / GDN), not per-token KV

    def kept(self, num_tokens: int) -> range:
        """The blocks (by position in the request's block table) holding KV of a
        ``num_tokens`` prompt that vLLM still keeps once the prompt is computed: all of them
        for full attention; for a sliding window, those from the first block the window
        reaches (vLLM's ``get_num_skipped_tokens``: blocks before it are freed, null)."""
        end = math.ceil(num_tokens / self.block_size)
        if not self.window:
            return range(end)
        skipped = max(0, num_tokens - self.window + 1 - self.retained)
        return range(min(skipped // self.block_size, end), end)

    def moved(self, table: Sequence[int], num_tokens: int, first: int = 0) -> tuple[int, ...]:
        """The block ids of ``table`` (a group's block table) that hold the KV of a
        ``num_tokens`` prompt, from position ``first`` on, without null blocks."""
        if not self.transfer:
            return ()
        if self.state:  # state pages (one, or per prefix block: the live ones are not null)
            start, stop = first, len(table)
        else:
            kept = self.kept(num_tokens)
            start, stop = max(kept.start, first), min(kept.stop, len(table))
        return tuple(b for b in table[start:stop] if b != NULL_BLOCK)


def prompt_blocks(
    groups: Sequence[KVGroup], num_tokens: int, tables: Sequence[Sequence[int]]
) -> BlockIds:
    """P's blocks holding the KV of a ``num_tokens`` prompt, per group (what D's pull may ask
    for): ``tables`` is the request's block table per group, in the order of ``groups``."""
    return tuple(
        group.moved(table, num_tokens) for group, table in zip(groups, tables, strict=True)
    )


@dataclass(frozen=True, slots=True)
class SendSpec:
    """P: the KV of ``transfer_id`` sits in ``block_ids`` until the worker reports it sent."""

    transfer_id: str
    block_ids: BlockIds  # per KV-cache group
    traceparent: str | None = None  # the request's W3C trace context (pdactors_vllm.tracing)


@dataclass(frozen=True, slots=True)
class PullSpec:
    """D: pull ``transfer_id`` from ``engine_id`` (found at ``bootstrap_url``) into ``block_ids``.

    ``notify_only`` pulls carry no blocks: they only tell P to free its KV, and their end is not
    reported to vLLM (the request is not waiting for them).
    """

    transfer_id: str
    engine_id: str
    bootstrap_url: str
    block_ids: BlockIds  # per KV-cache group
    notify_only: bool = False
    traceparent: str | None = None  # the request's W3C trace context (pdactors_vllm.tracing)


@dataclass
class PdActorsMetadata(KVConnectorMetadata):
    """What the workers must do this step (request ids are vLLM's)."""

    pending: list[str] = field(default_factory=list)  # P: transfer ids whose prefill started
    ready: dict[str, SendSpec] = field(default_factory=dict)  # P: req id -> KV to send
    #: P: req id -> KV to send once this step's forward is done (eager send)
    eager: dict[str, SendSpec] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # P: transfer ids that will never be ready
    pulls: dict[str, PullSpec] = field(default_factory=dict)  # D: req id -> what to pull
    aborts: dict[str, str] = field(default_factory=dict)  # D: req id -> transfer id to abort
    idle: bool = False  # the step computes nothing: the worker may wait for transfer results
    wake: str | None = None  # D: where the worker pings the engine core's idle gate
    slept: bool = False  # D: the engine core slept in its idle gate before this step

    def has_work(self) -> bool:
        """Whether the step hands the workers anything to do."""
        return bool(
            self.pending or self.ready or self.eager or self.dropped or self.pulls or self.aborts
        )


def traceparent(request: Request) -> str | None:
    """The W3C ``traceparent`` header ``request`` came with (vLLM keeps a request's trace
    headers only while its own tracing, ``--otlp-traces-endpoint``, is on)."""
    headers = request.trace_headers
    return headers.get("traceparent") if headers else None
