"""The actors through the transport seam: the in-memory transport under trio's autojump clock
(timeout rules exact and instant), and the fault injector around real ZMQ sockets (dropped,
duplicated and delayed messages, cut links). Every test ends with every block back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from pdactors import PullFailedError, ReceiverConfig, SenderConfig
from pdactors.actors import _p_connections
from pdactors.actors._p_connections import PARTING_PAUSES
from pdactors.config import Liveness
from pdactors.testing import (
    Cluster,
    FaultyTransport,
    MessageFaults,
    open_cluster,
    run_transfer,
)
from pdactors.transport import ZMQ, MemoryTransport
from tests.conftest import wait_until

SMALL = {"layers": 2, "num_blocks": 256, "block_bytes": 1024}
#: The bootstrap is real HTTP even under the autojump clock: no lease renewals to jump through.
QUIET_SENDER = SenderConfig(engine_id="p", lease_interval=0, register_timeout=1e6)


async def pull(cluster: Cluster, tid: str, n: int = 2) -> str:
    """Pull ``tid`` (which P never readies) into fresh blocks; why it failed."""
    d = cluster.decode[0]
    dst = d.pool.allocate(n)
    try:
        await d.receiver.pull(
            tid, bootstrap_url=cluster.bootstrap_url, engine_id="prefill-0", block_ids=dst
        )
    except PullFailedError as exc:
        return exc.reason
    finally:
        d.pool.free(dst)
    return "delivered"


async def test_memory_transport_moves_real_bytes() -> None:
    with trio.fail_after(20):
        async with open_cluster(transport=MemoryTransport(), **SMALL) as cluster:
            outcomes = [await run_transfer(cluster, f"m{i}", 1 + i % 4) for i in range(10)]
            assert all(o.ok and o.verified for o in outcomes), outcomes
            await cluster.wait_settled()


async def test_ready_timeout_is_exact_under_the_autojump_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sender = SenderConfig(engine_id="p", ready_timeout=480, lease_interval=0, tick_interval=1)
    receiver = ReceiverConfig(lookup_timeout=1e6, tick_interval=1)
    autojump_clock.autojump_threshold = 0.01  # the bootstrap's HTTP needs real moments
    async with open_cluster(
        sender=sender, receiver=receiver, transport=MemoryTransport(), **SMALL
    ) as cluster:
        start = trio.current_time()
        reason = await pull(cluster, "slow")
        assert "not ready within 480 s" in reason
        assert 480 <= trio.current_time() - start <= 482
        await cluster.wait_settled()


async def test_a_cut_link_ends_the_pull_as_p_gone_and_the_next_pull_works() -> None:
    memory = MemoryTransport()
    with trio.fail_after(20):
        async with open_cluster(sender=QUIET_SENDER, transport=memory, **SMALL) as cluster:
            p = cluster.prefill[0]
            async with trio.open_nursery() as nursery:
                reasons: list[str] = []

                async def waiting() -> None:
                    reasons.append(await pull(cluster, "cut"))

                nursery.start_soon(waiting)
                await wait_until(lambda: p.sender.transfer_state("cut") is not None)
                assert memory.cut(p.sender.address) == 1
            assert reasons and "P gone" in reasons[0], reasons
            # P heard D leave too: the transfer D waited for is over; P can still serve
            assert p.sender.transfer_state("cut").value == "cancelled"  # type: ignore[union-attr]
            outcome = await run_transfer(cluster, "after", 3)
            assert outcome.ok and outcome.verified
            await cluster.wait_settled()


async def test_duplicated_and_delayed_messages_change_no_outcome() -> None:
    faulty = FaultyTransport(ZMQ, MessageFaults(duplicate=0.5, delay=0.5, delay_seconds=0.01), 7)
    with trio.fail_after(60):
        async with open_cluster(transport=faulty, **SMALL) as cluster:
            outcomes: list[object] = []

            async def one(i: int) -> None:
                outcomes.append(await run_transfer(cluster, f"f{i}", 1 + i % 5))

            async with trio.open_nursery() as nursery:
                for i in range(24):
                    nursery.start_soon(one, i)
            bad = [o for o in outcomes if not (o.ok and o.verified)]  # type: ignore[attr-defined]
            assert not bad, bad
            assert faulty.stats["duplicated"] > 0 and faulty.stats["delayed"] > 0
            await cluster.wait_settled()


async def test_a_dropped_pull_ends_at_the_deadline_and_frees_everything(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A lost message on a live connection is the one end nothing but the clock can see.
    faulty = FaultyTransport(MemoryTransport(), MessageFaults(drop=1.0))
    receiver = ReceiverConfig(pull_timeout=60, lookup_timeout=1e6, tick_interval=1)
    autojump_clock.autojump_threshold = 0.01
    async with open_cluster(
        sender=QUIET_SENDER, receiver=receiver, transport=faulty, **SMALL
    ) as cluster:
        start = trio.current_time()
        reason = await pull(cluster, "lost")
        assert "pull deadline (60 s)" in reason
        assert 60 <= trio.current_time() - start <= 62
        assert faulty.stats["dropped"] >= 1
        await cluster.wait_settled()


@pytest.mark.parametrize("seed", [1, 2])
async def test_a_cut_mid_stream_ends_every_transfer_and_leaks_nothing(seed: int) -> None:
    faulty = FaultyTransport(ZMQ, MessageFaults(delay=0.3, delay_seconds=0.02), seed)
    with trio.fail_after(60):
        async with open_cluster(transport=faulty, **SMALL) as cluster:
            ends: list[bool] = []

            async def one(i: int) -> None:
                ends.append((await run_transfer(cluster, f"s{seed}-{i}", 2)).ok)

            async with trio.open_nursery() as nursery:
                for i in range(16):
                    nursery.start_soon(one, i)
                # Cut once D has its connection to P, while the transfers run (a fixed short
                # sleep found no connection yet on a loaded machine).
                await wait_until(lambda: bool(faulty.open_dealers))
                assert faulty.cut() >= 1
            assert len(ends) == 16  # every transfer ended: delivered or failed, none hung
            await cluster.wait_settled()


def _hold(p: Any, transfer_id: str) -> None:
    """P computed ``transfer_id``'s prompt (P first): its KV waits for D's pull."""
    src = p.pool.allocate(3)
    p.owned[transfer_id] = src
    p.kv.fill(transfer_id, src)
    p.sender.transfer_pending(transfer_id)
    p.sender.transfer_ready(transfer_id, src)


@asynccontextmanager
async def partitioned(
    clock: trio.testing.MockClock, held: str
) -> AsyncIterator[tuple[Cluster, MemoryTransport, Any]]:
    """A cluster on the in-memory transport whose D knows P's worker, then P partitioned away
    while it holds ``held`` for a pull D gave up on (P gone): D owes P its cancel. Yields the
    cluster, the transport and P; every block is back at the end."""
    memory = MemoryTransport()
    receiver = ReceiverConfig(lookup_timeout=1e6, tick_interval=1)
    clock.autojump_threshold = 0.01
    async with open_cluster(
        sender=QUIET_SENDER, receiver=receiver, transport=memory, **SMALL
    ) as cluster:
        p = cluster.prefill[0]
        assert (await run_transfer(cluster, "first", 2)).ok  # D knows P's worker now
        assert memory.partition(p.sender.address) == 1
        _hold(p, held)
        reason = await pull(cluster, held)
        assert "P gone" in reason, reason
        yield cluster, memory, p
        await cluster.wait_settled()


async def test_a_partition_that_heals_frees_the_kv_p_holds_for_pulls_d_gave_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """P readies a transfer while D cannot reach it (a partition: D's pull is lost with its
    connection, or gets no handshake on a new one, and ends as P gone; P never hears of it):
    P still holds the KV. Once the partition heals, D's
    parting cancel reaches P within one pause of its tries, long before P's unclaimed_ttl
    would free it."""
    async with partitioned(autojump_clock, "held") as (cluster, memory, p):
        await trio.sleep(30)  # the partition lasts; P keeps the KV meanwhile
        assert p.sender.transfer_state("held").value == "ready"  # type: ignore[union-attr]
        healed = trio.current_time()
        memory.heal(p.sender.address)
        bound = PARTING_PAUSES[1] + 2 * Liveness().connect_timeout
        await wait_until(
            lambda: p.sender.transfer_state("held").value == "cancelled",  # type: ignore[union-attr]
            within=bound,
        )
        print(f"P told {trio.current_time() - healed:.1f} s after the partition healed")
        assert cluster.decode[0].receiver._links.owed_cancels == 0


async def test_a_new_connection_to_p_carries_the_cancels_owed_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A partition long enough that D's parting cancels pause for their longest: once it heals
    and D sends P a pull again (the link is plainly back), the new connection carries the
    cancels still owed to P at once, not at the next try."""
    async with partitioned(autojump_clock, "held") as (cluster, memory, p):
        await trio.sleep(60)  # the tries pause for their longest now
        assert p.sender.transfer_state("held").value == "ready"  # type: ignore[union-attr]
        memory.heal(p.sender.address)
        healed = trio.current_time()
        assert (await run_transfer(cluster, "again", 2)).ok  # on a new connection
        await wait_until(
            lambda: p.sender.transfer_state("held").value == "cancelled",  # type: ignore[union-attr]
            within=0.5,
        )
        print(f"P told {trio.current_time() - healed:.2f} s after the partition healed")
        assert cluster.decode[0].receiver._links.owed_cancels == 0


