"""One harness worker — a P sender or a D receiver, with its own Mooncake engine and KV — in a
process of its own, driven over stdin and stdout by :mod:`pdactors.testing.process_cluster`.

``python -m pdactors.testing.kv_worker`` keeps the KV in host memory (a :class:`KVBuffer`);
``python -m pdactors_vllm.device_kv`` runs the same loop with the KV in a CUDA tensor (torch is
imported there, never in ``pdactors``). The first line on stdin is a :class:`WorkerSpec`; the
worker answers :class:`Hello` once it serves (or with ``error`` set, and exits 2, when its KV
device is not there), then reads one command per line (:mod:`pdactors.testing.worker_wire`):

* :class:`Ready`: P's prefill of a transfer is done: fill its blocks with the transfer's
  pattern and hand them to the sender; answers :class:`Readied`.
* :class:`Pull`: D pulls a transfer into its blocks, then checks every byte; answers
  :class:`Pulled` with the pull's start and end on the machine's monotonic clock (the same
  clock in every process of one machine).
* :class:`Stats`: answers :class:`Counts`.

A P worker also says :class:`Released` when its sender lets a transfer's blocks go (vLLM's
``finished_sending``). It runs until stdin closes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial

import msgspec
import trio

from pdactors.actors.receiver import Receiver, serve_receiver
from pdactors.actors.sender import Sender, serve_sender
from pdactors.config import RankInfo, ReceiverConfig, SenderConfig
from pdactors.dataplane import RunHasher, open_mooncake
from pdactors.errors import PdError
from pdactors.testing.kv import KVBuffer, KVDeviceUnavailable, KVMemory
from pdactors.testing.worker_wire import (
    Command,
    Counts,
    Hello,
    Pull,
    Pulled,
    Readied,
    Ready,
    Released,
    Reply,
    Stats,
    WorkerSpec,
)
from pdactors.transport import ZMQ, Transport, ZmqTransport
from pdactors.transport.curve import curve_from_secret

__all__ = ["KVPlace", "host_kv", "main"]


#: Makes a worker's KV and its checksum hasher (None: the default, xxh3 of host memory).
#: Raises :class:`KVDeviceUnavailable` when the spec's device is not there.
KVPlace = Callable[[WorkerSpec], tuple[KVMemory, RunHasher | None]]


def host_kv(spec: WorkerSpec) -> tuple[KVMemory, RunHasher | None]:
    """The KV in host memory (a :class:`KVBuffer`), hashed by the default hasher."""
    if spec.kv_device != "cpu":
        raise KVDeviceUnavailable(f"this worker keeps KV in host memory, not {spec.kv_device}")
    kv = KVBuffer(
        spec.layers,
        spec.num_blocks,
        spec.local_block_bytes,
        heads=spec.heads,
        total_heads=spec.kv_heads or 1,
    )
    return kv, None


def _say(reply: Reply) -> None:
    sys.stdout.buffer.write(msgspec.json.encode(reply) + b"\n")
    sys.stdout.buffer.flush()


def _transport(spec: WorkerSpec) -> Transport:
    return ZmqTransport(*curve_from_secret(spec.secret)) if spec.secret else ZMQ


def _ranks(spec: WorkerSpec) -> RankInfo:
    return RankInfo(tp_rank=spec.tp_rank, tp_size=spec.tp_size)


async def _serve(spec: WorkerSpec, kv: KVMemory, hasher: RunHasher | None) -> None:
    decode_command = msgspec.json.Decoder(Command)
    async with open_mooncake(spec.dataplane) as plane, trio.open_nursery() as nursery:
        plane.register(kv.regions)
        sender: Sender | None = None
        receiver: Receiver | None = None
        if spec.role == "prefill":
            config = SenderConfig(
                engine_id=spec.engine_id,
                bootstrap_url=spec.bootstrap_url,
                ranks=_ranks(spec),
                kv_heads=spec.kv_heads,
                checksum_kv=spec.checksums,
            )
            serve = partial(serve_sender, transport=_transport(spec), hasher=hasher)
            sender = await nursery.start(serve, config, plane, kv.layout)
            nursery.start_soon(_tell_released, sender)
        else:
            config_d = ReceiverConfig(
                engine_id=spec.engine_id,
                ranks=_ranks(spec),
                kv_heads=spec.kv_heads,
                trusted_bootstraps=(spec.bootstrap_url,),
                verify_kv="on" if spec.checksums else "off",
            )
            serve_d = partial(serve_receiver, transport=_transport(spec), hasher=hasher)
            receiver = await nursery.start(serve_d, config_d, plane, kv.layout)
        _say(Hello(session=plane.session))
        async for line in trio.wrap_file(sys.stdin):
            match decode_command.decode(line):
                case Ready(tid, blocks) if sender is not None:
                    _say(_ready(sender, kv, tid, blocks))
                case Pull() as pull if receiver is not None:
                    nursery.start_soon(_pull, spec, receiver, kv, pull)
                case Stats():
                    _say(Counts(sender.descriptors_sent if sender is not None else 0))
                case other:
                    raise PdError(f"a {spec.role} worker got {other!r}")
        nursery.cancel_scope.cancel()


def _ready(sender: Sender, kv: KVMemory, tid: str, blocks: list[int]) -> Readied:
    kv.fill(tid, blocks)
    try:
        sender.transfer_pending(tid)
        sender.transfer_ready(tid, blocks)
    except PdError as exc:  # refused (a duplicate id): the coordinator fails the transfer
        return Readied(tid, error=str(exc))
    return Readied(tid)


async def _tell_released(sender: Sender) -> None:
    while True:
        _say(Released(sorted(await sender.wait_finished())))


async def _pull(spec: WorkerSpec, receiver: Receiver, kv: KVMemory, pull: Pull) -> None:
    start = time.monotonic()
    try:
        await receiver.pull(
            pull.transfer_id,
            bootstrap_url=spec.bootstrap_url,
            engine_id=pull.engine_id,
            block_ids=pull.blocks,
        )
        ok, reason = True, ""
    except PdError as exc:
        ok, reason = False, getattr(exc, "reason", str(exc))
    end = time.monotonic()
    verified = ok and kv.verify(pull.transfer_id, pull.blocks, pull.src_count)
    nbytes = len(pull.blocks) * kv.layout.bytes_per_block if ok else 0
    _say(Pulled(pull.transfer_id, ok, reason, verified, nbytes, start, end))


def main(place: KVPlace = host_kv) -> None:
    """Read the spec, make the KV where ``place`` puts it, serve. Exits 2 (after a
    :class:`Hello` with the reason) when the KV device is not there."""
    spec = msgspec.json.decode(sys.stdin.buffer.readline(), type=WorkerSpec)
    try:
        kv, hasher = place(spec)
    except KVDeviceUnavailable as exc:
        _say(Hello(error=str(exc)))
        raise SystemExit(2) from None
    trio.run(_serve, spec, kv, hasher)


if __name__ == "__main__":
    main()
