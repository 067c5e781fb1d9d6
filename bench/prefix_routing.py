"""Does prefix-aware routing save P's prefills on multi-turn conversations?

Starts two P and one D of the tiny model (block size ``--block-size``, prefix caching on, each
P publishing its KV events: ``--kv-events-config``; ``--cache-blocks``: each engine's KV cache
bounded to that many blocks, so that the conversations outgrow one P's cache) and, in front
of the same servers one after the other, ``pdactors proxy`` with P's routing ``round_robin``,
then ``prefix_aware`` on what the proxy sent where (``--no-kv-events``), then ``prefix_aware``
on the P's KV events (exact, the default where engines publish them), then vllm-router's
``cache_aware`` policy in its Mooncake PD mode (when ``vllm-router`` is installed beside this
Python; skipped with a note otherwise). ``--proxy-args``: more proxy options for every run
(e.g. ``--placement disaggregate``: every prompt computed at a P); ``--proxies N``: N proxies
of each setup in front of the same engines, a conversation's turns sent to each in turn (as
replicas behind a load balancer: each proxy sends only some of the turns; vllm-router runs
alone).
Each runs the same workload shape: ``--conversations`` conversations at once, each a client that
sends ``--turns`` streamed completions one after the other, every prompt the last prompt plus
the answer plus a new user message (words drawn from a seeded list; each router gets fresh
conversations, so no router finds another's prefixes in the caches). Measured: P's prompt
tokens computed versus served from its prefix cache
(``vllm:prompt_tokens_by_source_total{source="local_compute"|"local_cache_hit"}`` on each P's
``/metrics``, the difference over the run), and the time to the first streamed chunk (TTFT)
p50/p99 at the client.

    python bench/prefix_routing.py [--conversations 8] [--turns 6] [--max-tokens 32]
                                   [--block-size 32] [--cache-blocks N] [--proxy-args "..."]
                                   [--proxies N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import (
    Server,
    consumer_config,
    free_port,
    producer_config,
    proxy,
    servers,
    stop,
)

WORDS = (
    "alpha river stone cloud market silver garden engine paper window yellow music planet "
    "forest bridge candle harbor violet winter summer copper lantern meadow signal orbit"
).split()
METRIC = "vllm:prompt_tokens_by_source_total"
MAX_MODEL_LEN = 1024


@dataclass
class Run:
    name: str
    ttft: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    requests: int = 0
    computed: dict[str, float] = field(default_factory=dict)
    cached: dict[str, float] = field(default_factory=dict)


def sources(p: Server) -> tuple[float, float]:
    return p.metric(METRIC, source="local_compute"), p.metric(METRIC, source="local_cache_hit")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def conversation(
    http: httpx.AsyncClient,
    urls: list[str],
    seed: int,
    args: argparse.Namespace,
    run: Run,
    count: Callable[[str], int],
) -> None:
    """One client: ``args.turns`` turns, each waiting for the last; stops early rather than
    outgrow the model's context."""
    rng = random.Random(seed)
    prompt = f"conversation {seed}: " + words(rng, args.first_words)
    for t in range(args.turns):
        url = urls[(seed + t) % len(urls)]  # several proxies: each turn to the next
        prompt += "\nuser: " + words(rng, args.turn_words) + "\nassistant:"
        if count(prompt) + args.max_tokens > MAX_MODEL_LEN - 8:
            return
        body = {
            "model": "tiny", "prompt": prompt, "max_tokens": args.max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
        }  # fmt: skip
        start = time.perf_counter()
        first: float | None = None
        answer: list[str] = []
        run.requests += 1
        try:
            async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    run.errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        run.errors.append(str(event["error"])[:200])
                        return
                    if first is None:
                        first = time.perf_counter() - start
                    for choice in event.get("choices") or ():
                        answer.append(choice.get("text") or "")
        except httpx.HTTPError as exc:
            run.errors.append(f"{type(exc).__name__}: {exc}")
            return
        if first is not None:
            run.ttft.append(first)
        prompt += "".join(answer)


