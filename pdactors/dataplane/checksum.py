"""KV checksums: what P hashes before a write and D recomputes over what landed.

The unit is one planned descriptor run, ``(dst, length)`` as :func:`~pdactors.core.plan.
plan_transfer` emits it (after coalescing): P hashes the source bytes of each run it hands
the data plane and sends ``(dst, length, digest)`` for every run in
:attr:`~pdactors.wire.PullDone.sums`; D hashes its destination range of each run. Runs, not
blocks: a run is exactly one range the engine moves, so a torn, short or misplaced engine write
shows in its run, and a coalesced transfer (the usual case: one run per region) costs one hash
call per run instead of one per block. The digest is xxh3-64 seeded with a hash of the transfer
id, so the sums of one transfer do not vouch for another's bytes.

Who computes the digests is a :class:`RunHasher`, given to the sender and the receiver: by
default :class:`Xxh3Hasher`, which reads host memory by address (ctypes). KV on a GPU needs a
hasher that runs where the bytes are; the vLLM adapter brings one
(``pdactors_vllm.device_sums``: torch ops on the KV tensors' own device, header
``wmix-64\x01``). The library never imports torch: a hasher is a header and a blocking
function, called in a worker thread, never on the trio thread. Integrity, not authenticity: a
peer that can compute the hash can forge the sums (docs/security.md).

``sums`` on the wire: the hasher's 8-byte header (the algorithm's name, then a version byte;
:data:`SUMS_HEADER` for xxh3), then little-endian ``uint64`` triples. ``b""`` means P sent no
checksums (its ``checksum_kv`` is off, or the transfer had more than
:data:`~pdactors.wire.MAX_SUM_RUNS` runs). A D whose hasher has another header cannot
recompute them: :func:`sums_kind` names them for its policy (``verify_kv``).
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Sequence
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt
import xxhash

from pdactors.core.plan import plan_transfer
from pdactors.dataplane.base import Addrs
from pdactors.wire import MAX_SUM_RUNS, BlockIds, Layout

__all__ = [
    "SUMS_HEADER",
    "RunHasher",
    "Xxh3Hasher",
    "check_landed",
    "locate",
    "pack_sums",
    "run_digests",
    "sums_kind",
    "transfer_seed",
]

#: The first 8 bytes of a non-empty ``PullDone.sums`` of xxh3: the algorithm, then a version.
SUMS_HEADER: Final = b"xxh3-64\x01"
#: The length of every hasher's header.
HEADER_BYTES: Final = 8
_TRIPLE: Final = 24


class RunHasher(Protocol):
    """What hashes KV runs where their bytes are: P's writes hash their source runs with it,
    D's check its destination runs. Both sides of a transfer must use the same algorithm
    (the header says which)."""

    @property
    def header(self) -> bytes:
        """8 bytes that start the sums: the algorithm's name, then a version byte."""
        ...

    def digests(self, seed: int, addrs: Addrs, lengths: Addrs) -> npt.NDArray[np.uint64]:
        """A 64-bit digest of each run of ``lengths[i]`` bytes at local address ``addrs[i]``,
        bound to ``seed`` (:func:`transfer_seed`). Blocking: called in a worker thread, after
        the bytes are complete (P: after the write's ``before``; D: after the write landed).
        The caller checks that the ranges are its own KV memory. Raises what it raises: the
        caller fails that transfer."""
        ...


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


class Xxh3Hasher:
    """xxh3-64 of host memory read by address (:func:`run_digests`): the default hasher."""

    header: Final = SUMS_HEADER

    def digests(self, seed: int, addrs: Addrs, lengths: Addrs) -> npt.NDArray[np.uint64]:
        return run_digests(seed, addrs, lengths)


def sums_kind(sums: bytes) -> str:
    """The algorithm that ``sums`` names, in words (for a reason or a log line):
    ``'xxh3-64' v1``. The bytes are a peer's: shown escaped, never trusted."""
    head = bytes(sums[:HEADER_BYTES])
    if len(head) < HEADER_BYTES:
        return f"{head!r} (too short for a header)"
    name = head[:-1].rstrip(b"\0").decode("ascii", "backslashreplace")
    return f"{name!r} v{head[-1]}"


def pack_sums(dst: Addrs, lengths: Addrs, digests: npt.NDArray[np.uint64]) -> bytes:
    """The runs' triples as the wire carries them (without :data:`SUMS_HEADER`)."""
    return np.stack([dst, lengths, digests], axis=1).astype("<u8").tobytes()


def _unpack(sums: bytes, header: bytes) -> npt.NDArray[np.uint64] | str:
    """``[runs, 3]`` (dst, length, digest), or why ``sums`` is malformed or of another kind
    than ``header``'s."""
    if not sums.startswith(header):
        return f"checksums of kind {sums_kind(sums)}, which this D cannot compute"
    body = len(sums) - len(header)
    if body % _TRIPLE or body // _TRIPLE > MAX_SUM_RUNS:
        return f"malformed checksums ({body} bytes)"
    return np.frombuffer(sums, dtype="<u8", offset=len(header)).reshape(-1, 3)


_XXH3: Final = Xxh3Hasher()


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
    hasher: RunHasher | None = None,
) -> str | None:
    """Recompute each P worker's sums over D's memory with ``hasher`` (default
    :class:`Xxh3Hasher`): None when every run matches, else the reason, naming the transfer,
    the P worker and the first bad run's region and block.

    ``parts``: ``(P worker, sums)`` with non-empty sums; sums of another kind than the
    hasher's are a reason too (the caller sorts those out first when its policy trusts them).
    Every run is first checked to lie in the pull's own blocks (``block_ids`` in ``layout``),
    so a peer's numbers never make D read memory outside them. Blocking; call it in a worker
    thread. Raises what the hasher raises."""
    hasher = hasher or _XXH3
    spans = _pull_spans(layout, block_ids)
    seed = transfer_seed(transfer_id)
    for peer, sums in parts:
        runs = _unpack(sums, hasher.header)
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
        bad = np.flatnonzero(hasher.digests(seed, dst, lengths) != digests)
        if len(bad):
            i = int(bad[0])
            return (f"KV checksum mismatch in transfer {transfer_id} from P worker {peer}: "
                    f"{len(bad)} of {len(digests)} runs differ, the first at "
                    f"{locate(layout, int(dst[i]))} ({int(lengths[i])} bytes)")  # fmt: skip
    return None
