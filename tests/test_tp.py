"""Tensor-parallel shapes through the actors: real ZMQ sockets, a real Mooncake engine per
worker, every byte of every head verified on each D worker, no block left allocated.

Heterogeneous TP: a D worker pulls its heads from several P workers (P TP > D TP), or several
D workers take head ranges of one P worker (P TP < D TP); with more workers than KV heads the
heads are replicated (GQA) and P workers whose replica D does not read are still told, so they
free their blocks at once.
"""

from __future__ import annotations

import itertools

import pytest
import trio

from pdactors import PullFailedError, open_bootstrap_client
from pdactors.core.pull_table import PullState
from pdactors.core.send_table import SendState
from pdactors.testing import FaultyDataPlane, open_cluster, run_transfer
from pdactors.testing.cluster import DecodeNode
from pdactors.transport import open_dealer
from pdactors.wire import (
    PullFailed,
    PullRequest,
    RegisterWorker,
    decode_frames,
    encode_frames,
)
from tests.conftest import settled, wait_until

SHAPE = {"layers": 3, "num_blocks": 32, "block_bytes": 4096}


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads"),
    [
        (2, 2, 4),  # homogeneous: rank i <-> rank i, whole blocks
        (2, 1, 4),  # one D worker pulls half of its heads from each P worker
        (1, 2, 4),  # two D workers each take half of P's heads
        (4, 1, 2),  # P replicates each head twice: D reads one replica, tells the other
        (1, 4, 2),  # D replicates: four D workers, two per head, all from one P worker
        (2, 4, 8),  # 1 -> 2 per P worker
        # MLA: one latent cache per layer, whole on every TP rank (kv_heads 1): each D rank
        # reads it from one P rank, the other P ranks only answer
        (2, 1, 1),
        (1, 2, 1),
        (2, 4, 1),
    ],
)
async def test_every_head_lands_on_the_right_d_worker(p_tp: int, d_tp: int, heads: int) -> None:
    with trio.fail_after(60):
        async with open_cluster(p_tp=p_tp, d_tp=d_tp, kv_heads=heads, **SHAPE) as cluster:
            assert [n.tp_rank for n in cluster.prefill] == list(range(p_tp))
            for i, (count, d_blocks) in enumerate([(5, None), (8, None), (6, 2)]):
                outcome = await run_transfer(cluster, f"t{i}", count, d_blocks=d_blocks)
                assert outcome.ok and outcome.verified, outcome.reason
            landed = sum(n.receiver.pull_statistics().count for n in cluster.decode)
            assert landed == 3 * d_tp
            await settled(cluster)


async def test_the_same_bytes_arrive_whatever_the_shapes() -> None:
    """2 -> 1 moves the model's KV exactly as 1 -> 1 does: D's buffers end up equal."""
    results = []
    for p_tp in (1, 2):
        with trio.fail_after(60):
            async with open_cluster(p_tp=p_tp, d_tp=1, kv_heads=4, **SHAPE) as cluster:
                outcome = await run_transfer(cluster, "same", 7)
                assert outcome.ok and outcome.verified
                results.append((outcome.nbytes, cluster.decode[0].kv.data.copy()))
                await settled(cluster)
    (n1, kv1), (n2, kv2) = results
    assert n1 == n2 == 7 * 3 * 4096
    assert (kv1 == kv2).all() and kv1.any()


