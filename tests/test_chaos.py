"""``pdactors chaos``, short: P in its own process killed, stopped and restarted, aborts,
dropped and delayed messages, failed writes and a bootstrap restart, while transfers stream.
Nothing may hang, leak or arrive corrupt; the run must also have delivered and failed some."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import trio

from pdactors.testing.chaos import FAULTS, run_chaos


@pytest.mark.parametrize("seed", [3])
async def test_chaos_nothing_hangs_leaks_or_corrupts(seed: int) -> None:
    report = await run_chaos(seconds=10, seed=seed, concurrency=4)
    assert report.passed, (report.last_line(), report.table())
    assert report.ok > 0 and report.failed > 0
    # seed 3's schedule opens with stop_p, kill_p, drop (the fault schedule has its own seed)
    assert {"stop_p", "kill_p"} <= set(report.faults)
    assert sum(int(report.faults.get(k, [0])[0]) for k in FAULTS) >= 3


async def test_chaos_catches_every_corruption_in_flight() -> None:
    report = await run_chaos(seconds=6, seed=1, concurrency=4, only=("corrupt",))
    assert report.passed, (report.corruption_line(), report.last_line())
    assert report.corrupted >= 3 and report.corrupt_delivered == 0
    assert report.caught == report.corrupted  # no other fault: each one reached D's check
    assert report.corrupt == 0 and report.ok > 0


def test_chaos_cli_prints_the_summary_and_exits_zero() -> None:
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
    args = ["chaos", "--seconds", "4", "--seed", "5", "--concurrency", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "pdactors.cli", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("chaos: ") and last.endswith(" 0 hung, 0 leaked blocks"), last
    assert "| kill_p |" in done.stdout


def _can_make_netns() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    name = f"pdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made


@pytest.mark.skipif(not _can_make_netns(), reason="needs root and iproute2 network namespaces")
async def test_chaos_across_two_network_namespaces_with_cut_links() -> None:
    report = await run_chaos(seconds=10, seed=8, concurrency=4, netns=True)
    assert report.passed, (report.last_line(), report.table())
    assert report.ok > 0
    listing = await trio.run_process(["ip", "netns", "list"], capture_stdout=True)
    assert b"pdchaos" not in listing.stdout  # the namespace and the veth pair are gone
