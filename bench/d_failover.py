"""Issue 41's D targets, run as a new user would: N streams in flight through ``pdactors proxy``
with its defaults (placement auto, migration on) when D is killed, stopped or drained
mid-stream.

Starts a single server (the reference: each prompt's greedy text), then a P and a D
(PdActorsConnector, the connector's defaults) of the ``--shape`` model in ``--dtype`` and the
proxy with its defaults. Per fault and stream count: the streams are sent, D is faulted once
every stream has ``--after`` of its events (D decodes the streams placed on it; auto may give
some to P whole), and the streams run to their end. Prints per run: how many failed, how many
texts differ from the single server's, the proxy's migrations, and the pause of each stream
that D was decoding (its longest gap between two events) p50/p99. ``--placement
disaggregate`` puts every stream on D.
Faults: ``killed`` (SIGKILL), ``stopped`` (SIGSTOP until the streams end), ``drained`` (the
operator's ``POST /admin/drain``: no new request, what D holds finishes there; the drain's
answer comes once D holds nothing, and its seconds are printed), ``drained-migrate`` (the
same with ``"migrate": true``: what D holds goes on elsewhere at once).
D is restarted between runs (same ports); a drained D is resumed.

    python bench/d_failover.py [--shape small] [--dtype bfloat16] [--tokens 64]
                               [--streams 8 64] [--after 3]
                               [--faults killed stopped drained drained-migrate]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import (
    Server,
    completion,
    free_port,
    producer_config,
    proxy,
    vllm_server,
    wait_healthy,
)

ENGINE = "prefill-d-failover"


class Stream:
    """One client stream: its text, its events' arrival times, or what went wrong."""

    def __init__(self) -> None:
        self.text = ""
        self.times: list[float] = []
        self.error: str | None = None
        self.placement = ""

    def run(self, url: str, prompt: list[int], tokens: int) -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900,
                              trust_env=False) as resp:  # fmt: skip
                if resp.status_code != 200:
                    self.error = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
                    return
                self.placement = resp.headers.get("x-pdactors-placement", "")
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = str(event)[:200]
                        return
                    self.times.append(time.monotonic())
                    self.text += "".join(c.get("text", "") for c in event.get("choices", ()))
        except httpx.HTTPError as exc:
            self.error = repr(exc)[:200]

    def pause(self) -> float:
        """Its longest gap between two events over its median gap (1: no pause)."""
        gaps = [b - a for a, b in itertools.pairwise(self.times)]
        return max(gaps) / statistics.median(gaps) if len(gaps) > 1 else 1.0

    def longest_gap(self) -> float:
        return max((b - a for a, b in itertools.pairwise(self.times)), default=0.0)


def migrations(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith("pdactors_proxy_migrations_total{"))  # fmt: skip


def admin(url: str, route: str, engine: str, **fields: Any) -> dict[str, Any]:
    """``POST /admin/<route>`` on the proxy for ``engine``; its answer, with ``_took`` (s)."""
    start = time.monotonic()
    resp = httpx.post(f"{url}/admin/{route}", json={"engine": engine, **fields},
                      timeout=660, trust_env=False)  # fmt: skip
    resp.raise_for_status()
    return {**resp.json(), "_took": time.monotonic() - start}


def d_up(url: str) -> bool:
    health = httpx.get(f"{url}/health", timeout=5, trust_env=False).json()
    return bool(health["decode"][0]["up"])


def all_past(streams: list[Stream], events: int) -> bool:
    """Every stream has ``events`` events (or one failed)."""
    return min(len(s.times) for s in streams) >= events or any(s.error for s in streams)


