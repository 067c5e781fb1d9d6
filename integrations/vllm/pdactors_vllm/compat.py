"""This engine's :class:`~pdactors.Compat` description, read from vLLM's config once per
worker: what a P and a D must share for KV bytes to mean the same thing.

* ``model``: the architecture and a hash of the model's config (paths and versions left out);
* ``weights``: the operator's ``model_fingerprint`` when set (e.g. a checkpoint revision),
  else :func:`weights_fingerprint` of the local checkpoint, else empty (not compared), said
  once in the log;
* ``dtype``, ``kv_dtype`` (vLLM's ``cache_dtype``, or the KV tensors' dtype for ``auto``),
  ``block_size``, and ``layout``: layers, KV heads, head size and the KV memory order.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import msgspec

from pdactors import Compat
from pdactors.wire import MAX_COMPAT_FIELD, PROTOCOL_VERSION

__all__ = [
    "SAMPLES",
    "SAMPLE_BYTES",
    "dtype_of",
    "engine_compat",
    "model_digest",
    "weights_fingerprint",
    "weights_of",
    "with_kv_dtype",
]

log = logging.getLogger("pdactors.vllm")

SAMPLES = 16  #: chunks read from a large shard's data, evenly spaced, first and last included
SAMPLE_BYTES = 64 << 10  #: bytes in each chunk
_WHOLE = 4 << 20  # a shard's data up to this size is hashed whole
_MAX_HEADER = 100 << 20  # safetensors' own bound on its JSON header
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")
_NOT_MODEL = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "name_or_path"}


def weights_fingerprint(model_dir: Path) -> str:
    """A sha256 (hex, 32 characters) over each weight file of ``model_dir`` (safetensors when
    there are any, else ``.bin`` / ``.pt``): its name and size, its safetensors header (tensor
    names, dtypes, shapes, offsets), and its data, whole up to 4 MiB, else :data:`SAMPLES`
    evenly spaced chunks of :data:`SAMPLE_BYTES`: about 1 MiB read per shard, however large.
    A sample tells checkpoints apart, not an edit of a few bytes between samples. "" when the
    directory holds no weights. Raises :class:`OSError`."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in _WEIGHTS and p.is_file())
    if any(p.suffix == ".safetensors" for p in files):
        files = [p for p in files if p.suffix == ".safetensors"]
    if not files:
        return ""
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            start = 0
            if path.suffix == ".safetensors" and size >= 8:
                header = int.from_bytes(f.read(8), "little")
                if header > min(_MAX_HEADER, size - 8):
                    raise OSError(f"{path}: not a safetensors file (header of {header} bytes)")
                digest.update(f.read(header))
                start = 8 + header
            data = size - start
            offsets = [start] if data <= _WHOLE else [
                start + i * (data - SAMPLE_BYTES) // (SAMPLES - 1) for i in range(SAMPLES)
            ]  # fmt: skip
            for offset in offsets:
                f.seek(offset)
                digest.update(f.read(data if data <= _WHOLE else SAMPLE_BYTES))
    return digest.hexdigest()[:32]


@functools.cache
def _local_weights(model: str, revision: str | None) -> str:
    """The fingerprint of ``model``'s local checkpoint (a directory, or the Hugging Face
    cache's copy of a hub model), computed once per process; "" (logged once) without one."""
    where: Path | None = Path(model) if Path(model).is_dir() else None
    if where is None:
        try:
            from huggingface_hub import snapshot_download

            where = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception:  # not in the cache, or not a hub id: no local weights
            where = None
    try:
        found = weights_fingerprint(where) if where is not None else ""
    except OSError as exc:
        log.warning("PdActorsConnector: cannot fingerprint the weights of %s: %s", model, exc)
        return ""
    if not found:
        log.warning("PdActorsConnector: no local weights found for %s: weights are not "
                    "compared with peers (model_fingerprint would be)", model)  # fmt: skip
    return found


def _config_hash(hf_config: Any) -> str:
    config = {k: v for k, v in hf_config.to_dict().items() if k not in _NOT_MODEL}
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def model_digest(model_config: Any) -> str:
    """The ``model`` field: the architecture and a hash of the model's config."""
    architecture = ",".join(getattr(model_config.hf_config, "architectures", None) or ["?"])
    return f"{architecture}:{_config_hash(model_config.hf_config)}"[:MAX_COMPAT_FIELD]


def weights_of(vllm_config: Any, model_fingerprint: str) -> str:
    """The ``weights`` field: ``model_fingerprint``, else the local checkpoint's fingerprint
    (none for ``load_format: dummy``), computed once per process."""
    weights = model_fingerprint
    if not weights and vllm_config.load_config.load_format != "dummy":
        model = vllm_config.model_config
        weights = _local_weights(str(model.model), model.revision)
    return weights[:MAX_COMPAT_FIELD]


def dtype_of(model_config: Any) -> str:
    """The ``dtype`` field: the model's dtype (``float32``, ``bfloat16``...)."""
    return _dtype(model_config.dtype)


def engine_compat(vllm_config: Any, model_fingerprint: str, kv_heads: int) -> Compat:
    """This engine's description, from ``vllm_config`` (``kv_heads``: as the actors count
    them). The KV dtype is vLLM's ``cache_dtype`` until :func:`with_kv_dtype` resolves
    ``auto``."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    layout = (f"layers={model.get_total_num_hidden_layers()} kv_heads={kv_heads} "
              f"head_size={model.get_head_size()} mla={bool(model.use_mla)}")  # fmt: skip
    return Compat(
        wire=PROTOCOL_VERSION,
        model=model_digest(model),
        weights=weights_of(vllm_config, model_fingerprint),
        dtype=dtype_of(model),
        kv_dtype=str(cache.cache_dtype),
        block_size=int(cache.block_size),
        layout=layout,
    )


def with_kv_dtype(compat: Compat | None, kv_caches: dict[str, Any]) -> Compat | None:
    """``compat`` with an ``auto`` KV dtype resolved to the registered KV tensors' dtype."""
    if compat is None or compat.kv_dtype != "auto" or not kv_caches:
        return compat
    dtypes = sorted({_dtype(cache.dtype) for cache in kv_caches.values()})
    return msgspec.structs.replace(compat, kv_dtype="/".join(dtypes))
