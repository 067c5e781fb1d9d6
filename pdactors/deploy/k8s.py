"""``pdactors launch --config deploy.toml --render k8s``: the deployment as Kubernetes manifests.

From a :class:`~pdactors.deploy.launch_config.LaunchConfig` (its ``[k8s]`` table is
:class:`~pdactors.deploy.k8s_config.K8sConfig`):

* P: a StatefulSet of vLLM OpenAI servers with PdActorsConnector (``kv_producer``), each pod
  with a ``pdactors bootstrap`` sidecar that is *its* bootstrap (``bootstrap_server_address``),
  behind a headless Service, so pod ``i`` is ``NAME-prefill-i.NAME-prefill.NS.svc.DOMAIN``.
  One bootstrap per P server, not one for all: the registry keeps one engine per DP rank, so
  independent P servers (each DP rank 0) registering at one bootstrap would replace each other.
* D: a StatefulSet (``kv_consumer``) behind a headless Service, likewise.
* Engines of every role (``both``): a StatefulSet (``kv_both``) behind a headless Service, each
  pod with its bootstrap sidecar as P's (it computes prompts for others too), D's trusted
  bootstraps in secure mode (it pulls from others too).
* The proxy: a Deployment of ``pdactors proxy`` naming every P pod (``ENGINE_URL@BOOTSTRAP_URL``),
  every D pod and every engine of every role (``--engine ENGINE_URL@BOOTSTRAP_URL``) by its
  DNS name, and a Service in front of it. A role with no server has no objects.

Workers advertise their pod IP (the downward API: ``host`` in the connector config is what
the side channel and Mooncake bind and advertise). Servers are ready when ``/health`` answers
(a startup probe allows ``startup_timeout`` for the model to load); pods carry Prometheus
scrape annotations. With ``secure``, every credential comes from a Secret the operator created
(docs/deploy.md); nothing secret is written into the manifests. No IO but
:func:`write_manifests`; no vllm or torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from pdactors.config import DEFAULT_BOOTSTRAP_PORT
from pdactors.deploy.credentials import SECRET_FILES
from pdactors.deploy.errors import BadDeployConfig
from pdactors.deploy.k8s_config import K8sConfig
from pdactors.deploy.launch_config import LaunchConfig
from pdactors.deploy.plan import proxy_policy_args

__all__ = ["SECRETS_DIR", "SECRET_KEYS", "render_k8s", "write_manifests"]

PREFILL_PORT, DECODE_PORT, ENGINE_PORT, DEFAULT_PROXY_PORT = 8100, 8200, 8300, 8000
SECRETS_DIR = "/etc/pdactors/secrets"
#: The Secret's keys: the file names ``pdactors launch --secure`` writes (make_secrets).
SECRET_KEYS = SECRET_FILES


def render_k8s(config: LaunchConfig) -> list[dict[str, Any]]:
    """The manifests of ``config``'s deployment, as plain dicts (Services before workloads).

    Raises :class:`~pdactors.deploy.errors.BadDeployConfig` when ``config`` cannot be
    deployed: no ``model`` (the tiny model is built on the launching machine), or ``rdma``
    with neither an RDMA resource nor the host's network.
    """
    k = config.k8s
    if config.model is None:
        raise BadDeployConfig(
            "a Kubernetes deployment needs a model: set model (a Hugging Face id, or a path "
            "under k8s.model_mount with k8s.model_pvc)"
        )
    if config.protocol == "rdma" and not (k.rdma_resource or k.host_network):
        raise BadDeployConfig(
            "protocol rdma needs the NIC in the pod: set k8s.rdma_resource (a device plugin's "
            "resource) or k8s.host_network = true"
        )
    bootstrap_port = config.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
    p_urls = _pod_urls(k, "prefill", config.prefill, PREFILL_PORT)
    boot_urls = _pod_urls(k, "prefill", config.prefill, bootstrap_port)
    d_urls = _pod_urls(k, "decode", config.decode, DECODE_PORT)
    e_urls = _pod_urls(k, "engine", config.both, ENGINE_PORT)
    e_boot_urls = _pod_urls(k, "engine", config.both, bootstrap_port)
    extra: dict[str, Any] = {
        "protocol": config.protocol,
        "device_name": config.device_name,
        "host": "$(POD_IP)",  # Kubernetes substitutes it from the env (downward API)
    }
    if config.secure:
        extra["side_channel_secret_file"] = f"{SECRETS_DIR}/side-channel.secret"
        extra["bootstrap_token_file"] = f"{SECRETS_DIR}/bootstrap.token"
    p_extra = {**extra, "bootstrap_server_address": f"$(POD_IP):{bootstrap_port}"}
    # D sends the token only to bootstraps it trusts: those of every server that computes
    # prompts for others, named as the proxy names them.
    trusted = {"trusted_bootstraps": boot_urls + e_boot_urls} if config.secure else {}
    d_extra = {**extra, **trusted}
    bootstrap_argv = ["pdactors", "bootstrap", "--host", "0.0.0.0", "--port", str(bootstrap_port)]
    if config.secure:
        bootstrap_argv += ["--token-file", f"{SECRETS_DIR}/bootstrap.token"]
    bootstrap = {
        "name": "bootstrap",
        "image": k.image,
        "imagePullPolicy": k.image_pull_policy,
        "command": bootstrap_argv,
        "ports": [{"name": "bootstrap", "containerPort": bootstrap_port}],
        "readinessProbe": _probe("bootstrap", period=5),
        **_secret_mount(config),
    }
    model = config.model
    prefill = _server(config, model, PREFILL_PORT, k.gpus_per_prefill, "kv_producer", p_extra)
    decode = _server(config, model, DECODE_PORT, k.gpus_per_decode, "kv_consumer", d_extra)
    every = _server(config, model, ENGINE_PORT, k.gpus_per_engine, "kv_both", p_extra | trusted)
    out = []
    for role, count, port, pod in (
        ("prefill", config.prefill, PREFILL_PORT, [prefill, bootstrap]),
        ("decode", config.decode, DECODE_PORT, [decode]),
        ("engine", config.both, ENGINE_PORT, [every, bootstrap]),
    ):
        if count:
            ports = [("http", port)] + ([("bootstrap", bootstrap_port)] if bootstrap in pod else [])
            out += [_headless_service(k, role, ports), _stateful_set(config, role, count, pod)]
    prefills = list(zip(p_urls, boot_urls, strict=True))
    engines = list(zip(e_urls, e_boot_urls, strict=True))
    return [*out, _proxy(config, prefills, d_urls, engines), _proxy_service(config)]


def write_manifests(config: LaunchConfig, out_dir: Path) -> list[Path]:
    """Write :func:`render_k8s`'s manifests into ``out_dir`` (created if need be), one YAML file
    per object (``NN-NAME-KIND.yaml``, in apply order), and return their paths. Existing files
    of those names are replaced. Raises BadDeployConfig (as render_k8s) or OSError."""
    manifests = render_k8s(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, manifest in enumerate(manifests):
        name, kind = manifest["metadata"]["name"], manifest["kind"].lower()
        path = out_dir / f"{i:02d}-{name}-{kind}.yaml"
        path.write_text(yaml.safe_dump(manifest, sort_keys=False, width=100))
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------- pieces


def _full(k: K8sConfig, role: str) -> str:
    return f"{k.name}-{role}"


def _labels(k: K8sConfig, role: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pdactors",
        "app.kubernetes.io/instance": k.name,
        "app.kubernetes.io/component": role,
    }


def _meta(k: K8sConfig, role: str) -> dict[str, Any]:
    return {"name": _full(k, role), "namespace": k.namespace, "labels": _labels(k, role)}


def _pod_urls(k: K8sConfig, role: str, n: int, port: int) -> list[str]:
    """The URLs of a StatefulSet's pods through its headless Service's DNS names."""
    svc = f"{_full(k, role)}.{k.namespace}.svc.{k.cluster_domain}"
    return [f"http://{_full(k, role)}-{i}.{svc}:{port}" for i in range(n)]


def _probe(port: str, *, period: int, failures: int = 3) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _scrape(port: int) -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


def _secret_mount(config: LaunchConfig) -> dict[str, Any]:
    if not config.secure:
        return {}
    return {"volumeMounts": [{"name": "secrets", "mountPath": SECRETS_DIR, "readOnly": True}]}


def _secret_env(config: LaunchConfig, name: str, key: str) -> dict[str, Any]:
    ref = {"name": config.k8s.secret_name, "key": key}
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def _server(
    config: LaunchConfig, model: str, port: int, gpus: int, kv_role: str, extra: dict[str, Any]
) -> dict[str, Any]:
    """One vLLM OpenAI server container of P, D or an engine of every role."""
    k = config.k8s
    kv = {"kv_connector": "PdActorsConnector", "kv_role": kv_role,
          "kv_connector_extra_config": extra}  # fmt: skip
    args = [model, "--host", "0.0.0.0", "--port", str(port),
            "--max-model-len", str(config.max_model_len)]  # fmt: skip
    if k.served_model_name:
        args += ["--served-model-name", k.served_model_name]
    user_args = (*config.vllm_args, *k.vllm_args)
    if gpus > 1 and not {"--tensor-parallel-size", "-tp"} & set(user_args):
        args += ["--tensor-parallel-size", str(gpus)]
    if gpus == 0:
        args += ["--enforce-eager", "--dtype", "float32"]  # as the launcher does on CPU
    args += [*user_args, "--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *({"name": n, "value": v} for n, v in sorted(k.env.items())),
    ]
    if config.secure:  # vLLM's --api-key, kept out of argv; the proxy sends it
        env.append(_secret_env(config, "VLLM_API_KEY", "engine.key"))
    limits: dict[str, int] = {k.gpu_resource: gpus} if gpus else {}
    if config.protocol == "rdma" and k.rdma_resource:
        limits[k.rdma_resource] = k.rdma_per_server
    mounts: list[dict[str, Any]] = [{"name": "shm", "mountPath": "/dev/shm"}]
    if k.model_pvc:
        mounts.append({"name": "model", "mountPath": k.model_mount, "readOnly": True})
    mounts += _secret_mount(config).get("volumeMounts", [])
    container: dict[str, Any] = {
        "name": "vllm",
        "image": k.image,
        "imagePullPolicy": k.image_pull_policy,
        "command": ["vllm", "serve"],
        "args": args,
        "env": env,
        "ports": [{"name": "http", "containerPort": port}],
        # Model loads take minutes: the startup probe allows startup_timeout for it.
        "startupProbe": _probe("http", period=10, failures=math.ceil(config.startup_timeout / 10)),
        "readinessProbe": _probe("http", period=5),
        "volumeMounts": mounts,
    }
    if limits:
        container["resources"] = {"limits": limits, "requests": dict(limits)}
    if config.protocol == "rdma":  # pinning KV memory for the NIC (memlock)
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    return container


def _stateful_set(
    config: LaunchConfig, role: str, replicas: int, containers: list[dict[str, Any]]
) -> dict[str, Any]:
    k = config.k8s
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}}
    ]
    if k.model_pvc:
        claim = {"claimName": k.model_pvc, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
    if config.secure:
        secret = {"secretName": k.secret_name, "defaultMode": 0o400}
        volumes.append({"name": "secrets", "secret": secret})
    spec: dict[str, Any] = {
        "containers": containers,
        "volumes": volumes,
        "terminationGracePeriodSeconds": math.ceil(config.shutdown_timeout),
    }
    selector = {
        "prefill": k.prefill_node_selector,
        "decode": k.decode_node_selector,
        "engine": k.engine_node_selector,
    }[role]
    if selector:
        spec["nodeSelector"] = dict(selector)
    if k.host_network:  # D still resolves P's bootstrap by its cluster DNS name
        spec |= {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
    annotations = {**_scrape(containers[0]["ports"][0]["containerPort"]), **k.pod_annotations}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(k, role),
        "spec": {
            "serviceName": _full(k, role),
            "replicas": replicas,
            "podManagementPolicy": "Parallel",  # P and D servers do not wait for each other
            "selector": {"matchLabels": _labels(k, role)},
            "template": {
                "metadata": {"labels": _labels(k, role), "annotations": annotations},
                "spec": spec,
            },
        },
    }


def _headless_service(k: K8sConfig, role: str, ports: list[tuple[str, int]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(k, role),
        "spec": {
            "clusterIP": "None",
            # The proxy's health loop is the rotation: names resolve while pods start.
            "publishNotReadyAddresses": True,
            "selector": _labels(k, role),
            "ports": [{"name": n, "port": p, "targetPort": n} for n, p in ports],
        },
    }


def _proxy(
    config: LaunchConfig,
    prefills: list[tuple[str, str]],
    decodes: list[str],
    engines: list[tuple[str, str]],
) -> dict[str, Any]:
    k = config.k8s
    port = config.proxy_port or DEFAULT_PROXY_PORT
    argv = ["pdactors", "proxy", "--host", "0.0.0.0", "--port", str(port)]
    for engine, bootstrap in prefills:
        argv += ["--prefill", f"{engine}@{bootstrap}"]
    for engine in decodes:
        argv += ["--decode", engine]
    for engine, bootstrap in engines:
        argv += ["--engine", f"{engine}@{bootstrap}"]
    argv += proxy_policy_args(config)
    container: dict[str, Any] = {
        "name": "proxy",
        "image": k.proxy_image or k.image,
        "imagePullPolicy": k.image_pull_policy,
        "command": argv,
        "ports": [{"name": "http", "containerPort": port}],
        # 503 until a P and a D are healthy: not ready, but not restarted either.
        "readinessProbe": _probe("http", period=5),
    }
    pod: dict[str, Any] = {"containers": [container]}
    if config.secure:
        container["command"] += ["--bootstrap-token-file", f"{SECRETS_DIR}/bootstrap.token"]
        container["env"] = [
            _secret_env(config, "PDACTORS_PROXY_API_KEY", "proxy.key"),
            _secret_env(config, "PDACTORS_ENGINE_API_KEY", "engine.key"),
        ]
        container |= _secret_mount(config)
        pod["volumes"] = [
            {"name": "secrets", "secret": {"secretName": k.secret_name, "defaultMode": 0o400}}
        ]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(k, "proxy"),
        "spec": {
            "replicas": k.proxy_replicas,
            "selector": {"matchLabels": _labels(k, "proxy")},
            "template": {
                "metadata": {"labels": _labels(k, "proxy"), "annotations": _scrape(port)},
                "spec": pod,
            },
        },
    }


def _proxy_service(config: LaunchConfig) -> dict[str, Any]:
    k = config.k8s
    port = config.proxy_port or DEFAULT_PROXY_PORT
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(k, "proxy"),
        "spec": {
            "type": k.service_type,
            "selector": _labels(k, "proxy"),
            "ports": [{"name": "http", "port": port, "targetPort": "http"}],
        },
    }
