"""Proxy overhead: completions straight to the engines vs through ``pdactors proxy``, every
piece in a process of its own, and the proxy's own CPU per request.

The engines are the tests' stand-ins (quart-trio apps that answer at once), each in its own
process (``bench/stand_in.py``); the proxy runs in its own (``python -m pdactors.cli proxy``);
the client (httpx) is this process. The proxy's CPU time (``/proc/<pid>/stat``) over a run,
divided by the requests, is what one request costs it; on a machine whose cores the engines
use, that CPU is what the proxy takes from them.

    python bench/proxy_overhead.py [--requests 2000] [--rounds 4] [--concurrency 1 32]
        [--stream] [--old-proxy REV] [--pin] [--compare-tls]

Paths, measured side by side in one run: *direct to D* (the client sends D's request only),
*direct P+D* (the client sends P's request in the background and reads D's answer: the
direct flow of upstream's example proxy; its latency is D's answer's), and each proxy. The
requests of a path are split in ``--rounds`` rounds, the paths taking turns, so that a drift
of the machine over the run falls on every path alike. Printed: p50 and p99 per path, then
per proxy the added ms (proxy − direct P+D) and the ratios.

``--old-proxy REV`` also measures the proxy of git revision REV (a temporary worktree; or a
directory holding a copy of ``pdactors/``), in front of the same stand-ins. ``--pin`` puts
the proxies on CPU 1 and the client and the stand-ins on CPU 0 (the deployment shape where
the proxy has a core of its own).
``--compare-tls`` also measures the proxy in front of a second pair of stand-ins that serve
HTTPS (a private CA, trustme): what TLS between the proxy and the engines costs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common import process_cpu_seconds, worktree  # noqa: E402  (bench/ is the script's directory)

_STAND_IN = Path(__file__).resolve().parent / "stand_in.py"


@dataclass
class Route:
    """One measured path: where the client sends, and what it has measured so far."""

    name: str
    url: str
    pid: int | None = None  # the proxy's, if through one
    p_url: str | None = None  # direct P+D: P's request too, in the background
    latencies: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    cpu: float = 0.0

    def percentiles(self) -> tuple[float, float]:
        p50, p99 = np.percentile(self.latencies, [50, 99]) * 1e3
        return float(p50), float(p99)


async def measure(path: Route, n: int, concurrency: int, stream: bool) -> list[float]:
    """``n`` requests over ``concurrency`` connections: their latencies (s); adds the wall
    time to ``path.elapsed``."""
    body: dict[str, object] = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": stream}
    if path.pid is None:  # what the proxy would send D
        body["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": "t"}
    p_body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t"},
    }
    latencies: list[float] = []
    todo = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency * 4)
    async with httpx.AsyncClient(trust_env=False, timeout=30, limits=limits) as client:

        async def prefill() -> None:
            (await client.post(f"{path.p_url}/v1/completions", json=p_body)).raise_for_status()

        async def worker() -> None:
            for _ in todo:
                async with trio.open_nursery() as legs:
                    start = time.perf_counter()
                    if path.p_url is not None:
                        legs.start_soon(prefill)
                    async with client.stream(
                        "POST", f"{path.url}/v1/completions", json=body
                    ) as resp:
                        resp.raise_for_status()
                        await resp.aread()
                    latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        path.elapsed += time.perf_counter() - start
    return latencies


@asynccontextmanager
async def _process(cmd: list[str], cwd: Path) -> AsyncIterator[tuple[str, int]]:
    """A child that prints its URL as the last word of its first line: (URL, pid)."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    proc = await trio.lowlevel.open_process(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert proc.stdout is not None
        line = (await proc.stdout.receive_some(4096)).decode()
        url = line.split()[-1]
        async with httpx.AsyncClient(trust_env=False, verify=False) as probe:
            while (await probe.get(f"{url}/health")).status_code != 200:  # noqa: ASYNC110
                await trio.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        await proc.wait()


def stand_in(name: str, engine_id: str = "", tls: tuple[str, str] | None = None) -> Any:
    """A stand-in engine in its own process: (URL, pid)."""
    cmd = [sys.executable, str(_STAND_IN), name, "--engine-id", engine_id]
    if tls is not None:
        cmd += ["--certfile", tls[0], "--keyfile", tls[1]]
    return _process(cmd, ROOT)


def proxy_process(p_url: str, d_url: str, cwd: Path, ca_file: str | None = None) -> Any:
    """``pdactors proxy`` (the code in ``cwd``) in front of the stand-ins: (URL, pid)."""
    cmd = [
        sys.executable, "-m", "pdactors.cli", "proxy", "--port", "0",
        "--prefill", f"{p_url}@{p_url}", "--decode", d_url,
    ]  # fmt: skip
    if ca_file is not None:
        cmd += ["--ca-file", ca_file]
    return _process(cmd, cwd)


