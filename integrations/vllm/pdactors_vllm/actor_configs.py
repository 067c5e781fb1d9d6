"""Where a worker sits, and the configs of the actors it runs, built from the connector's
settings in one place (before any thread starts)."""

from __future__ import annotations

from dataclasses import dataclass

from pdactors import (
    BootstrapConfig,
    Compat,
    DataPlaneConfig,
    Liveness,
    RankInfo,
    ReceiverConfig,
    SenderConfig,
)
from pdactors.config import VerifyKv
from pdactors_vllm.settings import ConnectorSettings

__all__ = ["ActorConfigs", "WorkerPlace", "actor_configs", "verify_kv_for"]


def verify_kv_for(s: ConnectorSettings, *, host_kv: bool) -> VerifyKv:
    """The KV checksums' mode for KV in host memory (``host_kv``) or on a GPU: the setting,
    with ``"auto"`` on for host memory and off on a GPU (where the measured cost is above the
    3 % of a TTFT the default allows: docs/benchmarks.md)."""
    if s.verify_kv == "auto":
        return "on" if host_kv else "off"
    return s.verify_kv


@dataclass(frozen=True, slots=True)
class WorkerPlace:
    """Where this worker sits: engine, role and parallel ranks."""

    engine_id: str
    is_producer: bool
    is_consumer: bool
    ranks: RankInfo
    runs_bootstrap: bool
    kv_heads: int = 0  # the model's KV heads in all (heterogeneous TP needs them)
    compat: Compat | None = None  # what a peer must match (pdactors_vllm.compat)


@dataclass(frozen=True, slots=True)
class ActorConfigs:
    """What one worker starts: the data plane, and the bootstrap, sender and receiver its role
    needs (None: not run here)."""

    plane: DataPlaneConfig
    bootstrap: BootstrapConfig | None
    sender: SenderConfig | None
    receiver: ReceiverConfig | None


def actor_configs(
    s: ConnectorSettings, place: WorkerPlace, *, host_kv: bool = True
) -> ActorConfigs:
    """The configs of ``place``'s actors from settings ``s``; ``host_kv``: its KV cache is in
    host memory. ``verify_kv`` sets P's ``checksum_kv`` and D's ``verify_kv`` (``"auto"``:
    on for host KV, off for a GPU's: :func:`verify_kv_for`); the hasher is chosen with the KV
    tensors (:func:`pdactors_vllm.worker_side.kv_hasher`). Reads the bootstrap token file:
    raises :class:`OSError` or :class:`ValueError` (empty file)."""
    token = s.bootstrap_token()
    verify = verify_kv_for(s, host_kv=host_kv)
    # A handshake a starved peer cannot answer is a heartbeat it cannot answer: one bound.
    hung = s.heartbeat_timeout
    liveness = Liveness(heartbeat_timeout=hung, connect_timeout=hung)
    plane = DataPlaneConfig(
        protocol=s.protocol, device_name=s.device_name, hostname=s.host,
        workers=s.sender_workers, inline_max_bytes=s.inline_max_bytes,
    )  # fmt: skip
    bootstrap = sender = receiver = None
    if place.runs_bootstrap:
        bootstrap = BootstrapConfig(
            host=s.bootstrap_host,
            port=s.bootstrap_port,
            token=token,
            certfile=s.bootstrap_certfile,
            keyfile=s.bootstrap_keyfile,
        )
    if place.is_producer:
        sender = SenderConfig(
            engine_id=place.engine_id,
            ranks=place.ranks,
            host=s.host,
            bootstrap_url=s.bootstrap_url,
            ready_timeout=s.ready_timeout,
            unclaimed_ttl=s.unclaimed_ttl,
            register_timeout=s.register_timeout,
            liveness=liveness,
            kv_heads=place.kv_heads,
            bootstrap_token=token,
            bootstrap_ca_file=s.bootstrap_ca_file,
            compat=place.compat,
            compat_relax=s.compat_relax,
            checksum_kv=verify != "off",
        )
    if place.is_consumer:
        receiver = ReceiverConfig(
            engine_id=place.engine_id,
            ranks=place.ranks,
            pull_timeout=s.pull_timeout,
            lookup_timeout=s.lookup_timeout,
            liveness=liveness,
            kv_heads=place.kv_heads,
            bootstrap_token=token,
            bootstrap_ca_file=s.bootstrap_ca_file,
            trusted_bootstraps=(*s.trusted_bootstraps, s.bootstrap_url),
            compat=place.compat,
            compat_relax=s.compat_relax,
            verify_kv=verify,
            fast_done=s.fast_done,
        )
    return ActorConfigs(plane, bootstrap, sender, receiver)
