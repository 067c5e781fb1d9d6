"""``pdactors chaos``: a stream of transfers through real actors while faults are injected.

P is a real sender in a process of its own (:mod:`pdactors.testing.prefill_process`, real
Mooncake engine); D is a receiver in this process (real Mooncake engine, real ZMQ behind a
:class:`~pdactors.testing.faults.FaultyTransport`); the bootstrap runs here too. ``concurrency``
workers move transfers (P readies its blocks before or after D's pull, at random) and verify
every delivered byte, while a seeded schedule injects one fault at a time:

* ``kill_p`` — SIGKILL of P, restarted half a second later (new port, same engine id);
* ``stop_p`` — SIGSTOP of P for two seconds, then SIGCONT (a hung peer);
* ``abort`` — D gives up on a few transfers in flight;
* ``drop`` / ``delay`` — D's side channel drops 30 % / delays half of its messages for a second;
* ``fail_write`` — P's next two writes fail;
* ``bootstrap`` — the bootstrap restarts on its port (P's lease puts its entry back);
* ``corrupt`` — the writes of the next three transfers are corrupted in flight, a flipped byte,
  a short run and a run one byte off (:mod:`pdactors.testing.corruption`): D's KV checksums
  must catch every one (a corrupted transfer delivered fails the run).

With ``netns`` (root, ``ip`` from iproute2), P lives in a network namespace of its own, joined to
D's by a veth pair as two hosts would be, and the faults include ``cut_link`` (the veth link
down for two seconds) and, where the kernel has ``sch_netem``, ``loss`` (10 % packet loss for
two seconds with ``tc netem``).

It reports, per fault kind, how many transfers were in flight when it struck and how long their
ends took, then ``chaos: N transfers, N ok, N failed, N hung, N leaked blocks``. A transfer is
*hung* when it has not ended ``hang_after`` seconds after it started (the pull deadline is
shorter); a block is *leaked* when it is still held on D or P once everything has settled.
"""

from __future__ import annotations

import os
import random
import signal
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import numpy as np
import trio

from pdactors.actors.bootstrap import serve_bootstrap
from pdactors.actors.receiver import Receiver, serve_receiver
from pdactors.config import BootstrapConfig, DataPlaneConfig, ReceiverConfig
from pdactors.dataplane import open_mooncake
from pdactors.errors import PullFailedError
from pdactors.testing.corruption import CORRUPTIONS
from pdactors.testing.faults import FaultyTransport, MessageFaults
from pdactors.testing.kv import BlockPool, KVBuffer
from pdactors.testing.prefill_process import PrefillProcess
from pdactors.transport import ZMQ

__all__ = ["FAULTS", "ChaosReport", "run_chaos"]

FAULTS = ("kill_p", "stop_p", "abort", "drop", "delay", "fail_write", "bootstrap", "corrupt")
NETNS_FAULTS = ("cut_link", "loss")
ENGINE = "chaos-p"
LAYERS, BLOCKS, BLOCK_BYTES = 4, 256, 4096
#: D's pull deadline here: dropped messages are the one fault only a clock can end.
PULL_TIMEOUT = 10.0
#: P frees KV nobody pulls after this (a dropped cancel leaves it to P's clock).
UNCLAIMED_TTL = 10.0


@dataclass
class _Transfer:
    tid: str
    started: float
    ended: float | None = None
    ok: bool = False
    reason: str = ""
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)


