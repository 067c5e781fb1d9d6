"""Frozen configuration records. Environment and argv are read only in ``cli.py`` and the
vLLM adapter; everything else receives one of these."""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = [
    "BootstrapConfig",
    "DataPlaneConfig",
    "Protocol",
    "RankInfo",
    "ReceiverConfig",
    "SenderConfig",
]

Protocol = Literal["tcp", "rdma", "nvlink_intra"]


class DataPlaneConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to start the Mooncake Transfer Engine.

    ``max_descriptors_per_call`` × ``max_calls_per_peer`` bounds the descriptors in flight to
    one peer (Mooncake's TCP transport breaks a peer's path past 2048).
    """

    protocol: Protocol = "tcp"
    device_name: str = ""
    hostname: str = "127.0.0.1"
    workers: int = 2
    max_descriptors_per_call: int = 1024
    max_calls_per_peer: int = 1

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.max_descriptors_per_call < 1 or self.max_calls_per_peer < 1:
            raise ValueError("max_descriptors_per_call and max_calls_per_peer must be >= 1")


class RankInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Where a worker sits in its engine: data-, tensor- and pipeline-parallel ranks."""

    dp_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"bad ranks {self}")
        if self.dp_rank < 0:
            raise ValueError("dp_rank must be >= 0")


class BootstrapConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where the bootstrap registry listens (port 0: any free port)."""

    host: str = "127.0.0.1"
    port: int = 0


class SenderConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A P worker's sender actor.

    * ``ready_timeout``: how long a D pull waits for P's prefill to finish.
    * ``unclaimed_ttl``: how long a ready transfer waits for D's pull before it expires and P
      frees its blocks.
    * ``tombstone_ttl``: how long an ended transfer id is remembered, so a late pull is answered
      at once instead of waiting.
    * ``register_timeout``: how long registration with the bootstrap is retried.
    """

    engine_id: str
    ranks: RankInfo = RankInfo()
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_url: str | None = None
    ready_timeout: float = 30.0
    unclaimed_ttl: float = 120.0
    tombstone_ttl: float = 60.0
    register_timeout: float = 30.0
    tick_interval: float = 0.1


class ReceiverConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A D worker's receiver actor.

    * ``pull_timeout``: the longest a pull may take, from request sent to P's answer. Must cover
      P's ``ready_timeout`` plus the write itself.
    * ``lookup_timeout``: the longest a bootstrap query may take.
    """

    engine_id: str = "decode"
    ranks: RankInfo = RankInfo()
    pull_timeout: float = 60.0
    lookup_timeout: float = 10.0
    tick_interval: float = 0.1
