"""What ``pdactors launch`` starts: :func:`plan_deployment` turns a
:class:`~pdactors.deploy.launch_config.LaunchConfig` into a :class:`Plan`, the child processes
(argv, environment, health URL) of P, D and every-role (``kv_both``) vLLM servers with
PdActorsConnector and the proxy.

Pure but for picking free ports; it starts vLLM only as a subprocess (``python -m
vllm.entrypoints.openai.api_server``) and imports neither vllm nor torch.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdactors.deploy.credentials import RunSecrets
from pdactors.deploy.errors import BadDeployConfig
from pdactors.deploy.launch_config import LaunchConfig

__all__ = ["Child", "Plan", "free_port", "plan_deployment", "proxy_policy_args"]


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
    """The processes to start, and where the proxy will answer. ``engine_key``: the vLLM
    servers' API key in a secure run ("" otherwise), for a client that asks them directly."""

    children: list[Child]
    proxy_url: str
    model_name: str
    engine_key: str = field(default="", repr=False)


#: The ports :func:`free_port` gave in this process (each is bound later, by another process).
_GIVEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports it gives to connections and to binds of port 0."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now, outside the kernel's ephemeral range
    and never given twice in this process. The servers bind it a minute or more later, after
    loading a model, while their processes open connections that take ephemeral ports: a port
    found by binding port 0 was taken in between (the proxy of a launcher test in CI, a P's
    bootstrap in another: "Address already in use")."""
    low, high = _ephemeral_range()
    outside = (10000, low) if low > 10000 else (high + 1, 65536)
    if outside[1] - outside[0] < 1000:  # the kernel's range is (nearly) every port
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    while True:
        port = random.randrange(*outside)
        if port in _GIVEN:
            continue
        with socket.socket() as s, suppress(OSError):
            s.bind((host, port))
            _GIVEN.add(port)
            return port


def _port(port: int, host: str) -> int:
    return port or free_port(host)


def proxy_policy_args(config: LaunchConfig) -> list[str]:
    """The ``pdactors proxy`` options that carry ``config``'s routing, placement and SLO (the
    same on one machine and in the Kubernetes manifests)."""
    return [
        "--routing", config.routing,
        "--placement", config.placement,
        "--slo-tpot-ms", str(config.slo_tpot_ms),
        "--slo-ttft-ms", str(config.slo_ttft_ms),
    ]  # fmt: skip


def _vllm_server(
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
    """One vLLM OpenAI server (with PdActorsConnector when ``kv_transfer_config`` is given)."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--host", host, "--port", str(port),
        "--max-model-len", str(max_model_len), *vllm_args,
    ]  # fmt: skip
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return Child(name, argv, env, f"http://{host}:{port}/health")


def plan_deployment(
    config: LaunchConfig,
    model: str,
    *,
    env: Mapping[str, str],
    served_name: str | None = None,
    single: bool = False,
    run_secrets: RunSecrets | None = None,
) -> Plan:
    """Turn ``config`` into the child processes to start (ports picked here), each with ``env``
    (the launching process's environment) and what it needs on top.

    With ``single``, a non-disaggregated server is added (``single``), for smoke checks.
    With ``run_secrets`` (required when ``config.secure``), every P and D gets the
    side-channel secret and the bootstrap token, and the proxy the token and its API key.
    Raises :class:`~pdactors.deploy.errors.BadDeployConfig` when they are missing.
    """
    if config.secure and run_secrets is None:
        raise BadDeployConfig("a secure deployment needs its secrets (make_secrets)")
    host = config.host
    on_gpu = bool(config.prefill_gpus or config.decode_gpus or config.both_gpus)
    base_env = {
        **env,
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
    boths: list[tuple[str, str]] = []  # engines of every role (kv_both)

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
    # Every server that may compute prompts for others (P, and every-role engines: kv_both)
    # runs a bootstrap registry; the first one's on config.bootstrap_port when given.
    sending = [("prefill", i) for i in range(config.prefill)]
    sending += [("engine", i) for i in range(config.both)]
    bootstraps = {
        name: _port(config.bootstrap_port if k == 0 else 0, host)
        for k, name in enumerate(f"{role}-{i}" for role, i in sending)
    }
    boot_urls = [f"http://{host}:{port}" for port in bootstraps.values()]
    d_extra = dict(extra)
    if run_secrets is not None:  # D sends the bootstrap token to these only
        d_extra["trusted_bootstraps"] = boot_urls
    roles = [("prefill", "kv_producer", config.prefill, config.prefill_gpus)]
    roles += [("decode", "kv_consumer", config.decode, config.decode_gpus)]
    roles += [("engine", "kv_both", config.both, config.both_gpus)]
    slot = 0  # CPU: each server bound to the next core
    for role, kv_role, count, gpus in roles:
        for i in range(count):
            name, port = f"{role}-{i}", _port(0, host)
            connector = dict(d_extra) if kv_role != "kv_producer" else dict(extra)
            if name in bootstraps:
                connector |= {"bootstrap_host": host, "bootstrap_port": bootstraps[name]}
            kv = {
                "kv_connector": "PdActorsConnector",
                "kv_role": kv_role,
                "engine_id": name,
                "kv_connector_extra_config": connector,
            }
            servers.append(
                _vllm_server(
                    name, model, host, port, kv_transfer_config=kv,
                    env=env_for(i, gpus, slot), max_model_len=config.max_model_len,
                    vllm_args=vllm_args,
                )
            )  # fmt: skip
            slot += 1
            url = f"http://{host}:{port}"
            if role == "decode":
                decodes.append(url)
            else:
                boot = f"http://{host}:{bootstraps[name]}"
                (prefills if role == "prefill" else boths).append((url, boot))
    if single:
        port = _port(0, host)
        servers.append(
            _vllm_server(
                "single", model, host, port, kv_transfer_config=None,
                env=env_for(0, config.decode_gpus or config.prefill_gpus or config.both_gpus, 0),
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
    for e_url, e_bootstrap in boths:
        argv += ["--engine", f"{e_url}@{e_bootstrap}"]
    argv += proxy_policy_args(config)
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
    engine_key = run_secrets.engine_key if run_secrets is not None else ""
    return Plan([*servers, proxy], proxy_url, served_name or model, engine_key)
