"""Shared set-up for the benchmarks: one P sender and one D receiver over real engines."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import httpx
import trio

from pdactors import (
    BootstrapConfig,
    DataPlaneConfig,
    Layout,
    MooncakeDataPlane,
    Receiver,
    ReceiverConfig,
    Sender,
    SenderConfig,
    open_mooncake,
    serve_bootstrap,
    serve_receiver,
    serve_sender,
)
from pdactors.core.plan import packed_layout
from pdactors.transport import ZMQ, Transport


@dataclass
class Pair:
    url: str
    sender: Sender
    receiver: Receiver
    p_plane: MooncakeDataPlane
    d_plane: MooncakeDataPlane
    p_layout: Layout
    d_layout: Layout


@asynccontextmanager
async def open_pair(
    cfg: DataPlaneConfig,
    p_ptr: int,
    d_ptr: int,
    nbytes: int,
    *,
    layers: int,
    pool: int,
    block_bytes: int,
    select_gpu: Callable[[int], None] | None = None,
    transport: Transport = ZMQ,
) -> AsyncIterator[Pair]:
    """Bootstrap + sender over ``p_ptr`` + receiver over ``d_ptr`` (each ``nbytes``).

    ``select_gpu(0)`` / ``select_gpu(1)`` runs before P's / D's memory is registered: CUDA
    memory must be registered with its own device current.
    """
    for name, value in cfg.mooncake_environment().items():
        os.environ.setdefault(name, value)  # nvlink_intra: the intra-node NVLink transport
    async with open_mooncake(cfg) as p_plane, open_mooncake(cfg) as d_plane:
        for gpu, plane, ptr in ((0, p_plane, p_ptr), (1, d_plane, d_ptr)):
            if select_gpu is not None:
                select_gpu(gpu)
            plane.register([(ptr, nbytes)])
        if select_gpu is not None:
            select_gpu(0)
        p_layout = packed_layout(p_ptr, layers, pool, block_bytes)
        d_layout = packed_layout(d_ptr, layers, pool, block_bytes)
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_bootstrap, BootstrapConfig())
            sender = await nursery.start(
                partial(serve_sender, transport=transport),
                SenderConfig(engine_id="p", bootstrap_url=url),
                p_plane,
                p_layout,
            )
            receiver = await nursery.start(
                partial(serve_receiver, transport=transport), ReceiverConfig(), d_plane, d_layout
            )
            yield Pair(url, sender, receiver, p_plane, d_plane, p_layout, d_layout)
            nursery.cancel_scope.cancel()


#: Clock ticks per second, the unit of /proc/PID/stat's CPU times.
CLK = os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the name (state ppid pgrp ... utime stime ...).
    Raises OSError when the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(fields: list[str]) -> float:
    """User + system CPU seconds in :func:`stat_fields` ``fields`` (utime, stime)."""
    return (int(fields[11]) + int(fields[12])) / CLK


def group_stats(pgid: int) -> dict[int, list[str]]:
    """Every live process of process group ``pgid``: pid -> its :func:`stat_fields`."""
    members = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = stat_fields(pid)
        except OSError:
            continue
        if int(fields[2]) == pgid:
            members[int(pid)] = fields
    return members


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid``."""
    return sum(cpu_seconds(f) for f in group_stats(pgid).values())


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    return cpu_seconds(stat_fields(pid))


