"""A real evaluation client against the proxy (issue 42): lm-evaluation-harness's
``local-completions`` model, as its users point it at an OpenAI server, run once against a
single vLLM server and once through ``pdactors proxy`` in front of a P and a D
(PdActorsConnector) of the same model; every sample's answer must be the same.

Two local tasks (this machine reaches no dataset hub), written here as lm-eval task YAML with
their data: ``pd_gen`` (``generate_until``: greedy text up to a newline, exact match) and
``pd_mc`` (``multiple_choice``: each choice's log-likelihood, which lm-eval asks for as a
completion with ``echo`` and ``logprobs``, ``max_tokens`` 1). The proxy's defaults place each
request; ``--placement`` pins one.

lm-eval is not one of the project's dependencies: give the interpreter that has it
(``--lm-eval-python``), e.g. a venv made with ``pip install "lm-eval[api]"``.

    python bench/eval_client.py --lm-eval-python /tmp/lmeval/bin/python [--placement auto]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdactors_vllm.tiny_model import ensure_tiny_model
from tests.vllm.servers import consumer_config, free_port, producer_config, proxy, servers

QUESTIONS = [
    "The capital of France is", "Two plus two equals", "The sky is usually", "Water boils at",
    "The first month of the year is", "A dog is a kind of", "The opposite of hot is",
    "Seven days make a", "The sun rises in the", "Ice is frozen",
    "The largest ocean is the", "A triangle has three",
]  # fmt: skip
CHOICES = [" yes", " no", " maybe", " blue"]


def write_tasks(folder: Path) -> None:
    """The two tasks' YAML and data in ``folder`` (lm-eval's ``--include_path``)."""
    data = folder / "data.jsonl"
    rows = [{"question": q, "answer": " Paris", "choices": CHOICES, "label": i % len(CHOICES)}
            for i, q in enumerate(QUESTIONS)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\ndoc_to_text: '{{question}}'\n"
    )
    (folder / "pd_gen.yaml").write_text(
        "task: pd_gen\n" + common + "output_type: generate_until\n"
        "doc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 16\n  do_sample: false\n"
        "  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    (folder / "pd_mc.yaml").write_text(
        "task: pd_mc\n" + common + "output_type: multiple_choice\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n"
    )


def evaluate(python: str, url: str, model: Path, tasks: Path, out: Path) -> dict[str, Any]:
    """lm-eval's samples against ``url``: ``{task: [(doc id, what the model answered)]}``."""
    args = [
        python, "-m", "lm_eval", "run", "--model", "local-completions",
        "--model_args", f"model=tiny,base_url={url}/v1/completions,tokenizer={model},"
        "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1",
        "--tasks", "pd_gen", "pd_mc", "--include_path", str(tasks),
        "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "OPENAI_API_KEY": "unused", "NO_PROXY": "*"}  # fmt: skip
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval failed:\n{done.stderr[-3000:]}")
    answers: dict[str, Any] = {}
    for file in out.rglob("samples_*.jsonl"):
        task = file.name.removeprefix("samples_").rsplit("_", 1)[0]
        rows = [json.loads(line) for line in file.read_text().splitlines() if line]
        answers[task] = sorted((r["doc_id"], r["filtered_resps"]) for r in rows)
    results = next(out.rglob("results_*.json"))
    answers["_metrics"] = json.loads(results.read_text())["results"]
    return answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm-eval-python", required=True, help="a python that has lm_eval")
    ap.add_argument("--placement", default="auto", help="the proxy's --placement")
    args = ap.parse_args()
    model = ensure_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="eval-client-"))
    write_tasks(work)
    bootstrap_port = free_port()
    specs: dict[str, dict[str, Any]] = {
        "single": {"core": 0},
        "prefill": {"core": 0,
                    "kv_transfer_config": producer_config("prefill-eval", bootstrap_port)},
        "decode": {"core": 1, "kv_transfer_config": consumer_config("decode-eval")},
    }  # fmt: skip
    with ExitStack() as stack:
        s = stack.enter_context(servers(specs, model, work))
        bootstrap = f"http://127.0.0.1:{bootstrap_port}"
        url = stack.enter_context(
            proxy(
                [(s["prefill"].url, bootstrap)],
                [s["decode"].url],
                work / "proxy.log",
                "--placement",
                args.placement,
            )
        )
        single = evaluate(args.lm_eval_python, s["single"].url, model, work, work / "single")
        through = evaluate(args.lm_eval_python, url, model, work, work / "proxy")
        moved = s["decode"].metric("vllm:prompt_tokens_by_source_total",
                                   source="external_kv_transfer")  # fmt: skip
    for task in ("pd_gen", "pd_mc"):
        same = sum(a == b for a, b in zip(single[task], through[task], strict=True))
        print(f"{task}: {same} of {len(single[task])} samples answered the same through the "
              f"proxy as by the single server")  # fmt: skip
        for a, b in zip(single[task], through[task], strict=True):
            if a != b:
                print(f"  doc {a[0]}: single {a[1]!r}, proxy {b[1]!r}"[:300])
    for task, metrics in single["_metrics"].items():
        print(f"{task}: single {metrics}; proxy {through['_metrics'].get(task)}")
    print(f"D took {moved:.0f} prompt tokens by KV transfer; files in {work}")


if __name__ == "__main__":
    main()