@dataclass
class ChaosReport:
    transfers: int = 0
    ok: int = 0
    failed: int = 0
    hung: int = 0
    corrupt: int = 0
    leaked_blocks: int = 0
    #: transfers whose write was corrupted in flight: caught by D's checksums, ended another way
    #: first (P killed or stopped, aborted, the write failed), delivered (must stay 0)
    corrupted: int = 0
    caught: int = 0
    corrupt_ended_otherwise: int = 0
    corrupt_delivered: int = 0
    #: fault kind -> [times it struck, transfers hit, end latencies of those (s)]
    faults: dict[str, list[float]] = field(default_factory=dict)
    hits: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def passed(self) -> bool:
        clean = self.hung == 0 and self.leaked_blocks == 0 and self.corrupt == 0
        return clean and self.corrupt_delivered == 0

    def table(self) -> str:
        lines = ["| fault | times | transfers hit | end after fault p50 ms | max ms |",
                 "|---|---|---|---|---|"]  # fmt: skip
        for kind in (*FAULTS, *NETNS_FAULTS):
            if kind in NETNS_FAULTS and kind not in self.faults:
                continue
            times = int(self.faults.get(kind, [0])[0])
            lat = self.hits.get(kind, [])
            p50 = f"{np.percentile(lat, 50) * 1e3:.0f}" if lat else "-"
            top = f"{max(lat) * 1e3:.0f}" if lat else "-"
            lines.append(f"| {kind} | {times} | {len(lat)} | {p50} | {top} |")
        return "\n".join(lines)

    def last_line(self) -> str:
        return (
            f"chaos: {self.transfers} transfers, {self.ok} ok, {self.failed} failed, "
            f"{self.hung} hung, {self.leaked_blocks} leaked blocks"
            + (f", {self.corrupt} CORRUPT" if self.corrupt else "")
        )

    def corruption_line(self) -> str:
        return (
            f"corruptions in flight: {self.corrupted} injected, {self.caught} caught by the KV "
            f"checksums, {self.corrupt_ended_otherwise} ended before their check (P killed or "
            f"stopped, aborted, write failed), {self.corrupt_delivered} delivered"
        )


@dataclass(frozen=True)
class _Hosts:
    d_ip: str = "127.0.0.1"
    p_ip: str = "127.0.0.1"
    netns: str | None = None
    link: str = ""  # D's end of the veth pair
    netem: bool = False


