"""``--render k8s``: the manifests validate offline against Kubernetes' published schemas
(kubernetes-validate, strict: unknown fields fail), and are wired as a schema cannot check —
selectors, ports, the proxy's backends, the connector config, replicas, credentials."""

from __future__ import annotations

import json
import re
import socket
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import msgspec
import pytest
import yaml

from pdactors.deploy import BadDeployConfig, K8sConfig, LaunchConfig, render_k8s, write_manifests
from pdactors.deploy.k8s import SECRET_KEYS, SECRETS_DIR
from pdactors_vllm.settings import ConnectorSettings, settings_from_extra_config

#: The Kubernetes version the manifests are validated against (kubernetes-validate 1.37.0
#: bundles the schemas of 1.25 to 1.37).
K8S_VERSION = "1.37"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "deploy.toml"

Manifest = dict[str, Any]


def load(text: str) -> LaunchConfig:
    return msgspec.convert(tomllib.loads(text), LaunchConfig)  # as launch --config does


CONFIGS = {
    "default": LaunchConfig(model="Qwen/Qwen3-0.6B"),
    "2p2d-rdma": load(
        """
        model = "/models/big"
        prefill = 2
        decode = 2
        protocol = "rdma"
        device_name = "mlx5_0"
        placement = "disaggregate"
        slo_tpot_ms = 40
        [k8s]
        name = "big"
        namespace = "llm"
        gpus_per_prefill = 2
        gpus_per_decode = 4
        rdma_resource = "rdma/rdma_shared_device_a"
        model_pvc = "models"
        service_type = "LoadBalancer"
        """
    ),
    "secure": load(
        """
        model = "Qwen/Qwen3-0.6B"
        prefill = 2
        decode = 3
        secure = true
        [k8s]
        gpus_per_prefill = 0
        gpus_per_decode = 0
        secret_name = "my-secrets"
        """
    ),
    "example": load(EXAMPLE.read_text()),
    # P, D and engines of every role, secure: every pairing's trust and wiring at once.
    "mixed": load(
        """
        model = "Qwen/Qwen3-0.6B"
        prefill = 1
        decode = 1
        both = 2
        secure = true
        [k8s]
        gpus_per_engine = 2
        engine_node_selector = { pool = "gpu" }
        """
    ),
}


@pytest.fixture(params=sorted(CONFIGS))
def case(request: pytest.FixtureRequest) -> tuple[LaunchConfig, list[Manifest]]:
    config = CONFIGS[request.param]
    return config, render_k8s(config)


def by_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def workloads(manifests: list[Manifest]) -> list[Manifest]:
    return [m for m in manifests if m["kind"] in ("StatefulSet", "Deployment")]


def containers(workload: Manifest) -> list[Manifest]:
    return list(workload["spec"]["template"]["spec"]["containers"])


def component(manifests: list[Manifest], role: str, kind: str) -> Manifest:
    (found,) = [
        m
        for m in by_kind(manifests, kind)
        if m["metadata"]["labels"]["app.kubernetes.io/component"] == role
    ]
    return found


def container_ports(workload: Manifest) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in containers(workload) for p in c["ports"]}


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def kv_config(workload: Manifest) -> dict[str, Any]:
    (vllm,) = [c for c in containers(workload) if c["name"] == "vllm"]
    (value,) = flag_values(vllm["args"], "--kv-transfer-config")
    parsed: dict[str, Any] = json.loads(value)
    return parsed


# ----------------------------------------------------------------------------- schemas


