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
        code = "from pdactors import timeline; timeline.mark('t1', 'landed')"
        env = {**os.environ, timeline.ENV: str(sink)}
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
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