@asynccontextmanager
async def _two_hosts(enabled: bool) -> AsyncIterator[_Hosts]:
    """P's network namespace and the veth pair to it (removed on exit), or plain loopback."""
    if not enabled:
        yield _Hosts()
        return
    tag = f"{os.getpid() % 10000}"
    ns, d_if, p_if = f"pdchaos{tag}", f"pdc{tag}d", f"pdc{tag}p"
    net = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    d_ip, p_ip = f"{net}.1", f"{net}.2"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", d_if, "type", "veth", "peer", "name", p_if],
        ["ip", "link", "set", p_if, "netns", ns],
        ["ip", "addr", "add", f"{d_ip}/24", "dev", d_if],
        ["ip", "link", "set", d_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{p_ip}/24", "dev", p_if],
        ["ip", "netns", "exec", ns, "ip", "link", "set", p_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            await trio.run_process(step, capture_stderr=True)
        probe = ["tc", "qdisc", "add", "dev", d_if, "root", "netem", "loss", "0%"]
        netem = (await trio.run_process(probe, check=False, capture_stderr=True)).returncode == 0
        if netem:
            await trio.run_process(["tc", "qdisc", "del", "dev", d_if, "root"], check=False)
        yield _Hosts(d_ip, p_ip, ns, d_if, netem)
    finally:
        with trio.move_on_after(10, shield=True):
            await trio.run_process(["ip", "link", "del", d_if], check=False, capture_stderr=True)
            await trio.run_process(["ip", "netns", "del", ns], check=False, capture_stderr=True)


async def run_chaos(
    *,
    seconds: float,
    seed: int,
    concurrency: int,
    progress: bool = False,
    netns: bool = False,
    only: tuple[str, ...] = (),
) -> ChaosReport:
    """Run the chaos for ``seconds`` (then let every transfer end and everything settle).

    ``netns`` puts P in a network namespace of its own (needs root and iproute2); raises
    ``subprocess.CalledProcessError`` when the namespace cannot be made. ``only``: inject
    only these fault kinds (default all).
    """
    async with _two_hosts(netns) as hosts:
        return await _run(seconds, seed, concurrency, progress, hosts, only)


async def _run(
    seconds: float, seed: int, concurrency: int, progress: bool, hosts: _Hosts,
    only: tuple[str, ...] = (),
) -> ChaosReport:  # fmt: skip
    rng = random.Random(seed)  # the transfers (their order depends on timing)
    schedule = random.Random(seed + 1_000_003)  # the faults: the same kinds in the same order
    report = ChaosReport()
    faults = MessageFaults()
    transport = FaultyTransport(ZMQ, faults, seed)
    hang_after = PULL_TIMEOUT + 10
    live: dict[str, _Transfer] = {}
    corrupt_next: list[str] = []  # kinds for the next transfers' writes
    kinds = FAULTS + (("cut_link",) + (("loss",) if hosts.netem else ()) if hosts.netns else ())
    kinds = tuple(k for k in kinds if k in only) if only else kinds
    async with (
        open_mooncake(DataPlaneConfig(hostname=hosts.d_ip)) as plane,
        trio.open_nursery() as nursery,
    ):
        kv = KVBuffer(LAYERS, BLOCKS, BLOCK_BYTES)
        plane.register(kv.regions)
        pool = BlockPool(BLOCKS)
        boot = [trio.CancelScope()]  # the bootstrap's scope, replaced at each restart
        url = await nursery.start(_serve_bootstrap, BootstrapConfig(host=hosts.d_ip), boot[0])
        port = int(url.rsplit(":", 1)[1])
        config = ReceiverConfig(engine_id="chaos-d", pull_timeout=PULL_TIMEOUT)
        receiver: Receiver = await nursery.start(
            lambda task_status: serve_receiver(
                config, plane, kv.layout, transport=transport, task_status=task_status
            )
        )
        p = PrefillProcess(
            url,
            ENGINE,
            LAYERS,
            BLOCKS,
            BLOCK_BYTES,
            UNCLAIMED_TTL,
            host=hosts.p_ip,
            netns=hosts.netns,
        )
        await p.start(nursery)
        counter = iter(range(10**9))

        async def one_transfer() -> None:
            tid = f"c{seed}-{next(counter)}"
            n = rng.randint(1, 8)
            t = live[tid] = _Transfer(tid, trio.current_time())
            report.transfers += 1
            ready_first = rng.random() < 0.5
            corruption = corrupt_next.pop() if corrupt_next else ""
            ready = f"ready {tid} {n} {corruption}".rstrip()
            if ready_first:
                await p.command(ready)
            dst = pool.allocate(n)
            try:
                with t.scope, trio.move_on_after(hang_after) as timer:
                    async with trio.open_nursery() as inner:
                        if not ready_first:
                            inner.start_soon(_ready_later, p, ready, rng.random() * 0.05)
                        try:
                            await receiver.pull(
                                tid, bootstrap_url=url, engine_id=ENGINE, block_ids=dst
                            )
                            t.ok = True
                        except PullFailedError as exc:
                            t.reason = exc.reason
                if timer.cancelled_caught:
                    report.hung += 1
                    t.reason = "hung"
                elif t.scope.cancelled_caught:
                    t.reason = "aborted by the chaos"
                if t.ok and not kv.verify(tid, dst, n):
                    report.corrupt += 1
            finally:
                t.ended = trio.current_time()
                # D reuses its blocks only once the pull has ended (an aborted pull ends when
                # P confirms or is gone): wait for it, bounded.
                with trio.move_on_after(hang_after, shield=True):
                    await receiver.wait_ended(tid)
                pool.free(dst)
                del live[tid]
                t.done.set()
            if corruption:
                report.corrupted += 1
                if t.ok:
                    report.corrupt_delivered += 1
                elif "KV checksum mismatch" in t.reason:
                    report.caught += 1
                else:
                    report.corrupt_ended_otherwise += 1
            if t.ok:
                report.ok += 1
            else:
                report.failed += 1
                report.reasons[_kind(t.reason)] += 1

        async def worker(until: float) -> None:
            while trio.current_time() < until:
                await one_transfer()

        async def inject(kind: str) -> None:
            now = trio.current_time()
            hit = list(live.values())
            report.faults.setdefault(kind, [0])[0] += 1
            if kind == "kill_p":
                await p.kill()
                await trio.sleep(0.5)
                await p.start(nursery)
            elif kind == "stop_p":
                p.signal(signal.SIGSTOP)
                await trio.sleep(2)
                p.signal(signal.SIGCONT)
            elif kind == "abort":
                for t in rng.sample(hit, min(3, len(hit))):
                    t.scope.cancel()
                hit = [t for t in hit if t.scope.cancel_called]
            elif kind in ("drop", "delay"):
                setattr(faults, kind, 0.3 if kind == "drop" else 0.5)
                await trio.sleep(1)
                setattr(faults, kind, 0.0)
            elif kind == "fail_write":
                await p.command("failwrite 2")
            elif kind == "corrupt":
                corrupt_next.extend(CORRUPTIONS)
            elif kind == "bootstrap":
                boot[0].cancel()
                await trio.sleep(0.2)
                boot[0] = trio.CancelScope()
                config = BootstrapConfig(host=hosts.d_ip, port=port)
                await nursery.start(_serve_bootstrap, config, boot[0])
            elif kind == "cut_link":
                await _ip("ip", "link", "set", hosts.link, "down")
                await trio.sleep(2)
                await _ip("ip", "link", "set", hosts.link, "up")
            elif kind == "loss":
                await _ip("tc", "qdisc", "add", "dev", hosts.link, "root", "netem", "loss", "10%")
                await trio.sleep(2)
                await _ip("tc", "qdisc", "del", "dev", hosts.link, "root")
            nursery.start_soon(_record_ends, report, kind, now, hit)

        start = trio.current_time()
        until = start + seconds
        async with trio.open_nursery() as work:
            for _ in range(concurrency):
                work.start_soon(worker, until)
            while trio.current_time() < until - 1:
                await trio.sleep(schedule.uniform(0.5, 1.5))
                kind = schedule.choice(kinds)
                if progress:
                    print(f"  {trio.current_time() - start:5.1f} s  {kind:<10} "
                          f"{report.transfers} transfers so far", flush=True)  # fmt: skip
                await inject(kind)
        # Settle: P frees KV nobody will pull after UNCLAIMED_TTL, and a write stuck behind a
        # cut link gives up after MC_TCP_PROGRESS_TIMEOUT_SEC (5 s); give them that and more.
        with trio.move_on_after(UNCLAIMED_TTL + 20):
            # P is another process: polling its count is the only way to hear it.
            while pool.in_use or await p.blocks_in_use():  # noqa: ASYNC110
                await trio.sleep(0.5)
        report.leaked_blocks = pool.in_use + await p.blocks_in_use()
        await p.kill()
        nursery.cancel_scope.cancel()
    return report


async def _ready_later(p: PrefillProcess, ready: str, delay: float) -> None:
    await trio.sleep(delay)
    await p.command(ready)


async def _record_ends(report: ChaosReport, kind: str, at: float, hit: list[_Transfer]) -> None:
    """The end latency, after the fault, of each transfer in flight when it struck."""
    for t in hit:
        await t.done.wait()
    report.hits[kind] += [max(0.0, (t.ended or at) - at) for t in hit]


async def _serve_bootstrap(
    config: BootstrapConfig,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await serve_bootstrap(config, task_status=task_status)


async def _ip(*args: str) -> None:
    await trio.run_process(list(args), capture_stderr=True)


def _kind(reason: str) -> str:
    for needle in ("P gone", "cannot reach", "injected", "cancelled", "aborted", "deadline",
                   "hung", "not ready", "expired", "KV checksum mismatch"):  # fmt: skip
        if needle in reason:
            return needle
    return reason[:60] or "unknown"
