"""Embed pdactors in your own trio program: a bootstrap, one P sender and one D receiver.

P's KV cache and D's KV cache are numpy buffers registered with two real Mooncake engines
(TCP on loopback). P fills 8 blocks, D pulls them into 8 blocks of its own, and we check the
bytes. Run it with ``python examples/embed.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake is chatty at INFO

import numpy as np
import trio

import pdactors

LAYERS, BLOCKS, BLOCK_BYTES = 4, 32, 16 * 1024


def kv_cache() -> tuple[np.ndarray, pdactors.Layout]:
    """One engine's KV cache: a region per layer, block i of layer l at data[l, i]."""
    data = np.zeros((LAYERS, BLOCKS, BLOCK_BYTES), np.uint8)
    regions = tuple(
        pdactors.BlockLayout(
            base=data[layer].ctypes.data,
            num_blocks=BLOCKS,
            block_bytes=BLOCK_BYTES,
            stride=BLOCK_BYTES,
        )
        for layer in range(LAYERS)
    )
    return data, pdactors.Layout(regions)


async def main() -> None:
    p_kv, p_layout = kv_cache()
    d_kv, d_layout = kv_cache()
    plane_config = pdactors.DataPlaneConfig(protocol="tcp", hostname="127.0.0.1")
    async with (
        pdactors.open_mooncake(plane_config) as p_plane,
        pdactors.open_mooncake(plane_config) as d_plane,
        trio.open_nursery() as nursery,
    ):
        p_plane.register([(p_kv.ctypes.data, p_kv.nbytes)])
        d_plane.register([(d_kv.ctypes.data, d_kv.nbytes)])

        url = await nursery.start(pdactors.serve_bootstrap, pdactors.BootstrapConfig())
        sender = await nursery.start(
            pdactors.serve_sender,
            pdactors.SenderConfig(engine_id="prefill-0", bootstrap_url=url),
            p_plane,
            p_layout,
        )
        receiver = await nursery.start(
            pdactors.serve_receiver, pdactors.ReceiverConfig(), d_plane, d_layout
        )

        # P: the prefill of request "req-1" wrote its KV into blocks 3..10.
        p_blocks = list(range(3, 11))
        p_kv[:, p_blocks, :] = np.random.default_rng(7).integers(
            0, 256, (LAYERS, len(p_blocks), BLOCK_BYTES), dtype=np.uint8
        )
        sender.transfer_pending("req-1")
        sender.transfer_ready("req-1", p_blocks)

        # D: pull it into blocks 20..27 of D's own cache.
        d_blocks = list(range(20, 28))
        with trio.fail_after(10):
            await receiver.pull(
                "req-1", bootstrap_url=url, engine_id="prefill-0", block_ids=d_blocks
            )
            released = await sender.wait_finished()  # P may free its blocks now

        same = np.array_equal(p_kv[:, p_blocks, :], d_kv[:, d_blocks, :])
        print(f"moved {len(d_blocks) * d_layout.bytes_per_block} bytes; identical: {same}")
        print(f"P released: {sorted(released)}")
        nursery.cancel_scope.cancel()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    trio.run(main)