def test_every_manifest_validates_offline(
    case: tuple[LaunchConfig, list[Manifest]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*args: object) -> None:
        raise AssertionError("the validator tried the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    _, manifests = case
    assert {m["kind"] for m in manifests} == {"Service", "StatefulSet", "Deployment"}
    for manifest in manifests:
        assert kubernetes_validate.validate(manifest, K8S_VERSION, strict=True) == K8S_VERSION


@pytest.mark.parametrize(
    "break_it",
    [
        lambda m: containers(m)[0].update(startupProbes=[]),  # an unknown field
        lambda m: m["spec"].update(replicas="two"),  # a wrong type
        lambda m: containers(m)[0].pop("name"),  # a required field missing
    ],
    ids=["unknown-field", "wrong-type", "missing-field"],
)
def test_the_validator_rejects_a_schema_error(break_it: Any) -> None:
    manifest = component(render_k8s(CONFIGS["default"]), "prefill", "StatefulSet")
    break_it(manifest)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


# ----------------------------------------------------------------------------- wiring


def test_services_select_their_workloads_pods(case: tuple[LaunchConfig, list[Manifest]]) -> None:
    _, manifests = case
    for w in workloads(manifests):
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in by_kind(manifests, "Service"):
        selector = service["spec"]["selector"].items()
        chosen = [
            w for w in workloads(manifests)
            if selector <= w["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert len(chosen) == 1, service["metadata"]["name"]
        for port in service["spec"]["ports"]:  # a named targetPort is a port of those pods
            assert port["targetPort"] in container_ports(chosen[0])
    for sts in by_kind(manifests, "StatefulSet"):  # the headless Service that names its pods
        (service,) = [
            s for s in by_kind(manifests, "Service")
            if s["metadata"]["name"] == sts["spec"]["serviceName"]
        ]  # fmt: skip
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]


def test_probes_and_scrape_annotations_name_container_ports(
    case: tuple[LaunchConfig, list[Manifest]],
) -> None:
    _, manifests = case
    for w in workloads(manifests):
        ports = container_ports(w)
        annotations = w["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == ports["http"]
        for c in containers(w):
            assert "readinessProbe" in c
            own = {p["name"] for p in c["ports"]}
            for probe in ("startupProbe", "readinessProbe"):
                if probe in c:
                    assert c[probe]["httpGet"]["path"] == "/health"
                    assert c[probe]["httpGet"]["port"] in own


def test_every_variable_an_argument_names_is_defined(
    case: tuple[LaunchConfig, list[Manifest]],
) -> None:
    _, manifests = case
    for w in workloads(manifests):
        for c in containers(w):
            defined = {e["name"] for e in c.get("env", [])}
            used = set(re.findall(r"\$\((\w+)\)", " ".join(c["command"] + c.get("args", []))))
            assert used <= defined, c["name"]


def test_replicas_follow_the_config(case: tuple[LaunchConfig, list[Manifest]]) -> None:
    config, manifests = case
    assert component(manifests, "prefill", "StatefulSet")["spec"]["replicas"] == config.prefill
    assert component(manifests, "decode", "StatefulSet")["spec"]["replicas"] == config.decode
    role = "app.kubernetes.io/component"
    sets = by_kind(manifests, "StatefulSet")
    engines = [m for m in sets if m["metadata"]["labels"][role] == "engine"]
    assert [m["spec"]["replicas"] for m in engines] == ([config.both] if config.both else [])
    assert component(manifests, "proxy", "Deployment")["spec"]["replicas"] == 1


def pod_dns_names(manifests: list[Manifest], role: str) -> list[str]:
    """Each pod's name under its StatefulSet's headless Service (Kubernetes' DNS rule)."""
    sts = component(manifests, role, "StatefulSet")
    meta, spec = sts["metadata"], sts["spec"]
    svc = f"{spec['serviceName']}.{meta['namespace']}.svc.cluster.local"
    return [f"{meta['name']}-{i}.{svc}" for i in range(spec["replicas"])]


def test_the_proxy_names_every_p_and_d_pod(case: tuple[LaunchConfig, list[Manifest]]) -> None:
    config, manifests = case
    proxy = component(manifests, "proxy", "Deployment")
    argv = containers(proxy)[0]["command"]
    assert argv[:2] == ["pdactors", "proxy"]
    p_ports = container_ports(component(manifests, "prefill", "StatefulSet"))
    d_ports = container_ports(component(manifests, "decode", "StatefulSet"))
    prefills = [v.partition("@") for v in flag_values(argv, "--prefill")]
    engines = [urlsplit(e) for e, _, _ in prefills]
    bootstraps = [urlsplit(b) for _, _, b in prefills]
    decodes = [urlsplit(d) for d in flag_values(argv, "--decode")]
    assert [u.hostname for u in engines] == pod_dns_names(manifests, "prefill")
    # With one bootstrap per P pod, P's bootstrap URL is that pod's, on the bootstrap port.
    assert [u.hostname for u in bootstraps] == pod_dns_names(manifests, "prefill")
    assert {u.port for u in engines} == {p_ports["http"]}
    assert {u.port for u in bootstraps} == {p_ports["bootstrap"]}
    assert [u.hostname for u in decodes] == pod_dns_names(manifests, "decode")
    assert {u.port for u in decodes} == {d_ports["http"]}
    assert {u.scheme for u in engines + bootstraps + decodes} == {"http"}
    every = [v.partition("@") for v in flag_values(argv, "--engine")]
    if config.both:  # each engine of every role, with its own pod's bootstrap, as a P's
        e_ports = container_ports(component(manifests, "engine", "StatefulSet"))
        names = pod_dns_names(manifests, "engine")
        assert [urlsplit(e).hostname for e, _, _ in every] == names
        assert [urlsplit(b).hostname for _, _, b in every] == names
        assert {urlsplit(e).port for e, _, _ in every} == {e_ports["http"]}
        assert {urlsplit(b).port for _, _, b in every} == {e_ports["bootstrap"]}
    assert len(every) == config.both
    assert flag_values(argv, "--routing") == [config.routing]
    assert flag_values(argv, "--placement") == [config.placement]
    assert flag_values(argv, "--slo-tpot-ms") == [str(config.slo_tpot_ms)]
    service = component(manifests, "proxy", "Service")
    assert service["spec"]["type"] == config.k8s.service_type
    (port,) = flag_values(argv, "--port")
    assert service["spec"]["ports"][0]["port"] == int(port) == container_ports(proxy)["http"]


def test_the_connector_config_parses_with_the_right_roles(
    case: tuple[LaunchConfig, list[Manifest]],
) -> None:
    config, manifests = case
    p_sts = component(manifests, "prefill", "StatefulSet")
    p, d = kv_config(p_sts), kv_config(component(manifests, "decode", "StatefulSet"))
    assert (p["kv_connector"], p["kv_role"]) == ("PdActorsConnector", "kv_producer")
    assert (d["kv_connector"], d["kv_role"]) == ("PdActorsConnector", "kv_consumer")
    bootstrap_port = container_ports(p_sts)["bootstrap"]
    for kv in (p, d):
        extra = kv["kv_connector_extra_config"]
        assert set(extra) <= set(ConnectorSettings.__struct_fields__)  # no key it would ignore
        # Kubernetes puts the pod's IP where $(POD_IP) is: reachable from the other pods.
        assert extra["host"] == "$(POD_IP)"
        substituted = json.loads(json.dumps(extra).replace("$(POD_IP)", "10.1.2.3"))
        settings = settings_from_extra_config(substituted)
        assert (settings.protocol, settings.device_name) == (config.protocol, config.device_name)
    p_settings = settings_from_extra_config(
        json.loads(json.dumps(p["kv_connector_extra_config"]).replace("$(POD_IP)", "10.1.2.3"))
    )
    assert p_settings.external_bootstrap  # the sidecar, not an embedded bootstrap
    assert p_settings.bootstrap_url == f"http://10.1.2.3:{bootstrap_port}"
    (bootstrap,) = [c for c in containers(p_sts) if c["name"] == "bootstrap"]
    assert bootstrap["command"][:2] == ["pdactors", "bootstrap"]
    assert flag_values(bootstrap["command"], "--port") == [str(bootstrap_port)]


def test_gpus_rdma_and_tensor_parallelism() -> None:
    manifests = render_k8s(CONFIGS["2p2d-rdma"])
    for role, gpus in (("prefill", 2), ("decode", 4)):
        sts = component(manifests, role, "StatefulSet")
        (vllm,) = [c for c in containers(sts) if c["name"] == "vllm"]
        want = {"nvidia.com/gpu": gpus, "rdma/rdma_shared_device_a": 1}
        assert vllm["resources"] == {"limits": want, "requests": want}
        assert vllm["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert flag_values(vllm["args"], "--tensor-parallel-size") == [str(gpus)]
        assert vllm["args"][0] == "/models/big"
        volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "models"
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    tcp = component(render_k8s(CONFIGS["default"]), "prefill", "StatefulSet")
    (vllm, _) = containers(tcp)
    assert "securityContext" not in vllm
    assert vllm["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert "--tensor-parallel-size" not in vllm["args"]


def test_secure_mode_references_the_secret_and_inlines_nothing() -> None:
    config = CONFIGS["secure"]
    manifests = render_k8s(config)
    text = json.dumps(manifests)
    for w in workloads(manifests):
        volumes = w["spec"]["template"]["spec"]["volumes"]
        (secret,) = [v["secret"] for v in volumes if "secret" in v]
        assert secret["secretName"] == "my-secrets"
        for c in containers(w):
            assert {"name": "secrets", "mountPath": SECRETS_DIR, "readOnly": True} in c[
                "volumeMounts"
            ]
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "my-secrets" and ref["key"] in SECRET_KEYS
    files = set(re.findall(re.escape(SECRETS_DIR) + r"/([\w.-]+)", text))
    assert files == {"side-channel.secret", "bootstrap.token"}
    p_sts = component(manifests, "prefill", "StatefulSet")
    d_sts = component(manifests, "decode", "StatefulSet")
    for sts in (p_sts, d_sts):
        extra = kv_config(sts)["kv_connector_extra_config"]
        assert extra["side_channel_secret_file"] == f"{SECRETS_DIR}/side-channel.secret"
        assert extra["bootstrap_token_file"] == f"{SECRETS_DIR}/bootstrap.token"
        (vllm, *_) = containers(sts)
        assert {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": "my-secrets", "key": "engine.key"}}} in vllm["env"]  # fmt: skip
    (bootstrap,) = [c for c in containers(p_sts) if c["name"] == "bootstrap"]
    assert flag_values(bootstrap["command"], "--token-file") == [f"{SECRETS_DIR}/bootstrap.token"]
    proxy = containers(component(manifests, "proxy", "Deployment"))[0]
    assert flag_values(proxy["command"], "--bootstrap-token-file") == [
        f"{SECRETS_DIR}/bootstrap.token"
    ]
    assert {e["name"] for e in proxy["env"]} == {
        "PDACTORS_PROXY_API_KEY",
        "PDACTORS_ENGINE_API_KEY",
    }
    # D sends the token only to the bootstraps the proxy names in remote_bootstrap_addr.
    trusted = kv_config(d_sts)["kv_connector_extra_config"]["trusted_bootstraps"]
    assert trusted == [v.partition("@")[2] for v in flag_values(proxy["command"], "--prefill")]
    assert len(trusted) == config.prefill
    # Without secure, no credential anywhere.
    plain = json.dumps(render_k8s(CONFIGS["default"]))
    assert "secret" not in plain.lower() and "token" not in plain and "API_KEY" not in plain


def test_engines_of_every_role_compute_prompts_for_others_and_pull_from_them() -> None:
    """``both``: kv_both servers, each with its own bootstrap sidecar (it computes prompts for
    others, as a P) and, in secure mode, trusting every bootstrap of a server that computes
    prompts (it pulls, as a D) — as D does; GPUs and node selector their own."""
    config = CONFIGS["mixed"]
    manifests = render_k8s(config)
    sts = component(manifests, "engine", "StatefulSet")
    kv = kv_config(sts)
    assert (kv["kv_connector"], kv["kv_role"]) == ("PdActorsConnector", "kv_both")
    extra = kv["kv_connector_extra_config"]
    assert set(extra) <= set(ConnectorSettings.__struct_fields__)
    settings = settings_from_extra_config(
        json.loads(json.dumps(extra).replace("$(POD_IP)", "10.1.2.3"))
    )
    ports = container_ports(sts)
    assert settings.external_bootstrap
    assert settings.bootstrap_url == f"http://10.1.2.3:{ports['bootstrap']}"
    (bootstrap,) = [c for c in containers(sts) if c["name"] == "bootstrap"]
    assert flag_values(bootstrap["command"], "--port") == [str(ports["bootstrap"])]
    argv = containers(component(manifests, "proxy", "Deployment"))[0]["command"]
    senders = [v.partition("@")[2] for f in ("--prefill", "--engine") for v in flag_values(argv, f)]
    assert len(senders) == config.prefill + config.both
    d_extra = kv_config(component(manifests, "decode", "StatefulSet"))["kv_connector_extra_config"]
    assert extra["trusted_bootstraps"] == d_extra["trusted_bootstraps"] == senders
    (vllm, _) = containers(sts)
    assert vllm["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert flag_values(vllm["args"], "--tensor-parallel-size") == ["2"]
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu"}
    # A pool alone: no P or D objects, the proxy names the engines only.
    pool = render_k8s(LaunchConfig(model="m", prefill=0, decode=0, both=2))
    assert {m["metadata"]["labels"]["app.kubernetes.io/component"] for m in pool} == {
        "engine", "proxy",
    }  # fmt: skip
    argv = containers(component(pool, "proxy", "Deployment"))[0]["command"]
    assert len(flag_values(argv, "--engine")) == 2
    assert not flag_values(argv, "--prefill") and not flag_values(argv, "--decode")
    for manifest in pool:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_cpu_servers_request_no_gpu() -> None:
    sts = component(render_k8s(CONFIGS["secure"]), "decode", "StatefulSet")
    (vllm,) = containers(sts)
    assert "resources" not in vllm
    assert "--enforce-eager" in vllm["args"]


def test_refusals() -> None:
    with pytest.raises(BadDeployConfig, match="needs a model"):
        render_k8s(LaunchConfig())
    with pytest.raises(BadDeployConfig, match="rdma_resource"):
        render_k8s(LaunchConfig(model="m", protocol="rdma"))
    host_net = LaunchConfig(model="m", protocol="rdma", k8s=K8sConfig(host_network=True))
    spec = component(render_k8s(host_net), "decode", "StatefulSet")["spec"]["template"]["spec"]
    assert (spec["hostNetwork"], spec["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    for bad in ({"name": "Big_Model"}, {"name": "x" * 41}, {"namespace": "-a"}):
        with pytest.raises(BadDeployConfig, match="DNS label"):
            K8sConfig(**bad)
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        load("model = 'm'\n[k8s]\nimage_name = 'x'\n")


def test_write_manifests_writes_what_render_gives(tmp_path: Path) -> None:
    config = CONFIGS["example"]
    paths = write_manifests(config, tmp_path / "manifests")
    assert [p.name for p in paths] == sorted(p.name for p in paths)  # apply order
    assert sorted(paths) == sorted((tmp_path / "manifests").glob("*.yaml"))
    loaded = [yaml.safe_load(p.read_text()) for p in paths]
    assert loaded == render_k8s(config)
    for manifest in loaded:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_the_example_is_the_two_node_walk_through() -> None:
    manifests = render_k8s(CONFIGS["example"])
    p_spec = component(manifests, "prefill", "StatefulSet")["spec"]["template"]["spec"]
    d_spec = component(manifests, "decode", "StatefulSet")["spec"]["template"]["spec"]
    assert p_spec["nodeSelector"] == {"kubernetes.io/hostname": "node-a"}
    assert d_spec["nodeSelector"] == {"kubernetes.io/hostname": "node-b"}
    assert all(m["metadata"]["namespace"] == "llm" for m in manifests)
    startup = containers(component(manifests, "prefill", "StatefulSet"))[0]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800


def test_the_launch_command_renders_the_example(tmp_path: Path) -> None:
    """`pdactors launch --config examples/deploy.toml --render k8s --out DIR`, as documented."""
    import subprocess
    import sys

    out = tmp_path / "manifests"
    done = subprocess.run(
        [sys.executable, "-m", "pdactors.cli", "launch", "--config", str(EXAMPLE),
         "--render", "k8s", "--out", str(out)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = sorted(out.glob("*.yaml"))
    assert [str(p) for p in written] == done.stdout.splitlines()[:-1]
    assert done.stdout.splitlines()[-1] == f"kubectl apply -f {out}/"
    for path in written:
        kubernetes_validate.validate(yaml.safe_load(path.read_text()), K8S_VERSION, strict=True)
    refused = subprocess.run(
        [sys.executable, "-m", "pdactors.cli", "launch", "--render", "k8s", "--out", str(out)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode == 2 and "needs a model" in refused.stderr