async def workload(urls: list[str], seed0: int, args: argparse.Namespace, run: Run) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    timeout = httpx.Timeout(300, connect=10)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
        async with trio.open_nursery() as nursery:
            for c in range(args.conversations):
                nursery.start_soon(conversation, http, urls, seed0 + c, args, run, count)
                await trio.sleep(0.05)  # staggered starts, as clients arrive


@contextmanager
def vllm_router(p: list[tuple[Server, int]], d: Server, log: Path) -> Iterator[str]:
    """vllm-router's Mooncake PD mode with the cache_aware policy; yields its URL."""
    port = free_port()
    args = [str(Path(sys.executable).parent / "vllm-router"), "--vllm-pd-disaggregation"]
    args += ["--kv-connector", "mooncake", "--policy", "cache_aware"]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    args += ["--prometheus-port", str(free_port())]
    for server, bootstrap_port in p:
        args += ["--prefill", server.url, str(bootstrap_port)]
    args += ["--decode", d.url]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"vllm-router exited:\n{log.read_text()[-3000:]}"
            try:
                health = httpx.get(f"{url}/health", timeout=2, trust_env=False)
                if health.status_code == 200:  # (0.1.17 answers no JSON)
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vllm-router not healthy in 120 s"
            time.sleep(0.5)
        yield url
    finally:
        stop(proc)


def events_config() -> dict[str, object]:
    """A P's ``--kv-events-config``: vLLM binds a wildcard endpoint (a host is connected to)."""
    return {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": f"tcp://*:{free_port()}", "replay_endpoint": f"tcp://*:{free_port()}",
    }  # fmt: skip


def wait_following(url: str, ps: list[Server]) -> None:
    """Until the proxy follows every P's KV events (its /health lists their blocks)."""
    deadline = time.monotonic() + 30
    while True:
        held = httpx.get(f"{url}/health", timeout=5, trust_env=False).json()
        if all(p.url in held.get("kv_event_blocks", {}) for p in ps):
            return
        assert time.monotonic() < deadline, f"the proxy follows no KV events: {held}"
        time.sleep(0.2)


def measure(
    name: str, urls: list[str], ps: list[Server], seed0: int, args: argparse.Namespace
) -> Run:
    run = Run(name)
    before = {p.name: sources(p) for p in ps}
    trio.run(workload, urls, seed0, args, run)
    time.sleep(1.0)  # vLLM's metrics are logged on the engine's step: let the last one land
    for p in ps:
        computed, cached = sources(p)
        run.computed[p.name] = computed - before[p.name][0]
        run.cached[p.name] = cached - before[p.name][1]
    return run