async def test_a_cancel_owed_late_in_a_long_partition_is_still_told_when_it_heals(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One partition: D gives up on a pull early in it, then on another just before its
    parting cancels would stop trying (``PARTING_MEMORY`` after the first): the second is owed
    as long as the first was. The partition heals after the first one's memory ran out: P
    still hears of the second, at D's next try, and frees its KV (the late pull's own
    connection takes the owed cancels over and, lost, owes them afresh; one owed with no new
    connection extends the memory). Fails with both removed. (The memory and the pauses are
    shortened here: every virtual second costs real ones under the autojump clock.)"""
    memory, pauses = 30.0, (1.0, 4.0)
    monkeypatch.setattr(_p_connections, "PARTING_MEMORY", memory)
    monkeypatch.setattr(_p_connections, "PARTING_PAUSES", pauses)
    async with partitioned(autojump_clock, "early") as (cluster, transport, p):
        await trio.sleep(memory - 10)
        _hold(p, "late")
        assert "P gone" in await pull(cluster, "late")
        await trio.sleep(20)  # PARTING_MEMORY has passed since the first was owed
        transport.heal(p.sender.address)
        bound = pauses[1] + 2 * Liveness().connect_timeout
        await wait_until(
            lambda: p.sender.transfer_state("late").value == "cancelled",  # type: ignore[union-attr]
            within=bound,
        )
        assert p.sender.transfer_state("early").value == "cancelled"  # type: ignore[union-attr]
        assert cluster.decode[0].receiver._links.owed_cancels == 0


@pytest.mark.parametrize("cancel", ["arrives", "lost with its connection"])
async def test_a_pull_given_up_while_d_looks_p_up_still_frees_ps_kv(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, cancel: str
) -> None:
    """P holds a transfer's KV (P first) while D's lookup of P hangs on a cut link; D gives up
    on the pull before it asked P (the request was moved off D): it ends on D at once, and once
    the lookup answers D tells P, which frees the KV long before its unclaimed_ttl. If that
    cancel is sent into a link that then breaks (lost with the connection, P never heard of
    it), P has not answered it: D owes it and tells it again on a fresh connection."""
    faults = MessageFaults()
    faulty = FaultyTransport(MemoryTransport(), faults)
    receiver = ReceiverConfig(lookup_timeout=1e6, tick_interval=1)
    autojump_clock.autojump_threshold = 0.01
    async with open_cluster(
        sender=QUIET_SENDER, receiver=receiver, transport=faulty, **SMALL
    ) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        assert (await run_transfer(cluster, "first", 2)).ok  # D's connection to P is up
        _hold(p, "held")
        # The fault, at the lookup's seam: its answer comes once the link is back.
        lookups, link_back = d.receiver._lookups, trio.Event()
        resolve = lookups.resolve

        async def across_the_cut(url: str, engine_id: str) -> Any:
            await link_back.wait()
            return await resolve(url, engine_id)

        monkeypatch.setattr(lookups, "resolve", across_the_cut)
        dst = d.pool.allocate(3)
        d.receiver.start_pull(
            "held", bootstrap_url=cluster.bootstrap_url, engine_id="prefill-0", block_ids=dst
        )
        await trio.testing.wait_all_tasks_blocked()
        d.receiver.abort("held", "the request was aborted on D")
        assert list(d.receiver.take_results().failed) == ["held"]  # at once: P was not asked
        d.pool.free(dst)
        if cancel == "lost with its connection":
            faults.drop = 1.0  # what D sends on its connection now never arrives
        link_back.set()
        if cancel == "lost with its connection":
            await wait_until(lambda: faulty.stats["dropped"] == 1)  # the cancel
            faults.drop = 0.0
            assert faulty.cut() == 1  # the connection breaks (heartbeats), the cancel in it
        told = trio.current_time()
        bound = PARTING_PAUSES[1] + 2 * Liveness().connect_timeout
        await wait_until(
            lambda: p.sender.transfer_state("held").value == "cancelled",  # type: ignore[union-attr]
            within=bound,
        )
        print(f"P told {trio.current_time() - told:.1f} s after D gave up ({cancel})")
        assert d.receiver._links.owed_cancels == 0
        await cluster.wait_settled()
