"""Issue 26's "done means", re-run as a new user would, on a model shape the tests do not use:
eight streams in flight through ``pdactors proxy`` when P is killed, stopped for a while, or
stopped for good, or stopped just before eight streams are sent (``stopped-before``: each
waits on P until the proxy's health verdict, then D serves it alone; the time from the stop
to each stream's first token is printed); then P and D serving two models of the same shape
with other weights.

Starts a single server (the reference), a P and a D (PdActorsConnector, the connector's
defaults) of the ``--shape`` model in ``--dtype``, and the proxy (its defaults but for
``--placement disaggregate``, so that every request goes through P). Per fault: D is frozen
while the eight streams are sent (none can finish before the fault), the fault is applied, D
resumes; then prints how many streams failed, how many texts differ from the single server's,
the proxy's retries and fall-backs, and how long the eight took. P is restarted between faults.
Last (``--compat``), P is restarted with a perturbed copy of the model: every answer must equal
the single server's (D refuses P's KV by name and computes the prompt itself).

    python bench/failover.py [--shape small] [--dtype bfloat16] [--tokens 64]
                             [--faults killed stopped stopped-for-good stopped-before]
                             [--compat]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdactors_vllm.tiny_model import ensure_tiny_model, perturbed_copy
from tests.vllm.servers import (
    Server,
    completion,
    free_port,
    producer_config,
    proxy,
    vllm_server,
    wait_healthy,
)

ENGINE = "prefill-failover"


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def stream(
    url: str, prompt: list[int], tokens: int, firsts: list[float] | None = None
) -> str | Exception:
    """The client's streamed text, or what went wrong (an HTTP status, an error event);
    ``firsts``: gets the time (``time.monotonic``) its first event came."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=900,
                          trust_env=False) as resp:  # fmt: skip
            if resp.status_code != 200:
                return RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:200]!r}")
            events = []
            for event in _events(resp.iter_lines()):
                if not events and firsts is not None:
                    firsts.append(time.monotonic())
                events.append(event)
    except httpx.HTTPError as exc:
        return exc
    errors = [e for e in events if "error" in e]
    if errors:
        return RuntimeError(str(errors[0])[:200])
    return "".join(c.get("text", "") for e in events for c in e.get("choices", ()))


def proxy_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("pdactors_proxy_retries_total", "pdactors_proxy_fallbacks_total"):
            if line.startswith(name + "{"):
                key = name.removeprefix("pdactors_proxy_").removesuffix("_total")
                counts[f"{key}{line[len(name) : line.index('}') + 1]}"] = float(line.split()[-1])
    return counts


def in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith("pdactors_proxy_requests_in_flight"))  # fmt: skip


def wait_for(what: str, ok: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--stopped-seconds", type=float, default=10.0)
    ap.add_argument("--faults", nargs="*", default=["killed", "stopped", "stopped-for-good"])
    ap.add_argument("--compat", action="store_true", help="also P with other weights")
    args = ap.parse_args()
    model = ensure_tiny_model(shape=args.shape)
    logs = Path(tempfile.mkdtemp(prefix="failover-"))
    print(f"logs in {logs}; model {model.name}, {args.dtype}")
    engine_args = ("--dtype", args.dtype)
    bootstrap_port, p_port = free_port(), free_port()
    bootstrap = f"http://127.0.0.1:{bootstrap_port}"
    d_config = {"kv_connector": "PdActorsConnector", "kv_role": "kv_consumer"}

    def start_p(stack: ExitStack, weights: Path) -> Server:
        p = stack.enter_context(vllm_server(
            "prefill", weights, logs, kv_transfer_config=producer_config(ENGINE, bootstrap_port),
            core=0, port=p_port, extra_args=engine_args))  # fmt: skip
        wait_healthy([p])
        return p

    prompts = [[int(i) for i in np.random.default_rng(500 + k).integers(4, 1024, 250 + 20 * k)]
               for k in range(8)]  # fmt: skip
    with ExitStack() as stack:
        single = stack.enter_context(
            vllm_server("single", model, logs, core=0, extra_args=engine_args)
        )
        d = stack.enter_context(vllm_server("decode", model, logs, kv_transfer_config=d_config,
                                            core=1, extra_args=engine_args))  # fmt: skip
        wait_healthy([single, d])
        want = [completion(single, p, max_tokens=args.tokens)["choices"][0]["text"]
                for p in prompts]  # fmt: skip
        single.kill()
        p_stack = stack.enter_context(ExitStack())
        p = start_p(p_stack, model)
        front = proxy([(p.url, bootstrap)], [d.url], logs / "proxy.log")
        url = stack.enter_context(front)
        for fault in args.faults:
            wait_for("P in rotation", lambda: json.loads(httpx.get(
                f"{url}/health", timeout=5, trust_env=False).text)["prefill"][0]["up"])  # fmt: skip
            before = proxy_counts(url)
            start = time.monotonic()
            firsts: list[float] = []
            with ThreadPoolExecutor(8) as pool:
                if fault == "stopped-before":  # P stopped, then the eight sent at once
                    os.killpg(p.process.pid, signal.SIGSTOP)
                    start = time.monotonic()
                    futures = [pool.submit(stream, url, pr, args.tokens, firsts) for pr in prompts]
                else:  # D frozen while the eight are sent (none ends before the fault)
                    os.killpg(d.process.pid, signal.SIGSTOP)
                    futures = [pool.submit(stream, url, pr, args.tokens) for pr in prompts]
                    try:
                        wait_for("eight in flight", lambda: in_flight(url) == 8)
                        if fault == "killed":
                            p.kill()
                        else:
                            os.killpg(p.process.pid, signal.SIGSTOP)
                    finally:
                        os.killpg(d.process.pid, signal.SIGCONT)
                    if fault == "stopped":
                        time.sleep(args.stopped_seconds)
                        os.killpg(p.process.pid, signal.SIGCONT)
                got = [f.result(timeout=900) for f in futures]
            if fault == "stopped-before":
                os.killpg(p.process.pid, signal.SIGCONT)
            took = time.monotonic() - start
            failed = [g for g in got if isinstance(g, Exception)]
            differ = sum(1 for g, w in zip(got, want, strict=True) if isinstance(g, str) and g != w)
            after = proxy_counts(url)
            moved = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
            print(f"P {fault}: {len(failed)} of 8 failed, {differ} texts differ from the single "
                  f"server's, {took:.1f} s for the eight; proxy counts {moved}")  # fmt: skip
            if firsts:
                after_stop = sorted(round(f - start, 2) for f in firsts)
                print(f"  first token after P's stop, each stream: {after_stop} s")
            for g in failed:
                print(f"  failure: {g!r}"[:300])
            if fault == "stopped-for-good":
                os.killpg(p.process.pid, signal.SIGCONT)
            p_stack.close()
            p = start_p(p_stack, model)
        if args.compat:
            p_stack.close()
            other = perturbed_copy(model, logs / "other-weights", seed=7)
            p = start_p(p_stack, other)
            wait_for("P in rotation", lambda: json.loads(httpx.get(
                f"{url}/health", timeout=5, trust_env=False).text)["prefill"][0]["up"])  # fmt: skip
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda pr: stream(url, pr, args.tokens), prompts))
            failed = [g for g in got if isinstance(g, Exception)]
            differ = sum(1 for g, w in zip(got, want, strict=True) if isinstance(g, str) and g != w)
            refused = d.log.read_text(errors="replace").count("incompatible peer: weights differ")
            print(
                f"P with other weights: {len(failed)} of 8 failed, {differ} texts differ from "
                f"the single server's; D's log names 'weights differ' {refused} times"
            )
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
