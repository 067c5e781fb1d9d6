"""Engine epochs and held leases through the actors (in-memory data plane and side channel,
the real bootstrap over loopback HTTP, trio's mock clock):

(a) a foreign registration against a live P is refused and D keeps pulling from the real P;
(b) P's lease lapses, a foreign registration takes its rank, P's next renewal is refused: P
    says so once and releases its READY KV at once, far sooner than ``unclaimed_ttl``;
(c) a pull naming another life of P is refused with ``lookup_again`` and the next succeeds;
(d) a restarted D (new epoch, same data-plane session) makes P end the old life's held pulls
    at once and never write them;
(e) upstream-shaped registrations (no epoch, no lease) behave as before.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from pdactors import Liveness, PullFailedError, ReceiverConfig, SenderConfig, serve_receiver
from pdactors.actors.sender import Sender, serve_sender
from pdactors.bootstrap_client import open_bootstrap_client
from pdactors.config import RankInfo
from pdactors.core.send_table import SendState
from pdactors.errors import RankHeld
from pdactors.testing import Cluster, open_cluster, run_transfer
from pdactors.testing.kv import KVBuffer
from pdactors.testing.memory_dataplane import MemoryFabric
from pdactors.transport import MemoryTransport
from pdactors.wire import RegisterWorker
from tests.conftest import settled, wait_until

SMALL = {"layers": 4, "num_blocks": 32, "block_bytes": 1024}
RECEIVER = ReceiverConfig(lookup_timeout=1e6, liveness=Liveness(connect_timeout=1e6))


def _leased(**kw: Any) -> SenderConfig:
    """A P whose registration is a lease renewed rarely: under the mock clock no renewal is
    in flight unless the test waits for one."""
    settings: dict[str, Any] = {"register_timeout": 1e6, "lease_interval": 1000, "lease_ttl": 2000}
    return SenderConfig(engine_id="p", **(settings | kw))


@asynccontextmanager
async def _cluster(sender: SenderConfig, **kw: Any) -> AsyncIterator[Cluster]:
    memory = kw.pop("transport", MemoryTransport())
    async with open_cluster(
        fabric=kw.pop("fabric", MemoryFabric()),
        transport=memory,
        sender=sender,
        receiver=RECEIVER,
        **SMALL,
        **kw,
    ) as cluster:
        yield cluster


def _ready(cluster: Cluster, tid: str, n: int = 3) -> list[int]:
    """P engine 0 holds ``tid``'s KV, READY, in ``n`` blocks of its pool."""
    p = cluster.prefill[0]
    src = p.owned[tid] = p.pool.allocate(n)
    p.kv.fill(tid, src)
    p.sender.transfer_ready(tid, src)
    return src


