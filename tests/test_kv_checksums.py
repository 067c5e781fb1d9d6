"""KV checksums end to end: P hashes every run it writes, D recomputes over what landed, and a
corruption in flight (a flipped byte, a short run, a run one byte off) fails the pull with a
reason naming the transfer and the first bad region and block, every block released."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from pdactors import Liveness, ReceiverConfig, RunHasher, SenderConfig, Xxh3Hasher
from pdactors.core.plan import plan_transfer
from pdactors.dataplane.base import Addrs, DataPlane
from pdactors.dataplane.checksum import (
    SUMS_HEADER,
    check_landed,
    pack_sums,
    run_digests,
    sums_kind,
    transfer_seed,
)
from pdactors.testing import Cluster, open_cluster, run_transfer
from pdactors.testing.corruption import CORRUPTIONS, CorruptingDataPlane
from pdactors.testing.kv import KVBuffer
from pdactors.testing.memory_dataplane import MemoryFabric
from pdactors.transport import MemoryTransport
from pdactors.wire import MAX_SUM_RUNS, PullDone, decode_frames, encode_frames

SMALL = {"layers": 4, "num_blocks": 32, "block_bytes": 1024}
PATIENT = ReceiverConfig(
    pull_timeout=1000, lookup_timeout=1e6, liveness=Liveness(connect_timeout=1e6)
)
QUIET = SenderConfig(engine_id="p", register_timeout=1e6, lease_interval=0)


def _sums(tid: str, src: KVBuffer, d: KVBuffer, s_ids: list[int], d_ids: list[int]) -> bytes:
    """What P sends for a transfer of ``s_ids`` from ``src`` into ``d_ids`` of ``d``."""
    plan = plan_transfer(src.layout, s_ids, d.layout, d_ids)
    digests = run_digests(transfer_seed(tid), plan.src, plan.lengths)
    return SUMS_HEADER + pack_sums(plan.dst, plan.lengths, digests)


def _landed(tid: str, blocks: list[int]) -> tuple[KVBuffer, bytes]:
    p, d = KVBuffer(3, 16, 256), KVBuffer(3, 16, 256)
    p.fill(tid, [0, 1, 2, 5])
    d.data[:, blocks, :] = p.data[:, [0, 1, 2, 5], :]
    return d, _sums(tid, p, d, [0, 1, 2, 5], blocks)


def test_what_landed_untouched_passes_and_sums_bind_the_transfer() -> None:
    d, sums = _landed("t", [4, 5, 9, 10])
    assert check_landed("t", [("p1", sums)], d.layout, ((4, 5, 9, 10),)) is None
    other = check_landed("u", [("p1", sums)], d.layout, ((4, 5, 9, 10),))
    assert other is not None and "mismatch in transfer u" in other


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_single_byte_flip_in_the_destination_is_caught(data: st.DataObject) -> None:
    blocks = [4, 5, 9, 10]
    d, sums = _landed("t", blocks)
    layer = data.draw(st.integers(0, 2))
    block = data.draw(st.sampled_from(blocks))
    offset = data.draw(st.integers(0, 255))
    flip = data.draw(st.integers(1, 255))
    d.data[layer, block, offset] ^= flip
    reason = check_landed("t", [("p1", sums)], d.layout, (tuple(blocks),))
    assert reason is not None
    assert "mismatch in transfer t from P worker p1" in reason
    # the run that holds the byte is named by its region and first block (P 0,1 → D 4,5 is one)
    assert f"region {layer} 'layers.{layer}' block {4 if block < 9 else block}" in reason


def test_runs_outside_the_pull_and_malformed_sums_are_refused_before_any_read() -> None:
    d, sums = _landed("t", [4, 5, 9, 10])
    outside = check_landed("t", [("p1", sums)], d.layout, ((4, 5, 9),))
    assert outside is not None and "outside the pull's blocks" in outside
    far = SUMS_HEADER + pack_sums(*(np.array([v], np.uint64) for v in (8, 16, 0)))
    refused = check_landed("t", [("p1", far)], d.layout, ((4,),))
    assert refused is not None and "in no region" in refused
    for bad in (b"crc32---" + sums[8:], sums[:-1]):
        reason = check_landed("t", [("p1", bad)], d.layout, ((4, 5, 9, 10),))
        assert reason is not None and "P worker p1 sent" in reason


def test_pull_done_carries_the_sums_within_the_wire_limit() -> None:
    done = PullDone("t", 10, 1, sums=SUMS_HEADER + bytes(24))
    assert decode_frames(encode_frames(done)) == done
    assert decode_frames(encode_frames(PullDone("t"))) == PullDone("t", 0, 0, sums=b"")
    with pytest.raises(Exception, match="undecodable"):
        decode_frames(encode_frames(PullDone("t", sums=bytes(8 + 24 * MAX_SUM_RUNS + 24))))


def _corrupting(planes: list[CorruptingDataPlane]) -> object:
    def wrap(inner: DataPlane) -> DataPlane:
        planes.append(CorruptingDataPlane(inner, seed=len(planes)))
        return planes[-1]

    return wrap


async def _released(cluster: Cluster) -> None:
    with trio.fail_after(5):
        await cluster.wait_settled()
    assert cluster.blocks_in_use() == 0  # P's blocks and D's, every worker's


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1)])
async def test_each_corruption_is_caught_and_every_block_released(
    mock_clock: trio.testing.MockClock, p_tp: int, d_tp: int
) -> None:
    planes: list[CorruptingDataPlane] = []
    async with open_cluster(
        fabric=MemoryFabric(),
        transport=MemoryTransport(),
        sender=QUIET,
        receiver=PATIENT,
        wrap_prefill=_corrupting(planes),  # type: ignore[arg-type]
        p_tp=p_tp,
        d_tp=d_tp,
        kv_heads=4,
        **SMALL,
    ) as cluster:
        assert (await run_transfer(cluster, "clean", 5)).verified
        for kind in CORRUPTIONS:
            planes[-1].arm(kind)
            outcome = await run_transfer(cluster, f"bad-{kind}", 5)
            assert not outcome.ok, kind
            assert f"KV checksum mismatch in transfer bad-{kind} from P worker" in outcome.reason
            assert "region " in outcome.reason and " block " in outcome.reason
            await _released(cluster)
        assert [k for k, _, _ in planes[-1].injected] == list(CORRUPTIONS)
        assert (await run_transfer(cluster, "clean-again", 5)).verified
        stats = cluster.decode[0].receiver.kv_check_statistics()
        assert (stats.verified, stats.corrupt, stats.unverified) == (2, 3, 0)
        await _released(cluster)


@pytest.mark.parametrize(
    ("checksum_kv", "verify_kv", "delivered"),
    [(True, "off", True), (False, "on", True), (False, "require", False)],
)
async def test_without_a_check_a_corruption_lands_and_a_p_without_sums_is_policy(
    mock_clock: trio.testing.MockClock, checksum_kv: bool, verify_kv: str, delivered: bool
) -> None:
    planes: list[CorruptingDataPlane] = []
    async with open_cluster(
        fabric=MemoryFabric(),
        transport=MemoryTransport(),
        sender=SenderConfig(
            engine_id="p", register_timeout=1e6, lease_interval=0, checksum_kv=checksum_kv
        ),
        receiver=ReceiverConfig(
            pull_timeout=1000,
            lookup_timeout=1e6,
            verify_kv=verify_kv,  # type: ignore[arg-type]
            liveness=Liveness(connect_timeout=1e6),
        ),
        wrap_prefill=_corrupting(planes),  # type: ignore[arg-type]
        **SMALL,
    ) as cluster:
        planes[0].arm("flip")
        outcome = await run_transfer(cluster, "t", 5)
        assert outcome.ok is delivered
        if delivered:
            assert not outcome.verified  # nothing checked it: the flipped byte is in D's KV
        else:
            assert "sent no KV checksums (verify_kv 'require')" in outcome.reason
        stats = cluster.decode[0].receiver.kv_check_statistics()
        assert stats.unverified == (verify_kv == "on" and not checksum_kv)
        await _released(cluster)


async def test_real_mooncake_tcp_bytes_each_corruption_is_caught() -> None:
    planes: list[CorruptingDataPlane] = []
    async with open_cluster(wrap_prefill=_corrupting(planes), **SMALL) as cluster:  # type: ignore[arg-type]
        assert (await run_transfer(cluster, "clean", 6)).verified
        for kind in CORRUPTIONS:
            planes[0].arm(kind)
            outcome = await run_transfer(cluster, f"tcp-{kind}", 6)
            assert not outcome.ok
            assert f"KV checksum mismatch in transfer tcp-{kind}" in outcome.reason
        await _released(cluster)
        planes[0].arm("shift")  # every block: the transfer is one run (the write it shifts)
        outcome = await run_transfer(cluster, "tcp-one-run", SMALL["num_blocks"])
        assert "KV checksum mismatch in transfer tcp-one-run" in outcome.reason
        assert "1 of 1 runs differ" in outcome.reason
        assert len(planes[0].injected) == 4
        assert (await run_transfer(cluster, "clean-again", 6)).verified
        await _released(cluster)


class OtherKind:
    """A hasher of another algorithm (xxh3 under another seed, named apart): what a P whose KV
    is on a GPU sends a D whose KV is in host memory, as far as that D can tell."""

    header = b"crc-64\x00\x02"

    def digests(self, seed: int, addrs: Addrs, lengths: Addrs) -> npt.NDArray[np.uint64]:
        return run_digests(seed ^ 1, addrs, lengths)


def _kinds(p: RunHasher, d: RunHasher) -> Callable[[str, KVBuffer], RunHasher]:
    return lambda role, kv: p if role == "prefill" else d


async def test_both_sides_hash_with_the_hasher_they_are_given(
    mock_clock: trio.testing.MockClock,
) -> None:
    planes: list[CorruptingDataPlane] = []
    async with open_cluster(
        fabric=MemoryFabric(),
        transport=MemoryTransport(),
        sender=QUIET,
        receiver=PATIENT,
        wrap_prefill=_corrupting(planes),  # type: ignore[arg-type]
        hasher=_kinds(OtherKind(), OtherKind()),
        **SMALL,
    ) as cluster:
        assert (await run_transfer(cluster, "clean", 5)).verified
        planes[0].arm("flip")
        outcome = await run_transfer(cluster, "bad", 5)
        assert "KV checksum mismatch in transfer bad from P worker" in outcome.reason
        stats = cluster.decode[0].receiver.kv_check_statistics()
        assert (stats.verified, stats.corrupt, stats.unverified) == (1, 1, 0)
        await _released(cluster)


@pytest.mark.parametrize("verify_kv", ["on", "require"])
@pytest.mark.parametrize("p_is_other", [True, False])
async def test_sums_of_a_kind_d_cannot_compute_are_trusted_or_refused_by_name(
    mock_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    verify_kv: str,
    p_is_other: bool,
) -> None:
    p, d = (OtherKind(), Xxh3Hasher()) if p_is_other else (Xxh3Hasher(), OtherKind())
    kind = "'crc-64' v2" if p_is_other else "'xxh3-64' v1"
    async with open_cluster(
        fabric=MemoryFabric(),
        transport=MemoryTransport(),
        sender=QUIET,
        receiver=msgspec.structs.replace(PATIENT, verify_kv=verify_kv),
        hasher=_kinds(p, d),
        **SMALL,
    ) as cluster:
        outcome = await run_transfer(cluster, "t", 5)
        stats = cluster.decode[0].receiver.kv_check_statistics()
        if verify_kv == "on":
            assert outcome.ok and outcome.verified  # delivered (the bytes are right, unchecked)
            assert (stats.verified, stats.unverified) == (0, 1)
            assert f"sends KV checksums of kind {kind}, which this D cannot compute" in caplog.text
        else:
            assert not outcome.ok
            assert (f"sent KV checksums of kind {kind}, which this D cannot compute "
                    "(verify_kv 'require')") in outcome.reason  # fmt: skip
        await _released(cluster)


def test_sums_kind_names_a_peers_header_escaped() -> None:
    assert sums_kind(SUMS_HEADER + bytes(24)) == "'xxh3-64' v1"
    assert sums_kind(b"\xffevil\n\x00\x07") == "'\\\\xffevil\\n' v7"
    assert "too short" in sums_kind(b"xx")