async def test_one_p_worker_failing_fails_the_pull_only_after_the_other_stopped_writing() -> None:
    """P TP 2 -> D TP 1: P rank 1's write fails while rank 0's is still in flight. D's pull must
    not end (and D's blocks must not be reused) until rank 0 is done with them."""
    planes: list[FaultyDataPlane] = []

    def wrap(plane: object) -> FaultyDataPlane:
        faulty = FaultyDataPlane(plane, fail_writes=len(planes))  # type: ignore[arg-type]
        planes.append(faulty)
        return faulty

    with trio.fail_after(30):
        async with open_cluster(p_tp=2, d_tp=1, kv_heads=4, wrap_prefill=wrap, **SHAPE) as cluster:
            gate = planes[0].gate = trio.Event()  # rank 0's write waits here
            d: DecodeNode = cluster.decode[0]
            async with trio.open_nursery() as nursery:
                result: list[object] = []

                async def transfer() -> None:
                    result.append(await run_transfer(cluster, "t-fail", 4))

                nursery.start_soon(transfer)
                await wait_until(
                    lambda: bool(planes[0].writes_started and planes[1].writes_started)
                )
                # Rank 1's failure reaches D: the pull stops rank 0 but waits for its word.
                p0 = cluster.prefill[0].sender.address
                with trio.fail_after(10):
                    while (pull := d.receiver._table.get("t-fail")) is None or pull.waiting != {p0}:
                        await trio.sleep(0.01)
                assert pull.state is PullState.ABORTING and d.receiver.in_flight == 1
                rank0 = cluster.prefill[0].sender
                await wait_until(  # D's cancel reached rank 0, whose write waits at the gate
                    lambda: rank0._table._entries["t-fail"].giving_up is SendState.CANCELLED
                )
                # rank 0 may still write: it has not answered, so D's pull has not ended
                assert rank0.transfer_state("t-fail") is SendState.SENDING
                assert rank0.pulls_waiting("t-fail") == 1
                assert d.receiver.in_flight == 1 and d.pool.in_use == 4
                gate.set()
            [outcome] = result
            assert not outcome.ok and "injected fault" in outcome.reason  # type: ignore[attr-defined]
            planes[0].gate = None
            good = await run_transfer(cluster, "t-next", 4)
            assert good.ok and good.verified
            await settled(cluster)


async def test_a_pull_planned_for_another_shape_is_refused_and_p_serves_on() -> None:
    with trio.fail_after(30):
        async with open_cluster(p_tp=2, d_tp=1, kv_heads=4, **SHAPE) as cluster:
            p = cluster.prefill[0]
            layout = cluster.decode[0].kv.layout
            bad = [
                # D believed P has 4 TP ranks (a stale or partial bootstrap answer)
                (dict(tp_size=1, p_tp_size=4, kv_heads=4), "planned for a P with tp_size 4"),
                # D's model has other heads
                (dict(tp_size=1, p_tp_size=2, kv_heads=8), "D's model has 8 KV heads"),
                # D TP 3 does not divide 4 heads
                (dict(tp_size=3, p_tp_size=2, kv_heads=4), "do not split"),
            ]
            async with open_dealer(p.sender.address) as dealer:
                for i, (shape, why) in enumerate(bad):
                    request = PullRequest(
                        f"bad{i}",
                        "127.0.0.1:1",
                        0,
                        shape["tp_size"],
                        0,
                        1,
                        ((0,),),
                        "x",
                        layout,
                        kv_heads=shape["kv_heads"],
                        p_tp_size=shape["p_tp_size"],
                    )
                    await dealer.send(encode_frames(request))
                    answer = decode_frames(await dealer.receive())
                    assert isinstance(answer, PullFailed) and why in answer.reason, answer
                    assert answer.lookup_again == (i == 0)  # only a stale view of P
            outcome = await run_transfer(cluster, "after", 3)
            assert outcome.ok and outcome.verified
            await settled(cluster)


