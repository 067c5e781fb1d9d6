"""How close is D's answer to a single server's, token by token, for one model family?

Starts a single server, a P and a D of the tiny ``--family`` model (the engine arguments the
e2e tests use for it), sends each prompt length through both with greedy decoding and prints,
per length: whether the first tokens are equal and how far apart their logprobs are, whether
the whole answers are equal, and where they first differ (with both sides' top two there).

    python bench/pd_vs_single.py [--family gdn|sliding|mla|llama] [--lengths 2 5 20 ...]
                                 [--engine-args="--dtype bfloat16 ..."] [--shared-prefix]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdactors_vllm.tiny_model import FAMILIES, ensure_tiny_model, serving_args
from tests.vllm.servers import (
    Server,
    completion,
    consumer_config,
    free_port,
    producer_config,
    servers,
)
from tests.vllm.test_e2e import prompt_ids


def greedy(server: Server, prompt: list[int], n: int, **params: Any) -> list[dict[str, float]]:
    """The top-2 logprobs of each of the ``n`` greedy tokens after ``prompt``."""
    answer = completion(
        server, prompt, max_tokens=n, logprobs=2, return_tokens_as_token_ids=True, **params
    )
    tops: list[dict[str, float]] = answer["choices"][0]["logprobs"]["top_logprobs"]
    return tops


def disaggregated(p: Server, d: Server, url: str, prompt: list[int], n: int) -> list[Any]:
    tid = f"bench-{uuid.uuid4().hex}"
    d_params = {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-bench",
        "remote_bootstrap_addr": url,
        "transfer_id": tid,
    }
    with ThreadPoolExecutor(2) as pool:
        p_done = pool.submit(
            completion, p, prompt, max_tokens=1,
            kv_transfer_params={"do_remote_decode": True, "transfer_id": tid},
        )  # fmt: skip
        d_done = pool.submit(greedy, d, prompt, n, kv_transfer_params=d_params)
        p_done.result()
        return d_done.result()


def best(top: dict[str, float]) -> tuple[str, float]:
    return max(top.items(), key=lambda kv: kv[1])


def main(args: argparse.Namespace) -> None:
    model = ensure_tiny_model(family=args.family)
    engine_args = serving_args(args.family)
    if args.engine_args is not None:
        engine_args = tuple(args.engine_args.split())
    port = free_port()
    specs = {
        "single": {"core": 0, "extra_args": engine_args},
        "prefill": {
            "core": 0,
            "kv_transfer_config": producer_config("prefill-bench", port),
            "extra_args": engine_args,
        },
        "decode": {
            "core": 1,
            "kv_transfer_config": consumer_config("decode-bench", pull_timeout=60),
            "extra_args": engine_args,
        },
    }
    with servers(specs, model, Path(tempfile.mkdtemp())) as s:
        url = f"http://127.0.0.1:{port}"
        print(f"# D vs a single server, tiny {args.family} model {' '.join(engine_args)}, "
              f"{args.tokens} greedy tokens")  # fmt: skip
        header = "| prompt tokens | first equal | first logprob gap | all equal |"
        print(header + " first diff: single / D top-2 |")
        print("|---|---|---|---|---|")
        firsts = alls = 0
        for n in args.lengths:
            prompt = prompt_ids(n, seed=11 if args.shared_prefix else n + 11)
            want = greedy(s["single"], prompt, args.tokens)
            got = disaggregated(s["prefill"], s["decode"], url, prompt, args.tokens)
            ids = [best(t)[0] for t in want], [best(t)[0] for t in got]
            diff = next((i for i, (a, b) in enumerate(zip(*ids, strict=True)) if a != b), None)
            gap = abs(best(want[0])[1] - best(got[0])[1])
            firsts += ids[0][0] == ids[1][0]
            alls += diff is None
            where = "—" if diff is None else f"token {diff}: {want[diff]} / {got[diff]}"
            print(f"| {n} | {ids[0][0] == ids[1][0]} | {gap:.3f} | {diff is None} | {where} |")
        print(f"\nfirst tokens equal: {firsts} of {len(args.lengths)}; "
              f"whole answers equal: {alls} of {len(args.lengths)}")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--family", choices=sorted(FAMILIES), default="gdn")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2, 5, 20, 64, 100, 300, 641])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--engine-args", help="the servers' arguments instead of the family's")
    ap.add_argument(
        "--shared-prefix",
        action="store_true",
        help="each prompt extends the one before (prefix-cache hits on P and D)",
    )
    main(ap.parse_args())
