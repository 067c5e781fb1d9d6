"""``pdactors launch`` end to end: the README's main command (``--smoke``), Ctrl-C, a rolling
restart and SIGTERM, with real vLLM servers — and no process left behind in any."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ENV = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
MARKERS = ("vllm.entrypoints.openai.api_server", "pdactors.cli proxy", "EngineCore")


def deployment_processes() -> list[str]:
    """Command lines of live vLLM servers, engine cores and proxies on this machine."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(m in cmd for m in MARKERS):
            found.append(f"{pid}: {cmd[:120]}")
    return found


@dataclass
class Launched:
    """A ``pdactors launch`` running with its defaults: its process, its proxy's URL, and
    what it has said since (read all along: a pipe nobody reads fills up and blocks it)."""

    proc: subprocess.Popen[str]
    url: str
    said: list[str]
    reader: threading.Thread


@contextlib.contextmanager
def launched() -> Iterator[Launched]:
    """Start ``pdactors launch`` (Ctrl-C as a terminal would send it), yield it once its proxy
    is up; kill it and whatever it left behind if it still runs at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdactors.cli", "launch", "--proxy-port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
        # An ignored SIGINT is inherited across exec (an earlier test's library may have set
        # it in this process): the launcher must get Ctrl-C as a terminal would send it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 400
        for line in proc.stderr:
            if line.startswith("proxy: http://"):
                url = line.split()[1]
                break
            assert time.monotonic() < deadline
        else:
            raise AssertionError(f"launch exited early with {proc.wait()}")
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
        reader.start()
        yield Launched(proc, url, said, reader)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            for found in deployment_processes():  # what the killed launcher left behind
                with contextlib.suppress(OSError):
                    os.killpg(int(found.split(":", 1)[0]), signal.SIGKILL)
        if proc.stderr is not None:
            proc.stderr.close()


def test_smoke_checks_answers_and_exits_clean(tmp_path: Path) -> None:
    assert deployment_processes() == []
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "pdactors.cli", "launch", "--smoke", "--run-dir", str(run)],
        capture_output=True, text=True, timeout=500, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert lines[0] == f"logs: {run}"
    # 4 prompts disaggregated, then the same 4 with the proxy's own placement
    assert "smoke: 8/8 answers through the proxy equal the single server's — PASS" in lines
    summary = done.stderr[done.stderr.index("smoke: 8/8") :]
    assert "time to first token (median): single " in summary
    assert "(P's token), second token " in summary
    assert "with the proxy's own placement: " in summary
    computed = next(line for line in lines if "prompt tokens D computed itself:" in line)
    # P's first token of each request D continued (D computes it), none of the prompts
    assert int(computed.split(": ")[1].split()[0]) <= 5, computed
    moved = next(line for line in lines if "KV moved P → D:" in line)
    assert " 5 transfers, " in moved and " 0.00 MiB" not in moved  # a warm-up and 4 prompts
    # A screen, not the servers' logs: those are in the run directory, one file each.
    assert done.stdout == "" and len(lines) <= 30, done.stderr
    for name in ("prefill-0", "decode-0", "single", "proxy", "tiny-model"):
        assert (run / f"{name}.log").is_file(), name
    assert "PdActorsConnector" in (run / "prefill-0.log").read_text()
    assert deployment_processes() == []


def stop_and_check(run: Launched, sig: signal.Signals) -> None:
    """Send ``sig`` to the launcher: it must exit 0 within 60 s and leave no process."""
    run.proc.send_signal(sig)
    try:
        code = run.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        told = "".join(run.said)
        raise AssertionError(
            f"launch still running 60 s after {sig.name}; it said:\n{told}"
        ) from None
    assert code == 0, "".join(run.said)
    run.reader.join(timeout=10)
    assert deployment_processes() == []


def test_ctrl_c_stops_everything_in_bounded_time() -> None:
    """Ctrl-C (SIGTERM — what ``timeout``, systemd, ``docker stop`` and Kubernetes send, and
    which used to end the launcher at once and leave P, D and the proxy running — ends the
    rolling-restart test: one deployment fewer to start)."""
    with launched() as run:
        assert len(deployment_processes()) >= 3
        stop_and_check(run, signal.SIGINT)


def test_a_rolling_restart_under_load_fails_no_request() -> None:
    """``kill -USR1`` the launcher: every engine is drained at the proxy, restarted and
    resumed, one at a time, while a client keeps sending requests; none fails."""
    stop = threading.Event()
    answers: list[int | str] = []  # each request's status, or what broke it
    with launched() as run:

        def load() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                body = {"model": "tiny", "prompt": [4 + (i * 7 + k) % 1000 for k in range(60)],
                        "max_tokens": 16, "temperature": 0, "stream": i % 2 == 0}  # fmt: skip
                try:
                    resp = httpx.post(f"{run.url}/v1/completions", json=body, timeout=120,
                                      trust_env=False)  # fmt: skip
                    broken = '"error"' in resp.text if body["stream"] else False
                    answers.append("error event" if broken else resp.status_code)
                except httpx.HTTPError as exc:
                    answers.append(repr(exc))

        client = threading.Thread(target=load, daemon=True)
        client.start()
        try:
            while len(answers) < 5:
                time.sleep(0.1)
            before = len(answers)
            run.proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 400
            while not any("every engine restarted" in line for line in run.said):
                assert run.proc.poll() is None, "".join(run.said)
                assert time.monotonic() < deadline, "".join(run.said)
                time.sleep(0.5)
        finally:
            stop.set()
            client.join(timeout=150)
        assert [a for a in answers if a != 200] == [], "".join(run.said)
        assert len(answers) - before >= 10  # the client kept asking through the restarts
        assert sum("back in the routing" in line for line in run.said) == 2  # P and D
        stop_and_check(run, signal.SIGTERM)  # after restarts: every new process stops too
