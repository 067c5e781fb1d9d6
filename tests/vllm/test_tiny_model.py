"""The project's tiny Llama: cached build, tokenizer, greedy behaviour, and parity with vLLM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pdactors_vllm.tiny_model import (
    MODEL_NAME,
    ensure_tiny_model,
    find_eos_first_prompts,
    first_greedy_token,
    hf_greedy,
    load_hf_model,
    load_tokenizer,
)

PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time"]
MAX_NEW_TOKENS = 16
VLLM_TIMEOUT_S = 300
SKIP_EXIT_CODE = 77

# Run as a script in its own session so a crash or hang of vLLM's engine processes can be killed
# as one process group. vLLM starts its engine with `spawn`, hence the __main__ guard.
_VLLM_SCRIPT = """\
import json, sys

def main():
    try:
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        print(f"vllm not importable: {exc!r}")
        sys.exit(SKIP_EXIT_CODE)
    model_dir, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model=model_dir, enforce_eager=True, max_model_len=1024, dtype="float32", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)

if __name__ == "__main__":
    main()
""".replace("SKIP_EXIT_CODE", str(SKIP_EXIT_CODE))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pdactors-cache")


@pytest.fixture(scope="module")
def model_dir(cache_root: Path) -> Path:
    return ensure_tiny_model(cache_root)


def test_build_is_cached_and_reused(cache_root: Path, model_dir: Path) -> None:
    assert model_dir == cache_root / MODEL_NAME
    files = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(
        files
    )
    assert ensure_tiny_model(cache_root) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == files
    assert sorted(p.name for p in cache_root.iterdir()) == [MODEL_NAME]


def test_concurrent_builds_agree_and_weights_are_deterministic(
    tmp_path: Path, model_dir: Path
) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_tiny_model(tmp_path)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / MODEL_NAME] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL_NAME]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / MODEL_NAME / name).read_bytes() == (model_dir / name).read_bytes()


def test_stale_directory_is_replaced(tmp_path: Path) -> None:
    stale = tmp_path / MODEL_NAME
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    assert ensure_tiny_model(tmp_path) == stale
    assert (stale / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL_NAME]


def test_tokenizer_round_trips_and_has_special_tokens(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    assert 1000 <= len(tok) <= 2048
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}) == 4
    for text in ["Hello, world!", "  two  spaces\nand a newline", "naïve café ☕ 42"]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<s><|user|>\nhi\n<|assistant|>\n"


def test_hf_greedy_is_deterministic_and_varied(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    model = load_hf_model(model_dir)
    first = [hf_greedy(model, tok, p, MAX_NEW_TOKENS) for p in PROMPTS]
    second = [hf_greedy(model, tok, p, MAX_NEW_TOKENS) for p in PROMPTS]
    assert first == second
    assert len({tuple(out) for out in first}) == len(PROMPTS)
    for out in first:
        assert len(out) == MAX_NEW_TOKENS
        assert tok.eos_token_id not in out
        assert len(set(out)) >= MAX_NEW_TOKENS // 2


def test_find_eos_first_prompts(model_dir: Path) -> None:
    prompts = find_eos_first_prompts(model_dir, 2, seed=0)
    assert len(set(prompts)) == 2
    assert find_eos_first_prompts(model_dir, 2, seed=0) == prompts
    tok = load_tokenizer(model_dir)
    model = load_hf_model(model_dir)
    for prompt in prompts:
        assert first_greedy_token(model, tok, prompt) == tok.eos_token_id
        assert hf_greedy(model, tok, prompt, MAX_NEW_TOKENS) == [tok.eos_token_id]


@pytest.mark.vllm
@pytest.mark.timeout(VLLM_TIMEOUT_S + 60)
def test_vllm_greedy_matches_hf(model_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(model_dir)
    model = load_hf_model(model_dir)
    prompts = [*PROMPTS, *find_eos_first_prompts(model_dir, 1)]
    expected = [hf_greedy(model, tok, p, MAX_NEW_TOKENS) for p in prompts]
    assert expected[-1] == [tok.eos_token_id]

    script = tmp_path / "run_vllm.py"
    script.write_text(_VLLM_SCRIPT)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    argv = [sys.executable, str(script), str(model_dir), json.dumps(prompts), str(MAX_NEW_TOKENS)]
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=VLLM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        output, _ = proc.communicate()
        pytest.fail(f"vLLM did not finish within {VLLM_TIMEOUT_S} s:\n{output[-4000:]}")
    finally:
        _kill_group(proc.pid)
    if proc.returncode == SKIP_EXIT_CODE:
        pytest.skip(output.strip().splitlines()[-1])
    assert proc.returncode == 0, output[-4000:]
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, output[-4000:]
    assert json.loads(lines[0].removeprefix("RESULT ")) == expected


def _kill_group(pgid: int) -> None:
    # The script leads its own session, so this reaches vLLM's engine and worker processes too.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
