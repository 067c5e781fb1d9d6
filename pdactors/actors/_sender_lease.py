"""A P worker's registration with the bootstrap: registered once, then renewed as a lease.

The registration is a lease that lapses when P dies; renewing it puts P's entry back if
someone replaced it.
"""

from __future__ import annotations

import logging

import trio

from pdactors.bootstrap_client import BootstrapClient
from pdactors.config import SenderConfig
from pdactors.errors import BootstrapError
from pdactors.transport import Router
from pdactors.wire import RegisterWorker

__all__ = ["register_sender"]

log = logging.getLogger("pdactors.sender")


async def register_sender(
    client: BootstrapClient,
    config: SenderConfig,
    router: Router,
    nursery: trio.Nursery,
) -> None:
    """Register the sender behind ``router`` with ``config.bootstrap_url`` (retrying with backoff
    for ``config.register_timeout``), then keep the lease renewed in ``nursery``. Raises
    :class:`~pdactors.errors.BootstrapError` when registration never succeeds."""
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
    )
    lease = config.lease_ttl if config.lease_interval > 0 else None
    url, timeout = config.bootstrap_url, config.register_timeout
    await client.register(url, worker, timeout=timeout, lease=lease)
    if lease is not None:
        nursery.start_soon(_renew_lease, client, url, worker, config)


async def _renew_lease(
    client: BootstrapClient, url: str, worker: RegisterWorker, config: SenderConfig
) -> None:
    """Re-register every ``lease_interval``, forever: the registration is a lease that lapses
    when P dies, and a renewal puts P's entry back if someone replaced it. A failed renewal is
    logged once per outage and retried; it never stops the sender."""
    failing = False
    while True:
        await trio.sleep(config.lease_interval)
        try:
            await client.register(
                url, worker, timeout=config.lease_interval, lease=config.lease_ttl
            )
        except BootstrapError as exc:
            if not failing:
                log.warning("sender %s: lease renewal failing: %s", worker.engine_id, exc)
            failing = True
            continue
        if failing:
            log.info("sender %s: lease renewed again at %s", worker.engine_id, url)
        failing = False
