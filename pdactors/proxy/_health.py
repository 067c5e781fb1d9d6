"""The proxy's health loop: every engine's ``GET /health`` and every P's bootstrap
``GET /query`` each ``health_interval``; engines in and out of rotation, P's engine ids.

An engine judged failed itself (its ``/health`` gave no answer within ``health_timeout`` while
none of its streams brought a byte either, an error status, a refused connection) has every
request waiting on it cut from it at once
(:attr:`Backend.waiting_on`): a P-first request still waiting for P's token is then served as
one whose P failed before its token (:mod:`pdactors.proxy._p_first`), a request the engine was
decoding goes on on another engine (migration: :mod:`pdactors.proxy._answer`). A failed
bootstrap only takes P out of the rotation: the requests at P may still get their token, and
D's look-ups are cached.
An engine that restarted (P: a new engine id; D: back in rotation after being out) has what
prefix-aware routing remembers of it dropped (:meth:`Pool.restarted`).

Which model each engine answers with (:mod:`pdactors.proxy._pairs`) is read here too: P's from
the same bootstrap answer that gives its engine ids, D's from its ``GET /metrics`` before D
enters the rotation (a D whose ``/metrics`` gives no answer stays out, as a P whose bootstrap
gives none does) and every :data:`~pdactors.proxy._pairs.REREAD_ROUNDS` rounds after; so no
request is paired before both identities are known."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import trio

from pdactors.bootstrap_client import BootstrapClient
from pdactors.errors import BootstrapError, BootstrapTimeout, describe
from pdactors.proxy._pairs import (
    REREAD_ROUNDS,
    IdentityUnread,
    Pairs,
    prefill_identity,
    read_identity,
)
from pdactors.proxy._state import Backend, Metrics, Pool
from pdactors.proxy_config import ProxyConfig

__all__ = ["HealthWatch"]

log = logging.getLogger("pdactors.proxy")


class HealthWatch:
    """The health of the proxy's engines, kept in their :class:`Backend` records."""

    def __init__(
        self,
        config: ProxyConfig,
        probe_http: httpx.AsyncClient,
        bootstrap: BootstrapClient,
        pools: tuple[Pool, Pool],
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.probe_http = probe_http  # httpx, its own pool: request traffic never delays probes
        self.bootstrap = bootstrap
        self.prefill, self.decode = pools
        self.metrics = metrics
        self.pairs = Pairs()
        #: Awaited before an engine that holds no request enters the rotation (the proxy's
        #: calibration: :mod:`pdactors.proxy._calibrate`); None: nothing.
        self.entering: Callable[[Backend], Awaitable[None]] | None = None

    async def run(self) -> None:
        """Probe every engine each ``health_interval``, forever. Never raises."""
        backends = self.prefill.backends + self.decode.backends
        while True:
            async with trio.open_nursery() as nursery:
                for backend in backends:
                    nursery.start_soon(self._probe, backend)
            self.pairs.report(self.prefill.backends, self.decode.backends)  # logs new refusals
            await trio.sleep(self.config.health_interval)

    async def _probe(self, b: Backend) -> None:
        problem = await self._check_engine(b)
        if problem is not None:
            self.set(b, problem, None, engine_failed=True)
            return
        engines = None
        if b.role == "decode":
            problem = await self._check_identity(b)
        else:
            problem, engines = await self._check_bootstrap(b)
        if problem is None and not b.up and not b.outstanding and self.entering is not None:
            await self.entering(b)
        self.set(b, problem, engines)

    async def _check_identity(self, b: Backend) -> str | None:
        """Read D's identity when due (not read since D came into rotation, or
        :data:`REREAD_ROUNDS` rounds ago); what keeps D out of rotation (None: nothing).
        Takes at most ``health_timeout``."""
        if b.identity_rounds is not None and b.identity_rounds + 1 < REREAD_ROUNDS:
            b.identity_rounds += 1
            return None
        try:
            found = await read_identity(self.probe_http, b.url, self.config.health_timeout)
        except IdentityUnread as exc:
            if b.identity_rounds is None:
                return f"identity not read: {exc}"
            return None  # busy is not dead: keep what was read; asked again next round
        if b.identity_rounds is None or found != b.identity:
            if found is None:
                log.info("proxy: decode %s exports no %s (an older D, or one without our "
                         "connector): its pairs are not checked", b.url, "compat info")  # fmt: skip
            else:
                c = found.compat
                log.info("proxy: decode %s answers with model %s, weights %s, dtype %s",
                         b.url, c.model, c.weights or "?", c.dtype)  # fmt: skip
        b.identity, b.identity_rounds = found, 0
        return None

    async def _check_engine(self, b: Backend) -> str | None:
        """What is wrong with ``b``'s own ``GET /health`` (None: it answered 200 in time).

        vLLM answers it in its API server process without asking the engine core (whose
        queue, however long, does not slow it): no answer within ``health_timeout`` is an
        API server that is stopped, hung or starved that long, not a busy engine."""
        timeout = self.config.health_timeout
        with trio.move_on_after(timeout) as scope:
            try:
                resp = await self.probe_http.get(f"{b.url}/health")
            except httpx.HTTPError as exc:
                return f"GET /health failed: {describe(exc)}"
        if scope.cancelled_caught:
            heard = trio.current_time() - b.heard
            if heard >= timeout:
                return f"GET /health gave no answer within {timeout:g} s"
            # Its streams flow: the answer is late on the way (a slow or lossy network), not
            # from a stopped engine. Judged on the next round's.
            if not b.health_late:
                b.health_late = True
                log.info("proxy: %s %s: GET /health gave no answer within %g s, but its "
                         "streams brought bytes %.1f s ago: kept", b.role, b.url, timeout,
                         heard)  # fmt: skip
            return None
        b.health_late = False
        if resp.status_code != 200:
            return f"GET /health answered HTTP {resp.status_code}"
        return None

    async def _check_bootstrap(self, b: Backend) -> tuple[str | None, dict[int, str] | None]:
        """``(problem, P's engine id per DP rank)`` from P's bootstrap (``(None, None)`` for
        D); takes at most ``health_timeout``."""
        if b.bootstrap_url is None:
            return None, None
        timeout = self.config.health_timeout
        try:
            answer = await self.bootstrap.query(b.bootstrap_url, timeout=timeout)
        except BootstrapTimeout as exc:
            if b.engine_id is None:
                return f"bootstrap: {exc}", None
            # Busy is not dead: P's bootstrap runs in P's worker, which a long forward can
            # starve; P's /health answered, and D's look-ups are cached. Keep the known ids.
            if not b.bootstrap_slow:
                b.bootstrap_slow = True
                log.info("proxy: %s's bootstrap is slow (%s); keeping engine id %s",
                         b.url, exc, b.engine_id)  # fmt: skip
            return None, dict(b.dp_engines)
        except BootstrapError as exc:
            return f"bootstrap: {exc}", None
        b.bootstrap_slow = False
        b.identity = prefill_identity(answer)  # read with the engine ids: known as P enters
        engines = {
            dp: entry.engine_id for dp, entry in answer.items() if any(entry.worker_addr.values())
        }
        if not engines:
            return f"bootstrap {b.bootstrap_url} has no worker registered", None
        return None, engines

    def set(
        self,
        b: Backend,
        problem: str | None,
        engines: dict[int, str] | None,
        *,
        engine_failed: bool = False,
    ) -> None:
        """Record ``b``'s health (``problem`` None: up), logging when it enters or leaves the
        rotation or P's engine id changes. ``engine_failed``: the engine itself failed (its
        ``/health``, a refused connection), not only its bootstrap: every request waiting for
        its first token is cut from it (logged once, with their count). Not a checkpoint."""
        was_up = b.up
        b.up = problem is None
        if problem is not None:
            b.problem = problem
        elif engines:
            old = b.engine_id
            if len(engines) > 1 and engines != b.dp_engines:
                log.info("proxy: %s has %d DP ranks: %s", b.url, len(engines), engines)
            b.dp_engines = engines
            if old is not None and b.engine_id != old:
                log.warning("proxy: %s engine id changed %s -> %s", b.url, old, b.engine_id)
                self.prefill.restarted(b)  # a new engine: its prefix cache is empty
                if b.twin is not None:  # the same engine as a D
                    self.decode.restarted(b.twin)
        self.metrics.backend_up.labels(b.role, b.url).set(1 if b.up else 0)
        if not b.up and b.identity_rounds is not None:
            # D: its identity is read again at the next round (perhaps it restarted), but a
            # read that fails then keeps the one known: only a D never read waits out of
            # rotation for it (a D frozen a moment must come back as soon as it answers).
            b.identity_rounds = REREAD_ROUNDS
        if was_up and not b.up:
            log.warning("proxy: %s %s out of rotation: %s", b.role, b.url, b.problem)
        elif b.up and not was_up:
            suffix = f" (engine id {b.engine_id})" if b.role == "prefill" else ""
            log.info("proxy: %s %s in rotation%s", b.role, b.url, suffix)
            if b.role == "decode":  # D has no engine id to tell a restart by: assume one
                self.decode.restarted(b)
        if engine_failed and b.waiting_on:
            log.warning(
                "proxy: %s %s judged failed (%s) with %d requests waiting on it: cut from it",
                b.role, b.url, b.problem, len(b.waiting_on),
            )  # fmt: skip
            for cut in b.waiting_on:
                cut.cancel()
            b.waiting_on.clear()

    def report(self) -> tuple[int, dict[str, Any]]:
        """``GET /health``'s status and body: 200 while requests can be served — ``ok`` with a
        P and a D taking requests, ``degraded`` with one role only whose engines may serve
        alone (``fall_back_to_d``, ``fall_back_to_p``), the missing role's problems in
        ``reason`` — else 503 (``unavailable``): a load balancer keeps a proxy that still
        serves."""
        reasons = [pool.why_none() for pool in (self.prefill, self.decode) if not pool.any_up]
        p, d, config = self.prefill.any_up, self.decode.any_up, self.config
        # A request can be served while one role has an engine that may serve it alone.
        serves = (d and (p or config.fall_back_to_d)) or (p and config.fall_back_to_p)
        report: dict[str, Any] = {
            "status": "ok" if not reasons else "degraded" if serves else "unavailable",
            "prefill": [b.describe() for b in self.prefill.backends],
            "decode": [b.describe() for b in self.decode.backends],
        }
        remembered = {
            pool.role: len(pool.prefixes)
            for pool in (self.prefill, self.decode)
            if pool.prefixes is not None
        }
        if remembered:  # prefix_aware routing: the prompt blocks it remembers per role
            report["prefix_blocks"] = remembered
        exact = self.prefill.exact or self.decode.exact
        if exact is not None:  # and the blocks each engine's KV events say it holds
            report["kv_event_blocks"] = exact.report()
        if refused := self.pairs.report(self.prefill.backends, self.decode.backends):
            report["incompatible"] = refused  # never paired: D serves their requests alone
        if reasons:
            report["reason"] = "; ".join(reasons)
        return (200 if serves else 503), report
