"""The standalone harness: a bootstrap, P senders and D receivers with real Mooncake engines.

No vLLM: each engine's KV cache is a numpy buffer ``[layers, num_blocks, block_bytes]`` (one
region per layer, registered with a real Mooncake engine over TCP on loopback), and a
:class:`BlockPool` plays vLLM's block manager. :func:`run_transfer` drives one request through
the actors exactly as the vLLM adapter does: P reports the prefill pending then ready, D pulls
into freshly allocated blocks, P frees its blocks when the sender releases them.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import numpy.typing as npt
import trio
from msgspec.structs import replace

from pdactors._pulse import Pulse
from pdactors.actors.bootstrap import serve_bootstrap
from pdactors.actors.receiver import Receiver, serve_receiver
from pdactors.actors.sender import Sender, serve_sender
from pdactors.config import BootstrapConfig, DataPlaneConfig, ReceiverConfig, SenderConfig
from pdactors.core.plan import packed_layout
from pdactors.dataplane import DataPlane, open_mooncake
from pdactors.errors import PdError
from pdactors.transport import ZMQ, Transport

__all__ = [
    "BlockPool",
    "Cluster",
    "DecodeNode",
    "KVBuffer",
    "PrefillNode",
    "TransferOutcome",
    "open_cluster",
    "run_transfer",
]


class BlockPool:
    """A free list of block ids, like vLLM's block pool; double frees raise."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()
        self._freed = Pulse()

    @property
    def in_use(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks. Raises :class:`PdError` when fewer are free."""
        if n > len(self._free):
            raise PdError(f"out of KV blocks: want {n}, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise PdError(f"block {i} freed twice")
            self._used.remove(i)
            self._free.append(i)
        self._freed.fire()

    async def wait_empty(self) -> None:
        """Wait until no block is allocated. Checkpoint."""
        while self._used:
            await self._freed.wait()
        await trio.lowlevel.checkpoint()


class KVBuffer:
    """One engine's KV cache: ``layers`` regions of ``num_blocks`` blocks of ``block_bytes``."""

    def __init__(self, layers: int, num_blocks: int, block_bytes: int) -> None:
        self.data: npt.NDArray[np.uint8] = np.zeros((layers, num_blocks, block_bytes), np.uint8)
        self.layout = packed_layout(self.data.ctypes.data, layers, num_blocks, block_bytes)

    @property
    def regions(self) -> list[tuple[int, int]]:
        return [(self.data.ctypes.data, self.data.nbytes)]

    def expected(self, transfer_id: str, count: int) -> npt.NDArray[np.uint8]:
        """The bytes P writes for ``transfer_id``: ``[layers, count, block_bytes]``.

        Each block holds a byte ramp shifted by an offset unique to (request, layer, block), so
        a misplaced, shifted or missing block is caught.
        """
        layers, _, block_bytes = self.data.shape
        seed = int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=4).digest())
        ramp = np.arange(block_bytes, dtype=np.uint8)
        offsets = (seed + np.arange(layers * count, dtype=np.uint64) * 40503) % 251
        return ramp[None, None, :] + offsets.astype(np.uint8).reshape(layers, count, 1)

    def fill(self, transfer_id: str, blocks: list[int]) -> None:
        self.data[:, blocks, :] = self.expected(transfer_id, len(blocks))

    def verify(self, transfer_id: str, blocks: list[int], src_count: int) -> bool:
        """True when ``blocks`` hold the last ``len(blocks)`` of P's ``src_count`` blocks."""
        want = self.expected(transfer_id, src_count)[:, src_count - len(blocks) :, :]
        return bool(np.array_equal(self.data[:, blocks, :], want))


@dataclass
class PrefillNode:
    engine_id: str
    sender: Sender
    kv: KVBuffer
    pool: BlockPool
    dataplane: DataPlane
    owned: dict[str, list[int]] = field(default_factory=dict)

    async def free_released(self) -> None:
        """Free P's blocks as the sender releases them (vLLM's ``finished_sending``)."""
        while True:
            for tid in await self.sender.wait_finished():
                self.pool.free(self.owned.pop(tid))


@dataclass
class DecodeNode:
    engine_id: str
    receiver: Receiver
    kv: KVBuffer
    pool: BlockPool
    dataplane: DataPlane


@dataclass
class Cluster:
    bootstrap_url: str
    prefill: list[PrefillNode]
    decode: list[DecodeNode]

    @property
    def pools(self) -> list[BlockPool]:
        return [n.pool for n in self.prefill] + [n.pool for n in self.decode]

    def blocks_in_use(self) -> int:
        """Blocks allocated anywhere in the cluster (0 once every transfer ended)."""
        return sum(pool.in_use for pool in self.pools)

    async def wait_settled(self) -> None:
        """Wait until every block is back in its pool. Checkpoint.

        Meant for when no new transfer starts: P's blocks come back as its sender releases them.
        """
        for pool in self.pools:
            await pool.wait_empty()


