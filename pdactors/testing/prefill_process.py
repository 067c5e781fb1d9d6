"""A P worker in a process of its own, for tests that kill or stop it (and for ``chaos``).

``python -m pdactors.testing.prefill_process --bootstrap URL --engine-id ID`` starts a Mooncake
engine over TCP on loopback, a KV buffer like the harness's, and a sender registered with the
bootstrap; prints one JSON line ``{"address": ..., "session": ...}`` once it serves; then reads
commands from stdin, one per line:

* ``ready TID N``: P's prefill of ``TID`` is done: N blocks are filled and handed to the sender;
* ``drop TID``: P's prefill of ``TID`` ended without its KV.

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
from pdactors.testing.cluster import BlockPool, KVBuffer, PrefillNode


async def _serve(args: argparse.Namespace) -> None:
    config = SenderConfig(engine_id=args.engine_id, bootstrap_url=args.bootstrap, port=args.port)
    async with open_mooncake(DataPlaneConfig()) as plane, trio.open_nursery() as nursery:
        kv = KVBuffer(args.layers, args.blocks, args.block_bytes)
        plane.register(kv.regions)
        sender = await nursery.start(serve_sender, config, plane, kv.layout)
        node = PrefillNode(args.engine_id, sender, kv, BlockPool(args.blocks), plane)
        nursery.start_soon(node.free_released)
        print(json.dumps({"address": sender.address, "session": plane.session}), flush=True)
        stdin = trio.wrap_file(sys.stdin)
        async for line in stdin:
            match line.split():
                case ["ready", tid, n]:
                    blocks = node.pool.allocate(int(n))
                    node.owned[tid] = blocks
                    kv.fill(tid, blocks)
                    sender.transfer_ready(tid, blocks)
                case ["drop", tid]:
                    sender.transfer_dropped(tid, "dropped on command")
                case _:
                    print(f"unknown command {line.strip()!r}", file=sys.stderr, flush=True)
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-bytes", type=int, default=4096)
    trio.run(_serve, parser.parse_args())


if __name__ == "__main__":
    main()
