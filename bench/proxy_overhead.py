"""Proxy overhead: completions straight to an engine vs through ``pdactors proxy``, and the
proxy's own CPU per request.

The engines are the tests' stand-ins (quart-trio apps that answer at once) in this process,
with the client; the proxy runs in its own process (``python -m pdactors.cli proxy``), so its
CPU time (``/proc/<pid>/stat``) over a run, divided by the requests, is what one request costs
it. On a machine whose cores the engines use, that CPU is what the proxy takes from them and
what queues requests behind each other under load.

    python bench/proxy_overhead.py [--requests 2000] [--concurrency 1 32] [--stream]
        [--old-proxy REV] [--pin] [--compare-tls]

Paths: *direct to D* (the client sends D's request only), *direct P+D* (the client sends P's
request in the background and reads D's answer: the direct flow of upstream's example proxy;
its latency is D's answer's), and each proxy. ``--old-proxy REV`` also measures the proxy of
git revision REV (a temporary worktree), in the same run, in front of the same stand-ins.
``--pin`` puts the proxies on CPU 1 and this process (client and stand-ins) on CPU 0, so that
the added latency is the proxy's own and not its CPU queueing behind the stand-ins' (the
deployment shape where the proxy has a core of its own). ``--compare-tls`` also measures the
proxy in front of a second pair of stand-ins that serve HTTPS (a private CA, trustme), in the
same run: what TLS between the proxy and the engines costs.
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
from pathlib import Path

import httpx
import numpy as np
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common import worktree  # noqa: E402  (bench/ is the script's directory)

from tests.test_proxy import FakeEngine, serve_fake  # noqa: E402

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


async def measure(
    url: str, n: int, concurrency: int, direct: bool, stream: bool, p_url: str | None = None
) -> tuple[float, float, float]:
    """``p_url``: the direct flow also sends P its request, in the background."""
    body: dict[str, object] = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": stream}
    if direct:  # what the proxy would send D
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
            (await client.post(f"{p_url}/v1/completions", json=p_body)).raise_for_status()

        async def worker() -> None:
            for _ in todo:
                async with trio.open_nursery() as legs:
                    start = time.perf_counter()
                    if p_url is not None:
                        legs.start_soon(prefill)
                    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                        resp.raise_for_status()
                        await resp.aread()
                    latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        elapsed = time.perf_counter() - start
    p50, p99 = np.percentile(latencies, [50, 99]) * 1e3
    return float(p50), float(p99), n / elapsed


@asynccontextmanager
async def proxy_process(
    p: FakeEngine, d: FakeEngine, cwd: Path, ca_file: str | None = None
) -> AsyncIterator[tuple[str, int]]:
    """``pdactors proxy`` (the code in ``cwd``) in front of the stand-ins: (URL, pid)."""
    cmd = [
        sys.executable, "-m", "pdactors.cli", "proxy", "--port", "0",
        "--prefill", f"{p.url}@{p.url}", "--decode", d.url,
    ]  # fmt: skip
    if ca_file is not None:
        cmd += ["--ca-file", ca_file]
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    proc = await trio.lowlevel.open_process(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert proc.stdout is not None
        line = (await proc.stdout.receive_some(4096)).decode()
        url = line.split()[-1]
        async with httpx.AsyncClient(trust_env=False) as probe:
            while (await probe.get(f"{url}/health")).status_code != 200:  # noqa: ASYNC110
                await trio.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        await proc.wait()


async def main(args: argparse.Namespace) -> None:
    logging.disable(logging.INFO)
    p, d = FakeEngine("p0", engine_id="prefill-0"), FakeEngine("d0")
    async with trio.open_nursery() as nursery:
        for engine in (p, d):
            await nursery.start(serve_fake, engine)
        proxies = [("proxy", ROOT)]
        with contextlib.ExitStack() as stack:
            tls_pair = None
            if args.compare_tls:
                tls_pair = await _tls_stand_ins(
                    nursery, Path(stack.enter_context(tempfile.TemporaryDirectory()))
                )
            if args.old_proxy:
                proxies.append(
                    (f"proxy {args.old_proxy}", stack.enter_context(worktree(args.old_proxy)))
                )
            kind = "streamed" if args.stream else "non-streamed"
            pinned = "; proxies on CPU 1, client and stand-ins on CPU 0" if args.pin else ""
            print(f"# proxy overhead: stand-in engines, proxy in its own process; {kind}{pinned}")
            print("| concurrency | path | p50 ms | p99 ms | requests/s | proxy CPU ms/request |")
            print("|---|---|---|---|---|---|")
            async with contextlib.AsyncExitStack() as procs:
                urls = [
                    (name, *await procs.enter_async_context(proxy_process(p, d, cwd)))
                    for name, cwd in proxies
                ]
                if tls_pair is not None:
                    p_tls, d_tls, ca_file = tls_pair
                    over_tls = proxy_process(p_tls, d_tls, ROOT, ca_file)
                    urls.append(
                        ("proxy → HTTPS engines", *await procs.enter_async_context(over_tls))
                    )
                if args.pin:
                    os.sched_setaffinity(0, {0})
                    for _, _, pid in urls:
                        os.sched_setaffinity(pid, {1})
                for concurrency in args.concurrency:
                    targets = [
                        ("direct to D", d.url, None, None),
                        ("direct P+D", d.url, None, p.url),
                    ]
                    targets += [(name, url, pid, None) for name, url, pid in urls]
                    for name, target, pid, p_url in targets:
                        direct = pid is None
                        await measure(
                            target, 50, concurrency, direct, args.stream, p_url
                        )  # warm-up
                        cpu0 = cpu_seconds(pid) if pid else 0.0
                        p50, p99, rate = await measure(
                            target, args.requests, concurrency, direct, args.stream, p_url
                        )
                        cpu = (cpu_seconds(pid) - cpu0) / args.requests * 1e3 if pid else 0.0
                        cpu_cell = f"{cpu:.2f}" if pid else ""
                        print(
                            f"| {concurrency} | {name} | {p50:.3f} | {p99:.3f} | {rate:.0f} "
                            f"| {cpu_cell} |",
                            flush=True,
                        )
        nursery.cancel_scope.cancel()


async def _tls_stand_ins(nursery: trio.Nursery, folder: Path) -> tuple[FakeEngine, FakeEngine, str]:
    """A P and a D stand-in serving HTTPS with a certificate of a private CA; and its file."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca_file, certfile, keyfile = (str(folder / n) for n in ("ca.pem", "cert.pem", "key.pem"))
    ca.cert_pem.write_to_path(ca_file)
    for i, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(certfile, append=i > 0)
    cert.private_key_pem.write_to_path(keyfile)
    engines = (
        FakeEngine("p0", engine_id="prefill-0", tls=(certfile, keyfile)),
        FakeEngine("d0", tls=(certfile, keyfile)),
    )
    for engine in engines:
        await nursery.start(serve_fake, engine)
    return engines[0], engines[1], ca_file


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--stream", action="store_true", help="streamed completions (SSE)")
    ap.add_argument("--old-proxy", metavar="REV", help="also measure the proxy of this revision")
    ap.add_argument("--pin", action="store_true", help="proxies on CPU 1, the rest on CPU 0")
    ap.add_argument(
        "--compare-tls", action="store_true", help="also the proxy in front of HTTPS stand-ins"
    )
    trio.run(main, ap.parse_args())
