"""A P worker in a process of its own, for tests that kill or stop it (and for ``chaos``).

``python -m pdactors.testing.prefill_process --bootstrap URL --engine-id ID`` starts a Mooncake
engine over TCP on loopback, a KV buffer like the harness's, and a sender registered with the
bootstrap; prints one JSON line ``{"address": ..., "session": ...}`` once it serves; then reads
commands from stdin, one per line:

* ``ready TID N``: P's prefill of ``TID`` is done: N blocks are filled and handed to the sender;
* ``drop TID``: P's prefill of ``TID`` ended without its KV;
* ``failwrite N``: the next N writes fail (an injected engine error);
* ``stats``: print ``{"in_use": blocks held}`` as one JSON line.

Blocks come back to the pool as the sender releases them. It runs until killed or stdin closes.
"""

from __future__ import annotations

import argparse
import json
import sys

import trio

from pdactors.actors.sender import serve_sender
from pdactors.config import DataPlaneConfig, SenderConfig
from pdactors.dataplane import open_mooncake
from pdactors.errors import PdError
from pdactors.testing.cluster import BlockPool, KVBuffer, PrefillNode
from pdactors.testing.faults import FaultyDataPlane


async def _serve(args: argparse.Namespace) -> None:
    config = SenderConfig(
        engine_id=args.engine_id,
        bootstrap_url=args.bootstrap,
        port=args.port,
        unclaimed_ttl=args.unclaimed_ttl,
    )
    async with open_mooncake(DataPlaneConfig()) as plane, trio.open_nursery() as nursery:
        kv = KVBuffer(args.layers, args.blocks, args.block_bytes)
        plane.register(kv.regions)
        faulty = FaultyDataPlane(plane)
        sender = await nursery.start(serve_sender, config, faulty, kv.layout)
        node = PrefillNode(args.engine_id, sender, kv, BlockPool(args.blocks), plane)
        nursery.start_soon(node.free_released)
        print(json.dumps({"address": sender.address, "session": plane.session}), flush=True)
        stdin = trio.wrap_file(sys.stdin)
        async for line in stdin:
            try:
                _command(line, node, faulty)
            except PdError as exc:  # a refused command is reported; P keeps serving
                print(f"command {line.strip()!r} refused: {exc}", file=sys.stderr, flush=True)
        nursery.cancel_scope.cancel()


def _command(line: str, node: PrefillNode, faulty: FaultyDataPlane) -> None:
    sender, kv = node.sender, node.kv
    match line.split():
        case ["ready", tid, n]:
            blocks = node.pool.allocate(int(n))
            kv.fill(tid, blocks)
            try:
                sender.transfer_ready(tid, blocks)
            except PdError:
                node.pool.free(blocks)
                raise
            node.owned[tid] = blocks
        case ["drop", tid]:
            sender.transfer_dropped(tid, "dropped on command")
        case ["failwrite", n]:
            faulty.fail_writes += int(n)
        case ["stats"]:
            print(json.dumps({"in_use": node.pool.in_use}), flush=True)
        case _:
            print(f"unknown command {line.strip()!r}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--unclaimed-ttl", type=float, default=120.0)
    trio.run(_serve, parser.parse_args())


if __name__ == "__main__":
    main()
