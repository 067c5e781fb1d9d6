"""The per-transfer timeline: off by default, marks to a shared file when on."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdactors import timeline


def test_marks_are_dropped_while_off(tmp_path: Path) -> None:
    assert not timeline.enabled()
    timeline.mark("t0", "ready")  # no file, no error


def test_marks_from_several_processes_join_per_transfer(tmp_path: Path) -> None:
    sink = tmp_path / "timeline.jsonl"
    timeline.enable(sink)
    try:
        timeline.mark("t1", "pull_sent")
        code = f"from pdactors import timeline; timeline.enable({str(sink)!r}); " + (
            "timeline.mark('t1', 'landed')"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        timeline.mark("t2", "ready")
        timeline.mark("t1", "pull_sent")  # a second mark of one event: the first one counts
    finally:
        timeline.disable()
    marks = timeline.read_timelines(sink)
    assert set(marks) == {"t1", "t2"}
    assert list(marks["t1"]) == ["pull_sent", "landed"]
    assert marks["t1"]["pull_sent"] <= marks["t1"]["landed"]
    timeline.mark("t3", "ready")  # off again: nothing written
    assert "t3" not in timeline.read_timelines(sink)


def test_debug_logging_turns_it_on(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="pdactors.timeline"):
        assert timeline.enabled()
        timeline.mark("t4", "write_start")
    assert "transfer t4: write_start" in caplog.text


def test_importing_it_reads_no_environment(tmp_path: Path) -> None:
    """The variable is read at the edges (CLI, adapter settings), not when the module loads."""
    sink = tmp_path / "timeline.jsonl"
    code = "from pdactors import timeline; assert not timeline.enabled(), 'enabled at import'"
    root = str(Path(timeline.__file__).resolve().parents[1])  # this pdactors, not the cwd's
    env = {**os.environ, timeline.ENV: str(sink), "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, timeout=60, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
    assert not sink.exists()


def test_the_adapters_settings_enable_the_sink_the_environment_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Users who set ``$PDACTORS_TIMELINE`` for vLLM servers keep getting their marks."""
    settings = pytest.importorskip("pdactors_vllm.settings")
    sink = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(timeline.ENV, str(sink))
    try:
        settings.settings_from_extra_config({})
        timeline.mark("t5", "reported")
    finally:
        timeline.disable()
    assert list(timeline.read_timelines(sink)) == ["t5"]


def test_the_cli_enables_the_sink_the_environment_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdactors._cli_setup import setup

    sink = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(timeline.ENV, str(sink))
    try:
        setup(verbose=False)
        timeline.mark("t6", "ready")
    finally:
        timeline.disable()
    assert list(timeline.read_timelines(sink)) == ["t6"]
