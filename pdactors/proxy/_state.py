"""The proxy's engines, routing and metrics (state only; the proxy actor drives them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdactors.core.compat import Identity
from pdactors.core.prefixes import BLOCK_IDS, Candidate, PrefixIndex, choose
from pdactors.proxy_config import ProxyConfig

__all__ = ["Backend", "Cut", "Metrics", "Pool", "Role"]

Role = Literal["prefill", "decode"]


class Cut(Protocol):
    """What cuts a request from an engine judged failed: a cancel scope, or one that holds
    the cut off while the client is written to (:mod:`pdactors.proxy._legs`)."""

    def cancel(self) -> None: ...


class Exact(Protocol):
    """What the engines' KV events say they hold
    (:class:`pdactors.proxy._kv_events.KvEventFeeds`)."""

    def matched(
        self, url: str, keys_of: dict[int, list[int]], token_ids: Sequence[int]
    ) -> int | None:
        """The engine's leading tokens of the prompt in its prefix cache; None: not known
        (``keys_of``: the prompt's block keys by block size, a cache across engines)."""

    def restarted(self, url: str) -> None:
        """The engine restarted: what it held is gone."""

    def report(self) -> dict[str, int]:
        """Blocks held per engine followed."""


_LATENCY_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


# --------------------------------------------------------------------------- backends, routing


@dataclass(eq=False)
class Backend:
    """One engine as the proxy sees it. ``up``: in rotation (for P: its engine id is known)."""

    role: Role
    url: str
    bootstrap_url: str | None = None  # P only
    #: P only: the engine id of each DP rank that has workers (vLLM's ``<id>_dp<rank>``), as
    #: last read from the bootstrap.
    dp_engines: dict[int, str] = field(default_factory=dict)
    up: bool = False
    problem: str = "not checked yet"
    #: Taken out by the operator (``POST /admin/drain``): healthy, but given no new request.
    draining: bool = False
    _empty: trio.Event | None = None  # set when ``outstanding`` comes down to 0
    outstanding: int = 0
    #: Prompt tokens sent to it whose first token has not come back yet (its prefill queue,
    #: as the proxy sees it: :mod:`pdactors.core.placement`).
    waiting_tokens: int = 0
    prefills: int = 0  # requests whose prompt it computes now (their first token not back)
    incoming: int = 0  # D only: requests it continues whose prompt is still at a P
    bootstrap_slow: bool = False  # P only: its bootstrap gave no answer in the last round
    #: When a stream of its last brought bytes (trio time): an engine whose streams flow is
    #: alive though its ``/health`` answer is late (a slow or lossy network).
    heard: float = float("-inf")
    health_late: bool = False  # its ``/health`` was late in the last round, its streams not
    #: A scope around each request's wait on this engine — a P-first request's for P's token,
    #: a decoding leg's for its answer — cancelled when the engine is judged failed
    #: meanwhile (a stopped or hung engine: :meth:`pdactors.proxy._health.HealthWatch.set`):
    #: the request is cut from it (P-first: served by D alone; decoding: migrated).
    waiting_on: set[Cut] = field(default_factory=set)
    #: Which model it answers with (:mod:`pdactors.proxy._pairs`): P's from its bootstrap,
    #: D's from its ``/metrics``; None: not known (not compared).
    identity: Identity | None = None
    #: D only: health rounds since its identity was read; None: not read since it last came
    #: into rotation (D enters the rotation only once it was read).
    identity_rounds: int | None = None
    #: The same engine in the other role: an engine that takes every role (``kv_both``) is in
    #: both pools, as one record each, each the other's twin; None: an engine of one role.
    twin: Backend | None = field(default=None, repr=False)
    _dp_next: int = 0

    @property
    def load(self) -> int:
        """Requests in flight on the engine, in both its roles (what routing weighs)."""
        return self.outstanding + (self.twin.outstanding if self.twin is not None else 0)

    def released(self) -> None:
        """Its ``outstanding`` count just went down. Not a checkpoint."""
        if self.outstanding == 0 and self._empty is not None:
            self._empty.set()
            self._empty = None

    async def wait_empty(self) -> None:
        """Until it holds no request (``outstanding`` 0)."""
        while self.outstanding:
            if self._empty is None:
                self._empty = trio.Event()
            await self._empty.wait()

    @property
    def serving(self) -> bool:
        """In rotation and not draining: new requests may go to it."""
        return self.up and not self.draining

    @property
    def engine_id(self) -> str | None:
        """P only: its lowest DP rank's engine id (None until the bootstrap was read)."""
        return self.dp_engines[min(self.dp_engines)] if self.dp_engines else None

    def pick_dp(self) -> tuple[int | None, str | None]:
        """P: the DP rank for the next request (round robin) and that rank's engine id; the
        rank is None when P has a single DP rank (no ``X-data-parallel-rank`` header then)."""
        if len(self.dp_engines) <= 1:
            return None, self.engine_id
        ranks = sorted(self.dp_engines)
        rank = ranks[self._dp_next % len(ranks)]
        self._dp_next += 1
        return rank, self.dp_engines[rank]

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "url": self.url,
            "up": self.up,
            "draining": self.draining,
            "outstanding": self.outstanding,
            "waiting_tokens": self.waiting_tokens,
            "prefills": self.prefills,
        }
        if self.role == "decode":
            out["incoming"] = self.incoming
        if self.twin is not None:
            out["every_role"] = True  # kv_both: listed in both roles
        if self.role == "prefill":
            out |= {"bootstrap_url": self.bootstrap_url, "engine_id": self.engine_id}
            if len(self.dp_engines) > 1:
                out["dp_engines"] = {str(k): v for k, v in sorted(self.dp_engines.items())}
        if self.identity is not None:
            c = self.identity.compat
            out["identity"] = {"model": c.model, "weights": c.weights, "dtype": c.dtype}
            if self.identity.relax:
                out["identity"]["relax"] = list(self.identity.relax)
        if not self.up:
            out["problem"] = self.problem
        return out


