"""A P worker in a process of its own, for tests that kill or stop it (and for ``chaos``).

``python -m pdactors.testing.prefill_process --bootstrap URL --engine-id ID`` starts a Mooncake
engine over TCP on loopback, a KV buffer like the harness's, and a sender registered with the
bootstrap (``--replaces EPOCH``: as the successor of the sender of that epoch, which may hold
its rank's lease still); prints one JSON line ``{"address": ..., "session": ..., "epoch": ...}``
once it serves; then reads
commands from stdin, one per line:

* ``ready TID N [KIND]``: P's prefill of ``TID`` is done: N blocks are filled and handed to the
  sender; with ``KIND`` (``flip``, ``truncate``, ``shift``) its write is corrupted in flight
  (:mod:`pdactors.testing.corruption`);
* ``drop TID``: P's prefill of ``TID`` ended without its KV;
* ``failwrite N``: the next N writes fail (an injected engine error);
* ``holdwrites`` / ``releasewrites``: writes wait at a gate from now on (P has said
  ``Writing``: the write is in flight for D) / go ahead;
* ``stats``: print ``{"in_use": blocks held}`` as one JSON line;
* ``waiting TID``: print ``{"waiting": n}``, the D workers' pulls of ``TID`` it holds unanswered.

Blocks come back to the pool as the sender releases them. It runs until killed or stdin closes.
:class:`PrefillProcess` drives it from a trio program (tests, ``pdactors chaos``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
from functools import partial

import trio

from pdactors.actors.sender import serve_sender
from pdactors.config import DataPlaneConfig, SenderConfig
from pdactors.dataplane import open_mooncake
from pdactors.errors import PdError
from pdactors.testing.cluster import PrefillNode
from pdactors.testing.corruption import CorruptingDataPlane
from pdactors.testing.faults import FaultyDataPlane
from pdactors.testing.kv import BlockPool, KVBuffer


async def _serve(args: argparse.Namespace) -> None:
    config = SenderConfig(
        engine_id=args.engine_id,
        bootstrap_url=args.bootstrap,
        host=args.host,
        port=args.port,
        unclaimed_ttl=args.unclaimed_ttl,
    )
    async with (
        open_mooncake(DataPlaneConfig(hostname=args.host)) as plane,
        trio.open_nursery() as nursery,
    ):
        kv = KVBuffer(args.layers, args.blocks, args.block_bytes)
        plane.register(kv.regions)
        faulty = FaultyDataPlane(CorruptingDataPlane(plane, seed=os.getpid()))
        serve = partial(serve_sender, replaces=args.replaces)
        sender = await nursery.start(serve, config, faulty, kv.layout)
        node = PrefillNode(args.engine_id, sender, kv, BlockPool(args.blocks), plane)
        nursery.start_soon(node.free_released)
        said = {"address": sender.address, "session": plane.session, "epoch": sender.epoch}
        print(json.dumps(said), flush=True)
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
        case ["ready", tid, n, *kind] if len(kind) <= 1:
            blocks = node.pool.allocate(int(n))
            kv.fill(tid, blocks)
            corrupting = faulty.inner
            assert isinstance(corrupting, CorruptingDataPlane)
            # The write's first source byte: region 0's first block (D pulls all N here).
            first = kv.data.ctypes.data + blocks[0] * kv.data.shape[2]
            corrupting.arm_source(first, kind[0] if kind else None)
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
        case ["holdwrites"]:
            faulty.gate = faulty.gate or trio.Event()
        case ["releasewrites"] if faulty.gate is not None:
            faulty.gate.set()
            faulty.gate = None
        case ["stats"]:
            print(json.dumps({"in_use": node.pool.in_use}), flush=True)
        case ["waiting", tid]:
            print(json.dumps({"waiting": sender.pulls_waiting(tid)}), flush=True)
        case _:
            print(f"unknown command {line.strip()!r}", file=sys.stderr, flush=True)


class PrefillProcess:
    """Drives this module as a child process: :meth:`start` it (again after :meth:`kill`),
    send it commands, ask what it holds, signal it (SIGSTOP / SIGCONT)."""

    def __init__(
        self,
        bootstrap_url: str,
        engine_id: str,
        layers: int = 4,
        blocks: int = 64,
        block_bytes: int = 4096,
        unclaimed_ttl: float = 120.0,
        *,
        host: str = "127.0.0.1",
        netns: str | None = None,
    ) -> None:
        self.bootstrap_url = bootstrap_url
        self.host = host
        self.netns = netns  # run it in this network namespace (``ip netns exec``)
        self.engine_id = engine_id
        self.shape = (layers, blocks, block_bytes, unclaimed_ttl)
        self.address = ""
        self.epoch = 0  # the running (or last) process's sender's: a restart replaces it
        self.proc: trio.Process | None = None
        self._stdin_lock = trio.Lock()
        self._lines: trio.MemoryReceiveChannel[dict[str, object]] | None = None

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the process (its output is read by a task in ``nursery``); returns once it
        serves. Raises ``TooSlowError`` if it does not within 30 s."""
        args = [sys.executable, "-m", "pdactors.testing.prefill_process"]
        layers, blocks, block_bytes, ttl = self.shape
        args += ["--bootstrap", self.bootstrap_url, "--engine-id", self.engine_id]
        args += ["--layers", str(layers), "--blocks", str(blocks)]
        args += ["--block-bytes", str(block_bytes), "--unclaimed-ttl", str(ttl)]
        args += ["--host", self.host, "--replaces", str(self.epoch)]
        if self.netns is not None:
            args = ["ip", "netns", "exec", self.netns, *args]
        # A write to a peer behind a cut link gives up after this, not Mooncake's ~30-60 s.
        env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "MC_TCP_PROGRESS_TIMEOUT_SEC": "5"}
        proc = await trio.lowlevel.open_process(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        send, recv = trio.open_memory_channel[dict[str, object]](math.inf)
        nursery.start_soon(_read_lines, proc, send)
        self.proc = proc
        with trio.fail_after(30):
            serving = await recv.receive()  # it serves
        self.address, self.epoch = str(serving["address"]), int(str(serving["epoch"]))
        self._lines = recv

    async def command(self, line: str) -> bool:
        proc = self.proc
        if proc is None or proc.stdin is None or proc.returncode is not None:
            return False
        try:
            async with self._stdin_lock:
                await proc.stdin.send_all(line.encode() + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return False
        return True

    async def blocks_in_use(self) -> int:
        assert self._lines is not None
        if not await self.command("stats"):
            return 0  # a dead P holds nothing
        with trio.fail_after(10):
            return int(str((await self._lines.receive())["in_use"]))

    async def pulls_waiting(self, transfer_id: str) -> int:
        """How many D workers' pulls of ``transfer_id`` it holds unanswered (0 when dead)."""
        assert self._lines is not None
        if not await self.command(f"waiting {transfer_id}"):
            return 0
        with trio.fail_after(10):
            return int(str((await self._lines.receive())["waiting"]))

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.kill(self.proc.pid, sig)

    async def kill(self) -> None:
        """SIGKILL it (a stopped one too) and reap it."""
        if self.proc is not None:
            self.signal(signal.SIGCONT)
            self.proc.kill()
            with trio.move_on_after(10, shield=True):
                await self.proc.wait()
            self.proc = None


async def _read_lines(proc: trio.Process, send: trio.MemorySendChannel[dict[str, object]]) -> None:
    assert proc.stdout is not None
    buffer = b""
    async for chunk in proc.stdout:
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            send.send_nowait(json.loads(line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--unclaimed-ttl", type=float, default=120.0)
    parser.add_argument("--replaces", type=int, default=0)
    trio.run(_serve, parser.parse_args())


if __name__ == "__main__":
    main()