def tokenize_ms(p: Server, n: int = 40) -> tuple[float, float]:
    """``POST /tokenize`` of a ~700-token prompt on an idle P, p50 and p99 in ms: what the
    proxy's exact routing adds to a text request's path."""
    rng = random.Random(7)
    times = []
    with httpx.Client(timeout=30, trust_env=False) as http:
        for _ in range(n):
            body = {"model": "tiny", "prompt": words(rng, 300)}
            start = time.perf_counter()
            http.post(f"{p.url}/tokenize", json=body).raise_for_status()
            times.append(1000 * (time.perf_counter() - start))
    return pct(times, 0.5), pct(times, 0.99)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(runs: list[Run]) -> None:
    print(f"\n{'router':<40} {'reqs':>4} {'err':>3} {'P computed':>10} {'P cached':>9} "
          f"{'hit %':>6} {'per P (computed)':>20} {'TTFT p50':>9} {'p99':>8}")  # fmt: skip
    for r in runs:
        computed, cached = sum(r.computed.values()), sum(r.cached.values())
        hit = 100 * cached / (computed + cached) if computed + cached else 0.0
        per_p = "/".join(f"{v:.0f}" for v in r.computed.values())
        print(
            f"{r.name:<40} {r.requests:>4} {len(r.errors):>3} {computed:>10.0f} {cached:>9.0f} "
            f"{hit:>6.1f} {per_p:>20} {1000 * pct(r.ttft, 0.5):>7.1f}ms "
            f"{1000 * pct(r.ttft, 0.99):>6.1f}ms"
        )
        for e in r.errors[:3]:
            print(f"    error: {e}")
    base = sum(runs[0].computed.values())
    for r in runs[1:]:
        fewer = 100 * (1 - sum(r.computed.values()) / base) if base else 0.0
        print(f"{r.name}: {fewer:.1f} % fewer prompt tokens computed on P than {runs[0].name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--first-words", type=int, default=70)
    ap.add_argument("--turn-words", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--cache-blocks", type=int, default=0, help="KV blocks per P (0: all)")
    ap.add_argument("--proxy-args", default="", help="more pdactors proxy options, every run")
    ap.add_argument(
        "--proxies", type=int, default=1,
        help="pdactors proxies in front of the same engines; a conversation's turns go to each "
        "in turn (replicas behind a load balancer)",
    )  # fmt: skip
    args = ap.parse_args()
    args.model = ensure_tiny_model()
    extra: tuple[str, ...] = ("--block-size", str(args.block_size))
    if args.cache_blocks:
        extra += ("--num-gpu-blocks-override", str(args.cache_blocks))
    bootstrap_ports = [free_port(), free_port()]
    specs = {
        f"p{i}": {
            "kv_transfer_config": producer_config(f"prefill-prefix-{i}", bootstrap_ports[i]),
            "core": str(i),
            "extra_args": (*extra, "--kv-events-config", json.dumps(events_config())),
        }
        for i in range(2)
    }
    specs["d"] = {  # D's cache unbounded: it holds every conversation's running request
        "kv_transfer_config": consumer_config("decode-prefix"),
        "core": "0-1",
        "extra_args": ("--block-size", str(args.block_size)),
    }
    router = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    with tempfile.TemporaryDirectory() as tmp, servers(specs, args.model, Path(tmp)) as s:
        logs = Path(tmp)
        ps = [s["p0"], s["p1"]]
        pairs = [
            (p.url, f"http://127.0.0.1:{port}") for p, port in zip(ps, bootstrap_ports, strict=True)
        ]
        runs: list[Run] = []
        setups = {
            "round_robin": ("--prefill-routing", "round_robin"),
            "prefix_aware (sent)": ("--prefill-routing", "prefix_aware", "--no-kv-events"),
            "prefix_aware (KV events)": ("--prefill-routing", "prefix_aware"),
        }
        for i, (name, options) in enumerate(setups.items()):
            log = logs / f"proxy-{i}.log"
            with contextlib.ExitStack() as proxies:
                urls = [
                    proxies.enter_context(
                        proxy(pairs, [s["d"].url], log.with_suffix(f".{k}.log"), *options,
                              *args.proxy_args.split())
                    )
                    for k in range(args.proxies)
                ]  # fmt: skip
                for url in urls if "events" in name else ():
                    wait_following(url, ps)
                runs.append(measure(f"pdactors proxy {name}", urls, ps, 1000 * i, args))
        report(runs)  # the proxy's figures, whatever becomes of the router's run
        p50, p99 = tokenize_ms(ps[0])
        print(f"POST /tokenize on an idle P: p50 {p50:.1f} ms, p99 {p99:.1f} ms")
        if router is None:
            print("note: vllm-router is not installed beside this Python: its run is skipped")
        else:
            with vllm_router(
                list(zip(ps, bootstrap_ports, strict=True)), s["d"], logs / "router.log"
            ) as url:
                runs.append(measure("vllm-router cache_aware", [url], ps, 5000, args))
        report(runs)


if __name__ == "__main__":
    main()
