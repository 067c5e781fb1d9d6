"""How D learns its KV landed: the options of issue 28 item 1, side by side.

Each option is built minimally here, not in the library. P writes ``--mib`` MiB as
``--descriptors`` descriptors into D's registered memory with a real Mooncake engine (P and D
in two processes; ``nvlink_intra`` needs that), then D is told in the option's way; a consumer
thread in D, standing in for vLLM's ``get_finished``, notes when it knows. The span measured
is from the data write returning in P's worker thread (``t_end``) to that consumer knowing.

Options (``--paths``):

* **trio** (today): P's Trio loop awaits the write in a worker thread
  (``trio.to_thread.run_sync``, as the data plane does), then sends ``PullDone`` on its ROUTER
  (pdactors' trio-ZMQ transport); D's Trio loop receives it on its DEALER, decodes it and
  publishes it to a mailbox (the worker's ``Mailbox``: a lock, a set, a ``threading.Event``).
* **thread_send** (A): P's write thread sends ``PullDone`` itself, on a ROUTER that only
  write threads use (under a lock); D as today.
* **thread_recv** (C): P as today; D's answer is read by a thread that owns its DEALER (a
  blocking ``zmq.Poller``) and publishes to the mailbox itself: no D Trio hop.
* **threads** (A + C): both: ZMQ, but no Trio loop on either side.
* **record** (B): after the data write returned, P's write thread makes a second engine call
  writing an 8-byte record (the request's sequence number) into a slot of D's registered
  memory; D's consumer reads the slot where it already asks. No ZMQ, no Trio. On a GPU the
  slot is in D's GPU memory (read with an 8-byte copy to the host).
* **notify** (B'): the data write itself carries a Mooncake ``TransferNotify``
  (``batch_transfer_sync(..., notify=)``; the engine sends it once the batch completed, over
  its own RPC connection); D's consumer drains ``get_notifies()``.

Consumers (``--consumers``): **poll** checks once per ``--step-ms`` at a random phase (a busy
D: ``get_finished`` once per step); **block** waits (a D whose requests all wait): the
mailbox's event for the ZMQ options, a check every ``--spin-us`` for record and notify,
which nothing can wake. *consumer CPU* is the consumer thread's CPU time per request.

Every request's bytes are checked on D after it is known (for record and notify that checks
the order: the data landed before D was told). *raw* is the data write alone, back to back in
P's thread. Clocks: ``time.monotonic`` (one clock for every process of the machine).

    python bench/completion_paths.py --protocol tcp --device cpu --mib 4
    MC_INTRANODE_NVLINK=1 python bench/completion_paths.py --protocol nvlink_intra \\
        --device cuda:0 --mib 141.75 --descriptors 36
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout

import numpy as np
import trio
import zmq

from pdactors import DataPlaneConfig, open_mooncake
from pdactors.transport import open_dealer, open_router
from pdactors.wire import PullDone, decode_frames, encode_frames

PATHS = ("trio", "thread_send", "thread_recv", "threads", "record", "notify")
CONSUMERS = ("poll", "block")
ZMQ_PATHS = ("trio", "thread_send", "thread_recv", "threads")
SLOTS = 4096  # completion-record slots in D's memory (8 bytes each)
clock = time.monotonic


def salt(k: int) -> int:
    return (k * 37 + 11) % 251


# ------------------------------------------------------------------ memory (host or CUDA)


class Memory:
    """A registered byte buffer on the host (numpy) or a GPU (torch)."""

    def __init__(self, nbytes: int, device: str) -> None:
        self.device = device
        if device == "cpu":
            self.array: Any = np.zeros(nbytes, dtype=np.uint8)
            self.ptr = int(self.array.ctypes.data)
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "vllm"))
            from pdactors_vllm.device_kv import kv_tensor

            self.array = kv_tensor((nbytes,), device)
            self.ptr = int(self.array.data_ptr())
        self.nbytes = nbytes

    def fill(self, value: int) -> None:
        if self.device == "cpu":
            self.array.fill(value)
        else:
            import torch

            self.array.fill_(value)
            torch.cuda.synchronize(self.device)

    def all_equal(self, value: int) -> bool:
        if self.device == "cpu":
            return bool((self.array == value).all())
        return bool((self.array == value).all().item())

    def u64(self) -> Any:
        """The buffer as 64-bit words (the record slots)."""
        if self.device == "cpu":
            return self.array.view(np.uint64)
        import torch

        return self.array.view(torch.int64)

    def word(self, words: Any, slot: int) -> int:
        return int(words[slot]) if self.device == "cpu" else int(words[slot].item())

    def set_word(self, words: Any, slot: int, value: int) -> None:
        words[slot] = value
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize(self.device)


def descriptors(src: int, dst: int, nbytes: int, count: int) -> tuple[list[int], ...]:
    step = -(-nbytes // count)
    offsets = list(range(0, nbytes, step))
    lengths = [min(step, nbytes - o) for o in offsets]
    return [src + o for o in offsets], [dst + o for o in offsets], lengths


def plane_config(args: argparse.Namespace) -> DataPlaneConfig:
    return DataPlaneConfig(protocol=args.protocol)


# ------------------------------------------------------------------ P (the child process)


async def prefill(args: argparse.Namespace) -> None:
    from mooncake.engine import TransferNotify, TransferOpcode

    nbytes = int(args.mib * 2**20)
    src = Memory(nbytes, args.device)
    rec = Memory(SLOTS * 8, args.device)
    rec_words = rec.u64()
    srcs, dsts, lens = descriptors(src.ptr, args.d_ptr, nbytes, args.descriptors)
    context: zmq.Context[Any] = zmq.Context.instance()
    side = context.socket(zmq.ROUTER)  # only write threads use it (A)
    side.setsockopt(zmq.LINGER, 0)
    side.setsockopt(zmq.ROUTER_MANDATORY, 1)
    side_port = side.bind_to_random_port("tcp://127.0.0.1")
    side_lock = threading.Lock()
    async with open_mooncake(plane_config(args)) as plane, open_router("127.0.0.1") as router:
        plane.register([(src.ptr, nbytes)])
        plane.register([(rec.ptr, rec.nbytes)])
        engine: Any = plane.engine
        session = args.d_session
        print(json.dumps({"router": router.address, "side": f"tcp://127.0.0.1:{side_port}"}),
              flush=True)  # fmt: skip
        who: dict[bytes, bytes] = {}  # D's dealer name -> its identity, on either socket
        for _ in range(2):
            identity, frames = await router.receive()
            who[frames[1]] = identity

        def side_hellos() -> None:
            for _ in range(2):
                identity, _, name = side.recv_multipart()
                who[name] = identity

        await trio.to_thread.run_sync(side_hellos)
        print("READY", flush=True)

        def write() -> None:
            rc = engine.batch_transfer_sync_write(session, srcs, dsts, lens)
            if rc != 0:
                raise RuntimeError(f"data write failed: {rc}")

        stamps: dict[int, tuple[float, float, float, str]] = {}
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line.strip():
                break
            k, path = int(line.split()[0]), line.split()[1]
            tid = f"{path}-{k}"
            src.fill(salt(k))
            slot, seq = k % SLOTS, k + 1
            if path == "record":
                rec.set_word(rec_words, slot, seq)  # prepared before the write: off the path

            def job(
                path: str = path, tid: str = tid, slot: int = slot
            ) -> tuple[float, float, float, str]:
                start = clock()
                try:
                    if path == "notify":
                        rc = engine.batch_transfer_sync(
                            session, srcs, dsts, lens, TransferOpcode.Write,
                            TransferNotify("pdactors", tid),
                        )  # fmt: skip
                        if rc != 0:
                            raise RuntimeError(f"notified write failed: {rc}")
                    else:
                        write()
                except Exception as exc:  # the option cannot run here: D gives it up
                    return start, clock(), clock(), repr(exc)
                end = clock()
                if path in ("thread_send", "threads"):
                    name = b"t2" if path == "thread_send" else b"c2"
                    frames = encode_frames(PullDone(tid, nbytes))
                    with side_lock:
                        side.send_multipart([who[name], *frames], zmq.NOBLOCK)
                elif path == "record":
                    rc = engine.batch_transfer_sync_write(
                        session, [rec.ptr + 8 * slot], [args.d_rec + 8 * slot], [8]
                    )
                    if rc != 0:
                        return start, end, clock(), f"record write failed: {rc}"
                return start, end, clock(), ""

            start, end, free, error = await trio.to_thread.run_sync(job)
            if error:
                print(f"# {tid}: {error}", file=sys.stderr, flush=True)
            elif path in ("trio", "thread_recv"):  # today's reply: from P's Trio loop
                name = b"t" if path == "trio" else b"c"
                await router.send(who[name], encode_frames(PullDone(tid, nbytes)))
            stamps[k] = (start, end, free, error)

        for _ in range(3):
            write()
        raw = []
        for _ in range(args.requests):
            start = clock()
            write()
            raw.append(clock() - start)
        print(json.dumps({"stamps": stamps, "raw": raw}), flush=True)
    side.close(linger=0)


# ------------------------------------------------------------------ D (the parent process)


class Mailbox:
    """The worker's mailbox, as ``pdactors_vllm.mailbox.Mailbox`` keeps it (that module needs
    vLLM): results under a lock, an event a waiting ``get_finished`` sleeps on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recved: set[str] = set()
        self._ready = threading.Event()

    def add(self, tid: str) -> None:
        with self._lock:
            self._recved.add(tid)
            self._ready.set()

    def take(self, wait: float = 0.0) -> set[str]:
        if wait > 0 and not self._ready.is_set():
            self._ready.wait(wait)
        with self._lock:
            self._ready.clear()
            got, self._recved = self._recved, set()
        return got


