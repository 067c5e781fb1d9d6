"""The proxy's configuration record (:func:`pdactors.proxy.serve_proxy`): its engines, routing,
placement, limits and keys. A module of its own beside :mod:`pdactors.config`, which holds the
actors' and the data plane's."""

from __future__ import annotations

from typing import Literal, get_args
from urllib.parse import urlsplit

import msgspec

from pdactors.config import (
    DEFAULT_BOOTSTRAP_PORT,
    MAX_CONNECTIONS_PER_CLIENT,
    WRITE_TIMEOUT,
    check_door_limits,
)
from pdactors.errors import ConfigError

__all__ = [
    "ROUTINGS",
    "FirstToken",
    "Placement",
    "PrefillBackend",
    "ProxyConfig",
    "Routing",
]

Routing = Literal["round_robin", "least_outstanding", "prefix_aware"]
#: The proxy's routing policies.
ROUTINGS: tuple[str, ...] = get_args(Routing)
#: Who computes the client's first token (:class:`ProxyConfig`'s ``first_token``).
FirstToken = Literal["p", "d"]
#: Where the proxy has a request's prompt computed (:class:`ProxyConfig`'s ``placement``).
Placement = Literal["auto", "disaggregate", "local", "whole-on-p"]


class PrefillBackend(msgspec.Struct, frozen=True):
    """A prefill engine: its OpenAI API base URL and the URL of the bootstrap registry it
    registers with (where D looks it up, and where the proxy reads its engine id)."""

    url: str
    bootstrap_url: str

    @classmethod
    def parse(cls, value: str) -> PrefillBackend:
        """``ENGINE_URL@BOOTSTRAP_URL``, or a bare ``ENGINE_URL`` whose bootstrap is on
        :data:`DEFAULT_BOOTSTRAP_PORT` of the same host. Raises :class:`ConfigError`."""
        engine, sep, bootstrap = value.partition("@")
        if not sep:
            parts = urlsplit(engine)
            if not parts.hostname:
                raise ConfigError(f"{value!r} is not a URL")
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            bootstrap = f"http://{host}:{DEFAULT_BOOTSTRAP_PORT}"
        return cls(engine, bootstrap)


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The proxy actor (:func:`pdactors.proxy.serve_proxy`).

    * ``prefill`` / ``decode``: the engines, base URLs such as ``"http://127.0.0.1:8100"``.
    * ``engines``: engines that take every role (vLLM's ``kv_role`` ``kv_both``), each as a
      :class:`PrefillBackend`: per request one may compute the prompt for another, decode
      after another, or serve the request whole. Each is in both pools (one engine, two
      roles: its requests in either count against it in both); a request's P is never its
      D. A deployment may have only these, or mix them with ``prefill`` and ``decode``.
    * ``routing``: how an engine of each role is picked among the healthy ones:
      ``"round_robin"``, ``"least_outstanding"`` (fewest requests in flight; ties go round
      robin) or ``"prefix_aware"`` (the engine the proxy sent the longest start of the prompt,
      unless it has more than ``prefix_imbalance`` requests in flight beyond the least-loaded
      one; :mod:`pdactors.core.prefixes`). ``prefill_routing`` / ``decode_routing`` set one
      role's (None: ``routing``'s).
    * ``prefix_imbalance``: for ``"prefix_aware"``, how many more requests in flight than the
      least-loaded engine the best-matching one may have and still be picked.
    * ``kv_events``: for ``"prefix_aware"``, follow the KV events of engines that publish them
      (vLLM's ``--kv-events-config``, found at their ``GET /kv_event_sources``) and match a
      prompt's tokens against what each engine's prefix cache holds
      (:mod:`pdactors.proxy._kv_events`); engines that publish none are matched on what the
      proxy sent them. False: the latter for every engine.
    * ``prefix_max_blocks`` / ``prefix_max_age``: for ``"prefix_aware"``, the most prompt
      blocks (64 characters or 16 token ids each) the proxy remembers per role, all engines
      together, least recently sent first out, and the seconds it remembers each.
    * ``health_interval``: seconds between health rounds (engine ``GET /health``, bootstrap
      ``GET /query``); ``health_timeout`` bounds each of those calls. An engine whose
      ``/health`` gives no answer within it leaves the rotation, and for a P every P-first
      request still waiting for its first token is cut from it (D serves it alone, with
      ``fall_back_to_d``).
    * ``request_timeout``: the longest one client request may take, start to last byte.
    * ``connect_timeout``: the longest a connection to an engine may take to open.
    * ``max_connections``: connections the proxy keeps open to the engines, all together.
    * ``max_body_bytes``: request bodies above this are refused with 413 (from their
      ``Content-Length`` when they give one, before any of them is read).
    * ``body_timeout``: the longest a client may take to send a request's body; a body not
      all in by then is refused with 408 and its connection closed.
    * ``max_connections_per_client``: a client (a peer address) holding that many
      connections to the proxy has its next one closed as it is accepted (0: no cap).
    * ``write_timeout``: a connection whose client takes no piece (64 KiB) of its answer for
      that many seconds (it stopped reading) is closed, which cancels its request (0: none).
    * ``bootstrap_token``: the bearer token P's bootstraps ask for (``pdactors bootstrap
      --token-file``), sent with the proxy's ``GET /query``.
    * ``api_key``: when set, clients must send ``Authorization: Bearer <api_key>`` (OpenAI's
      convention) on every route but ``/health`` and ``/metrics``; 401 with OpenAI's error
      body otherwise.
    * ``certfile`` / ``keyfile``: serve HTTPS with this PEM certificate and key.
    * ``ca_file``: the CA bundle that signs the certificates of HTTPS bootstraps and of
      ``https://`` engines (a private CA); the system's CAs otherwise.
    * ``placement``: ``"auto"`` (the default): per request, P computes the prompt or D
      computes the request whole, whichever the proxy's estimates say costs less
      (:mod:`pdactors.core.placement`); ``"disaggregate"``: P computes every prompt;
      ``"local"``: D computes each request whole (an ordinary request to D; P takes no part);
      ``"whole-on-p"``: a P serves each request whole (an ordinary request to P, which
      vLLM serves on a ``kv_producer`` engine; D takes no part).
    * ``slo_tpot_ms``: the operator's objective for the time per output token (ms). With
      ``"auto"``, once the time per token D's clients got (from their first chunk to their
      last, D's catch-up after P's token included) reaches 80 % of it while D decodes, and
      P's clients got theirs faster, the next requests are served whole by P (P prefills and
      decodes them; D takes no part) until D's clients get theirs faster again: P shares the
      decodes that would otherwise all wait on D. 0: never. Default 25.
    * ``slo_ttft_ms``: the operator's objective for the time to first token (ms). With
      ``"auto"``, when only one of the two placements' estimated time to the client's first
      token meets it (D computing the prompt behind D's queue and running step, or P behind
      P's), that one is taken (reason ``slo_ttft``); when both or neither do, the cheaper
      estimate decides as before. 0: not weighed. Default 200. Both objectives may be set
      per request (``x-pdactors-slo-ttft-ms``, ``x-pdactors-slo-tpot-ms`` headers).
    * ``placement_stall_weight``: for ``"auto"``, what a millisecond of pause to a request D
      is decoding counts for against a millisecond of the new request's time to first token.
    * ``fall_back_to_d``: when no P is in rotation, or a P fails (or is judged failed by the
      health loop) before its first token (the P-first flow, nothing sent to the client yet),
      D serves the request alone instead of the client getting a 503 or 502; default true.
    * ``fall_back_to_p``: when no D is in rotation (dead, restarting, out of rotation), a P
      serves each request whole (as ``"whole-on-p"``) instead of the client getting a 503;
      default true.
    * ``calibrate``: with ``placement="auto"``, each engine that comes into rotation holding no
      request is first sent a few probe requests of several prompt lengths, and the placement
      starts from what they took (:mod:`pdactors.proxy._calibrate`) rather than from a prior.
      Default true.
    * ``migration_limit``: how many times one request may be handed to another engine when
      the engine decoding it fails (a broken connection, a 5xx, an error event): the next
      engine continues after the tokens the client already got (another D, or with
      ``fall_back_to_p`` a P serving it whole), so the client's stream goes on. 0: never
      (the stream ends with an error event). Default 3.
    * ``first_token``: ``"p"`` (the default): the client's first token is P's answer, D
      continues after it (:mod:`pdactors.proxy._p_first`); ``"d"``: upstream's flow, P and D
      asked at once and D computing every token the client gets.
    * ``engine_api_key``: the key the engines were started with (vLLM's ``--api-key``), sent
      to them instead of the client's. With neither key set, the client's ``Authorization``
      header is passed to the engines as it came.
    * ``otlp_traces_endpoint``: an OTLP/HTTP traces URL (e.g.
      ``http://collector:4318/v1/traces``): each request gets an OpenTelemetry span, whose
      context (``traceparent``) goes to P and D (:mod:`pdactors.proxy._tracing`; needs
      ``pdactors[tracing]``). None (the default): no spans, no header.
    """

    prefill: tuple[PrefillBackend, ...] = ()
    decode: tuple[str, ...] = ()
    engines: tuple[PrefillBackend, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0
    routing: Routing = "round_robin"
    prefill_routing: Routing | None = None
    decode_routing: Routing | None = None
    prefix_imbalance: int = 8
    prefix_max_blocks: int = 131_072
    prefix_max_age: float = 600.0
    kv_events: bool = True
    first_token: FirstToken = "p"
    placement: Placement = "auto"
    placement_stall_weight: float = 0.25
    slo_tpot_ms: float = 25.0
    slo_ttft_ms: float = 200.0
    fall_back_to_d: bool = True
    fall_back_to_p: bool = True
    migration_limit: int = 3
    calibrate: bool = True
    health_interval: float = 2.0
    health_timeout: float = 2.0
    request_timeout: float = 600.0
    connect_timeout: float = 5.0
    max_connections: int = 1024
    max_body_bytes: int = 32 * 1024 * 1024
    body_timeout: float = 30.0
    max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT
    write_timeout: float = WRITE_TIMEOUT
    bootstrap_token: str | None = None
    api_key: str | None = None
    engine_api_key: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    ca_file: str | None = None
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not (self.prefill or self.engines) or not (self.decode or self.engines):
            raise ConfigError(
                "the proxy needs at least one prefill and one decode engine, or engines that "
                "take every role"
            )
        both = (*self.prefill, *self.engines)
        urls = [u for p in both for u in (p.url, p.bootstrap_url)] + list(self.decode)
        urls += [self.otlp_traces_endpoint] if self.otlp_traces_endpoint is not None else []
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{url!r} is not an http:// or https:// URL")
        engines = [p.url for p in both] + list(self.decode)
        if len(set(engines)) != len(engines):
            raise ConfigError(
                "an engine URL is listed twice (an engine that takes both roles, kv_both, is "
                "listed once, as one of engines: pdactors proxy --engine)"
            )
        for routing in (self.routing, self.prefill_routing, self.decode_routing):
            if routing is not None and routing not in ROUTINGS:
                raise ConfigError(f"unknown routing {routing!r} (one of {', '.join(ROUTINGS)})")
        if self.prefix_imbalance < 0 or self.prefix_max_blocks < 1:
            raise ConfigError("prefix_imbalance must be >= 0 and prefix_max_blocks >= 1")
        if not self.prefix_max_age > 0:
            raise ConfigError("prefix_max_age must be > 0")
        if self.placement not in get_args(Placement):
            allowed = ", ".join(repr(p) for p in get_args(Placement))
            raise ConfigError(f"placement must be one of {allowed}, not {self.placement!r}")
        if not self.placement_stall_weight >= 0:
            raise ConfigError("placement_stall_weight must be >= 0")
        if self.migration_limit < 0:
            raise ConfigError("migration_limit must be >= 0")
        if not self.slo_ttft_ms >= 0:
            raise ConfigError("slo_ttft_ms must be >= 0")
        if not self.slo_tpot_ms >= 0:
            raise ConfigError("slo_tpot_ms must be >= 0")
        if self.first_token not in get_args(FirstToken):
            raise ConfigError(f"first_token must be 'p' or 'd', not {self.first_token!r}")
        timeouts = (self.health_interval, self.health_timeout, self.request_timeout)
        if min(*timeouts, self.connect_timeout, self.body_timeout) <= 0:
            raise ConfigError("intervals and timeouts must be > 0")
        if self.max_connections < 1 or self.max_body_bytes < 1:
            raise ConfigError("max_connections and max_body_bytes must be >= 1")
        check_door_limits(self.max_connections_per_client, self.write_timeout)