async def test_a_partial_registration_is_refused_then_looked_up_again() -> None:
    """D reads P's TP size from the bootstrap; while only P's rank 0 is registered (under an
    engine id of its own, on DP rank 1: rank 0 is held by P's own live lease), D plans for a
    TP 1 P and P refuses with lookup_again, so D asks the bootstrap again next time and then
    pulls from both ranks."""
    with trio.fail_after(30):
        async with (
            open_cluster(p_tp=2, d_tp=1, kv_heads=4, **SHAPE) as cluster,
            open_bootstrap_client() as client,
        ):
            p0, p1 = cluster.prefill
            d = cluster.decode[0]
            url = cluster.bootstrap_url
            await client.register(
                url, RegisterWorker("late", 1, 0, 0, p0.sender.address), timeout=5
            )
            src = p0.owned["x1"] = p0.pool.allocate(2)
            for worker in (p0, p1):
                worker.kv.fill("x1", src)
                worker.sender.transfer_ready("x1", src)
            dst = d.pool.allocate(2)
            with pytest.raises(PullFailedError, match="planned for a P with tp_size 1"):
                await d.receiver.pull("x1", bootstrap_url=url, engine_id="late", block_ids=dst)
            await client.register(
                url, RegisterWorker("late", 1, 1, 0, p1.sender.address), timeout=5
            )
            for worker in (p0, p1):  # P's request for x1 goes away: both free its blocks
                worker.sender.transfer_dropped("x1")
            src = p0.owned["x2"] = p0.pool.allocate(2)
            for worker in (p0, p1):
                worker.kv.fill("x2", src)
                worker.sender.transfer_ready("x2", src)
            await d.receiver.pull("x2", bootstrap_url=url, engine_id="late", block_ids=dst)
            assert d.kv.verify("x2", dst, 2)
            d.pool.free(dst)
            await settled(cluster)


async def test_many_concurrent_transfers_two_to_one() -> None:
    with trio.fail_after(60):
        async with open_cluster(p_tp=2, d_tp=1, kv_heads=4, **SHAPE) as cluster:
            outcomes = []
            ids = itertools.count()

            async def worker() -> None:
                for _ in range(6):
                    outcomes.append(await run_transfer(cluster, f"c{next(ids)}", 2))

            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(worker)
            assert len(outcomes) == 48 and all(o.ok and o.verified for o in outcomes)
            await settled(cluster)


@pytest.mark.parametrize(("p_tp", "p_pp", "d_tp"), [(1, 2, 1), (2, 2, 1), (1, 2, 2)])
async def test_p_pipeline_stages_each_write_their_layers_into_d(
    p_tp: int, p_pp: int, d_tp: int
) -> None:
    """P PP 2 -> D PP 1: D's pull goes to every stage; each writes its layers into D's regions
    of the same name; D's blocks hold the whole model's KV."""
    shape = {**SHAPE, "layers": 4}
    with trio.fail_after(60):
        async with open_cluster(
            p_tp=p_tp, p_pp=p_pp, d_tp=d_tp, kv_heads=4 if p_tp != d_tp else 0, **shape
        ) as cluster:
            stages = {(n.pp_rank, n.kv.layout.names) for n in cluster.prefill}
            assert stages == {(0, ("layers.0", "layers.1")), (1, ("layers.2", "layers.3"))}
            for i, (count, d_blocks) in enumerate([(5, None), (6, 3)]):
                outcome = await run_transfer(cluster, f"pp{i}", count, d_blocks=d_blocks)
                assert outcome.ok and outcome.verified, outcome.reason
            await settled(cluster)


async def test_a_p_stage_with_a_layer_d_lacks_is_refused() -> None:
    from pdactors.core.plan import matching_regions
    from pdactors.errors import LayoutMismatch
    from pdactors.wire import Layout

    with trio.fail_after(30):
        async with open_cluster(p_pp=2, **{**SHAPE, "layers": 4}) as cluster:
            p = cluster.prefill[1]
            d_layout = cluster.decode[0].kv.layout
            other = Layout(d_layout.regions, tuple(f"other.{i}" for i in range(4)))
            with pytest.raises(LayoutMismatch, match=r"D has no KV region 'layers\.2'"):
                matching_regions(p.kv.layout, other)
            assert matching_regions(p.kv.layout, d_layout).regions == d_layout.regions[2:]
