"""The project's own tiny Llama checkpoint, built locally so tests and demos never need a model hub.

`ensure_tiny_model` builds (once per cache directory) a random-weight Llama-style causal LM with a
byte-level BPE tokenizer trained on a small embedded corpus, and returns its directory, which both
HF transformers and vLLM load offline. Weights come from a fixed-seed generator, so every machine
builds the same model.

Each model is stored in the dtype every vLLM CPU path serves it in (:data:`DTYPES`), and vLLM must
be started with that dtype (:func:`serving_args`): on CPU, ``"auto"`` turns a float32 checkpoint
into bfloat16, and greedy tokens would then drift from HF's.

`find_eos_first_prompts` finds prompts whose greedy first generated token is EOS, for tests of
requests that finish at prefill.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from pdactors_vllm.tiny_model_weights import (
    BOS,
    CORPUS,
    EOS,
    PAD,
    UNK,
    deterministic_weights,
    model_config,
    train_tokenizer,
)

MODEL_NAME = "tiny-llama-v1"
"""Directory name of the model inside the cache directory; bump it with `_VERSION`."""

_VERSION = "pdactors-tiny-llama-v1"
_MARKER = ".pdactors-model-version"
_SEARCH_BATCH = 64
_SEARCH_BATCHES = 200


def default_cache_dir() -> Path:
    """The cache root: ``$PDACTORS_CACHE`` if set, else ``~/.cache/pdactors``."""
    root = os.environ.get("PDACTORS_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pdactors"


#: Model shapes: ``tiny`` (the tests') and ``small``, about 15x the compute per token (4 layers of
#: width 256, 8 query and 4 KV heads of 32), for benchmarks that need a slower engine; ``medium``
#: (4 layers of width 512, 8 query and 2 KV heads of 64) where decode steps near a 25 ms TPOT
#: objective at a few requests a second on one core.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    },
    "small": {
        "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
    },
    "medium": {
        "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    },
}  # fmt: skip


#: Model families beside the default Llama (``family=``), each tiny and random like it, with the
#: same tokenizer; what makes each one its family:
#:
#: * ``sliding``: Llama with a sliding window of 32 tokens on its first layer and full
#:   attention on the second (``layer_types``, which vLLM's Llama reads per layer);
#: * ``mla``: DeepSeek-V2-style multi-head latent attention (one latent cache per layer,
#:   ``kv_lora_rank`` 512 + 64 rope dims: the head size vLLM's CPU MLA kernel takes), dense MLP;
#: * ``gdn``: Qwen3-Next-style hybrid, gated delta-net linear attention on three layers of four
#:   and full attention on the fourth, a small mixture of experts.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "sliding": {
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "mla": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "num_key_value_heads": 4,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "first_k_dense_replace": 2,  # every layer dense: no experts
    },
    "gdn": {
        "architectures": ["Qwen3NextForCausalLM"],
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 128,  # the CPU gated delta-rule kernel's head size
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        # vLLM's Qwen3-Next needs a mixture-of-experts MLP: four small experts, two per token
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    },
}


#: The dtype each family is stored in and served with (float32 for the others). Chosen so that
#: every CPU path of vLLM 0.32 serves it: its CPU gated delta-net kernel takes bfloat16 only, and
#: on x86 CPUs with AMX vLLM runs MLA with its AMX kernel, which refuses float32 weights
#: ("expect weight to be bfloat16, float16, ..."), where the reference CPU MLA kernel of other
#: CPUs serves bfloat16 as well. (What else vLLM derives from the host, block sizes and the
#: recurrent state's dtype, is reported by the connector at start: pdactors_vllm.kv_report.)
DTYPES: dict[str, str] = {"mla": "bfloat16", "gdn": "bfloat16"}


#: Families built at any shape (their layer pattern repeats over the shape's layers); the
#: others at the ``tiny`` shape only.
ANY_SHAPE: frozenset[str] = frozenset({"llama", "sliding"})


def _config(shape: str, family: str) -> dict[str, Any]:
    config = {**SHAPES[shape], **FAMILIES[family]}
    pattern = FAMILIES[family].get("layer_types")
    if family in ANY_SHAPE and pattern:  # the pattern over every layer of the shape
        layers = config["num_hidden_layers"]
        config["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    return config


def serving_args(family: str = "llama") -> tuple[str, ...]:
    """The vLLM arguments a tiny ``family`` model must be served with: its dtype."""
    return ("--dtype", DTYPES.get(family, "float32"))


def ensure_tiny_model(
    cache_dir: Path | None = None, *, shape: str = "tiny", family: str = "llama"
) -> Path:
    """Build the tiny model under ``cache_dir`` (default `default_cache_dir`) once; return its path.

    ``shape`` picks one of :data:`SHAPES` (same tokenizer, weights drawn the same way); a shape
    other than ``tiny`` lives in ``MODEL_NAME-<shape>``. ``family`` picks one of
    :data:`FAMILIES` (at the ``tiny`` shape, or any shape for :data:`ANY_SHAPE`); another than
    ``llama`` lives in ``MODEL_NAME-<family>`` (``MODEL_NAME-<shape>-<family>`` beyond tiny).
    Raises `ValueError` for an unknown shape or family.
    The model directory is ``cache_dir / MODEL_NAME``. It holds ``config.json``,
    ``model.safetensors``, ``generation_config.json`` and a ``PreTrainedTokenizerFast``
    (``tokenizer.json``, ``tokenizer_config.json``, special tokens, chat template). An existing
    directory is reused when its version marker matches. The model is built in a temporary
    directory next to the target and renamed into place, so concurrent callers never see a
    partial model. Raises `OSError` if the directory cannot be written.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {sorted(SHAPES)}")
    if family not in FAMILIES or (family not in ANY_SHAPE and shape != "tiny"):
        raise ValueError(
            f"unknown model family {family!r} (shape tiny, or any for {sorted(ANY_SHAPE)}); "
            f"known: {sorted(FAMILIES)}"
        )
    root = (cache_dir if cache_dir is not None else default_cache_dir()).expanduser()
    name = MODEL_NAME if shape == "tiny" else f"{MODEL_NAME}-{shape}"
    name = name if family == "llama" else f"{name}-{family}"
    target = root / name
    if _is_complete(target, family):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would make a shared cache unreadable to others
        dtype = DTYPES.get(family, "float32")
        _build(tmp, _config(shape, family) | {"dtype": dtype}, family)
        for _ in range(3):
            if _is_complete(target, family):
                return target
            try:
                tmp.rename(target)
                return target
            except OSError:
                if _is_complete(target, family):
                    return target
                # A stale or foreign directory holds the name: move it aside, then retry.
                _discard(target, root)
        raise OSError(f"could not install the tiny model at {target}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def perturbed_copy(model_dir: Path, out: Path, *, seed: int = 1) -> Path:
    """Copy the model at ``model_dir`` to ``out`` with different weights of the same shape
    (what a half-finished rolling upgrade serves): seeded noise as large as each weight's own
    spread is added to every weight but the norms, and rows that are zero (tokens greedy
    decoding must never pick) stay zero. Returns ``out``. Raises `OSError`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    path = out / "model.safetensors"
    state = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(state):
        weight = state[name].float()
        if not name.endswith("norm.weight"):
            noise = torch.randn(weight.shape, generator=gen) * weight.std()
            state[name] = (weight + noise * (weight != 0)).to(state[name].dtype)
    save_file(state, str(path), metadata={"format": "pt"})
    return out


def find_eos_first_prompts(model_dir: Path, n: int = 1, *, seed: int = 0) -> list[str]:
    """Return ``n`` prompts whose greedy first generated token is EOS (checked with HF on CPU).

    The search is deterministic for a given ``seed``: it tries short sequences of corpus words
    in a seeded order. Raises `LookupError` if fewer than ``n`` are found within the search budget.
    """
    tokenizer = load_tokenizer(model_dir)
    model = load_hf_model(model_dir)
    eos = tokenizer.eos_token_id
    words = sorted(set(CORPUS.split()))
    rng = random.Random(seed)
    found: list[str] = []
    seen: set[str] = set()
    for _ in range(_SEARCH_BATCHES):
        candidates: list[str] = []
        while len(candidates) < _SEARCH_BATCH:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
            if text not in seen:
                seen.add(text)
                candidates.append(text)
        for text, token in zip(
            candidates, _batch_first_tokens(model, tokenizer, candidates), strict=True
        ):
            # The batched pass only screens; the answer is checked the way callers will check it.
            if token == eos and first_greedy_token(model, tokenizer, text) == eos:
                found.append(text)
                if len(found) == n:
                    return found
    raise LookupError(f"found only {len(found)} of {n} EOS-first prompts")


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    """Load the tiny model's tokenizer from ``model_dir`` (offline)."""
    tokenizer: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(
        str(model_dir), local_files_only=True
    )
    return tokenizer


def load_hf_model(model_dir: Path) -> LlamaForCausalLM:
    """Load the tiny model with HF transformers in float32 on CPU, in eval mode."""
    model: LlamaForCausalLM = LlamaForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, local_files_only=True
    )
    model.train(False)
    return model


