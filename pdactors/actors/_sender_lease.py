"""A P worker's registration with the bootstrap: registered once, then renewed as a lease.

The registration is a lease that lapses when P dies, and carries the sender's epoch (new at
every start). While the lease is live, nobody can move P's rank elsewhere (the registry
answers 409); a sender restarted inside the same process names its predecessor's epoch in
``replaces`` and takes the rank at once; a sender started elsewhere waits for the old lease
to lapse (within ``register_timeout``).

When a renewal is refused because another live registration holds P's rank (P stalled past
its lease and someone took it), no D that looks P up can find it: P says so once, releases
every READY transfer no D has pulled (``unreachable``) at each refused renewal, keeps
retrying, and says once when its renewal succeeds again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import trio

from pdactors.bootstrap_client import BootstrapClient
from pdactors.config import SenderConfig
from pdactors.errors import BootstrapError, RankHeld
from pdactors.transport import Router
from pdactors.wire import RegisterWorker

__all__ = ["UNREACHABLE", "register_sender"]

log = logging.getLogger("pdactors.sender")

#: Why P released a READY transfer while another registration held its rank.
UNREACHABLE = "no D can find this P worker: another registration holds its bootstrap rank"

#: Releases every READY transfer no D has pulled, for the reason given; returns how many.
Unreachable = Callable[[str], int]


async def register_sender(
    client: BootstrapClient,
    config: SenderConfig,
    router: Router,
    nursery: trio.Nursery,
    *,
    epoch: int = 0,
    replaces: int = 0,
    unreachable: Unreachable = lambda reason: 0,
) -> None:
    """Register the sender behind ``router`` (its ``epoch``; ``replaces``: the epoch of the
    same process's previous sender, 0 if none) with ``config.bootstrap_url``, retrying with
    backoff for ``config.register_timeout`` (and while another live lease holds the rank),
    then keep the lease renewed in ``nursery``. Raises
    :class:`~pdactors.errors.BootstrapError` (:class:`~pdactors.errors.RankHeld` when the rank
    stayed held) when registration never succeeds."""
    assert config.bootstrap_url is not None
    ranks = config.ranks
    worker = RegisterWorker(
        engine_id=config.engine_id,
        dp_rank=ranks.dp_rank,
        tp_rank=ranks.tp_rank,
        pp_rank=ranks.pp_rank,
        addr=router.address,
        curve_key=getattr(router, "curve_key", ""),  # transports before it had none
        compat=config.compat,
        epoch=epoch,
        replaces=replaces,
    )
    lease = config.lease_ttl if config.lease_interval > 0 else None
    url = config.bootstrap_url
    deadline = trio.current_time() + config.register_timeout
    said = False
    while True:
        budget = max(deadline - trio.current_time(), 0.0)
        try:
            await client.register(url, worker, timeout=budget, lease=lease)
            break
        except RankHeld as exc:
            wait = min(config.lease_interval or 0.5, 0.5)
            if trio.current_time() + wait >= deadline:
                raise
            if not said:
                log.warning("sender %s: %s; waiting for that lease to lapse", worker.engine_id, exc)
            said = True
            await trio.sleep(wait)
    if lease is not None:
        renewal = msgspec.structs.replace(worker, replaces=0)  # the rank is this sender's now
        nursery.start_soon(_renew_lease, client, url, renewal, config, unreachable)


async def _renew_lease(
    client: BootstrapClient,
    url: str,
    worker: RegisterWorker,
    config: SenderConfig,
    unreachable: Unreachable,
) -> None:
    """Re-register every ``lease_interval``, forever: the registration is a lease that lapses
    when P dies, and a renewal puts P's entry back if an unleased one replaced it. A failed
    renewal is logged once per outage and retried; a refused one (the rank held by another
    live lease) once per episode, and releases P's unpulled READY transfers each time. It
    never stops the sender."""
    failing = held = False
    while True:
        await trio.sleep(config.lease_interval)
        try:
            await client.register(
                url, worker, timeout=config.lease_interval, lease=config.lease_ttl
            )
        except RankHeld as exc:
            released = unreachable(UNREACHABLE)
            if not held:
                log.warning("sender %s: lease renewal refused, %s: %s; released %d READY "
                            "transfers no D had pulled, and will release each new one until "
                            "the rank is back", worker.engine_id, UNREACHABLE, exc,
                            released)  # fmt: skip
            elif released:
                log.debug("sender %s: released %d more READY transfers", worker.engine_id,
                          released)  # fmt: skip
            held = True
            continue
        except BootstrapError as exc:
            if not failing:
                log.warning("sender %s: lease renewal failing: %s", worker.engine_id, exc)
            failing = True
            continue
        if held:
            log.warning("sender %s: lease renewed: its bootstrap rank is back at %s",
                        worker.engine_id, worker.addr)  # fmt: skip
        elif failing:
            log.info("sender %s: lease renewed again at %s", worker.engine_id, url)
        failing = held = False
