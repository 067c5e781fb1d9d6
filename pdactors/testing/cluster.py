"""The standalone harness: a bootstrap, P senders and D receivers with real Mooncake engines.

No vLLM: each worker's KV cache is a numpy buffer ``[layers, num_blocks, block_bytes]`` (one
region per layer, registered with a real Mooncake engine over TCP on loopback), and a
:class:`BlockPool` plays vLLM's block manager. :func:`run_transfer` drives one request through
the actors exactly as the vLLM adapter does: P reports the prefill pending then ready, D pulls
into freshly allocated blocks, P frees its blocks when the sender releases them.

Tensor parallelism: an engine of ``tp`` workers (each with its own Mooncake engine, as vLLM's
worker processes have) shares one block pool, since vLLM's scheduler hands every worker the
same block ids; each worker's blocks hold its KV heads (:func:`~pdactors.core.plan.rank_heads`)
back to back, and P frees a transfer's blocks once every worker released them, as vLLM's
scheduler does with ``finished_sending``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import trio
from msgspec.structs import replace

from pdactors.actors.bootstrap import serve_bootstrap
from pdactors.actors.receiver import Receiver, serve_receiver
from pdactors.actors.sender import Sender, serve_sender
from pdactors.config import (
    BootstrapConfig,
    DataPlaneConfig,
    RankInfo,
    ReceiverConfig,
    SenderConfig,
)
from pdactors.core.plan import rank_heads
from pdactors.dataplane import DataPlane, RunHasher, open_mooncake
from pdactors.errors import PdError
from pdactors.testing.kv import BlockPool, KVBuffer
from pdactors.testing.memory_dataplane import MemoryFabric
from pdactors.transport import ZMQ, Transport
from pdactors.wire import Compat

__all__ = [
    "Cluster",
    "DecodeNode",
    "PrefillNode",
    "TransferOutcome",
    "open_cluster",
    "run_transfer",
]


@dataclass
class PrefillNode:
    """One P worker. The workers of one engine share ``pool``, ``owned`` and ``releases``."""

    engine_id: str
    sender: Sender
    kv: KVBuffer
    pool: BlockPool
    dataplane: DataPlane
    owned: dict[str, list[int]] = field(default_factory=dict)
    tp_rank: int = 0
    tp_size: int = 1
    releases: Counter[str] = field(default_factory=Counter)
    pp_rank: int = 0
    pp_size: int = 1

    async def free_released(self) -> None:
        """Free P's blocks as the senders release them (vLLM's ``finished_sending``: once
        every worker of the engine has)."""
        while True:
            for tid in await self.sender.wait_finished():
                self.releases[tid] += 1
                if self.releases[tid] == self.tp_size * self.pp_size:
                    del self.releases[tid]
                    self.pool.free(self.owned.pop(tid))


@dataclass
class DecodeNode:
    """One D worker. The workers of one engine share ``pool``."""

    engine_id: str
    receiver: Receiver
    kv: KVBuffer
    pool: BlockPool
    dataplane: DataPlane
    tp_rank: int = 0
    tp_size: int = 1


@dataclass
class Cluster:
    bootstrap_url: str
    prefill: list[PrefillNode]
    decode: list[DecodeNode]

    @property
    def pools(self) -> list[BlockPool]:
        nodes: list[PrefillNode | DecodeNode] = [*self.prefill, *self.decode]
        return list({id(n.pool): n.pool for n in nodes}.values())

    def prefill_workers(self, engine: int) -> list[PrefillNode]:
        """The workers of P engine ``engine`` (by index), in TP rank order."""
        return [n for n in self.prefill if n.engine_id == f"prefill-{engine}"]

    def decode_workers(self, engine: int) -> list[DecodeNode]:
        """The workers of D engine ``engine`` (by index), in TP rank order."""
        return [n for n in self.decode if n.engine_id == f"decode-{engine}"]

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
    transport: Transport | Callable[[str, int], Transport] = ZMQ,
    p_tp: int = 1,
    d_tp: int = 1,
    kv_heads: int = 0,
    p_pp: int = 1,
    bootstrap_token: str | None = None,
    fabric: MemoryFabric | None = None,
    compat: Callable[[str, int], Compat | None] | None = None,
    p_bootstrap: Callable[[str], str] | None = None,
    hasher: Callable[[str, KVBuffer], RunHasher] | None = None,
) -> AsyncIterator[Cluster]:
    """Start a bootstrap, ``prefill`` P engines of ``p_tp`` workers (P engine ``e`` is DP rank
    ``e`` there) and ``decode`` D engines of ``d_tp`` workers, each worker with its own
    Mooncake engine and KV buffer; stop them all on exit.

    ``block_bytes`` is one layer's block of the whole model: ``kv_heads`` KV heads (0: TP sizes
    are equal and heads do not matter) split over each engine's workers as vLLM splits them.
    ``bootstrap_token``: the bootstrap asks for it (give it to ``sender`` and ``receiver``).
    ``p_pp``: P's pipeline stages (each TP rank of each holds ``layers / p_pp`` layers; D
    holds them all and pulls from every stage).
    ``sender`` / ``receiver`` give the other settings (their engine ids, ranks, head count and
    bootstrap URL are filled in here). ``wrap_prefill`` wraps P's real data planes (fault
    injection); ``transport`` is every actor's side channel (a memory transport, a faulty
    wrapper, ...), or a function of the role (``"prefill"`` / ``"decode"``) and engine index
    that gives each engine its own (per-engine CURVE keys).
    ``fabric``: every worker's data plane is an in-process one on it instead of a Mooncake
    engine (no engine threads: the autojump clock then sees every wait).
    ``compat``: each engine's compatibility description, a function of the role and engine
    index as for ``transport`` (None: the one in ``sender`` / ``receiver``).
    ``p_bootstrap``: the URL P's senders register at, a function of the bootstrap's (e.g. a
    forwarder that can be cut, to stop their lease renewals); D looks P up at the bootstrap.
    ``hasher``: each worker's KV checksum hasher, a function of the role and the worker's KV
    buffer (None: the default, xxh3 of host memory).
    """
    dp_config = dataplane or DataPlaneConfig()
    s_config = sender or SenderConfig(engine_id="prefill")
    r_config = receiver or ReceiverConfig()
    total = kv_heads or 1
    if not kv_heads and p_tp != d_tp:
        raise ValueError("P and D of different TP sizes need kv_heads")
    if layers % p_pp:
        raise ValueError(f"{layers} layers do not split into {p_pp} pipeline stages")
    shapes = [("prefill", e, p_tp, p_pp) for e in range(prefill)]
    shapes += [("decode", e, d_tp, 1) for e in range(decode)]
    async with AsyncExitStack() as stack:
        planes: list[DataPlane] = [
            fabric.open() if fabric else await stack.enter_async_context(open_mooncake(dp_config))
            for _, _, tp, pp in shapes
            for _ in range(tp * pp)
        ]
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_bootstrap, BootstrapConfig(token=bootstrap_token))
            p_nodes: list[PrefillNode] = []
            d_nodes: list[DecodeNode] = []
            worker_planes = iter(planes)
            for role, e, tp, pp in shapes:
                engine_id = f"{role}-{e}"
                side = transport(role, e) if callable(transport) else transport
                own = (s_config if role == "prefill" else r_config).compat
                described = compat(role, e) if compat is not None else own
                pool, owned, releases = (
                    BlockPool(num_blocks),
                    dict[str, list[int]](),
                    Counter[str](),
                )
                for stage, rank in itertools.product(range(pp), range(tp)):
                    plane = next(worker_planes)
                    heads = rank_heads(rank, tp, total) if kv_heads else range(1)
                    local = block_bytes * len(heads) // total if kv_heads else block_bytes
                    kv = KVBuffer(
                        layers // pp,
                        num_blocks,
                        local,
                        heads=heads,
                        total_heads=total,
                        first_layer=stage * layers // pp,
                    )
                    plane.register(kv.regions)
                    # P engine e registers as DP rank e of the one bootstrap (one entry each)
                    ranks = RankInfo(
                        dp_rank=e if role == "prefill" else 0,
                        tp_rank=rank,
                        tp_size=tp,
                        pp_rank=stage,
                        pp_size=pp,
                    )
                    sums = hasher(role, kv) if hasher is not None else None
                    if role == "prefill":
                        config = replace(
                            s_config,
                            engine_id=engine_id,
                            bootstrap_url=p_bootstrap(url) if p_bootstrap else url,
                            ranks=ranks,
                            kv_heads=kv_heads,
                            compat=described,
                        )
                        wrapped = wrap_prefill(plane) if wrap_prefill else plane
                        snd = await nursery.start(
                            partial(serve_sender, transport=side, hasher=sums),
                            config,
                            wrapped,
                            kv.layout,
                        )
                        node = PrefillNode(
                            engine_id, snd, kv, pool, plane, owned, rank, tp, releases, stage, pp
                        )
                        nursery.start_soon(node.free_released)
                        p_nodes.append(node)
                    else:
                        rcv = await nursery.start(
                            partial(serve_receiver, transport=side, hasher=sums),
                            replace(
                                r_config,
                                engine_id=engine_id,
                                ranks=ranks,
                                kv_heads=kv_heads,
                                trusted_bootstraps=(*r_config.trusted_bootstraps, url),
                                compat=described,
                            ),
                            plane,
                            kv.layout,
                        )
                        d_nodes.append(DecodeNode(engine_id, rcv, kv, pool, plane, rank, tp))
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
    """Move one request's KV from P engine ``p`` to D engine ``d`` through the actors (every
    worker of each) and verify it on D, head by head.

    ``d_blocks`` (≤ ``num_blocks``) pulls only the last blocks, as a D with a prefix-cache hit
    does. D's blocks are freed when every worker's pull has ended, whatever the outcome.
    Checkpoint.
    """
    p_workers, d_workers = cluster.prefill_workers(p), cluster.decode_workers(d)
    pnode = p_workers[0]
    src = pnode.pool.allocate(num_blocks)
    pnode.owned[transfer_id] = src
    for p_worker in p_workers:
        p_worker.kv.fill(transfer_id, src)
        p_worker.sender.transfer_pending(transfer_id)
        p_worker.sender.transfer_ready(transfer_id, src)
    dst = d_workers[0].pool.allocate(num_blocks if d_blocks is None else d_blocks)
    errors: dict[int, str] = {}

    async def pull(worker: DecodeNode) -> None:
        try:
            await worker.receiver.pull(
                transfer_id,
                bootstrap_url=cluster.bootstrap_url,
                engine_id=pnode.engine_id,
                block_ids=dst,
            )
        except PdError as exc:
            errors[worker.tp_rank] = getattr(exc, "reason", str(exc))

    start = trio.current_time()
    try:
        async with trio.open_nursery() as nursery:  # each pull ends on its own
            for worker in d_workers:
                nursery.start_soon(pull, worker)
        seconds = trio.current_time() - start
        if errors:
            reason = "; ".join(f"D rank {r}: {why}" for r, why in sorted(errors.items()))
            return TransferOutcome(transfer_id, False, reason, 0, seconds, False)
        verified = all(w.kv.verify(transfer_id, dst, num_blocks) for w in d_workers)
        nbytes = len(dst) * sum(w.kv.layout.bytes_per_block for w in d_workers)
        return TransferOutcome(transfer_id, True, "", nbytes, seconds, verified)
    finally:
        d_workers[0].pool.free(dst)