@torch.inference_mode()
def first_greedy_token(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, text: str
) -> int:
    """The token id greedy decoding would emit first after ``text`` (tokenized with BOS)."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    logits = model(input_ids=ids).logits
    return int(logits[0, -1].argmax())


@torch.inference_mode()
def hf_greedy(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    text: str,
    max_new_tokens: int,
) -> list[int]:
    """Greedy-generate up to ``max_new_tokens`` after ``text`` with HF; return the new ids."""
    enc = tokenizer(text, return_tensors="pt")
    out = model.generate(  # type: ignore[misc]  # transformers types self too narrowly
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return [int(t) for t in out[0, enc["input_ids"].shape[1] :]]


@torch.inference_mode()
def _batch_first_tokens(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, texts: list[str]
) -> list[int]:
    # Right padding needs no attention mask: causal attention never looks at later positions.
    rows = [tokenizer(t)["input_ids"] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    logits = model(input_ids=ids).logits
    last = torch.tensor([len(r) - 1 for r in rows])
    return [int(t) for t in logits[torch.arange(len(rows)), last].argmax(-1)]


def _marker(family: str) -> str:
    """What a complete model's marker file says: the version (and the family)."""
    return _VERSION if family == "llama" else f"{_VERSION}-{family}-4"


def _is_complete(path: Path, family: str = "llama") -> bool:
    try:
        return (path / _MARKER).read_text().strip() == _marker(family)
    except OSError:
        return False


def _discard(path: Path, root: Path) -> None:
    aside = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.stale-", dir=root))
    try:
        path.rename(aside / "old")
    except OSError:
        pass
    shutil.rmtree(aside, ignore_errors=True)


def _build(out: Path, shape: dict[str, Any], family: str = "llama") -> None:
    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(str(out))
    config = model_config(tokenizer, shape)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(deterministic_weights(model, tokenizer))
    model.to(getattr(torch, shape.get("dtype", "float32")))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    (out / _MARKER).write_text(_marker(family) + "\n")


__all__ = [
    "BOS",
    "EOS",
    "MODEL_NAME",
    "PAD",
    "SHAPES",
    "UNK",
    "default_cache_dir",
    "ensure_tiny_model",
    "find_eos_first_prompts",
    "first_greedy_token",
    "hf_greedy",
    "load_hf_model",
    "load_tokenizer",
    "perturbed_copy",
]
