"""bench/completion_paths.py (issue 28 item 1) runs here, briefly: real Mooncake TCP engines
in two processes, real ZMQ, real trio loops; every option is known on D with its bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_completion_path_is_known_on_d_with_its_bytes() -> None:
    pytest.importorskip("mooncake.engine")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'integrations' / 'vllm'}"}
    args = ["--protocol", "tcp", "--device", "cpu", "--mib", "0.25", "--descriptors", "4",
            "--requests", "2", "--warmup", "1", "--step-ms", "1"]  # fmt: skip
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "completion_paths.py"), *args],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")]
    measured = {(r[0].lstrip("| "), r[1]): r[3] for r in rows[1:]}
    paths = ("trio", "thread_send", "thread_recv", "threads", "record", "notify")
    assert set(measured) == {(p, c) for p in paths for c in ("poll", "block")}, done.stdout
    assert all(ok == "3/3" for ok in measured.values()), done.stdout
    assert "# raw write" in done.stdout
