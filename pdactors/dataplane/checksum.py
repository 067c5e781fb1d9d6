"""KV checksums: what P hashes before a write and D recomputes over what landed.

The unit is one planned descriptor run, ``(dst, length)`` as :func:`~pdactors.core.plan.
plan_transfer` emits it (after coalescing): P hashes the source bytes of each run it hands
the data plane and sends ``(dst, length, digest)`` for every run in
:attr:`~pdactors.wire.PullDone.sums`; D hashes its destination range of each run. Runs, not
blocks: a run is exactly one range the engine moves, so a torn, short or misplaced engine write
shows in its run, and a coalesced transfer (the usual case: one run per region) costs one hash
call per run instead of one per block. The digest is xxh3-64 seeded with a hash of the transfer
id, so the sums of one transfer do not vouch for another's bytes.

Host memory only: the bytes are read by address (ctypes), in a worker thread, never on the trio
thread. Integrity, not authenticity: a peer that can compute xxh3 can forge the sums
(docs/security.md).

``sums`` on the wire: :data:`SUMS_HEADER` (8 bytes naming the algorithm), then little-endian
``uint64`` triples. ``b""`` means P sent no checksums (its ``checksum_kv`` is off, or the
transfer had more than :data:`~pdactors.wire.MAX_SUM_RUNS` runs).
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
import xxhash

from pdactors.core.plan import plan_transfer
from pdactors.dataplane.base import Addrs
from pdactors.wire import MAX_SUM_RUNS, BlockIds, Layout

__all__ = ["SUMS_HEADER", "check_landed", "locate", "pack_sums", "run_digests", "transfer_seed"]

#: The first 8 bytes of a non-empty ``PullDone.sums``: the algorithm, then a version.
SUMS_HEADER: Final = b"xxh3-64\x01"
_TRIPLE: Final = 24


def transfer_seed(transfer_id: str) -> int:
    """The xxh3 seed of ``transfer_id``'s sums (64 bits of its BLAKE2b)."""
    return int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=8).digest(), "little")


def run_digests(seed: int, addrs: Addrs, lengths: Addrs) -> npt.NDArray[np.uint64]:
    """xxh3-64 of ``lengths[i]`` bytes at local address ``addrs[i]``, each seeded with ``seed``.
    Blocking (reads memory at about 13 GB/s per core here); call it in a worker thread. The
    ranges must be readable host memory: the caller checks them."""
    out = np.empty(len(lengths), dtype=np.uint64)
    digest = xxhash.xxh3_64_intdigest
    for i, (addr, n) in enumerate(zip(addrs.tolist(), lengths.tolist(), strict=True)):
        out[i] = digest((ctypes.c_char * n).from_address(addr), seed)
    return out


def pack_sums(dst: Addrs, lengths: Addrs, digests: npt.NDArray[np.uint64]) -> bytes:
    """The runs' triples as the wire carries them (without :data:`SUMS_HEADER`)."""
    return np.stack([dst, lengths, digests], axis=1).astype("<u8").tobytes()


def _unpack(sums: bytes) -> npt.NDArray[np.uint64] | str:
    """``[runs, 3]`` (dst, length, digest), or why ``sums`` is malformed."""
    if not sums.startswith(SUMS_HEADER):
        return f"checksums of an unknown kind {bytes(sums[:8])!r}"
    body = len(sums) - len(SUMS_HEADER)
    if body % _TRIPLE or body // _TRIPLE > MAX_SUM_RUNS:
        return f"malformed checksums ({body} bytes)"
    return np.frombuffer(sums, dtype="<u8", offset=len(SUMS_HEADER)).reshape(-1, 3)


def locate(layout: Layout, addr: int) -> str:
    """Which region and block of ``layout`` hold ``addr``, in words (for a failure's reason)."""
    for r, reg in enumerate(layout.regions):
        block, offset = divmod(addr - reg.base, reg.stride)
        if addr >= reg.base and block < reg.num_blocks and offset < reg.block_bytes:
            name = f" {layout.names[r]!r}" if layout.names else ""
            return f"region {r}{name} block {block} (+{offset} bytes)"
    return f"address {addr:#x}, in no region"


def _pull_spans(layout: Layout, block_ids: BlockIds) -> npt.NDArray[np.uint64]:
    """The pull's destination bytes as sorted, disjoint ``[start, end)`` rows."""
    plan = plan_transfer(layout, block_ids, layout, block_ids)
    order = np.argsort(plan.dst, kind="stable")
    starts, ends = plan.dst[order], plan.dst[order] + plan.lengths[order]
    rows: list[list[int]] = []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        if rows and s <= rows[-1][1]:
            rows[-1][1] = max(rows[-1][1], e)
        else:
            rows.append([s, e])
    return np.array(rows, dtype=np.uint64).reshape(-1, 2)


def check_landed(
    transfer_id: str,
    parts: Sequence[tuple[str, bytes]],
    layout: Layout,
    block_ids: BlockIds,
) -> str | None:
    """Recompute each P worker's sums over D's memory: None when every run matches, else the
    reason, naming the transfer, the P worker and the first bad run's region and block.

    ``parts``: ``(P worker, sums)`` with non-empty sums. Every run is first checked to lie in
    the pull's own blocks (``block_ids`` in ``layout``), so a peer's numbers never make D read
    memory outside them. Blocking; call it in a worker thread."""
    spans = _pull_spans(layout, block_ids)
    seed = transfer_seed(transfer_id)
    for peer, sums in parts:
        runs = _unpack(sums)
        if isinstance(runs, str):
            return f"transfer {transfer_id}: P worker {peer} sent {runs}"
        dst, lengths, digests = runs[:, 0], runs[:, 1], runs[:, 2]
        row = np.searchsorted(spans[:, 0], dst, side="right").astype(np.int64) - 1
        inside = (row >= 0) & (dst + lengths <= spans[np.maximum(row, 0), 1]) & (lengths > 0)
        if not inside.all():
            i = int(np.flatnonzero(~inside)[0])
            return (f"transfer {transfer_id}: P worker {peer}'s checksum run {i} "
                    f"({int(lengths[i])} bytes at {locate(layout, int(dst[i]))}) is outside "
                    "the pull's blocks")  # fmt: skip
        bad = np.flatnonzero(run_digests(seed, dst, lengths) != digests)
        if len(bad):
            i = int(bad[0])
            return (f"KV checksum mismatch in transfer {transfer_id} from P worker {peer}: "
                    f"{len(bad)} of {len(digests)} runs differ, the first at "
                    f"{locate(layout, int(dst[i]))} ({int(lengths[i])} bytes)")  # fmt: skip
    return None
