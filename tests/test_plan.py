"""Tests of the sans-IO transfer planner (plain synchronous tests)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdactors.core.plan import (
    WHOLE_BLOCK,
    HeadSlice,
    TransferPlan,
    check_layout,
    matching_regions,
    packed_layout,
    plan_transfer,
    rank_heads,
    tp_expected,
    tp_pulls,
    tp_sources,
)
from pdactors.errors import LayoutMismatch, PlanError
from pdactors.wire import BlockLayout, Layout

KiB = 1024


def stacked(base: int, regions: int, num_blocks: int, block_bytes: int, gap: int = 0) -> Layout:
    """Regions laid out back to back (``gap`` bytes apart), blocks dense within each."""
    step = num_blocks * block_bytes + gap
    return Layout(
        tuple(
            BlockLayout(base + r * step, num_blocks, block_bytes, block_bytes)
            for r in range(regions)
        )
    )


def triples(plan: TransferPlan) -> list[tuple[int, int, int]]:
    return list(zip(plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist(), strict=True))


# --------------------------------------------------------------------------- coalescing


def test_contiguous_run_collapses_to_one_descriptor_per_region() -> None:
    src = stacked(0x1000_0000, 2, 100, 4 * KiB, gap=4 * KiB)
    dst = stacked(0x9000_0000, 2, 100, 4 * KiB, gap=4 * KiB)
    plan = plan_transfer(src, [3, 4, 5, 6], dst, [10, 11, 12, 13])
    assert triples(plan) == [
        (0x1000_0000 + 3 * 4 * KiB, 0x9000_0000 + 10 * 4 * KiB, 16 * KiB),
        (0x1000_0000 + 101 * 4 * KiB + 3 * 4 * KiB, 0x9000_0000 + 111 * 4 * KiB, 16 * KiB),
    ]
    assert plan.nbytes == 32 * KiB
    assert plan.descriptors == 2
    assert plan.src.dtype == plan.dst.dtype == plan.lengths.dtype == np.uint64


def test_non_contiguous_ids_split_runs() -> None:
    src = stacked(0, 1, 50, 1 * KiB)
    dst = stacked(1 << 30, 1, 50, 1 * KiB)
    plan = plan_transfer(src, [1, 2, 7, 8, 9, 20], dst, [1, 2, 3, 4, 5, 6])
    # runs break where either side jumps: src 2→7 and 9→20
    assert triples(plan) == [
        (1 * KiB, (1 << 30) + 1 * KiB, 2 * KiB),
        (7 * KiB, (1 << 30) + 3 * KiB, 3 * KiB),
        (20 * KiB, (1 << 30) + 6 * KiB, 1 * KiB),
    ]


def test_destination_discontinuity_alone_splits() -> None:
    src = stacked(0, 1, 50, 1 * KiB)
    dst = stacked(1 << 30, 1, 50, 1 * KiB)
    plan = plan_transfer(src, [0, 1, 2], dst, [0, 1, 5])
    assert plan.descriptors == 2
    assert plan.lengths.tolist() == [2 * KiB, 1 * KiB]


def test_reversed_ids_do_not_merge() -> None:
    src = stacked(0, 1, 10, 256)
    dst = stacked(1 << 20, 1, 10, 256)
    plan = plan_transfer(src, [5, 4, 3], dst, [5, 4, 3])
    assert triples(plan) == [
        (5 * 256, (1 << 20) + 5 * 256, 256),
        (4 * 256, (1 << 20) + 4 * 256, 256),
        (3 * 256, (1 << 20) + 3 * 256, 256),
    ]


def test_padding_between_blocks_prevents_merge() -> None:
    # block_bytes < stride: consecutive ids are not contiguous in memory.
    src = Layout((BlockLayout(0, 10, 100, 128),))
    dst = Layout((BlockLayout(1 << 20, 10, 100, 100),))
    plan = plan_transfer(src, [0, 1, 2], dst, [0, 1, 2])
    assert plan.descriptors == 3
    assert plan.src.tolist() == [0, 128, 256]
    assert plan.dst.tolist() == [1 << 20, (1 << 20) + 100, (1 << 20) + 200]


def test_adjacent_whole_regions_merge_across_regions() -> None:
    src = stacked(0x1000, 3, 8, 512)
    dst = stacked(0x10_0000, 3, 8, 512)
    plan = plan_transfer(src, range(8), dst, range(8))
    assert triples(plan) == [(0x1000, 0x10_0000, 3 * 8 * 512)]


def test_regions_adjacent_on_one_side_only_do_not_merge() -> None:
    src = stacked(0x1000, 2, 8, 512)
    dst = stacked(0x10_0000, 2, 8, 512, gap=512)
    plan = plan_transfer(src, range(8), dst, range(8))
    assert plan.descriptors == 2


def test_reference_request_shape() -> None:
    # Qwen3-8B, 36 layers x 63 blocks of 64 KiB, layer-outermost like vLLM's CPU cache.
    src = stacked(1 << 32, 36, 1000, 64 * KiB)
    dst = stacked(1 << 40, 36, 1000, 64 * KiB)
    plan = plan_transfer(src, range(200, 263), dst, range(500, 563))
    assert plan.descriptors == 36
    assert plan.nbytes == 36 * 63 * 64 * KiB
    scattered = plan_transfer(src, range(0, 126, 2), dst, range(0, 126, 2))
    assert scattered.descriptors == 36 * 63


def test_plan_arrays_are_read_only() -> None:
    plan = plan_transfer(stacked(0, 1, 4, 8), [0, 1], stacked(64, 1, 4, 8), [2, 3])
    with pytest.raises(ValueError):
        plan.src[0] = 1


# --------------------------------------------------------------------------- prefix cache


def test_prefix_cached_on_d_sends_ps_last_blocks() -> None:
    src = stacked(0, 1, 20, 100)
    dst = stacked(1 << 20, 1, 20, 100)
    plan = plan_transfer(src, [0, 1, 2, 3, 9], dst, [7, 8])
    assert triples(plan) == [(3 * 100, (1 << 20) + 700, 100), (9 * 100, (1 << 20) + 800, 100)]


def test_empty_destination_is_an_empty_plan() -> None:
    src = stacked(0, 2, 20, 100)
    dst = stacked(1 << 20, 2, 20, 100)
    plan = plan_transfer(src, [1, 2, 3], dst, [])
    assert plan.descriptors == 0
    assert plan.nbytes == 0
    assert plan_transfer(src, [], dst, []).descriptors == 0


def test_more_destination_blocks_than_source_blocks_is_refused() -> None:
    with pytest.raises(PlanError, match="asks for 3 blocks but P holds only 2"):
        plan_transfer(stacked(0, 1, 10, 8), [0, 1], stacked(1 << 20, 1, 10, 8), [0, 1, 2])


# --------------------------------------------------------------------------- errors


def test_region_count_mismatch() -> None:
    with pytest.raises(LayoutMismatch, match="P has 2 KV regions, D has 3"):
        plan_transfer(stacked(0, 2, 10, 8), [0], stacked(1 << 20, 3, 10, 8), [0])


def test_block_bytes_mismatch_names_the_region() -> None:
    dst = Layout((BlockLayout(1 << 20, 10, 8, 8), BlockLayout(1 << 21, 10, 16, 16)))
    with pytest.raises(LayoutMismatch, match="region 1 moves 8 bytes per block on P but 16"):
        plan_transfer(stacked(0, 2, 10, 8), [0], dst, [0])


def test_layout_mismatch_is_checked_before_block_ids() -> None:
    with pytest.raises(LayoutMismatch):
        plan_transfer(stacked(0, 1, 10, 8), [99], stacked(1 << 20, 2, 10, 8), [99])


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "message"),
    [
        ([10], [0], r"P block id 10 is out of range \[0, 10\) of P region 0"),
        ([-1], [0], r"P block id -1 is out of range \[0, 10\) of P region 0"),
        ([0], [12], r"D block id 12 is out of range \[0, 12\) of D region 1"),
        ([0], [-3], r"D block id -3 is out of range \[0, 20\) of D region 0"),
        ([0], [2**70], "D block ids are not 64-bit integers"),
        ([0, 1], [3, 3], "D block ids contain duplicates"),
    ],
)
def test_bad_block_ids(src_ids: list[int], dst_ids: list[int], message: str) -> None:
    dst = Layout((BlockLayout(1 << 20, 20, 8, 8), BlockLayout(1 << 21, 12, 8, 8)))
    with pytest.raises(PlanError, match=message):
        plan_transfer(stacked(0, 2, 10, 8), src_ids, dst, dst_ids)


def test_every_source_id_is_checked_even_those_of_the_prefix() -> None:
    # A bad id anywhere in P's list means P's bookkeeping is wrong: refuse the whole plan.
    with pytest.raises(PlanError, match="P block id 99"):
        plan_transfer(stacked(0, 1, 10, 8), [99, 1], stacked(1 << 20, 1, 10, 8), [4])


@pytest.mark.parametrize(
    ("region", "message"),
    [
        (BlockLayout(0, 0, 8, 8), "sizes > 0"),
        (BlockLayout(0, 4, 0, 8), "sizes > 0"),
        (BlockLayout(0, 4, 8, 0), "sizes > 0"),
        (BlockLayout(-8, 4, 8, 8), "base must be >= 0"),
        (BlockLayout(0, 4, 16, 8), "block_bytes 16 exceeds stride 8"),
        (BlockLayout(2**64 - 16, 4, 8, 8), "64-bit address space"),
        (BlockLayout(2**64 - 16, 3, 8, 8), "64-bit address space"),  # one block past the end
    ],
)
def test_check_layout_rejects(region: BlockLayout, message: str) -> None:
    layout = Layout((BlockLayout(0, 4, 8, 8), region))
    with pytest.raises(PlanError, match=f"region 1: .*{message}"):
        check_layout(layout)
    with pytest.raises(PlanError, match=message):
        plan_transfer(layout, [0], layout, [0])


def test_check_layout_rejects_empty_layout_and_accepts_good_one() -> None:
    with pytest.raises(PlanError, match="no regions"):
        check_layout(Layout(()))
    check_layout(stacked(0, 3, 10, 64))
    check_layout(Layout((BlockLayout(2**64 - 16, 2, 8, 8),)))


def test_check_layout_rejects_names_and_groups_that_do_not_fit_the_regions() -> None:
    two = stacked(0, 2, 4, 8).regions
    for layout in (
        Layout(two, names=("k",)),
        Layout(two, names=("k", "k")),
        Layout(two, groups=(0,)),
        Layout(two, groups=(0, -1)),
    ):
        with pytest.raises(PlanError, match=r"region (names|groups)"):
            check_layout(layout)
    check_layout(Layout(two, names=("k", "v"), groups=(0, 1)))


def test_a_p_stage_writes_its_regions_into_ds_of_the_same_name() -> None:
    regions = stacked(0x1000, 3, 4, 8).regions
    d = Layout(regions, names=("a", "b", "c"))
    assert matching_regions(Layout(regions[:2], names=("a", "b")), d) == Layout(
        regions[:2], names=("a", "b")
    )  # the same order: D's first two
    stage = Layout(regions[:2], names=("c", "a"), groups=())
    assert matching_regions(stage, d) == Layout((regions[2], regions[0]), names=("c", "a"))
    assert matching_regions(Layout(regions), d) is d  # no names on P: by position
    assert matching_regions(d, d) is d
    grouped = Layout(regions, names=("a", "b", "c"), groups=(0, 1, 1))
    assert matching_regions(stage, grouped).groups == (1, 0)
    with pytest.raises(LayoutMismatch, match="no KV region 'x' of P"):
        matching_regions(Layout(regions[:1], names=("x",)), d)


def test_a_malformed_head_slice_or_block_ids_are_refused() -> None:
    lay = stacked(0x1000, 1, 4, 64)
    for bad in (HeadSlice(2, 2, 0, 0, 0), HeadSlice(2, 2, -1, 0, 1), HeadSlice(2, 0, 0, 0, 1)):
        with pytest.raises(PlanError, match="bad head slice"):
            plan_transfer(lay, [0], lay, [1], heads=bad)
    with pytest.raises(PlanError, match="reaches past"):
        plan_transfer(lay, [0], lay, [1], heads=HeadSlice(2, 2, 0, 1, 2))
    with pytest.raises(LayoutMismatch, match="do not split into 3"):
        plan_transfer(lay, [0], lay, [1], heads=HeadSlice(3, 3, 0, 0, 1))
    with pytest.raises(LayoutMismatch, match=r"do not split into 2 \(P\) or 3 \(D\)"):
        plan_transfer(lay, [0], lay, [1], heads=HeadSlice(2, 3, 0, 0, 1))  # D's alone
    with pytest.raises(PlanError, match="P block id -1 is out of range"):
        plan_transfer(lay, [-1, 3], stacked(1 << 20, 1, 4, 64), [1, 2])
    with pytest.raises(PlanError, match="P block id 9 is out of range"):
        plan_transfer(lay, [0, 9], stacked(1 << 20, 1, 4, 64), [1, 2])
    with pytest.raises(PlanError, match="flat sequence"):
        plan_transfer(lay, (((0, 1), (2, 3)),), lay, [1])  # group 0's ids nested


def test_a_flat_tuple_of_ids_is_the_one_group_and_an_empty_one_moves_nothing() -> None:
    p, d = stacked(0x1000, 1, 4, 64), stacked(1 << 20, 1, 4, 64)
    flat = plan_transfer(p, (0, 1), d, (2, 3))
    assert (flat.src.tolist(), flat.dst.tolist(), flat.lengths.tolist()) == (
        [0x1000], [(1 << 20) + 128], [128]
    )  # fmt: skip
    assert plan_transfer(p, (), d, ()).lengths.tolist() == []


def test_packed_layout_lays_regions_back_to_back() -> None:
    assert packed_layout(0x1000, 2, 4, 8) == Layout(
        (BlockLayout(0x1000, 4, 8, 8), BlockLayout(0x1000 + 32, 4, 8, 8))
    )


def test_tp_expected_refuses_the_shapes_vllm_refuses() -> None:
    # (P rank, D tp, P tp, KV heads): a rank out of range, no D rank, no head count for
    # heterogeneous TP, heads that do not split over D's ranks
    for args in ((2, 2, 2, 4), (-1, 2, 4, 4), (0, 0, 2, 4), (0, 2, 4, 0), (0, 3, 4, 4)):
        with pytest.raises(PlanError):
            tp_expected(*args)


def test_tp_pulls_pairs_equal_sizes_rank_for_rank_in_whole_blocks() -> None:
    assert tp_pulls(0, 1, 1, 0) == {0: (WHOLE_BLOCK,)}
    assert tp_pulls(3, 4, 4, 0) == {3: (WHOLE_BLOCK,)}  # no head count needed
    assert tp_expected(3, 4, 4, 0) == 1
    with pytest.raises(PlanError, match="needs the model's KV head count"):
        tp_pulls(0, 2, 4, 0)
    with pytest.raises(PlanError, match="D tp rank 2 of 2"):
        tp_pulls(2, 2, 2, 8)
    with pytest.raises(PlanError, match="D tp rank -1"):
        tp_pulls(-1, 2, 2, 8)
    with pytest.raises(PlanError, match="do not split"):
        tp_pulls(0, 1, 3, 4)  # a P shape vLLM refuses


def test_tp_pulls_two_to_one_and_one_to_two() -> None:
    # P TP 2 -> D TP 1, 4 heads: D's one rank takes heads 0-1 from P0 and 2-3 from P1.
    assert tp_pulls(0, 1, 2, 4) == {
        0: (HeadSlice(2, 4, 0, 0, 2),),
        1: (HeadSlice(2, 4, 0, 2, 2),),
    }
    assert [tp_expected(p, 1, 2, 4) for p in (0, 1)] == [1, 1]
    # P TP 1 -> D TP 2: both D ranks pull from P0, each its half of P's heads.
    assert tp_pulls(0, 2, 1, 4) == {0: (HeadSlice(4, 2, 0, 0, 2),)}
    assert tp_pulls(1, 2, 1, 4) == {0: (HeadSlice(4, 2, 2, 0, 2),)}
    assert tp_expected(0, 2, 1, 4) == 2


def test_tp_pulls_tells_replicas_d_does_not_read() -> None:
    # 2 heads, P TP 4 (each head on two P ranks) -> D TP 1: D reads P0 and P2 and tells P1
    # and P3 with an empty pull, so they free their blocks.
    assert tp_pulls(0, 1, 4, 2) == {
        0: (HeadSlice(1, 2, 0, 0, 1),),
        1: (),
        2: (HeadSlice(1, 2, 0, 1, 1),),
        3: (),
    }
    assert [tp_expected(p, 1, 4, 2) for p in range(4)] == [1, 1, 1, 1]


@settings(max_examples=300, deadline=None)
@given(
    heads_log=st.integers(0, 4),
    p_log=st.integers(0, 5),
    d_log=st.integers(0, 5),
)
def test_tp_pulls_cover_every_head_once_and_every_p_rank(
    heads_log: int, p_log: int, d_log: int
) -> None:
    """For any power-of-two shape vLLM runs: each D rank gets each of its heads from exactly
    one P rank that holds it, every P rank is pulled at least once per transfer (else its
    blocks would wait for their expiry), and tp_expected counts those pulls."""
    total, p_tp, d_tp = 1 << heads_log, 1 << p_log, 1 << d_log
    pulled = [0] * p_tp
    for d in range(d_tp):
        pulls = tp_pulls(d, d_tp, p_tp, total)
        mine = rank_heads(d, d_tp, total)
        got: list[int] = []
        for p, slices in pulls.items():
            pulled[p] += 1
            theirs = rank_heads(p, p_tp, total)
            if p_tp == d_tp:
                assert (p, slices) == (d, (WHOLE_BLOCK,))
                got += list(mine)
                continue
            for h in slices:
                assert (h.src_heads, h.dst_heads) == (len(theirs), len(mine))
                src = [theirs.start + h.src_first + i for i in range(h.num_heads)]
                dst = [mine.start + h.dst_first + i for i in range(h.num_heads)]
                assert src == dst  # the same model heads on both sides
                got += dst
        assert sorted(got) == list(mine)
    assert min(pulled) >= 1
    assert pulled == [tp_expected(p, d_tp, p_tp, total) for p in range(p_tp)]


def test_tp_arithmetic_costs_microseconds_at_the_largest_shapes() -> None:
    """Issue 23: tp_expected did O(tp_size²) work in P's receive loop (one pull with
    tp_size 1,000 froze P for 2.8 s, 4,000 for 34 s)."""
    start = time.perf_counter()
    for d_tp, p_tp, heads in [(1024, 1, 8), (1024, 2, 8), (1024, 8, 4096), (1, 1024, 8),
                              (512, 1024, 8), (1024, 512, 1024)]:  # fmt: skip
        tp_pulls.cache_clear()
        for p in (0, p_tp - 1):
            tp_expected(p, d_tp, p_tp, heads)
        for d in (0, d_tp - 1):
            tp_pulls(d, d_tp, p_tp, heads)
    assert time.perf_counter() - start < 0.2


def _factors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@settings(max_examples=300, deadline=None)
@given(heads=st.integers(1, 48), data=st.data())
def test_tp_expected_counts_the_pulls_of_any_shape(heads: int, data: st.DataObject) -> None:
    """The closed forms agree with their definition for every shape vLLM runs (TP sizes that
    divide the head count, or that it divides), powers of two or not."""
    shapes = _factors(heads) + [heads * k for k in range(2, 6)]
    p_tp, d_tp = data.draw(st.sampled_from(shapes)), data.draw(st.sampled_from(shapes))
    pulls = [tp_pulls(j, d_tp, p_tp, heads) for j in range(d_tp)]
    for p in range(p_tp):
        assert tp_expected(p, d_tp, p_tp, heads) == sum(p in x for x in pulls) >= 1
    for j in range(d_tp):
        sources = tp_sources(j, d_tp, p_tp, heads)
        assert sum(s.num_heads for _, s in sources) == len(rank_heads(j, d_tp, heads))


# --------------------------------------------------------------------------- property


@st.composite
def side(draw: st.DrawFn, block_bytes: list[int]) -> tuple[Layout, int]:
    """A layout whose regions lie in one buffer (addresses are offsets), and the buffer size.

    Regions sit back to back or apart, and blocks may be padded (stride > block_bytes), so
    every coalescing case comes up.
    """
    regions = []
    cursor = draw(st.integers(0, 16))
    for bb in block_bytes:
        num_blocks = draw(st.integers(1, 12))
        stride = bb + draw(st.sampled_from([0, 0, 0, 1, 5]))
        regions.append(BlockLayout(cursor, num_blocks, bb, stride))
        cursor += num_blocks * stride + draw(st.sampled_from([0, 0, 3]))
    return Layout(tuple(regions)), cursor


Case = tuple[Layout, list[int], Layout, list[int], int, int]


@st.composite
def transfer(draw: st.DrawFn) -> Case:
    block_bytes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
    src, src_size = draw(side(block_bytes))
    dst, dst_size = draw(side(block_bytes))
    src_limit = min(r.num_blocks for r in src.regions)
    dst_limit = min(r.num_blocks for r in dst.regions)
    src_ids = draw(st.lists(st.integers(0, src_limit - 1), max_size=10))
    n_dst = draw(st.integers(0, min(len(src_ids), dst_limit)))
    dst_ids = draw(
        st.lists(st.integers(0, dst_limit - 1), min_size=n_dst, max_size=n_dst, unique=True)
    )
    return src, src_ids, dst, dst_ids, src_size, dst_size


def block_mask(layout: Layout, size: int) -> np.ndarray:
    """True at every byte that belongs to some block of some region."""
    mask = np.zeros(size, dtype=np.bool_)
    for r in layout.regions:
        for i in range(r.num_blocks):
            mask[r.base + i * r.stride : r.base + i * r.stride + r.block_bytes] = True
    return mask


@settings(max_examples=300, deadline=None)
@given(transfer())
def test_plan_copies_exactly_what_a_naive_block_copy_does(case: Case) -> None:
    src, src_ids, dst, dst_ids, src_size, dst_size = case
    source = np.random.default_rng(len(src_ids)).integers(1, 256, src_size, dtype=np.uint8)
    expected = np.zeros(dst_size, dtype=np.uint8)
    sent = src_ids[len(src_ids) - len(dst_ids) :]
    for s_reg, d_reg in zip(src.regions, dst.regions, strict=True):
        for s, d in zip(sent, dst_ids, strict=True):
            a = s_reg.base + s * s_reg.stride
            b = d_reg.base + d * d_reg.stride
            expected[b : b + d_reg.block_bytes] = source[a : a + s_reg.block_bytes]

    plan = plan_transfer(src, src_ids, dst, dst_ids)
    got = np.zeros(dst_size, dtype=np.uint8)
    for a, b, n in triples(plan):
        got[b : b + n] = source[a : a + n]
    np.testing.assert_array_equal(got, expected)
    assert plan.nbytes == len(dst_ids) * src.bytes_per_block
    assert plan.descriptors <= len(dst_ids) * len(src.regions)

    # No descriptor leaves its regions: every byte it covers is a block byte on its side
    # (never padding between blocks, a gap between regions, or outside the buffer).
    for layout, size, addrs in ((src, src_size, plan.src), (dst, dst_size, plan.dst)):
        mask = block_mask(layout, size)
        for addr, n in zip(addrs.tolist(), plan.lengths.tolist(), strict=True):
            assert addr + n <= size
            assert mask[addr : addr + n].all()


@settings(max_examples=200, deadline=None)
@given(transfer(), st.randoms(use_true_random=False))
def test_region_by_region_plans_together_copy_what_the_whole_plan_does(
    case: Case, rnd: Any
) -> None:
    """Streaming a transfer layer by layer: plans of any partition of the regions, applied in
    any order, write the same bytes as the whole plan, and only their regions' bytes."""
    src, src_ids, dst, dst_ids, src_size, dst_size = case
    source = np.random.default_rng(7).integers(1, 256, src_size, dtype=np.uint8)
    whole = np.zeros(dst_size, dtype=np.uint8)
    for a, b, n in triples(plan_transfer(src, src_ids, dst, dst_ids)):
        whole[b : b + n] = source[a : a + n]
    order = list(range(len(src.regions)))
    rnd.shuffle(order)
    cut = rnd.randint(0, len(order))
    got = np.zeros(dst_size, dtype=np.uint8)
    nbytes = 0
    for part in (order[:cut], order[cut:]):
        plan = plan_transfer(src, src_ids, dst, dst_ids, regions=part)
        nbytes += plan.nbytes
        for a, b, n in triples(plan):
            got[b : b + n] = source[a : a + n]
        # a part writes nothing outside its own regions' blocks on D
        mask = np.zeros(dst_size, dtype=np.bool_)
        for r in part:
            reg = dst.regions[r]
            for i in dst_ids:
                mask[reg.base + i * reg.stride : reg.base + i * reg.stride + reg.block_bytes] = True
        for b, n in zip(plan.dst.tolist(), plan.lengths.tolist(), strict=True):
            assert mask[b : b + n].all()
    np.testing.assert_array_equal(got, whole)
    assert nbytes == len(dst_ids) * src.bytes_per_block