@dataclass
class Expect:
    """What the consumer waits for next."""

    k: int
    path: str
    consumer: str
    tid: str
    known: float = 0.0
    cancelled: bool = False  # given up: the consumer stops waiting
    cpu: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class Consumer:
    """The thread standing in for vLLM's ``get_finished`` loop."""

    def __init__(
        self, args: argparse.Namespace, mailbox: Mailbox, rec: Memory, engine: Any
    ) -> None:
        self.args, self.mailbox, self.rec, self.engine = args, mailbox, rec, engine
        self.words = rec.u64()
        self.jobs: queue.Queue[Expect | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="get_finished", daemon=True)
        self.thread.start()

    def _known(self, e: Expect) -> bool:
        if e.path == "record":
            return self.rec.word(self.words, e.k % SLOTS) == e.k + 1
        if e.path == "notify":
            return any(n.msg == e.tid for n in self.engine.get_notifies())
        return e.tid in self.mailbox.take()

    def _run(self) -> None:
        step, spin = self.args.step_ms / 1e3, self.args.spin_us / 1e6
        while (e := self.jobs.get()) is not None:
            cpu = time.thread_time()
            if e.consumer == "poll":
                wake = clock() + random.uniform(0, step)  # a random phase of the step
                while not e.cancelled:
                    time.sleep(max(0.0, wake - clock()))
                    if self._known(e):
                        break
                    wake += step
            elif e.path in ZMQ_PATHS:
                while not e.cancelled and e.tid not in self.mailbox.take(wait=0.02):
                    pass
            else:
                while not e.cancelled and not self._known(e):
                    time.sleep(spin)
            e.known = clock()
            e.cpu = time.thread_time() - cpu
            e.done.set()


