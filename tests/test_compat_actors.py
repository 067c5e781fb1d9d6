"""The compatibility check through the actors: a P and a D whose descriptions differ never
move KV; the pull ends at once naming the first field that differs (refused by D from P's
registration, or by P from D's pull), P's blocks are released and its table's record freed,
and both actors go on serving peers that match. In-memory data plane and side channel."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from pdactors import Compat, Liveness, PullFailedError, ReceiverConfig, SenderConfig
from pdactors.core.send_table import SendState
from pdactors.testing import Cluster, open_cluster, run_transfer
from pdactors.testing.memory_dataplane import MemoryFabric
from pdactors.transport import MemoryTransport
from tests.conftest import settled

SMALL = {"layers": 4, "num_blocks": 32, "block_bytes": 1024}
P_DESC = Compat(wire=2, model="Tiny:abc", weights="3f2a" * 16, dtype="float32", block_size=16)
D_BAD = msgspec.structs.replace(P_DESC, weights="9c1b" * 16)
REASON = "incompatible peer: weights differ (P 3f2a3f2a3f2a…, D 9c1b9c1b9c1b…)"


def _configs(relax_p: tuple[str, ...] = (), relax_d: tuple[str, ...] = ()) -> dict[str, Any]:
    # Registered once (no lease to renew under the jumping clock: see test_memory_dataplane).
    sender = SenderConfig(engine_id="p", register_timeout=1e6, lease_interval=0,
                          compat_relax=relax_p)  # fmt: skip
    receiver = ReceiverConfig(lookup_timeout=1e6, liveness=Liveness(connect_timeout=1e6),
                              compat_relax=relax_d)  # fmt: skip
    return {"sender": sender, "receiver": receiver}


def _described(
    d0: Compat | None, d1: Compat | None = P_DESC
) -> Callable[[str, int], Compat | None]:
    """P engine 0 is described by P_DESC; D engine 0 by ``d0``, D engine 1 by ``d1``."""
    return lambda role, e: P_DESC if role == "prefill" else (d0, d1)[e]


def _p_freed(cluster: Cluster, tid: str) -> None:
    """P's blocks are back and its table holds no live record: only the tombstone."""
    sender = cluster.prefill[0].sender
    assert cluster.blocks_in_use() == 0
    assert sender.statistics().live == 0 and sender.pulls_waiting(tid) == 0
    assert sender.transfer_state(tid) is SendState.CANCELLED
    assert tid not in cluster.prefill[0].owned


async def test_d_refuses_ps_registration_by_name_and_p_frees_at_once(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pdactors.receiver")
    async with open_cluster(
        fabric=MemoryFabric(),
        transport=MemoryTransport(),
        decode=2,
        compat=_described(D_BAD),
        **SMALL,
        **_configs(),
    ) as cluster:
        start = trio.current_time()
        bad = await run_transfer(cluster, "bad", 5, d=0)
        assert not bad.ok and bad.reason == f"D rank 0: {REASON}"  # D's own words: never sent
        assert trio.current_time() - start < 1  # at once, not at a deadline
        await settled(cluster)
        _p_freed(cluster, "bad")
        # Both actors go on: the matching D is served, and the bad one refused again.
        good = await run_transfer(cluster, "good", 5, d=1)
        assert good.ok and good.verified
        again = await run_transfer(cluster, "again", 3, d=0)
        assert not again.ok and REASON in again.reason
        await settled(cluster)
        assert cluster.blocks_in_use() == 0 and cluster.prefill[0].sender.statistics().sent == 1
    refusals = [r for r in caplog.records if "refused: incompatible" in r.getMessage()]
    assert [r.levelno for r in refusals] == [logging.WARNING, logging.DEBUG]  # once per peer


async def test_p_refuses_ds_pull_by_name_and_frees_its_blocks(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """D relaxes ``weights`` (so it asks), P does not: P's check is the one that refuses."""
    async with open_cluster(
        fabric=MemoryFabric(),
        transport=MemoryTransport(),
        decode=2,
        compat=_described(D_BAD),
        **SMALL,
        **_configs(relax_d=("weights",)),
    ) as cluster:
        bad = await run_transfer(cluster, "bad", 5, d=0)
        assert not bad.ok and bad.reason == f"D rank 0: P: {REASON}"
        await settled(cluster)
        _p_freed(cluster, "bad")
        good = await run_transfer(cluster, "good", 5, d=1)
        assert good.ok and good.verified
        d1, url = cluster.decode_workers(1)[0], cluster.bootstrap_url
        with pytest.raises(PullFailedError, match=re.escape(REASON)):  # the tombstone's reason
            await d1.receiver.pull("bad", bootstrap_url=url, engine_id="prefill-0", block_ids=[0])
        await settled(cluster)
    relaxed = [r for r in caplog.records if "accepted: compat_relax names 'weights'" in r.message]
    assert len(relaxed) == 1 and relaxed[0].levelno == logging.WARNING  # D, once for that P
    p_side = [r for r in caplog.records if r.name == "pdactors.sender" and REASON in r.message]
    assert len(p_side) == 1 and p_side[0].levelno == logging.WARNING


async def test_relaxed_on_both_sides_it_moves_and_says_so_once_per_peer(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    relax = ("weights",)
    async with open_cluster(
        fabric=MemoryFabric(),
        transport=MemoryTransport(),
        compat=_described(D_BAD),
        **SMALL,
        **_configs(relax, relax),
    ) as cluster:
        outcomes = [await run_transfer(cluster, f"t{i}", 3) for i in range(3)]
        assert all(o.ok and o.verified for o in outcomes)
        await settled(cluster)
    warned = [r for r in caplog.records if "compat_relax names 'weights'" in r.message]
    assert sorted(r.name for r in warned) == ["pdactors.receiver", "pdactors.sender"]


async def test_a_d_without_a_description_is_served_as_before(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with open_cluster(
        fabric=MemoryFabric(),
        transport=MemoryTransport(),
        compat=_described(None),
        **SMALL,
        **_configs(),
    ) as cluster:
        outcome = await run_transfer(cluster, "t", 4)
        assert outcome.ok and outcome.verified
        await settled(cluster)