def settle(pgids: Sequence[int], *, share: float = 0.1, within: float = 20.0) -> float:
    """Wait until the process groups ``pgids`` together use under ``share`` of one core over
    a quarter second (at most ``within`` seconds); return how long it took. A vLLM server
    without our connector keeps its workers spinning for a while after its last request
    (vLLM's busy waits), on the core the next setup measured may need: a bench that measures
    setups in turn settles between them, or the one that follows a plain server pays."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        before = sum(group_cpu_seconds(g) for g in pgids)
        time.sleep(0.25)
        if sum(group_cpu_seconds(g) for g in pgids) - before < share * 0.25:
            break
    return time.monotonic() - start


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A checkout of git revision ``rev`` of this repository in a temporary directory (for
    measuring an older version side by side); removed on exit."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tree"
        git = ["git", "-C", str(root)]
        subprocess.run([*git, "worktree", "add", "-q", "--detach", str(path), rev], check=True)
        try:
            yield path
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(path)], check=False)


PLACEMENTS = ("local", "disaggregated", "whole-on-p")


def placed(proxy_url: str | None, *, why: bool = False) -> dict[str, float]:
    """The proxy's requests so far by placement (``pdactors_proxy_placement_total``); with
    ``why``, by placement and reason (``"whole-on-p/overloaded"``)."""
    counts: dict[str, float] = {} if why else dict.fromkeys(PLACEMENTS, 0.0)
    if proxy_url is None:
        return counts
    text = httpx.get(f"{proxy_url}/metrics", timeout=10, trust_env=False).text
    for line in text.splitlines():
        if line.startswith("pdactors_proxy_placement_total{"):
            where = line.split('placement="', 1)[1].split('"', 1)[0]
            if why:
                where += "/" + line.split('reason="', 1)[1].split('"', 1)[0]
            counts[where] = counts.get(where, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def busy_python() -> threading.Event:
    """Start a daemon thread running Python until the returned event is set, as a vLLM
    worker's forward does between its ops: every other thread then waits for the GIL after
    each blocking call, up to the switch interval (``pdactors_vllm.gil``)."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for _ in range(1000):
                x += 1

    threading.Thread(target=spin, name="busy-python", daemon=True).start()
    return stop


class TimedPlane:
    """A sender's Mooncake data plane, timing each write as the sender awaits it (``writes``:
    start, end, bytes), each engine call in its worker thread (``calls``: start, end) and each
    write's ``after`` (``afters``: start, end), on ``clock`` (the wall clock where times are
    compared across processes)."""

    def __init__(self, inner: MooncakeDataPlane, clock: Callable[[], float]) -> None:
        self.inner, self.session, self.clock = inner, inner.session, clock
        self.writes: list[tuple[float, float, int]] = []
        self.calls: list[tuple[float, float]] = []
        self.afters: list[tuple[float, float]] = []
        engine, calls = inner._engine, self.calls

        class Engine:  # the engine call itself, timed in the worker thread
            def batch_transfer_sync_write(self, *a: Any) -> int:
                start = clock()
                rc = engine.batch_transfer_sync_write(*a)
                calls.append((start, clock()))
                return int(rc)

            def __getattr__(self, name: str) -> Any:
                return getattr(engine, name)

        inner._engine = Engine()  # type: ignore[assignment]

    def register(self, regions: list[tuple[int, int]]) -> None:
        self.inner.register(regions)

    async def write(
        self, peer: str, src: Any, dst: Any, lengths: Any, *, before: Any = None, after: Any = None
    ) -> None:
        if after is not None:
            after = self._timed(after)
        start = self.clock()
        await self.inner.write(peer, src, dst, lengths, before=before, after=after)
        self.writes.append((start, self.clock(), int(lengths.sum())))

    def _timed(self, after: Callable[[], object]) -> Callable[[], None]:
        def timed() -> None:
            start = self.clock()
            after()
            self.afters.append((start, self.clock()))

        return timed

    def stages(self, first: int, count: int) -> dict[str, list[float]]:
        """Writes ``first`` to ``first + count`` (one at a time, each in one engine call),
        cut in stages, in seconds: ``to_call`` (the write's start to its call's),
        ``call``, ``after`` (its ``after``, if it had one) and ``from_call`` (the call's end
        to the write's return, the ``after`` left out)."""
        out: dict[str, list[float]] = {"to_call": [], "call": [], "after": [], "from_call": []}
        for start, end, _ in self.writes[first : first + count]:
            calls = [c for c in self.calls if start <= c[0] and c[1] <= end]
            afters = [a for a in self.afters if start <= a[0] and a[1] <= end]
            if len(calls) != 1:
                continue
            spent = sum(e - s for s, e in afters)
            out["to_call"].append(calls[0][0] - start)
            out["call"].append(calls[0][1] - calls[0][0])
            out["after"].append(spent)
            out["from_call"].append(end - calls[0][1] - spent)
        return out
