"""The harness with every worker in a process of its own (``pdactors harness --processes``):
real worker processes, real Mooncake engines over TCP on loopback, KV in host memory. It
proves the process split itself — the coordinator's block pools, P's releases coming back over
the pipes, D's byte checks in D's processes, TP shapes as several worker processes, the same
report — without a GPU; ``--kv-device cuda:N`` runs the same coordinator and loop with the KV
in CUDA tensors (tests/vllm/test_device_kv.py runs that code on CPU tensors)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import trio

from pdactors.config import DataPlaneConfig
from pdactors.errors import PdError
from pdactors.testing.harness import run_harness
from pdactors.testing.process_cluster import open_process_cluster

ENV = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
SMALL = {"blocks": 4, "layers": 3, "block_bytes": 4096}


def _children() -> list[int]:
    """This process's live children (zombies count: a child not reaped is left behind)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                found.append(int(pid))
    return found


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
async def test_tp_shapes_move_and_verify_every_head_across_processes(p_tp: int, d_tp: int) -> None:
    before = set(_children())
    with trio.fail_after(90):
        report = await run_harness(
            requests=6, concurrency=2, processes=True, p_tp=p_tp, d_tp=d_tp,
            kv_heads=8 if p_tp != d_tp else 0, **SMALL,
        )  # fmt: skip
    assert report.passed, report.summary()
    assert (report.ok, report.verified, report.blocks_leaked) == (6, 6, 0)
    assert report.bytes_per_request == 3 * 4 * 4096  # the model's KV once, over D's workers
    assert len(report.latencies) == 6 and all(0 < t < 30 for t in report.latencies)
    # Different TP sizes: each (layer, block) is its own descriptor on one side at least.
    least = 3 * 4 if p_tp != d_tp else 3
    assert report.descriptors_per_request >= least
    assert set(_children()) <= before  # every worker process exited and was reaped


def test_cli_runs_the_process_split_and_prints_the_report() -> None:
    args = ["harness", "--processes", "--requests", "5", "--p-tp", "2", "--secure"]
    args += ["--blocks", "4", "--layers", "3", "--block-bytes", "4096"]
    done = subprocess.run(
        [sys.executable, "-m", "pdactors.cli", *args],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 ok, 5 verified, 0 failed, 0 blocks leaked" in done.stdout
    assert "latency    p50" in done.stdout and "PASS" in done.stdout


async def test_a_worker_that_dies_fails_its_transfer_and_no_process_is_left() -> None:
    before = set(_children())
    procs = []
    with trio.fail_after(90):
        with pytest.raises(BaseExceptionGroup) as caught:
            async with open_process_cluster(
                layers=2, num_blocks=8, block_bytes=4096, dataplane=DataPlaneConfig(), d_tp=1
            ) as cluster:
                procs = [w.proc for w in (*cluster.prefill, *cluster.decode)]
                assert (await cluster.run_transfer("first", 4)).verified
                cluster.decode[0].proc.kill()
                await cluster.run_transfer("second", 4)
    errors = _leaves(caught.value)
    assert any(isinstance(e, PdError) and "decode worker 0" in str(e) for e in errors), errors
    assert procs and all(p.returncode is not None for p in procs)
    assert set(_children()) <= before


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--protocol", "nvlink_intra"], "nvlink_intra moves GPU memory"),
        (["--kv-device", "tpu:0"], "use cpu or cuda:N"),
        (["--processes", "--corrupt-every", "2"], "in-process harness"),
    ],
)
def test_flags_that_do_not_fit_exit_2_at_once(flags: list[str], says: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdactors.cli", "harness", *flags],
        capture_output=True, text=True, timeout=60, env=ENV,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in " ".join(done.stderr.split())


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU may be here")
def test_gpu_kv_without_a_gpu_exits_2_with_a_sentence() -> None:
    """Where the machine has no GPU (or torch no CUDA, or no torch at all), the GPU flags fail
    before anything moves, with one sentence and exit code 2, and leave no process."""
    before = set(_children())
    done = subprocess.run(
        [sys.executable, "-m", "pdactors.cli", "harness", "--kv-device", "cuda:0",
         "--protocol", "nvlink_intra", "--requests", "2"],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    said = " ".join(done.stderr.split())
    assert "KV device cuda:0 is not available" in said or "not importable here" in said, said
    assert "Traceback" not in done.stderr and "requests" not in done.stdout
    assert set(_children()) <= before