# --------------------------------------------------------------------------- KV-cache groups

GroupCase = tuple[Layout, list[list[int]], Layout, list[list[int]], int, int]


@st.composite
def grouped_transfer(draw: st.DrawFn) -> GroupCase:
    """A transfer whose regions belong to up to three KV-cache groups, each with its own ids
    (D's possibly fewer: a prefix hit, a sliding window's tail; or none)."""
    block_bytes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=5))
    groups = tuple(draw(st.lists(st.integers(0, 2), min_size=len(block_bytes),
                                 max_size=len(block_bytes))))  # fmt: skip
    src, src_size = draw(side(block_bytes))
    dst, dst_size = draw(side(block_bytes))
    src = Layout(src.regions, (), groups)
    dst = Layout(dst.regions, (), groups)
    src_limit = min(r.num_blocks for r in src.regions)
    dst_limit = min(r.num_blocks for r in dst.regions)
    n_groups = max(groups) + 1
    src_ids = [draw(st.lists(st.integers(0, src_limit - 1), max_size=6)) for _ in range(n_groups)]
    dst_ids = []
    for g in range(draw(st.integers(0, n_groups))):
        n = draw(st.integers(0, min(len(src_ids[g]), dst_limit)))
        dst_ids.append(draw(st.lists(st.integers(0, dst_limit - 1), min_size=n, max_size=n,
                                     unique=True)))  # fmt: skip
    return src, src_ids, dst, dst_ids, src_size, dst_size


