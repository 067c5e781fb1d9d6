"""The public surface: what ``pdactors`` exports, what it must not import, and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

import pdactors
import pdactors.deploy

PUBLIC = {
    "BadBlockIds", "BadMessage", "BadTransferParams", "BlockLayout", "ConfigError",
    "BootstrapClient", "BootstrapConfig", "BootstrapError", "Compat",
    "DataPlane",
    "DataPlaneConfig", "DataPlaneError", "DuplicateTransfer", "IllegalTransition",
    "KVTransferParams", "Layout", "Liveness",
    "LayoutMismatch", "MooncakeDataPlane", "PdError", "PlanError", "PrefillBackend",
    "ProxyConfig", "PullFailedError", "PullResults", "RankInfo", "Receiver", "ReceiverConfig",
    "RunHasher", "Sender", "SenderConfig", "SideChannelStats", "TransferError", "Xxh3Hasher",
    "open_bootstrap_client", "open_mooncake",
    "serve_bootstrap", "serve_proxy", "serve_receiver", "serve_sender",
}  # fmt: skip

DEPLOY_PUBLIC = {
    "BadDeployConfig", "Child", "ChildDied", "DeployError", "K8sConfig", "LaunchConfig",
    "LaunchView", "ModelBuildFailed", "NotHealthy", "Plan", "RunSecrets", "Smoke", "Stats",
    "UnsafeSecretsDir", "is_loopback", "launch", "launch_command", "log_tail", "make_secrets",
    "metric_total", "plan_deployment", "render_k8s", "write_manifests",
}  # fmt: skip

ENV = {**os.environ, "MC_LOG_LEVEL": "ERROR"}


def test_public_names() -> None:
    names = {n for n in vars(pdactors) if not n.startswith("_")}
    modules = {n for n in names if type(getattr(pdactors, n)).__name__ == "module"}
    assert names - modules == PUBLIC


def test_deploy_public_names() -> None:
    names = {n for n in vars(pdactors.deploy) if not n.startswith("_")}
    modules = {n for n in names if type(getattr(pdactors.deploy, n)).__name__ == "module"}
    assert names - modules == DEPLOY_PUBLIC
    errors = [getattr(pdactors.deploy, n) for n in DEPLOY_PUBLIC if n.endswith(("Error", "Died"))]
    assert errors and all(issubclass(e, pdactors.PdError) for e in errors)


def test_import_pulls_in_neither_torch_nor_vllm_nor_mooncake() -> None:
    code = "import sys, pdactors; print([m for m in ('torch', 'vllm', 'mooncake') if m in sys.modules])"  # noqa: E501
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"  # mooncake loads only when an engine starts


def test_harness_cli_moves_and_verifies_bytes() -> None:
    args = [
        "harness",
        "--requests",
        "20",
        "--blocks",
        "4",
        "--layers",
        "3",
        "--block-bytes",
        "2048",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pdactors.cli", *args, "--concurrency", "4"],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "20 ok, 20 verified, 0 failed, 0 blocks leaked" in done.stdout
    assert "PASS" in done.stdout


def test_harness_cli_rejects_bad_protocol() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdactors.cli", "harness", "--protocol", "carrier-pigeon"],
        capture_output=True, text=True, timeout=60, env=ENV,
    )  # fmt: skip
    assert done.returncode == 2
    assert "unknown protocol" in done.stderr


def test_bootstrap_cli_serves_health() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "pdactors.cli", "bootstrap", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV,
    ) as proc:  # fmt: skip
        _check_health(proc)


def _check_health(proc: subprocess.Popen[str]) -> None:
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("bootstrap serving on http://127.0.0.1:"), line
        url = line.split()[-1]
        assert httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)
