"""Does one vLLM server compute a token the same by its decode path as by its prefill path?

For each prompt length n: the server generates 2 tokens after an n-token prompt (the second is
computed by the decode path, at context n + 1), then it is given the prompt extended by the
first generated token and generates 1 (computed by the prefill path). A model whose paths
agree gives the same token both ways; PD disaggregation relies on that (D computes the last
prompt token by decode over the received KV, a single server by prefill). No connector runs.

    python bench/decode_vs_prefill.py [--family llama|sliding|mla] [--lengths 10 13 ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdactors_vllm.tiny_model import FAMILIES, ensure_tiny_model, serving_args
from tests.vllm.servers import Server, completion, servers
from tests.vllm.test_e2e import prompt_ids


def top(server: Server, prompt: list[int], n: int) -> list[tuple[int, dict[str, float]]]:
    """The ``n`` greedy tokens after ``prompt``, each with its top-3 logprobs."""
    answer: dict[str, Any] = completion(
        server, prompt, max_tokens=n, logprobs=3, return_tokens_as_token_ids=True
    )
    logprobs = answer["choices"][0]["logprobs"]
    ids = [int(t.split(":")[1]) for t in logprobs["tokens"]]
    return list(zip(ids, logprobs["top_logprobs"], strict=True))


def main(args: argparse.Namespace) -> None:
    model = ensure_tiny_model(family=args.family)
    spec = {"core": "0-1", "extra_args": serving_args(args.family)}
    with servers({"one": spec}, model, Path(tempfile.mkdtemp())) as started:
        one = started["one"]
        print(f"# decode vs prefill on one vLLM server, tiny {args.family} model")
        print("| prompt tokens | same token | by decode (logprob) | by prefill (logprob) |")
        print("|---|---|---|---|")
        same = 0
        for n in args.lengths:
            prompt = prompt_ids(n, seed=4000 + n)
            (first, _), (by_decode, decode_lp) = top(one, prompt, 2)
            ((by_prefill, prefill_lp),) = top(one, [*prompt, first], 1)
            same += by_decode == by_prefill
            print(
                f"| {n} | {by_decode == by_prefill} | {by_decode} ({max(decode_lp.values()):.3f}) "
                f"| {by_prefill} ({max(prefill_lp.values()):.3f}) |",
                flush=True,
            )
        print(f"\n{same} of {len(args.lengths)} equal")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--family", choices=sorted(set(FAMILIES) - {"gdn"}), default="mla")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(range(10, 70, 3)))
    main(ap.parse_args())