def naive_group_copy(case: GroupCase, source: np.ndarray, regions: list[int]) -> np.ndarray:
    src, src_ids, dst, dst_ids, _, dst_size = case
    out = np.zeros(dst_size, dtype=np.uint8)
    for r in regions:
        s_reg, d_reg, g = src.regions[r], dst.regions[r], src.groups[r]
        wanted = dst_ids[g] if g < len(dst_ids) else []
        sent = src_ids[g][len(src_ids[g]) - len(wanted) :]
        for s, d in zip(sent, wanted, strict=True):
            a = s_reg.base + s * s_reg.stride
            b = d_reg.base + d * d_reg.stride
            out[b : b + d_reg.block_bytes] = source[a : a + s_reg.block_bytes]
    return out


@settings(max_examples=300, deadline=None)
@given(grouped_transfer(), st.randoms(use_true_random=False))
def test_each_region_moves_its_groups_blocks_tail_aligned(case: GroupCase, rnd: Any) -> None:
    """Whole, and region by region in any partition: every region copies its group's last
    blocks into D's blocks of that group, exactly as a naive copy does, and nothing else."""
    src, src_ids, dst, dst_ids, src_size, dst_size = case
    source = np.random.default_rng(3).integers(1, 256, src_size, dtype=np.uint8)
    everything = list(range(len(src.regions)))
    order = everything[:]
    rnd.shuffle(order)
    cut = rnd.randint(0, len(order))
    for parts in ([None], [order[:cut], order[cut:]]):
        got = np.zeros(dst_size, dtype=np.uint8)
        expected = np.zeros(dst_size, dtype=np.uint8)
        for part in parts:
            plan = plan_transfer(src, src_ids, dst, dst_ids, regions=part)
            for a, b, n in triples(plan):
                got[b : b + n] = source[a : a + n]
            expected |= naive_group_copy(case, source, everything if part is None else part)
            covered = naive_group_copy(case, np.full(src_size, 1, np.uint8), part or everything)
            for b, n in zip(plan.dst.tolist(), plan.lengths.tolist(), strict=True):
                assert covered[b : b + n].all()  # only its regions' wanted blocks
        np.testing.assert_array_equal(got, expected)