def thread_receiver(
    addresses: dict[bytes, str], mailbox: Mailbox, ready: threading.Event, stop: threading.Event
) -> None:
    """C: a thread that owns its DEALERs and publishes each answer to the mailbox itself."""
    context: zmq.Context[Any] = zmq.Context.instance()
    poller = zmq.Poller()
    sockets = []
    for name, address in addresses.items():
        s = context.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        s.send_multipart([b"hello", name])
        poller.register(s, zmq.POLLIN)
        sockets.append(s)
    ready.set()
    while not stop.is_set():
        for s, _ in poller.poll(100):
            msg = decode_frames(s.recv_multipart())
            assert isinstance(msg, PullDone)
            mailbox.add(msg.transfer_id)
    for s in sockets:
        s.close(linger=0)


async def decode(args: argparse.Namespace) -> None:
    nbytes = int(args.mib * 2**20)
    dst = Memory(nbytes, args.device)
    rec = Memory(SLOTS * 8, args.device)
    mailbox = Mailbox()
    async with open_mooncake(plane_config(args)) as plane, trio.open_nursery() as nursery:
        plane.register([(dst.ptr, nbytes)])
        plane.register([(rec.ptr, rec.nbytes)])
        child = subprocess.Popen(  # noqa: ASYNC220 (starting it does not block)
            [sys.executable, __file__, *sys.argv[1:], "--role", "prefill",
             "--d-session", plane.session, "--d-ptr", str(dst.ptr), "--d-rec", str(rec.ptr)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert child.stdin is not None and child.stdout is not None
        readline = child.stdout.readline
        addresses = json.loads(await trio.to_thread.run_sync(readline))
        stop, receiver_up = threading.Event(), threading.Event()
        receiver = threading.Thread(
            target=thread_receiver,
            args=({b"c": addresses["router"], b"c2": addresses["side"]}, mailbox, receiver_up,
                  stop),
            daemon=True,
        )  # fmt: skip
        receiver.start()

        async def trio_receiver(
            address: str, name: bytes, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
        ) -> None:
            async with open_dealer(address) as dealer:
                await dealer.send([b"hello", name])
                task_status.started()
                while True:
                    msg = decode_frames(await dealer.receive())
                    assert isinstance(msg, PullDone)
                    mailbox.add(msg.transfer_id)

        await nursery.start(trio_receiver, addresses["router"], b"t")
        await nursery.start(trio_receiver, addresses["side"], b"t2")
        await trio.to_thread.run_sync(receiver_up.wait)
        line = await trio.to_thread.run_sync(readline)
        assert line.strip() == "READY", line
        consumer = Consumer(args, mailbox, rec, plane.engine)
        done: list[Expect] = []
        ok: dict[tuple[str, str], list[bool]] = {}
        broken: dict[str, str] = {}
        k = 0
        try:
            for i in range(args.warmup + args.requests):
                for path in args.paths:
                    for how in args.consumers:
                        if path in broken:
                            continue
                        e = Expect(k, path, how, f"{path}-{k}")
                        consumer.jobs.put(e)
                        child.stdin.write(f"{k} {path}\n")
                        child.stdin.flush()
                        k += 1
                        if not await trio.to_thread.run_sync(e.done.wait, args.give_up_s):
                            broken[path] = f"{e.tid} not known on D within {args.give_up_s:g} s"
                            e.cancelled = True
                            await trio.to_thread.run_sync(e.done.wait)
                            continue
                        ok.setdefault((path, how), []).append(dst.all_equal(salt(e.k)))
                        if i >= args.warmup:
                            done.append(e)
            child.stdin.write("\n")
            child.stdin.flush()
            result = json.loads(await trio.to_thread.run_sync(readline))
        finally:
            consumer.jobs.put(None)
            stop.set()
            child.stdin.close()
            await trio.to_thread.run_sync(child.wait)
        nursery.cancel_scope.cancel()
    report(args, done, ok, result, broken)


# ------------------------------------------------------------------ the report


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def report(
    args: argparse.Namespace,
    done: list[Expect],
    ok: dict[tuple[str, str], list[bool]],
    result: dict[str, Any],
    broken: dict[str, str],
) -> None:
    stamps = {int(k): v for k, v in result["stamps"].items()}
    raw = result["raw"]
    ms = 1e3
    print(
        f"# {args.protocol} on {args.device}: {args.mib:g} MiB as {args.descriptors} descriptors;"
        f" {args.requests} requests per row after {args.warmup} warm-up;"
        f" poll every {args.step_ms:g} ms, spin every {args.spin_us:g} us"
    )
    print(
        f"# raw write (P's thread, back to back): p50 {statistics.median(raw) * ms:.3f} ms,"
        f" p90 {pct(raw, 90) * ms:.3f} ms"
    )
    print(
        "| option | consumer | n | bytes ok | D knows after write returned p50 / p90 ms"
        " | after write started p50 / p90 ms | write call p50 ms | P thread busy after write p50 ms"
        " | consumer CPU per request ms |"
    )
    print("|" + "---|" * 9)
    for path in args.paths:
        if path in broken:
            print(f"| {path} | - | 0 | - | not run here: {broken[path]} (P said why on stderr) |")
            continue
        for how in args.consumers:
            rows = [e for e in done if e.path == path and e.consumer == how]
            after = [e.known - stamps[e.k][1] for e in rows]
            since = [e.known - stamps[e.k][0] for e in rows]
            call = [stamps[e.k][1] - stamps[e.k][0] for e in rows]
            busy = [stamps[e.k][2] - stamps[e.k][1] for e in rows]
            cpu = [e.cpu for e in rows]
            good = ok.get((path, how), [])
            print(
                f"| {path} | {how} | {len(rows)} | {sum(good)}/{len(good)}"
                f" | {pct(after, 50) * ms:.3f} / {pct(after, 90) * ms:.3f}"
                f" | {pct(since, 50) * ms:.3f} / {pct(since, 90) * ms:.3f}"
                f" | {pct(call, 50) * ms:.3f} | {pct(busy, 50) * ms:.3f}"
                f" | {pct(cpu, 50) * ms:.3f} |"
            )
    sys.stdout.flush()


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--role", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:N (P and D on it)")
    ap.add_argument("--mib", type=float, default=4.0, help="bytes of the data write, MiB")
    ap.add_argument("--descriptors", type=int, default=36)
    ap.add_argument("--paths", type=lambda s: s.split(","), default=list(PATHS))
    ap.add_argument("--consumers", type=lambda s: s.split(","), default=list(CONSUMERS))
    ap.add_argument("--requests", type=int, default=30, help="per row, after the warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="rounds not counted")
    ap.add_argument("--step-ms", type=float, default=5.0, help="the polling consumer's step")
    ap.add_argument("--spin-us", type=float, default=50.0, help="record/notify blocking check")
    ap.add_argument("--give-up-s", type=float, default=5.0,
                    help="an option not known within this is reported as not run")  # fmt: skip
    ap.add_argument("--d-session", default="")
    ap.add_argument("--d-ptr", type=int, default=0)
    ap.add_argument("--d-rec", type=int, default=0)
    args = ap.parse_args()
    for bad in set(args.paths) - set(PATHS):
        ap.error(f"unknown option {bad!r}; choose from {','.join(PATHS)}")
    for bad in set(args.consumers) - set(CONSUMERS):
        ap.error(f"unknown consumer {bad!r}; choose from {','.join(CONSUMERS)}")
    return args


if __name__ == "__main__":
    ns = parse()
    for name, value in plane_config(ns).mooncake_environment().items():
        os.environ.setdefault(name, value)  # nvlink_intra: the intra-node NVLink transport
    trio.run(prefill if ns.role == "prefill" else decode, ns)
