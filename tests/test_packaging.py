"""The two distributions: ``pdactors`` (no vLLM code) and ``pdactors-vllm`` (the adapter and its
vLLM plugin entry point), built from copies of their sources into wheels that are then read."""

from __future__ import annotations

import configparser
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "pdactors_vllm.plugin:register"


def _wheel(sources: Path, tmp: Path) -> zipfile.ZipFile:
    """Build ``sources`` (a copy: the build leaves nothing in the checkout) into a wheel."""
    copy = tmp / "src"
    shutil.copytree(sources, copy, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(copy)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def _top_level(wheel: zipfile.ZipFile) -> set[str]:
    return {name.split("/")[0] for name in wheel.namelist()}


def _entry_points(wheel: zipfile.ZipFile) -> dict[str, dict[str, str]]:
    names = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    for name in names:
        parser.read_string(wheel.read(name).decode())
    return {section: dict(parser[section]) for section in parser.sections()}


@pytest.fixture
def core_sources(tmp_path: Path) -> Path:
    src = tmp_path / "core"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "pdactors", src / "pdactors")
    return src


def test_pdactors_installs_no_vllm_code_and_no_integrations_package(
    core_sources: Path, tmp_path: Path
) -> None:
    wheel = _wheel(core_sources, tmp_path)
    assert _top_level(wheel) == {"pdactors", "pdactors-0.1.0.dist-info"}
    assert "vllm.general_plugins" not in _entry_points(wheel)
    assert _entry_points(wheel)["console_scripts"] == {"pdactors": "pdactors.cli:main"}


def test_the_adapter_is_its_own_distribution_with_the_plugin_entry_point(tmp_path: Path) -> None:
    wheel = _wheel(ROOT / "integrations" / "vllm", tmp_path)
    assert _top_level(wheel) == {"pdactors_vllm", "pdactors_vllm-0.1.0.dist-info"}
    assert {n for n in wheel.namelist() if n.startswith("pdactors_vllm/")} >= {
        "pdactors_vllm/connector.py",
        "pdactors_vllm/plugin.py",
    }
    assert _entry_points(wheel)["vllm.general_plugins"] == {"pdactors": PLUGIN}
    metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    requires = [
        line for line in wheel.read(metadata).decode().splitlines() if line.startswith("Requires")
    ]
    assert "Requires-Dist: pdactors==0.1.0" in requires


def test_the_installed_plugin_is_what_vllm_will_load() -> None:
    """vLLM loads ``vllm.general_plugins`` entry points by name in every process it starts."""
    (entry,) = [
        e for e in importlib.metadata.entry_points(group="vllm.general_plugins")
        if e.name == "pdactors"
    ]  # fmt: skip
    assert entry.value == PLUGIN
    assert entry.dist is not None and entry.dist.name == "pdactors-vllm"
    assert entry.load().__module__ == "pdactors_vllm.plugin"  # vllm is imported only when called