async def main(args: argparse.Namespace) -> None:
    logging.disable(logging.INFO)
    with contextlib.ExitStack() as stack:
        async with contextlib.AsyncExitStack() as procs:
            p_url, p_pid = await procs.enter_async_context(stand_in("p0", "prefill-0"))
            d_url, d_pid = await procs.enter_async_context(stand_in("d0"))
            engine_pids = [p_pid, d_pid]
            proxies = [("proxy", ROOT)]
            if args.old_proxy:
                proxies.append((f"proxy {args.old_proxy}", _tree(stack, args.old_proxy)))
            urls = [
                (name, *await procs.enter_async_context(proxy_process(p_url, d_url, cwd)))
                for name, cwd in proxies
            ]
            if args.compare_tls:
                certs = _certificates(Path(stack.enter_context(tempfile.TemporaryDirectory())))
                certfile, keyfile, ca_file = certs
                p_tls, p_tls_pid = await procs.enter_async_context(
                    stand_in("p0", "prefill-0", (certfile, keyfile))
                )
                d_tls, d_tls_pid = await procs.enter_async_context(
                    stand_in("d0", "", (certfile, keyfile))
                )
                engine_pids += [p_tls_pid, d_tls_pid]
                over_tls = proxy_process(p_tls, d_tls, ROOT, ca_file)
                urls.append(("proxy → HTTPS engines", *await procs.enter_async_context(over_tls)))
            if args.pin:
                for pid in (0, *engine_pids):
                    os.sched_setaffinity(pid, {0})
                for _, _, pid in urls:
                    os.sched_setaffinity(pid, {1})
            kind = "streamed" if args.stream else "non-streamed"
            pinned = "; proxies on CPU 1, client and stand-ins on CPU 0" if args.pin else ""
            print(
                f"# proxy overhead: stand-ins, proxy and client in processes of their own; "
                f"{kind}; {args.requests} requests per row in {args.rounds} rounds{pinned}"
            )
            print("| concurrency | path | p50 ms | p99 ms | requests/s | proxy CPU ms/request |")
            print("|---|---|---|---|---|---|")
            summary = []
            for concurrency in args.concurrency:
                paths = [Route("direct to D", d_url), Route("direct P+D", d_url, p_url=p_url)]
                paths += [Route(name, url, pid) for name, url, pid in urls]
                for path in paths:
                    await measure(path, 50, concurrency, args.stream)  # warm-up
                per_round = max(1, args.requests // args.rounds)
                for _ in range(args.rounds):
                    for path in paths:
                        cpu0 = process_cpu_seconds(path.pid) if path.pid else 0.0
                        path.latencies += await measure(path, per_round, concurrency, args.stream)
                        path.cpu += process_cpu_seconds(path.pid) - cpu0 if path.pid else 0.0
                for path in paths:
                    p50, p99 = path.percentiles()
                    rate = len(path.latencies) / path.elapsed
                    cpu = f"{path.cpu / len(path.latencies) * 1e3:.2f}" if path.pid else ""
                    print(
                        f"| {concurrency} | {path.name} | {p50:.3f} | {p99:.3f} | {rate:.0f} "
                        f"| {cpu} |",
                        flush=True,
                    )
                base50, base99 = paths[1].percentiles()
                for path in paths[2:]:
                    p50, p99 = path.percentiles()
                    added = f"{p50 - base50:+.3f} | {p99 - base99:+.3f}"
                    ratios = f"{p50 / base50:.2f} | {p99 / base99:.2f}"
                    summary.append(f"| {concurrency} | {path.name} | {added} | {ratios} |")
            print("\n# added: proxy − direct P+D; ratio: proxy / direct P+D")
            print("| concurrency | path | added p50 ms | added p99 ms | p50 ratio | p99 ratio |")
            print("|---|---|---|---|---|---|")
            print("\n".join(summary))


def _tree(stack: contextlib.ExitStack, rev: str) -> Path:
    """The directory ``rev``, or a temporary worktree of revision ``rev`` (for ``stack``)."""
    return Path(rev) if Path(rev).is_dir() else stack.enter_context(worktree(rev))


def _certificates(folder: Path) -> tuple[str, str, str]:
    """A certificate for 127.0.0.1 from a private CA: (certfile, keyfile, CA file)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca_file, certfile, keyfile = (str(folder / n) for n in ("ca.pem", "cert.pem", "key.pem"))
    ca.cert_pem.write_to_path(ca_file)
    for i, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(certfile, append=i > 0)
    cert.private_key_pem.write_to_path(keyfile)
    return certfile, keyfile, ca_file


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--stream", action="store_true", help="streamed completions (SSE)")
    ap.add_argument(
        "--old-proxy", metavar="REV", help="also measure the proxy of this revision (or directory)"
    )
    ap.add_argument("--pin", action="store_true", help="proxies on CPU 1, the rest on CPU 0")
    ap.add_argument(
        "--compare-tls", action="store_true", help="also the proxy in front of HTTPS stand-ins"
    )
    trio.run(main, ap.parse_args())