def test_groups_must_match_and_name_the_group() -> None:
    two = Layout(stacked(0, 2, 8, 4).regions, (), (0, 1))
    one = stacked(1000, 2, 8, 4)
    with pytest.raises(LayoutMismatch, match="region 1 is in KV-cache group 1 on P but 0 on D"):
        plan_transfer(two, [[1], [2]], one, [[3], [4]])
    with pytest.raises(PlanError, match="4 blocks of KV-cache group 1 but P holds only 1"):
        plan_transfer(two, [[1, 2], [3]], two, [[1], [4, 5, 6, 7]])
    with pytest.raises(PlanError, match="blocks of 3 KV-cache groups but P names only 2"):
        plan_transfer(two, [[1], [3]], two, [[1], [4], [5]])
    with pytest.raises(PlanError, match="group 1, but the layout has 1 group"):
        plan_transfer(one, [[1], [3]], one, [[1], [4]])
    with pytest.raises(PlanError, match="mix integers and lists"):
        plan_transfer(one, [1, [3]], one, [[1]])  # type: ignore[list-item]


def test_flat_ids_are_the_one_group_and_a_missing_group_moves_nothing() -> None:
    layout = stacked(0, 2, 8, 4)
    assert triples(plan_transfer(layout, [1, 2], layout, [3, 4])) == triples(
        plan_transfer(layout, ((1, 2),), layout, ((3, 4),))
    )
    two = Layout(layout.regions, (), (0, 1))
    plan = plan_transfer(two, [[1], [2, 3]], two, [[5]])
    assert plan.nbytes == 4  # region 0's one block; group 1 (region 1) not asked for
    # D naming more groups than P, all empty beyond P's: nothing more to move
    assert plan_transfer(layout, [[1]], layout, [[2], []]).nbytes == 8


