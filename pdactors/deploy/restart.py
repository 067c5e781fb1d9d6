"""A rolling restart of a launched deployment's engines under load, with no request failed
(``pdactors launch``; ``kill -USR1`` the launcher).

One engine at a time, the proxy's own ``/admin`` routes (:mod:`pdactors.proxy._admin`) take
it out of the routing: it is drained (no new request; what it holds finishes, for at most
``drain_timeout``, then what is left is handed to other engines: migration), stopped and
started again with the same command line, and once the proxy has seen it go and come back up
it is resumed. The proxy itself is not restarted (its clients' connections would break).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final

import httpx
import trio

from pdactors.deploy.errors import NotHealthy
from pdactors.deploy.plan import Child, Plan
from pdactors.deploy.supervise import Running, restart

__all__ = ["rolling_restart"]

#: How often the restart looks at the proxy's view of an engine and at the engine's health.
_POLL: Final = 0.5


async def rolling_restart(
    plan: Plan,
    running: dict[str, Running],
    *,
    grace: float,
    startup_timeout: float,
    drain_timeout: float,
    say: Callable[[str], None],
    proxy_key: str | None = None,
) -> None:
    """Restart every engine of ``plan`` (not the proxy, not a smoke run's single server), one
    at a time (see the module's doc). Raises :class:`~pdactors.deploy.errors.NotHealthy` for
    an engine not back within ``startup_timeout``; an HTTP error from the proxy."""
    headers = {"authorization": f"Bearer {proxy_key}"} if proxy_key else {}
    engines = [c for c in plan.children if c.name not in ("proxy", "single")]
    timeout = httpx.Timeout(10.0, read=drain_timeout + 10.0)
    async with httpx.AsyncClient(trust_env=False, timeout=timeout, headers=headers) as http:

        async def admin(route: str, **body: Any) -> dict[str, Any]:
            resp = await http.post(f"{plan.proxy_url}/admin/{route}", json=body)
            resp.raise_for_status()
            answer: dict[str, Any] = resp.json()
            return answer

        for child in engines:
            say(f"restart: draining {child.name} ({child.base_url})")
            state = await admin("drain", engine=child.base_url, wait=drain_timeout)
            if not state["empty"]:
                say(f"restart: {child.name} still holds {state['outstanding']}: handed over")
                await admin("drain", engine=child.base_url, migrate=True, wait=drain_timeout)
            say(f"restart: stopping and starting {child.name}")
            await restart(running[child.name], grace)
            with trio.move_on_after(startup_timeout) as bound:
                await _until(partial(_seen_up, http, plan, child), up=False)
                await _until(partial(_healthy, http, child), up=True)
                await _until(partial(_seen_up, http, plan, child), up=True)
            if bound.cancelled_caught:
                raise NotHealthy([child.name], startup_timeout)
            await admin("resume", engine=child.base_url)
            say(f"restart: {child.name} back in the routing")
    say("restart: every engine restarted")


async def _until(check: Callable[[], Awaitable[bool]], *, up: bool) -> None:
    """Until ``check()`` (another process's state, read over HTTP) answers ``up``."""
    while await check() is not up:  # noqa: ASYNC110  (no event crosses the process boundary)
        await trio.sleep(_POLL)


async def _seen_up(http: httpx.AsyncClient, plan: Plan, child: Child) -> bool:
    """Whether the proxy has ``child`` up (in rotation, drained or not)."""
    try:
        resp = await http.get(f"{plan.proxy_url}/admin/engines")
        engines = resp.json()["engines"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return any(e["url"] == child.base_url and e["up"] for e in engines)


async def _healthy(http: httpx.AsyncClient, child: Child) -> bool:
    try:
        return (await http.get(child.health_url)).is_success
    except httpx.HTTPError:
        return False
