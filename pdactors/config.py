"""Frozen configuration records. Environment and argv are read only in ``cli.py`` and the
vLLM adapter; everything else receives one of these."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

import msgspec

from pdactors.core.compat import check_relax
from pdactors.errors import ConfigError
from pdactors.wire import Compat

__all__ = [
    "DEFAULT_BOOTSTRAP_PORT",
    "INLINE_MAX_BYTES",
    "MAX_CONNECTIONS_PER_CLIENT",
    "PROTOCOLS",
    "WRITE_TIMEOUT",
    "BootstrapConfig",
    "DataPlaneConfig",
    "Liveness",
    "Protocol",
    "RankInfo",
    "ReceiverConfig",
    "Secret",
    "SenderConfig",
    "VerifyKv",
    "check_door_limits",
    "default_of",
    "read_token_file",
]

Protocol = Literal["tcp", "rdma", "nvlink_intra"]
#: The Mooncake protocols, as named on command lines and in configs.
PROTOCOLS: tuple[str, ...] = get_args(Protocol)
#: Upstream's bootstrap port (``VLLM_MOONCAKE_BOOTSTRAP_PORT``'s default).
DEFAULT_BOOTSTRAP_PORT = 8998
#: Every HTTP door's defaults (the bootstrap's, the proxy's): the connections one client (one
#: peer address) may hold open at once, and the seconds a write of an answer to a client may
#: wait for it to read (docs/security.md, "Limits on the HTTP doors"). 0: no limit.
MAX_CONNECTIONS_PER_CLIENT = 256
WRITE_TIMEOUT = 30.0


def default_of(config: type[msgspec.Struct], name: str) -> Any:
    """The default of field ``name`` of the config struct ``config``: defaults are stated
    once, where the field is, and read from there by the CLI and the vLLM settings."""
    fields = {f.name: f for f in msgspec.structs.fields(config)}
    field = fields[name]
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    raise KeyError(f"{config.__name__}.{name} has no default")


#: ``DataPlaneConfig.inline_max_bytes`` by protocol where it is not set (issue 28, measured on
#: one H200 with ``bench/gpu_dataplane.py``: the write inside the sender 0.17 ms against 0.41
#: for a 0.12 ms call, and 1.4x the throughput with 4 pulls at once). Others: 0.
INLINE_MAX_BYTES: dict[str, int] = {"nvlink_intra": 256 << 20}


class DataPlaneConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to start the Mooncake Transfer Engine.

    ``max_descriptors_per_call`` × ``max_calls_per_peer`` bounds the descriptors in flight to
    one peer (Mooncake's TCP transport breaks a peer's path past 2048). ``inline_max_bytes``:
    an engine call of at most this many bytes whose writes wait for nothing (no ``before``, or
    one whose ``ready()`` says the KV is complete) is made in the Trio thread itself, blocking
    it for the call, instead of in a worker thread: for fast transports (``nvlink_intra``)
    where the hand-off to the thread and back costs more than the call (issue 28: 0.39 ms for
    a 0.13 ms call on an H200 host). 0: every call goes to a worker thread. None (default):
    by protocol (:data:`INLINE_MAX_BYTES`: 256 MiB for ``nvlink_intra``, where such a call
    takes ~0.2 ms on an H200; 0 for the others, whose calls take milliseconds):
    :attr:`inline_limit` says which.
    """

    protocol: Protocol = "tcp"
    device_name: str = ""
    hostname: str = "127.0.0.1"
    workers: int = 2
    max_descriptors_per_call: int = 1024
    max_calls_per_peer: int = 1
    inline_max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.inline_max_bytes is not None and self.inline_max_bytes < 0:
            raise ConfigError("inline_max_bytes must be >= 0")
        if self.workers < 1:
            raise ConfigError("workers must be >= 1")
        if self.max_descriptors_per_call < 1 or self.max_calls_per_peer < 1:
            raise ConfigError("max_descriptors_per_call and max_calls_per_peer must be >= 1")

    @property
    def inline_limit(self) -> int:
        """``inline_max_bytes``, or the protocol's default where it is None."""
        if self.inline_max_bytes is not None:
            return self.inline_max_bytes
        return INLINE_MAX_BYTES.get(self.protocol, 0)

    def mooncake_environment(self) -> dict[str, str]:
        """The environment a process needs before its Mooncake engine starts (the engine
        reads no other way in): ``MC_INTRANODE_NVLINK`` (Mooncake installs its intra-node
        NVLink transport only when it is set) for ``nvlink_intra``; ``MC_LOG_LEVEL``, since
        Mooncake is chatty at INFO. Defaults: the caller applies those not set yet."""
        env = {"MC_LOG_LEVEL": "ERROR"}
        if self.protocol == "nvlink_intra":
            env["MC_INTRANODE_NVLINK"] = "1"
        return env


class RankInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Where a worker sits in its engine: data-, tensor- and pipeline-parallel ranks."""

    dp_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ConfigError(f"bad ranks {self}")
        if self.dp_rank < 0:
            raise ConfigError("dp_rank must be >= 0")


class Liveness(msgspec.Struct, frozen=True, kw_only=True):
    """How the side channel judges a peer gone: ZMQ heartbeats, answered by libzmq's I/O thread
    (a peer whose Python thread is busy still answers; a dead, stopped or cut-off one does not).

    * ``heartbeat_interval``: seconds between pings on an idle connection.
    * ``heartbeat_timeout``: a connection silent this long after a ping is dropped, and every
      transfer on it ends ("peer gone"): how fast a *hung* peer is noticed (a dead one is
      noticed at once, by its disconnect). 3 s by default: on an oversubscribed host (vLLM's
      CPU workers spinning on every core) libzmq's I/O thread can be starved for over a
      second, and a live peer must not be judged gone.
    * ``connect_timeout``: D gives up on a P whose side channel never completes a handshake
      (refused, unroutable, or stopped before it answered) after this long.
    """

    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 3.0
    connect_timeout: float = 2.0

    def __post_init__(self) -> None:
        if min(self.heartbeat_interval, self.heartbeat_timeout, self.connect_timeout) <= 0:
            raise ConfigError("liveness intervals must be > 0")


class BootstrapConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where the bootstrap registry listens (port 0: any free port). ``token``: when set,
    ``POST /register`` and ``GET /query`` need ``Authorization: Bearer <token>`` (401
    otherwise); ``GET /health`` stays open. ``max_workers``: the most registrations (one per
    dp/tp/pp rank) the registry holds; a new worker beyond them gets 429.
    ``max_connections_per_client``: a client (a peer address) holding that many connections
    has its next one closed as it is accepted; ``write_timeout``: a connection whose client
    takes no piece (64 KiB) of its answer for that many seconds is closed. 0: no limit."""

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    certfile: str | None = None  # PEM certificate (chain) and key: serve HTTPS
    keyfile: str | None = None
    max_workers: int = 4096
    max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT
    write_timeout: float = WRITE_TIMEOUT

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ConfigError("max_workers must be >= 1")
        check_door_limits(self.max_connections_per_client, self.write_timeout)


def check_door_limits(max_connections_per_client: int, write_timeout: float) -> None:
    """Raise :class:`ConfigError` unless both HTTP door limits are >= 0 (0: none)."""
    if max_connections_per_client < 0:
        raise ConfigError("max_connections_per_client must be >= 0 (0: no cap)")
    if not 0 <= write_timeout < float("inf"):
        raise ConfigError("write_timeout must be >= 0 seconds (0: none)")


class Secret(str):
    """A string that keeps itself out of reprs (configs are logged; tokens must not be)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "Secret('***')"


def read_token_file(path: str | os.PathLike[str]) -> Secret:
    """The secret in the file at ``path`` (surrounding whitespace stripped). Raises
    :class:`ValueError` for an empty file and :class:`OSError` when it cannot be read."""
    token = Path(path).read_text().strip()
    if not token:
        raise ConfigError(f"token file {path} is empty")
    return Secret(token)


class SenderConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A P worker's sender actor.

    * ``ready_timeout``: the longest a pull from a *connected* D waits for P's prefill to finish
      (P's queue may be long: busy is not dead). A D that goes away ends its waits at once
      (``liveness``); P dropping the request ends them at once too. Also how long P remembers
      a prefill that started when no pull ever comes. Default 480 s, like upstream's abort
      timeout.
    * ``unclaimed_ttl``: how long a ready transfer waits for D's pull before it expires and P
      frees its blocks.
    * ``tombstone_ttl``: how long an ended transfer id is remembered, so a late pull is answered
      at once instead of waiting.
    * ``register_timeout``: how long the first registration with the bootstrap is retried.
    * ``lease_interval``: seconds between renewals of the registration (a lease: the bootstrap
      drops a worker that stops renewing after ``lease_ttl``); 0 registers once, as upstream.
    * ``liveness``: heartbeats on the side channel (how fast a dead D is noticed).
    * ``kv_heads``: the model's KV heads in all (vLLM's ``get_total_num_kv_heads()``); needed
      to serve a D whose TP size differs (0: unknown, taken from D's pull).
    * ``compat``: what a D must match (model, weights, dtypes, block size, layout, wire
      version), registered with the bootstrap and checked against each pull's; a pull that
      differs is refused by the name of the first field (None: nothing checked).
      ``compat_relax``: the fields that may differ (each logged once per peer).
    * ``checksum_kv``: hash the source bytes of every run written (in the write's worker
      thread, before the engine call) and send the sums with ``PullDone`` for D to verify
      (:mod:`pdactors.dataplane.checksum`). The algorithm is the sender's ``hasher``: xxh3-64
      of host memory by default; KV on a GPU needs one that runs there (the vLLM adapter's).
    """

    engine_id: str
    ranks: RankInfo = RankInfo()
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_url: str | None = None
    ready_timeout: float = 480.0
    unclaimed_ttl: float = 120.0
    tombstone_ttl: float = 60.0
    register_timeout: float = 30.0
    lease_interval: float = 1.0
    lease_ttl: float = 5.0
    tick_interval: float = 0.1
    liveness: Liveness = Liveness()
    kv_heads: int = 0
    bootstrap_token: str | None = None
    bootstrap_ca_file: str | None = None
    compat: Compat | None = None
    compat_relax: tuple[str, ...] = ()
    checksum_kv: bool = True

    def __post_init__(self) -> None:
        if self.lease_interval < 0 or self.lease_ttl <= self.lease_interval:
            raise ConfigError("need 0 <= lease_interval < lease_ttl")
        check_relax(self.compat_relax)