DataPlaneWrapper = Callable[[DataPlane], DataPlane]


@asynccontextmanager
async def open_cluster(
    *,
    prefill: int = 1,
    decode: int = 1,
    layers: int = 4,
    num_blocks: int = 64,
    block_bytes: int = 4096,
    dataplane: DataPlaneConfig | None = None,
    sender: SenderConfig | None = None,
    receiver: ReceiverConfig | None = None,
    wrap_prefill: DataPlaneWrapper | None = None,
    transport: Transport = ZMQ,
) -> AsyncIterator[Cluster]:
    """Start a bootstrap, ``prefill`` senders and ``decode`` receivers, each with its own
    Mooncake engine and KV buffer; stop them all on exit.

    ``sender`` / ``receiver`` give the other settings (their engine ids, ranks and bootstrap
    URL are filled in here). ``wrap_prefill`` wraps P's real data plane (fault injection);
    ``transport`` is every actor's side channel (a memory transport, a faulty wrapper, ...).
    """
    dp_config = dataplane or DataPlaneConfig()
    s_config = sender or SenderConfig(engine_id="prefill")
    r_config = receiver or ReceiverConfig()
    async with AsyncExitStack() as stack:
        planes = [
            await stack.enter_async_context(open_mooncake(dp_config))
            for _ in range(prefill + decode)
        ]
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_bootstrap, BootstrapConfig())
            p_nodes: list[PrefillNode] = []
            d_nodes: list[DecodeNode] = []
            for i, plane in enumerate(planes):
                kv = KVBuffer(layers, num_blocks, block_bytes)
                plane.register(kv.regions)
                if i < prefill:
                    engine_id = f"prefill-{i}"
                    config = replace(s_config, engine_id=engine_id, bootstrap_url=url)
                    wrapped = wrap_prefill(plane) if wrap_prefill else plane
                    snd = await nursery.start(
                        partial(serve_sender, transport=transport), config, wrapped, kv.layout
                    )
                    node = PrefillNode(engine_id, snd, kv, BlockPool(num_blocks), plane)
                    nursery.start_soon(node.free_released)
                    p_nodes.append(node)
                else:
                    engine_id = f"decode-{i - prefill}"
                    rcv = await nursery.start(
                        partial(serve_receiver, transport=transport),
                        replace(r_config, engine_id=engine_id),
                        plane,
                        kv.layout,
                    )
                    d_nodes.append(DecodeNode(engine_id, rcv, kv, BlockPool(num_blocks), plane))
            try:
                yield Cluster(url, p_nodes, d_nodes)
            finally:
                nursery.cancel_scope.cancel()


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    transfer_id: str
    ok: bool
    reason: str
    nbytes: int
    seconds: float
    verified: bool


async def run_transfer(
    cluster: Cluster,
    transfer_id: str,
    num_blocks: int,
    *,
    p: int = 0,
    d: int = 0,
    d_blocks: int | None = None,
) -> TransferOutcome:
    """Move one request's KV from P ``p`` to D ``d`` through the actors and verify it on D.

    ``d_blocks`` (≤ ``num_blocks``) pulls only the last blocks, as a D with a prefix-cache hit
    does. D's blocks are freed when the pull ends, whatever the outcome. Checkpoint.
    """
    pnode, dnode = cluster.prefill[p], cluster.decode[d]
    src = pnode.pool.allocate(num_blocks)
    pnode.owned[transfer_id] = src
    pnode.kv.fill(transfer_id, src)
    pnode.sender.transfer_pending(transfer_id)
    pnode.sender.transfer_ready(transfer_id, src)
    dst = dnode.pool.allocate(num_blocks if d_blocks is None else d_blocks)
    start = trio.current_time()
    try:
        await dnode.receiver.pull(
            transfer_id,
            bootstrap_url=cluster.bootstrap_url,
            engine_id=pnode.engine_id,
            block_ids=dst,
        )
    except PdError as exc:
        reason = getattr(exc, "reason", str(exc))
        return TransferOutcome(transfer_id, False, reason, 0, trio.current_time() - start, False)
    else:
        seconds = trio.current_time() - start
        verified = dnode.kv.verify(transfer_id, dst, num_blocks)
        nbytes = len(dst) * dnode.kv.layout.bytes_per_block
        return TransferOutcome(transfer_id, True, "", nbytes, seconds, verified)
    finally:
        dnode.pool.free(dst)