def test_regions_out_of_range_are_refused() -> None:
    src = stacked(0, 2, 10, 64)
    with pytest.raises(PlanError, match="regions"):
        plan_transfer(src, [1], src, [2], regions=[2])


# --------------------------------------------------------------------------- heterogeneous TP


def test_rank_heads_splits_and_replicates_like_vllm() -> None:
    assert [rank_heads(r, 2, 8) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [rank_heads(r, 4, 2) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert rank_heads(0, 1, 1) == range(0, 1)
    for bad in ((0, 3, 8), (0, 3, 2), (2, 2, 8), (0, 1, 0)):
        with pytest.raises(PlanError):
            rank_heads(*bad)


def test_tp_sources_both_ways() -> None:
    # P TP 2 -> D TP 1: D's one rank takes half its heads from each P rank.
    assert tp_sources(0, 1, 2, 4) == [(0, HeadSlice(2, 4, 0, 0, 2)), (1, HeadSlice(2, 4, 0, 2, 2))]
    # P TP 1 -> D TP 2: each D rank takes its half of P's heads.
    assert tp_sources(1, 2, 1, 4) == [(0, HeadSlice(4, 2, 2, 0, 2))]
    # P replicates (TP 4 over 2 heads): D's ranks spread over the replicas.
    assert tp_sources(0, 2, 4, 2) == [(0, HeadSlice(1, 1, 0, 0, 1))]
    assert tp_sources(1, 2, 4, 2) == [(3, HeadSlice(1, 1, 0, 0, 1))]


def test_a_head_slice_that_reaches_past_the_block_is_refused() -> None:
    lay = stacked(0x1000, 1, 4, 64)
    with pytest.raises(PlanError, match="reaches past"):
        plan_transfer(lay, [0], lay, [1], heads=HeadSlice(2, 2, 1, 0, 2))
    with pytest.raises(LayoutMismatch, match="per head"):
        plan_transfer(lay, [0], stacked(0x9000, 1, 4, 32), [1], heads=HeadSlice(2, 2, 0, 0, 1))


class _Memory:
    """Fake address spaces: each rank's KV buffer at an address of its own, and plans
    applied by copying bytes between them (what the engine would do)."""

    def __init__(self) -> None:
        self.buffers: list[tuple[int, np.ndarray[Any, Any]]] = []

    def add(self, nbytes: int, fill: np.ndarray[Any, Any] | None = None) -> tuple[int, Any]:
        base = (len(self.buffers) + 1) << 32
        buf = np.zeros(nbytes, np.uint8) if fill is None else fill
        self.buffers.append((base, buf))
        return base, buf

    def _at(self, addr: int, n: int) -> np.ndarray[Any, Any]:
        for base, buf in self.buffers:
            if base <= addr and addr + n <= base + len(buf):
                return buf[addr - base : addr - base + n]
        raise AssertionError(f"{n} bytes at {addr:#x} are outside every buffer")

    def apply(self, plan: TransferPlan) -> None:
        for s, d, n in triples(plan):
            self._at(d, n)[:] = self._at(s, n)


def _value(region: int, block: int, head: int, byte: np.ndarray[Any, Any]) -> Any:
    return ((region * 7 + block * 13 + head * 31 + byte) % 251 + 1).astype(np.uint8)


@settings(max_examples=300, deadline=None)
@given(
    total_heads=st.sampled_from([1, 2, 4, 8]),
    p_tp=st.sampled_from([1, 2, 4, 8]),
    d_tp=st.sampled_from([1, 2, 4, 8]),
    regions=st.integers(1, 3),
    num_blocks=st.integers(2, 6),
    head_bytes=st.sampled_from([4, 12, 32]),
    pad=st.sampled_from([0, 8]),
    data=st.data(),
)
def test_every_d_byte_comes_from_the_right_head_of_the_right_p_rank(
    total_heads: int,
    p_tp: int,
    d_tp: int,
    regions: int,
    num_blocks: int,
    head_bytes: int,
    pad: int,
    data: st.DataObject,
) -> None:
    """For any TP on each side (split or replicated heads): every destination byte of D's
    blocks holds the byte of the right head of the right P block, and nothing else of D's
    memory (other blocks, padding) is written."""
    n = data.draw(st.integers(1, num_blocks))
    src_ids = data.draw(st.permutations(range(num_blocks)))[:n]
    dst_ids = data.draw(st.permutations(range(num_blocks)))[:n]
    mem = _Memory()

    def layout(base: int, heads: int) -> Layout:
        block = heads * head_bytes
        stride = block + pad
        return Layout(
            tuple(
                BlockLayout(base + r * num_blocks * stride, num_blocks, block, stride)
                for r in range(regions)
            )
        )

    p_layouts = []
    for i in range(p_tp):
        mine = rank_heads(i, p_tp, total_heads)
        stride = len(mine) * head_bytes + pad
        kv = np.zeros((regions, num_blocks, stride), np.uint8)
        for r in range(regions):
            for b in range(num_blocks):
                for k, head in enumerate(mine):
                    at = k * head_bytes + np.arange(head_bytes)
                    kv[r, b, at] = _value(r, b, head, np.arange(head_bytes))
        base, _ = mem.add(kv.size, kv.ravel())
        p_layouts.append(layout(base, len(mine)))
    for j in range(d_tp):
        mine = rank_heads(j, d_tp, total_heads)
        base, buf = mem.add(regions * num_blocks * (len(mine) * head_bytes + pad))
        d_layout = layout(base, len(mine))
        sources = tp_sources(j, d_tp, p_tp, total_heads)
        assert sum(s.num_heads for _, s in sources) == len(mine)  # each head exactly once
        for p_rank, heads in sources:
            mem.apply(plan_transfer(p_layouts[p_rank], src_ids, d_layout, dst_ids, heads=heads))
        got = buf.reshape(regions, num_blocks, -1)
        expected = np.zeros_like(got)
        for r in range(regions):
            for s, d in zip(src_ids, dst_ids, strict=True):
                for k, head in enumerate(mine):
                    at = k * head_bytes + np.arange(head_bytes)
                    expected[r, d, at] = _value(r, s, head, np.arange(head_bytes))
        np.testing.assert_array_equal(got, expected)
