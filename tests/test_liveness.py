"""Transfers end because of what is known about the peers, not because a clock ran out.

P runs in a process of its own (``pdactors.testing.prefill_process``) so that it can be killed
or stopped for real; D is a receiver with real Mooncake engines and sockets. Every pull here
has the default pull deadline (540 s): an end within seconds can only come from liveness.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from pdactors import DuplicateTransfer, Liveness, PullFailedError, ReceiverConfig, SenderConfig
from pdactors.bootstrap_client import open_bootstrap_client
from pdactors.core.send_table import SendState
from pdactors.testing import Cluster, open_cluster, run_transfer
from pdactors.testing.prefill_process import PrefillProcess
from pdactors.transport import open_dealer
from pdactors.wire import PullRequest, RegisterWorker, encode_frames
from tests.conftest import wait_until

SMALL = {"layers": 4, "num_blocks": 64, "block_bytes": 4096}


@asynccontextmanager
async def p_process(bootstrap_url: str, engine_id: str = "p-proc") -> AsyncIterator[PrefillProcess]:
    """A P worker in its own process; killed on exit whatever happens."""
    async with trio.open_nursery() as nursery:
        p = PrefillProcess(bootstrap_url, engine_id)
        try:
            await p.start(nursery)
            yield p
        finally:
            await p.kill()
            nursery.cancel_scope.cancel()


async def pull_ends(cluster: Cluster, tid: str, engine_id: str = "p-proc") -> str:
    """Pull ``tid`` into fresh blocks; return why it failed (blocks freed either way)."""
    d = cluster.decode[0]
    dst = d.pool.allocate(2)
    try:
        await d.receiver.pull(
            tid, bootstrap_url=cluster.bootstrap_url, engine_id=engine_id, block_ids=dst
        )
    except PullFailedError as exc:
        return exc.reason
    finally:
        d.pool.free(dst)
    return "delivered"


async def wait_until_pulls_reach_p(p: PrefillProcess, tids: list[str]) -> None:
    """Until P holds a pull of each of ``tids`` (they wait there: P never gets their KV)."""
    while [await p.pulls_waiting(tid) for tid in tids] != [1] * len(tids):
        await trio.sleep(0.01)


@pytest.mark.parametrize("how", ["killed", "stopped"])
async def test_pulls_on_a_dead_or_hung_p_end_within_seconds(how: str) -> None:
    async with open_cluster(prefill=0, **SMALL) as cluster:
        async with p_process(cluster.bootstrap_url) as p:
            async with trio.open_nursery() as nursery:
                reasons: list[str] = []

                async def one(tid: str) -> None:
                    reasons.append(await pull_ends(cluster, tid))

                tids = [f"w{i}" for i in range(4)]
                for tid in tids:
                    nursery.start_soon(one, tid)  # P never gets these: they wait at P
                with trio.fail_after(10):
                    await wait_until_pulls_reach_p(p, tids)
                start = trio.current_time()
                p.signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
                with trio.fail_after(5):  # the pull deadline is 540 s
                    while len(reasons) < 4:
                        await trio.sleep(0.01)
            elapsed = trio.current_time() - start
            assert all("P gone" in r for r in reasons), reasons
            assert elapsed < 5
        # D keeps serving: a pull to the vanished P fails within seconds, nothing is held
        with trio.fail_after(10):
            late = await pull_ends(cluster, "late")
        assert "cannot reach" in late or "P gone" in late, late
        assert cluster.blocks_in_use() == 0


async def test_a_restarted_p_is_found_again_without_restarting_d() -> None:
    async with open_cluster(prefill=0, **SMALL) as cluster:
        async with p_process(cluster.bootstrap_url) as first:
            await first.command("ready r1 2")
            with trio.fail_after(15):
                assert await pull_ends(cluster, "r1") == "delivered"
            await first.kill()
        async with p_process(cluster.bootstrap_url) as second:
            assert second.address != first.address
            await second.command("ready r2 2")
            with trio.fail_after(15):
                assert await pull_ends(cluster, "r2") == "delivered"
        assert cluster.blocks_in_use() == 0


async def test_a_lost_d_frees_what_it_was_waiting_for() -> None:
    sender = SenderConfig(engine_id="p")  # ready_timeout 480 s: only the loss can end it
    with trio.fail_after(20):
        async with open_cluster(sender=sender, decode=0, **SMALL) as cluster:
            p = cluster.prefill[0]
            p.sender.transfer_pending("gone")
            layout = p.kv.layout
            request = PullRequest("gone", "127.0.0.1:1", 0, 1, 0, 1, ((0, 1),), "l", layout)
            async with open_dealer(p.sender.address, liveness=Liveness()) as dealer:
                await dealer.send(encode_frames(request))
                while not p.sender._table._entries["gone"].claims:
                    await trio.sleep(0.01)
            # the dealer is closed: D is gone; P hears it from its ROUTER's monitor
            while p.sender.transfer_state("gone") is not SendState.CANCELLED:
                await trio.sleep(0.01)
            src = p.pool.allocate(2)
            p.owned["gone"] = src
            p.sender.transfer_ready("gone", src)  # nobody to write to: released at once
            await cluster.wait_settled()


async def test_a_busy_p_is_waited_for_as_long_as_it_is_alive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 400 s of P's queue: far past the 30 s that used to fail requests.
    sender = SenderConfig(engine_id="p", tick_interval=30, lease_interval=0, register_timeout=1e6)
    patient = Liveness(connect_timeout=1e6)
    receiver = ReceiverConfig(tick_interval=30, lookup_timeout=1e6, liveness=patient)
    autojump_clock.autojump_threshold = 0.01
    async with open_cluster(sender=sender, receiver=receiver, **SMALL) as cluster:
        p = cluster.prefill[0]

        async def prefill_late() -> None:
            await trio.sleep(400)
            src = p.pool.allocate(3)
            p.owned["busy"] = src
            p.kv.fill("busy", src)
            p.sender.transfer_ready("busy", src)

        d = cluster.decode[0]
        dst = d.pool.allocate(3)
        p.sender.transfer_pending("busy")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prefill_late)
            await d.receiver.pull(
                "busy", bootstrap_url=cluster.bootstrap_url, engine_id="prefill-0", block_ids=dst
            )
        assert d.kv.verify("busy", dst, 3)
        d.pool.free(dst)
        await cluster.wait_settled()


async def test_a_bad_address_fails_its_pull_and_the_receiver_keeps_serving() -> None:
    with trio.fail_after(20):
        async with open_cluster(**SMALL) as cluster:
            async with open_bootstrap_client() as client:
                bogus = RegisterWorker("bogus", 1, 0, 0, "tcp://nohost")
                await client.register(cluster.bootstrap_url, bogus, timeout=5)
            reason = await pull_ends(cluster, "b1", engine_id="bogus")
            assert "cannot reach" in reason and "nohost" in reason
            refused = RegisterWorker("refused", 2, 0, 0, "tcp://127.0.0.1:9")
            async with open_bootstrap_client() as client:
                await client.register(cluster.bootstrap_url, refused, timeout=5)
            assert "refused" in await pull_ends(cluster, "b2", engine_id="refused")
            outcome = await run_transfer(cluster, "b3", 2)
            assert outcome.ok and outcome.verified
            await cluster.wait_settled()


async def test_a_duplicate_pull_is_refused_and_the_first_one_lands() -> None:
    with trio.fail_after(20):
        async with open_cluster(**SMALL) as cluster:
            p, d = cluster.prefill[0], cluster.decode[0]
            dst = d.pool.allocate(2)
            p.sender.transfer_pending("dup")
            async with trio.open_nursery() as nursery:
                first = {"ok": False}

                async def pull_first() -> None:
                    await d.receiver.pull(
                        "dup", bootstrap_url=cluster.bootstrap_url, engine_id="prefill-0",
                        block_ids=dst,
                    )  # fmt: skip
                    first["ok"] = True

                nursery.start_soon(pull_first)
                await wait_until(lambda: d.receiver.in_flight == 1)  # the first is in flight
                with pytest.raises(DuplicateTransfer):
                    await d.receiver.pull(
                        "dup", bootstrap_url=cluster.bootstrap_url, engine_id="prefill-0",
                        block_ids=[9, 10],
                    )  # fmt: skip
                with pytest.raises(DuplicateTransfer):
                    d.receiver.start_pull(
                        "dup", bootstrap_url=cluster.bootstrap_url, engine_id="prefill-0",
                        block_ids=[9, 10],
                    )  # fmt: skip
                src = p.pool.allocate(2)
                p.owned["dup"] = src
                p.kv.fill("dup", src)
                p.sender.transfer_ready("dup", src)
            assert first["ok"] and d.kv.verify("dup", dst, 2)
            d.pool.free(dst)
            await cluster.wait_settled()