async def test_a_a_foreign_registration_against_a_live_p_is_refused_and_d_keeps_pulling(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with _cluster(_leased(), decode=2) as cluster, open_bootstrap_client() as client:
        url, p = cluster.bootstrap_url, cluster.prefill[0]
        assert (await run_transfer(cluster, "before", 3)).ok
        for foreign in (
            RegisterWorker("prefill-0", 0, 0, 0, "tcp://10.9.9.9:1"),  # another address
            RegisterWorker("intruder", 0, 0, 0, "tcp://10.9.9.9:1", epoch=99),  # engine id
            RegisterWorker("prefill-0", 0, 0, 0, "tcp://10.9.9.9:1", replaces=98),  # a guess
        ):
            with pytest.raises(RankHeld, match=f"held by '{p.sender.address}'"):
                await client.register(url, foreign, timeout=5, lease=30)
        entry = (await client.query(url, timeout=5))[0]
        assert entry.worker_addr == {0: {0: p.sender.address}}
        assert entry.epochs == {0: {0: p.sender.epoch}}
        # D engine 1 looks P up only now: it finds the real P; every pull lands
        outcomes = [await run_transfer(cluster, f"t{i}", 3, d=i % 2) for i in range(6)]
        assert all(o.ok and o.verified for o in outcomes), outcomes
        await settled(cluster)
        assert p.sender.statistics().sent == 7
    assert sum("409" in r.getMessage() for r in caplog.records) == 1  # once a minute per client


class _Cuttable:
    """An HTTP forwarder in front of the bootstrap: while ``cut``, it answers every request
    503 itself (P's lease renewals fail, as a stalled P's would stop reaching the registry).
    Whole answers, never a connection cut mid-request (httpx would leave its request body's
    iterator to the garbage collector)."""

    def __init__(self) -> None:
        self.cut = False
        self._target: tuple[str, int] | None = None
        self.url = ""

    def to(self, url: str) -> str:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self._target = (host, int(port))
        return self.url

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        task_status.started()
        await trio.serve_listeners(self._forward, listeners)

    async def _forward(self, client: trio.SocketStream) -> None:
        """One request at a time: read it whole, answer it (503, or the bootstrap's answer
        over a connection of its own)."""
        assert self._target is not None
        async with client:
            pending = b""
            while True:
                while b"\r\n\r\n" not in pending:
                    if not (data := await client.receive_some(65536)):
                        return
                    pending += data
                head, _, rest = pending.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                while len(rest) < length:
                    rest += await client.receive_some(65536)
                request, pending = head + b"\r\n\r\n" + rest[:length], rest[length:]
                if self.cut:
                    await client.send_all(b"HTTP/1.1 503 Service Unavailable\r\n"
                                          b"Content-Length: 0\r\n\r\n")  # fmt: skip
                    continue
                async with await trio.open_tcp_stream(*self._target) as server:
                    line, _, rest = request.partition(b"\r\n")
                    await server.send_all(line + b"\r\nConnection: close\r\n" + rest)
                    while data := await server.receive_some(65536):
                        await client.send_all(data)
                return  # (the bootstrap closed: so does this connection)


async def test_b_a_p_whose_rank_was_taken_says_so_once_and_releases_its_ready_kv_at_once(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdactors.sender")
    cuttable = _Cuttable()
    sender = _leased(lease_interval=2, lease_ttl=6, unclaimed_ttl=1000)
    async with trio.open_nursery() as nursery:
        await nursery.start(cuttable.serve)
        async with (
            _cluster(sender, p_bootstrap=cuttable.to) as cluster,
            open_bootstrap_client() as client,
        ):
            url, p = cluster.bootstrap_url, cluster.prefill[0]
            _ready(cluster, "orphan")
            cuttable.cut = True  # P stalls: its renewals stop reaching the bootstrap
            while await client.query(url, timeout=5):  # until its lease lapses
                await trio.sleep(0.5)
            foreign = RegisterWorker("prefill-0", 0, 0, 0, "tcp://10.9.9.9:1", epoch=7)
            await client.register(url, foreign, timeout=5, lease=20)
            taken = trio.current_time()
            cuttable.cut = False  # P resumes: its next renewal is refused
            await wait_until(lambda: "orphan" not in p.owned, within=30)
            assert trio.current_time() - taken <= 2 * sender.lease_interval  # not unclaimed_ttl
            assert p.sender.transfer_state("orphan") is SendState.EXPIRED
            _ready(cluster, "during")  # while the rank is held, each renewal releases anew
            await wait_until(lambda: "during" not in p.owned, within=30)
            await settled(cluster)
            stats = p.sender.statistics()
            assert stats.expired == 2 and stats.live == 0
            # the foreign lease lapses; P's renewal takes its rank back
            with trio.fail_after(60):  # (coarse steps: the clock jumps after 10 ms of real idling)
                while not _said(caplog, "its bootstrap rank is back"):
                    await trio.sleep(0.5)
            entry = (await client.query(url, timeout=5))[0]
            assert entry.worker_addr == {0: {0: p.sender.address}}
            assert (await run_transfer(cluster, "after", 2)).ok
        nursery.cancel_scope.cancel()
    refused = [r for r in caplog.records if "lease renewal refused" in r.getMessage()]
    assert len(refused) == 1 and "tcp://10.9.9.9:1" in refused[0].getMessage()
    assert "released 1 READY" in refused[0].getMessage()
    assert sum(_said_in(r, "its bootstrap rank is back") for r in caplog.records) == 1


def _said_in(record: logging.LogRecord, text: str) -> bool:
    return record.name == "pdactors.sender" and text in record.getMessage()


def _said(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(_said_in(r, text) for r in caplog.records)


@asynccontextmanager
async def _sender_at(
    cluster: Cluster, memory: MemoryTransport, fabric: MemoryFabric, port: int
) -> AsyncIterator[tuple[Sender, KVBuffer]]:
    """A P engine "again" of one worker at ``tcp://127.0.0.1:port``, registered (once, no
    lease) with the cluster's bootstrap as DP rank 1; stopped on exit."""
    kv = KVBuffer(SMALL["layers"], SMALL["num_blocks"], SMALL["block_bytes"])
    plane = fabric.open()
    plane.register(kv.regions)
    config = SenderConfig(engine_id="again", port=port, bootstrap_url=cluster.bootstrap_url,
                          ranks=RankInfo(dp_rank=1), lease_interval=0)  # fmt: skip
    async with trio.open_nursery() as nursery:
        sender = await nursery.start(partial(serve_sender, transport=memory), config, plane,
                                     kv.layout)  # fmt: skip
        yield sender, kv
        nursery.cancel_scope.cancel()


async def test_c_a_pull_meant_for_another_life_of_p_is_refused_and_the_next_one_lands(
    mock_clock: trio.testing.MockClock,
) -> None:
    memory, fabric = MemoryTransport(), MemoryFabric()
    async with _cluster(_leased(), transport=memory, fabric=fabric) as cluster:
        d, url = cluster.decode[0], cluster.bootstrap_url
        async with _sender_at(cluster, memory, fabric, 7000) as (first, _):
            assert (await run_transfer(cluster, "warm", 2)).ok  # D caches the whole answer
        async with _sender_at(cluster, memory, fabric, 7000) as (second, kv):
            assert second.address == first.address and second.epoch != first.epoch
            kv.fill("x", [0, 1])
            second.transfer_ready("x", [0, 1])
            dst = d.pool.allocate(2)
            start = trio.current_time()
            with pytest.raises(PullFailedError, match="another life of this P worker") as info:
                await d.receiver.pull("x", bootstrap_url=url, engine_id="again", block_ids=dst)
            assert f"epoch {first.epoch}; this one is {second.epoch}" in info.value.reason
            assert trio.current_time() - start < 1  # at once, not at a deadline
            assert second.transfer_state("x") is SendState.READY  # untouched: not its pull
            await d.receiver.pull("x", bootstrap_url=url, engine_id="again", block_ids=dst)
            assert d.kv.verify("x", dst, 2)
            d.pool.free(dst)


async def test_d_a_restarted_d_makes_p_end_the_old_lifes_pulls_at_once_and_never_write_them(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    memory = MemoryTransport()
    async with _cluster(_leased(), transport=memory) as cluster:
        p, d, url = cluster.prefill[0], cluster.decode[0], cluster.bootstrap_url
        src = p.owned["held"] = p.pool.allocate(3)
        p.kv.fill("held", src)
        p.sender.transfer_pending("held")
        old_dst = d.pool.allocate(3)
        failures: list[str] = []

        async def old_life_pull() -> None:
            try:
                await d.receiver.pull("held", bootstrap_url=url, engine_id=p.engine_id,
                                      block_ids=old_dst)  # fmt: skip
            except PullFailedError as exc:
                failures.append(exc.reason)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(old_life_pull)
            await wait_until(lambda: p.sender.pulls_waiting("held") == 1)
            # D restarts: a new receiver on the same data plane (the same Mooncake session)
            new = await nursery.start(partial(serve_receiver, transport=memory), RECEIVER,
                                      d.dataplane, d.kv.layout)  # fmt: skip
            assert new.epoch != d.receiver.epoch
            writes = p.dataplane.writes  # type: ignore[attr-defined]
            start = trio.current_time()
            fresh = _ready(cluster, "fresh", 2)
            dst = d.pool.allocate(2)
            await new.pull("fresh", bootstrap_url=url, engine_id=p.engine_id, block_ids=dst)
            assert d.kv.verify("fresh", dst, len(fresh))
            await wait_until(lambda: bool(failures))
            assert trio.current_time() - start < 1
            assert "restarted" in failures[0] and "earlier life's pulls end" in failures[0]
            assert p.sender.transfer_state("held") is SendState.CANCELLED
            p.sender.transfer_ready("held", src)  # P's KV comes after: released, never written
            await wait_until(lambda: "held" not in p.owned)
            assert p.dataplane.writes == writes + 1  # type: ignore[attr-defined]  # fresh only
            assert not d.kv.data[:, old_dst].any()
            # a pull of the old life is refused from now on
            with pytest.raises(PullFailedError, match="earlier life of D session"):
                await d.receiver.pull("late", bootstrap_url=url, engine_id=p.engine_id,
                                      block_ids=old_dst)  # fmt: skip
            d.pool.free(dst)
            d.pool.free(old_dst)
            nursery.cancel_scope.cancel()
        await settled(cluster)
    restarts = [r for r in caplog.records if "restarted (epoch" in r.getMessage()]
    assert len(restarts) == 1 and restarts[0].levelno == logging.WARNING


async def test_e_upstream_shaped_registrations_behave_as_before(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A P registered once without a lease (upstream's shape) is replaced by whoever
    registers its rank, as before; an entry with no epoch (an older P, upstream's tools) is
    pulled from without one."""
    once = SenderConfig(engine_id="p", register_timeout=1e6, lease_interval=0)
    async with _cluster(once) as cluster, open_bootstrap_client() as client:
        url, p = cluster.bootstrap_url, cluster.prefill[0]
        plain = RegisterWorker("prefill-0", 0, 0, 0, p.sender.address)  # no epoch, no lease
        await client.register(url, plain, timeout=5)
        entry = (await client.query(url, timeout=5))[0]
        assert entry.epochs == {} and entry.worker_addr == {0: {0: p.sender.address}}
        outcome = await run_transfer(cluster, "no-epoch", 3)  # D's pull names no P epoch
        assert outcome.ok and outcome.verified
        elsewhere = RegisterWorker("prefill-0", 0, 0, 0, "tcp://10.9.9.9:1")
        await client.register(url, elsewhere, timeout=5)  # replaces it, as it always did
        assert (await client.query(url, timeout=5))[0].worker_addr == {0: {0: elsewhere.addr}}
        await settled(cluster)
