"""The adapter's compatibility description (no servers): the weights fingerprint tells two
same-shape models apart and a model from its copy not; the description is read from vLLM's
own config objects; the settings validate ``compat_relax`` and reach both actors."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import CacheConfig, LoadConfig, ModelConfig

from pdactors import RankInfo
from pdactors.wire import PROTOCOL_VERSION
from pdactors_vllm.actor_configs import WorkerPlace, actor_configs
from pdactors_vllm.compat import (
    SAMPLE_BYTES,
    SAMPLES,
    engine_compat,
    weights_fingerprint,
    with_kv_dtype,
)
from pdactors_vllm.errors import ConnectorConfigError
from pdactors_vllm.settings import settings_from_extra_config
from pdactors_vllm.tiny_model import ensure_tiny_model, perturbed_copy

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model() -> Path:
    return ensure_tiny_model()


def test_the_same_model_has_one_fingerprint_and_other_weights_another(
    model: Path, tmp_path: Path
) -> None:
    mine = weights_fingerprint(model)
    assert len(mine) == 32 and mine == weights_fingerprint(model)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert weights_fingerprint(copy) == mine  # where it lives does not matter
    other = perturbed_copy(model, tmp_path / "other", seed=1)
    assert weights_fingerprint(other) not in ("", mine)
    assert weights_fingerprint(perturbed_copy(model, tmp_path / "again", seed=1)) == (
        weights_fingerprint(other)
    )  # same seed, same weights
    assert weights_fingerprint(perturbed_copy(model, tmp_path / "seed2", seed=2)) != (
        weights_fingerprint(other)
    )


def _safetensors(path: Path, header: bytes, data: bytes) -> None:
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def test_a_large_shard_is_sampled_and_its_header_always_counts(tmp_path: Path) -> None:
    data = bytearray(64 << 20)  # 64 MiB: sampled, not read whole
    header = b'{"w": {"dtype": "F32", "shape": [16777216], "data_offsets": [0, 67108864]}}'
    _safetensors(tmp_path / "model.safetensors", header, bytes(data))
    base = weights_fingerprint(tmp_path)
    step = (len(data) - SAMPLE_BYTES) // (SAMPLES - 1)
    data[3 * step + 5] = 1  # inside the fourth sample
    _safetensors(tmp_path / "model.safetensors", header, bytes(data))
    assert weights_fingerprint(tmp_path) != base
    data[3 * step + 5] = 0
    _safetensors(tmp_path / "model.safetensors", header.replace(b"F32", b"I32"), bytes(data))
    assert weights_fingerprint(tmp_path) != base
    (tmp_path / "model.safetensors").unlink()
    assert weights_fingerprint(tmp_path) == ""  # no weights: nothing invented
    (tmp_path / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little"))
    with pytest.raises(OSError, match="not a safetensors file"):
        weights_fingerprint(tmp_path)


def _vllm_config(model: Path | str, **cache: object) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=ModelConfig(model=str(model), dtype="float32"),
        cache_config=CacheConfig(block_size=16, **cache),  # type: ignore[arg-type]
        load_config=LoadConfig(),
    )


def test_the_description_is_read_from_vllms_config(model: Path, tmp_path: Path) -> None:
    mine = engine_compat(_vllm_config(model), "", 2)
    assert mine.wire == PROTOCOL_VERSION and mine.model.startswith("LlamaForCausalLM:")
    assert mine.weights == weights_fingerprint(model)
    assert (mine.dtype, mine.kv_dtype, mine.block_size) == ("float32", "auto", 16)
    assert mine.layout == "layers=2 kv_heads=2 head_size=32 mla=False"
    other = engine_compat(_vllm_config(perturbed_copy(model, tmp_path / "o")), "", 2)
    assert other.model == mine.model and other.weights != mine.weights  # same config
    assert engine_compat(_vllm_config(model), "rev-42", 2).weights == "rev-42"  # the operator's
    caches = {"layer.0": torch.zeros(2, dtype=torch.bfloat16)}
    assert with_kv_dtype(mine, caches).kv_dtype == "bfloat16"  # type: ignore[union-attr]
    fp8 = engine_compat(_vllm_config(model, cache_dtype="fp8_e4m3"), "", 2)
    assert with_kv_dtype(fp8, caches) == fp8  # what vLLM was told wins over the storage


def test_no_local_weights_leaves_the_field_empty_and_says_so_once(
    tmp_path: Path, model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(model / "config.json", bare / "config.json")
    for _ in range(2):
        assert engine_compat(_vllm_config(bare), "", 2).weights == ""
    said = [r for r in caplog.records if "no local weights found" in r.message]
    assert len(said) == 1 and said[0].levelno == logging.WARNING


def test_settings_name_relaxed_fields_and_both_actors_get_them() -> None:
    with pytest.raises(ConnectorConfigError, match="'kv_type', which is not a compat"):
        settings_from_extra_config({"compat_relax": ["kv_type"]})
    s = settings_from_extra_config({"compat_relax": ["kv_dtype"], "model_fingerprint": "r1"})
    assert s.model_fingerprint == "r1"
    from pdactors import Compat

    place = WorkerPlace("e", True, True, RankInfo(), False, compat=Compat(weights="r1"))
    configs = actor_configs(s, place)
    assert configs.sender is not None and configs.receiver is not None
    assert configs.sender.compat == configs.receiver.compat == Compat(weights="r1")
    assert configs.sender.compat_relax == configs.receiver.compat_relax == ("kv_dtype",)


def _with_transfer(config: SimpleNamespace, **extra: object) -> SimpleNamespace:
    config.kv_transfer_config = SimpleNamespace(
        kv_role="kv_consumer", kv_connector_extra_config=extra
    )
    return config


def test_the_api_servers_info_labels_are_the_workers_identity_fields(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What D's API server exports for the proxy equals, field by field, what its workers
    register (the same functions, the same digests); a field that cannot be computed is left
    empty and said, never a failed server."""
    from pdactors_vllm.metrics import identity_labels

    workers = engine_compat(_vllm_config(model), "", 2)
    labels = identity_labels(_with_transfer(_vllm_config(model)))
    assert labels == {"role": "kv_consumer", "model": workers.model, "weights": workers.weights,
                      "dtype": workers.dtype, "relax": ""}  # fmt: skip
    pinned = identity_labels(
        _with_transfer(_vllm_config(model), model_fingerprint="rev-42", compat_relax=["kv_dtype"])
    )
    assert (pinned["weights"], pinned["relax"]) == ("rev-42", "kv_dtype")
    broken = _with_transfer(_vllm_config(model))
    broken.load_config = None  # the weights cannot be looked up: the rest is still exported
    labels = identity_labels(broken)
    assert (labels["weights"], labels["model"]) == ("", workers.model)
    assert any("cannot compute weights" in r.message for r in caplog.records)


def test_the_info_gauge_is_on_metrics_from_start_up(model: Path) -> None:
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest

    from pdactors_vllm.metrics import PdActorsPromMetrics

    before = set(REGISTRY._names_to_collectors)
    config = _with_transfer(_vllm_config(model))
    types: dict[type, type] = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    try:
        PdActorsPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
        text = generate_latest(REGISTRY).decode()
    finally:
        for name in set(REGISTRY._names_to_collectors) - before:
            collector = REGISTRY._names_to_collectors.get(name)
            if collector is not None:
                REGISTRY.unregister(collector)
    (line,) = [x for x in text.splitlines() if x.startswith("vllm:pdactors_compat_info{")]
    assert 'role="kv_consumer"' in line and f'weights="{weights_fingerprint(model)}"' in line
    assert line.endswith(" 1.0")