def wait_for(what: str, ok: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="*", default=[8, 64])
    ap.add_argument("--faults", nargs="*", default=["killed", "stopped"])
    ap.add_argument("--after", type=int, default=3, help="events each stream has at the fault")
    ap.add_argument("--placement", default="auto", help="the proxy's --placement")
    args = ap.parse_args()
    model = ensure_tiny_model(shape=args.shape)
    logs = Path(tempfile.mkdtemp(prefix="d-failover-"))
    print(f"logs in {logs}; model {model.name}, {args.dtype}, {args.tokens} tokens a stream")
    engine_args = ("--dtype", args.dtype)
    bootstrap_port, d_port = free_port(), free_port()
    bootstrap = f"http://127.0.0.1:{bootstrap_port}"
    d_config = {"kv_connector": "PdActorsConnector", "kv_role": "kv_consumer"}
    n_max = max(args.streams)
    prompts = [[int(i) for i in np.random.default_rng(900 + k).integers(4, 1024, 150 + 5 * k)]
               for k in range(n_max)]  # fmt: skip

    def start_d(stack: ExitStack) -> Server:
        server = vllm_server("decode", model, logs, kv_transfer_config=d_config, core=1,
                             port=d_port, extra_args=engine_args)  # fmt: skip
        d = stack.enter_context(server)
        wait_healthy([d])
        return d

    with ExitStack() as stack:
        single = stack.enter_context(
            vllm_server("single", model, logs, core=0, extra_args=engine_args)
        )
        wait_healthy([single])
        want = [completion(single, p, max_tokens=args.tokens, ignore_eos=True)["choices"][0]["text"]
                for p in prompts]  # fmt: skip
        single.kill()
        p = stack.enter_context(vllm_server(
            "prefill", model, logs, kv_transfer_config=producer_config(ENGINE, bootstrap_port),
            core=0, extra_args=engine_args))  # fmt: skip
        d_stack = stack.enter_context(ExitStack())
        d = start_d(d_stack)
        wait_healthy([p])
        url = stack.enter_context(
            proxy([(p.url, bootstrap)], [d.url], logs / "proxy.log", "--placement", args.placement)
        )
        for fault in args.faults:
            for n in args.streams:
                wait_for("D in rotation", lambda: d_up(url))
                before = migrations(url)
                streams = [Stream() for _ in range(n)]
                start = time.monotonic()
                stopped = False
                with ThreadPoolExecutor(n) as pool:
                    for s, pr in zip(streams, prompts, strict=False):
                        pool.submit(s.run, url, pr, args.tokens)
                    wait_for(f"{args.after} events in every stream",
                             partial(all_past, streams, args.after))  # fmt: skip
                    # Those D decodes (not those a P serves whole), still short of their end.
                    on_d = [s for s in streams if s.placement != "whole-on-p"
                            and len(s.times) < args.tokens]  # fmt: skip
                    fault_at = time.monotonic()
                    if fault == "killed":
                        d.kill()
                    elif fault == "stopped":
                        os.killpg(d.process.pid, signal.SIGSTOP)
                        stopped = True
                    else:
                        migrate = fault == "drained-migrate"
                        drain = pool.submit(admin, url, "drain", d.url, migrate=migrate, wait=600)
                took = time.monotonic() - start
                drained = ""
                if fault.startswith("drained"):
                    state = drain.result()
                    drained = (f"; the drain answered after {state['_took']:.1f} s, D empty: "
                               f"{state.get('empty')}")  # fmt: skip
                if stopped:
                    os.killpg(d.process.pid, signal.SIGCONT)
                failed = [s for s in streams if s.error]
                differ = sum(1 for s, w in zip(streams, want, strict=False)
                             if not s.error and s.text != w)  # fmt: skip
                moved = migrations(url) - before
                gaps = [s.longest_gap() * 1e3 for s in on_d if s.times[-1] > fault_at]
                print(
                    f"D {fault}, {n} streams ({len(on_d)} mid-stream on D at the fault): "
                    f"{len(failed)} "
                    f"failed, {differ} texts differ from the single server's, {moved:.0f} "
                    f"migrations; longest gap of each stream on D p50 {pct(gaps, 50):.0f} ms, p99 "
                    f"{pct(gaps, 99):.0f} ms; {took:.1f} s for all{drained}"
                )
                for s in failed[:3]:
                    print(f"  failure: {s.error}")
                for s, w in [(s, w) for s, w in zip(streams, want, strict=False)
                             if not s.error and s.text != w][:3]:  # fmt: skip
                    pairs = enumerate(zip(s.text, w, strict=False))
                    at = next((i for i, (a, b) in pairs if a != b), min(len(s.text), len(w)))
                    print(f"  differs at char {at} of {len(w)} ({len(s.text)} got): got "
                          f"{s.text[max(0, at - 30):at + 30]!r}, single server "
                          f"{w[max(0, at - 30):at + 30]!r}")  # fmt: skip
                if fault.startswith("drained"):
                    admin(url, "resume", d.url)
                else:
                    d_stack.close()
                    d = start_d(d_stack)
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
