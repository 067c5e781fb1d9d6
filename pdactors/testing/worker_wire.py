"""What the harness's coordinator (:mod:`pdactors.testing.process_cluster`) and its worker
processes (:mod:`pdactors.testing.kv_worker`) say to each other: one JSON object per line, the
worker's :class:`WorkerSpec` first, then :data:`Command` s down and :data:`Reply` s up."""

from __future__ import annotations

from typing import Literal

import msgspec

from pdactors.config import DataPlaneConfig
from pdactors.core.plan import rank_heads

__all__ = [
    "Command",
    "Counts",
    "Hello",
    "Pull",
    "Pulled",
    "Readied",
    "Ready",
    "Released",
    "Reply",
    "Stats",
    "WorkerSpec",
]


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker is: its engine's role and id, its TP rank, the model's KV shape
    (``block_bytes``: one layer's block of the whole model, split over ``kv_heads`` heads;
    0 when TP sizes are equal), where its KV lives, and how it reaches the others."""

    role: Literal["prefill", "decode"]
    engine_id: str
    tp_rank: int = 0
    tp_size: int = 1
    kv_heads: int = 0
    layers: int
    num_blocks: int
    block_bytes: int
    bootstrap_url: str
    dataplane: DataPlaneConfig
    checksums: bool = True
    secret: str = ""  # the side channel runs CURVE with keys derived from it when set
    kv_device: str = "cpu"

    @property
    def heads(self) -> range:
        return rank_heads(self.tp_rank, self.tp_size, self.kv_heads) if self.kv_heads else range(1)

    @property
    def local_block_bytes(self) -> int:
        """This worker's part of a block: its heads' bytes."""
        if not self.kv_heads:
            return self.block_bytes
        return self.block_bytes * len(self.heads) // self.kv_heads


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    transfer_id: str
    blocks: list[int]


class Pull(msgspec.Struct, frozen=True, tag="pull"):
    transfer_id: str
    engine_id: str
    blocks: list[int]
    src_count: int  # P's blocks of the transfer; D's are its last ``len(blocks)``


class Stats(msgspec.Struct, frozen=True, tag="stats"):
    pass


Command = Ready | Pull | Stats


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    session: str = ""
    error: str = ""


class Readied(msgspec.Struct, frozen=True, tag="readied"):
    transfer_id: str
    error: str = ""


class Pulled(msgspec.Struct, frozen=True, tag="pulled"):
    transfer_id: str
    ok: bool
    reason: str
    verified: bool
    nbytes: int
    start: float
    end: float


class Released(msgspec.Struct, frozen=True, tag="released"):
    transfer_ids: list[str]


class Counts(msgspec.Struct, frozen=True, tag="counts"):
    descriptors_sent: int = 0


Reply = Hello | Readied | Pulled | Released | Counts