class Pool:
    """The engines of one role and the routing rule that picks among those that are up:
    ``round_robin``, ``least_outstanding`` (fewest requests in flight, ties round robin) or
    ``prefix_aware`` (the engine that was sent the longest start of the prompt, weighed
    against load: :mod:`pdactors.core.prefixes`; ``prefixes`` then holds what was sent where,
    ``imbalance`` bounds how many more requests in flight the best match may have)."""

    def __init__(
        self,
        role: Role,
        backends: list[Backend],
        routing: str,
        prefixes: PrefixIndex | None = None,
        imbalance: int = 8,
    ) -> None:
        self.role = role
        self.backends = backends
        self.routing = routing
        if routing == "prefix_aware" and prefixes is None:
            raise ValueError("prefix_aware routing needs a PrefixIndex")
        self.prefixes = prefixes if routing == "prefix_aware" else None
        self.imbalance = imbalance
        #: The engines' KV events, for prefix_aware routing (None: not followed).
        self.exact: Exact | None = None
        self._next = 0  # round-robin cursor (also the tie-break of the other rules)

    @classmethod
    def of(
        cls, config: ProxyConfig, role: Role, backends: list[Backend], routing: str | None
    ) -> Pool:
        """One role's pool with its routing (``config.routing`` unless the role has its own)."""
        routing = routing or config.routing
        prefixes = None
        if routing == "prefix_aware":
            prefixes = PrefixIndex(config.prefix_max_blocks, config.prefix_max_age)
        return cls(role, backends, routing, prefixes, config.prefix_imbalance)

    def pick(self) -> Backend | None:
        """The next engine to use, or None when none is up (no prompt: prefix-aware routing
        goes by load alone). Not a checkpoint."""
        return self.route(())[0]

    def route(
        self,
        prompt: Sequence[int],
        usable: Callable[[Backend], bool] | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> tuple[Backend | None, str]:
        """The engine to use for a prompt of block keys ``prompt``
        (:func:`pdactors.core.prefixes.prefix_keys`; its ``token_ids`` when known, matched
        against the engines' KV events by :attr:`exact`) and why (the routing's name, or for
        prefix-aware routing ``prefix``, ``exact``, ``spill`` or ``no_match``); None when none is up
        (and ``usable``, when given: e.g. P compatible with the request's D). Nothing is
        remembered: :meth:`sent` says where the prompt went. Not a checkpoint."""
        n = len(self.backends)
        order = [(self._next + i) % n for i in range(n)]
        candidates = [
            i
            for i in order
            if self.backends[i].serving and (usable is None or usable(self.backends[i]))
        ]
        if not candidates:
            return None, self.routing
        chosen, why = candidates[0], self.routing
        if self.routing == "least_outstanding":
            chosen = min(candidates, key=lambda i: self.backends[i].load)
        elif self.prefixes is not None:
            chosen, why = self._by_prefix(candidates, prompt, token_ids)
        self._next = (chosen + 1) % n
        return self.backends[chosen], why

    def _by_prefix(
        self, candidates: list[int], prompt: Sequence[int], token_ids: Sequence[int] | None
    ) -> tuple[int, str]:
        """Prefix-aware routing: each engine's match in tokens, from its KV events where
        :attr:`exact` has them, else from what it was sent (a remembered block: ~16 tokens)."""
        now = trio.current_time()
        keys_of: dict[int, list[int]] = {}  # the prompt's keys by block size, for every engine
        weighed, exact = [], set()  # exact: the candidates matched by their KV events
        for i in candidates:
            b = self.backends[i]
            found = None
            if token_ids is not None and self.exact is not None:
                found = self.exact.matched(b.url, keys_of, token_ids)
            if found is None:
                assert self.prefixes is not None
                found = self.prefixes.matched(b.url, prompt, now) * BLOCK_IDS
            else:
                exact.add(i)
            weighed.append(Candidate(i, b.load, found))
        chosen, why = choose(weighed, self.imbalance)
        return chosen, "exact" if why == "prefix" and chosen in exact else why

    def sent(self, backend: Backend, prompt: Sequence[int]) -> None:
        """Note that ``backend`` computes (and will cache) the prompt of keys ``prompt``."""
        if self.prefixes is not None and prompt:
            self.prefixes.sent(backend.url, prompt, trio.current_time())

    def restarted(self, backend: Backend) -> None:
        """``backend`` restarted (or may have): forget what it was sent. Not a checkpoint."""
        if self.prefixes is not None:
            self.prefixes.forget(backend.url)
        if self.exact is not None:
            self.exact.restarted(backend.url)

    @property
    def any_up(self) -> bool:
        """Some engine of the pool takes new requests (up, not draining)."""
        return any(b.serving for b in self.backends)

    def why_none(self) -> str:
        problems = "; ".join(f"{b.url}: {'draining' if b.up else b.problem}" for b in self.backends)
        return f"no {self.role} engine is available ({problems})"


# --------------------------------------------------------------------------- metrics


class Metrics:
    """The proxy's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdactors_proxy_requests",
            "Client requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.backend_errors = Counter(
            "pdactors_proxy_backend_errors",
            "Failed calls to engines (connection errors, timeouts, 5xx answers)",
            ["role", "backend"],
            registry=r,
        )
        self.in_flight = Gauge(
            "pdactors_proxy_requests_in_flight", "Client requests being served", registry=r
        )
        self.backend_up = Gauge(
            "pdactors_proxy_backend_up", "1 when the engine is in rotation", ["role", "backend"],
            registry=r,
        )  # fmt: skip
        self.routed = Counter(
            "pdactors_proxy_routed",
            "Engines picked, by role and why: the routing's name, or for prefix_aware the "
            "longest prefix match (prefix; exact when it was read from the engine's KV events), "
            "the least-loaded engine because the best match had too many requests in flight "
            "(spill) or because no engine matched (no_match)",
            ["role", "why"],
            registry=r,
        )
        self.kv_event_gaps = Counter(
            "pdactors_proxy_kv_event_gaps",
            "Gaps in an engine's KV event sequence: replayed from its publisher, or its index "
            "cleared (no replay, or the gap no longer buffered)",
            ["backend", "outcome"],
            registry=r,
        )
        pd = ["prefill", "decode"]
        self.ttft = Histogram(
            "pdactors_proxy_ttft_seconds",
            "Time from a streaming request's arrival to its first chunk (D's, or P's token when P "
            "goes first)",
            pd,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.second_chunk = Histogram(
            "pdactors_proxy_second_chunk_seconds",
            "P-first flow: time from a streaming request's arrival to D's first chunk, after "
            "P's token",
            pd,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.placement = Counter(
            "pdactors_proxy_placement",
            "Requests by where their prompt was computed, on P (disaggregated) or on D (local), "
            "and why (pinned: the operator's --placement; else auto's reason)",
            ["placement", "reason"],
            registry=r,
        )
        self.kv_freed_at_p = Counter(
            "pdactors_proxy_kv_freed_at_p",
            "Transfers whose KV P kept for a pull no D will make now (D's leg given up): P "
            "told to free it (told), or not reached and left to its unclaimed_ttl (not_told)",
            ["outcome"],
            registry=r,
        )
        self.fallbacks = Counter(
            "pdactors_proxy_fallbacks",
            "Requests one engine served alone although they were meant for two: D, as no P "
            "is in rotation (no_prefill), no P in rotation answers with D's model "
            "(incompatible), P failed before its first token (prefill_failed), or P was "
            "judged unhealthy while they waited for its first token (p_unhealthy); a P, as "
            "no D is in rotation (no_decode)",
            ["why"],
            registry=r,
        )
        self.retries = Counter(
            "pdactors_proxy_retries",
            "D legs asked again with D computing the prompt itself, after D failed before any "
            "of its answer reached the client (its KV did not come): D answered an error "
            "(decode_failed) or its answer broke (decode_broke)",
            ["reason"],
            registry=r,
        )
        self.migrations = Counter(
            "pdactors_proxy_migrations",
            "Requests handed to another engine after the one decoding them failed, by the "
            "role of the engine that continued them (each hand-over counted)",
            ["to"],
            registry=r,
        )
        self.p_first = Counter(
            "pdactors_proxy_p_first",
            "Requests served P first, by how they ended: at P's token, or continued on D",
            ["path"],
            registry=r,
        )
        self.connections_closed = Counter(
            "pdactors_proxy_connections_closed",
            "Client connections the proxy closed on the client: as they came, their client "
            "holding max_connections_per_client already (max_connections_per_client), or "
            "mid-answer, their client taking none of it within write_timeout (write_timeout)",
            ["why"],
            registry=r,
        )
        self.latency = Histogram(
            "pdactors_proxy_request_seconds",
            "Time from a successful request's arrival to its last byte",
            pd,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