#: What D does with P's KV checksums (:class:`ReceiverConfig`'s ``verify_kv``).
VerifyKv = Literal["off", "on", "require"]


class ReceiverConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A D worker's receiver actor.

    * ``pull_timeout``: the pull deadline, a last resort for a P that stays alive (answers
      heartbeats) but never answers the pull. A dead or hung P ends its pulls within about
      ``liveness.heartbeat_timeout``; P's drop, a failed write and D's abort end them at once.
      Keep it above P's ``ready_timeout`` plus a write. Default 540 s.
    * ``lookup_timeout``: the longest a bootstrap query may take.
    * ``liveness``: heartbeats on the side channel (how fast a dead or hung P is noticed).
    * ``kv_heads``: the model's KV heads in all (vLLM's ``get_total_num_kv_heads()``); needed
      to pull from a P whose TP size differs (0: unknown, equal TP sizes only).
    * ``bootstrap_token`` / ``bootstrap_ca_file``: the bootstraps' bearer token and CA bundle.
      With a token, D looks P up only at ``trusted_bootstraps`` (a request names its
      bootstrap, and must not be able to collect the token); a pull naming another fails.
    * ``tick_interval``: not used (the receiver sleeps until its next pull deadline); kept so
      that configurations which set it still load.
    * ``compat`` / ``compat_relax``: as the sender's: sent with each pull, and checked
      against P's registered description before the pull is sent.
    * ``fence_timeout``: a P worker lost while it wrote a pull's blocks (it says so before
      it writes) may still write them should it resume (a stopped process, a frozen VM):
      that pull fails but keeps D's blocks until P confirms no write is in flight (asked on
      a new connection) or is found dead (a reconnect is refused at once), and ends at this
      timeout after the loss at the latest, its blocks then reused at a risk the end names.
      The pull deadline does not end a fenced pull. 0: no fence (the pull ends when P is
      lost, as before). Default 30 s.
    * ``verify_kv``: ``"on"`` (default): before a pull is reported delivered, recompute P's
      checksums over what landed; a mismatch fails the pull (the engine's load-failure policy
      applies); a P that sends no checksums (an older P, or ``checksum_kv`` off) is trusted,
      counted and logged once, and so are sums of a kind the receiver's ``hasher`` cannot
      compute (named in the log line). ``"require"``: such a P's pulls fail. ``"off"``: no
      check.
    * ``fast_done``: with ``verify_kv`` off, P's write thread tells D its KV landed (issue 28).
    """

    engine_id: str = "decode"
    ranks: RankInfo = RankInfo()
    pull_timeout: float = 540.0
    fence_timeout: float = 30.0
    lookup_timeout: float = 10.0
    tick_interval: float = 0.1
    liveness: Liveness = Liveness()
    kv_heads: int = 0
    bootstrap_token: str | None = None
    bootstrap_ca_file: str | None = None
    trusted_bootstraps: tuple[str, ...] = ()
    compat: Compat | None = None
    compat_relax: tuple[str, ...] = ()
    verify_kv: VerifyKv = "on"
    fast_done: bool = True

    def __post_init__(self) -> None:
        check_relax(self.compat_relax)
        if self.fence_timeout < 0:
            raise ConfigError("fence_timeout must be >= 0")
        if self.verify_kv not in get_args(VerifyKv):
            raise ConfigError(f"verify_kv must be 'off', 'on' or 'require', not {self.verify_kv!r}")

    def trusts(self, bootstrap_url: str) -> bool:
        """Whether D may send its bootstrap token to ``bootstrap_url``: the bootstrap named by a
        request is the requester's choice, so with a token D talks only to the bootstraps
        (``scheme://host:port``) it was given in ``trusted_bootstraps``."""
        if self.bootstrap_token is None:
            return True
        return origin(bootstrap_url) in {origin(u) for u in self.trusted_bootstraps}


def origin(url: str) -> str:
    """``scheme://host:port`` of ``url`` (the default port made explicit), for comparisons."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"
