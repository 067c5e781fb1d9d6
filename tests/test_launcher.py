"""The launcher's supervision with real child processes (small HTTP servers stand in for vLLM):
health waits, forwarded logs, a child dying, cancellation — and never a process left behind."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import typer
import yaml
from typer.testing import CliRunner

import pdactors
import pdactors.deploy.plan as plan_module
from pdactors._cli_setup import scratch_dir
from pdactors.cli import app
from pdactors.config import default_of
from pdactors.deploy import (
    BadDeployConfig,
    Child,
    ChildDied,
    LaunchConfig,
    NotHealthy,
    Plan,
    UnsafeSecretsDir,
    is_loopback,
    launch,
    make_secrets,
    plan_deployment,
)
from pdactors.deploy.command import _run_dir
from pdactors.deploy.plan import free_port
from pdactors.deploy.supervise import _wait_healthy
from pdactors.proxy_config import ProxyConfig

SERVER = textwrap.dedent(
    """
    import http.server, os, signal, socket, sys, time
    port, delay, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"child {os.getpid()} starting", flush=True)
    if mode == "crash":
        if len(sys.argv) > 4:  # only once that port serves (another child is up)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", int(sys.argv[4])), 1).close()
                    break
                except OSError:
                    time.sleep(0.02)
        sys.exit(3)
    time.sleep(delay)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def child(
    name: str, port: int, delay: float = 0.0, mode: str = "ok", after: int | None = None
) -> Child:
    """A stand-in server on ``port``; ``mode`` "crash": it exits (3) at once, or once the
    port ``after`` serves."""
    argv = [sys.executable, "-c", SERVER, str(port), str(delay), mode]
    if after is not None:
        argv.append(str(after))
    return Child(name, argv, dict(os.environ), f"http://127.0.0.1:{port}/health")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Recorder:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.healthy: list[str] = []

    def out(self, line: str) -> None:
        self.lines.append(line)

    def progress(self, name: str, elapsed: float, ok: bool) -> None:
        if ok:
            self.healthy.append(name)

    def pids(self) -> list[int]:
        return [int(line.split()[2]) for line in self.lines if "starting" in line]


async def test_all_healthy_then_ready_then_everything_stopped(tmp_path: Path) -> None:
    rec = Recorder()
    plan = Plan([child("a", free_port(), 0.3), child("proxy", free_port())], "http://x", "m")
    seen: list[str] = []

    async def ready(p: Plan) -> None:
        seen.append(p.proxy_url)

    with trio.fail_after(30):
        await launch(
            plan, startup_timeout=20, shutdown_timeout=5, out=rec.out, progress=rec.progress,
            log_dir=tmp_path, when_ready=ready,
        )  # fmt: skip
    assert seen == ["http://x"]
    assert rec.healthy == ["a", "proxy"]  # the proxy starts after its backends are healthy
    assert any(line.startswith("[a] child ") for line in rec.lines)
    assert rec.pids() and not any(alive(pid) for pid in rec.pids())


async def test_child_crash_at_startup_stops_the_rest(tmp_path: Path) -> None:
    rec = Recorder()
    ok_port = free_port()
    # "bad" crashes once "ok" serves: "ok" has written its line (a crash at once could stop
    # it before its interpreter started, leaving its log empty on a loaded machine).
    bad = child("bad", free_port(), mode="crash", after=ok_port)
    plan = Plan([child("ok", ok_port), bad], "u", "m")

    async def never(p: Plan) -> None:
        raise AssertionError("not ready")

    with trio.fail_after(30), pytest.raises(ExceptionGroup) as info:
        await launch(
            plan, startup_timeout=20, shutdown_timeout=5, out=rec.out, progress=rec.progress,
            log_dir=tmp_path, when_ready=never,
        )  # fmt: skip
    matched, _ = info.value.split(ChildDied)
    assert matched is not None
    (died,) = matched.exceptions
    assert isinstance(died, ChildDied) and died.name == "bad" and died.code == 3
    assert not any(alive(pid) for pid in rec.pids())


async def test_the_health_wait_leaves_a_childs_death_to_its_supervisor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The one cause, once: a child that exited before the health wait polled it is reported
    by its supervisor's ChildDied alone; the wait raising one as well reported the same death
    twice when both saw it before the cancel (once in 25 minutes of a loaded full suite)."""
    crashed = await trio.lowlevel.open_process([sys.executable, "-c", "raise SystemExit(3)"])
    await crashed.wait()
    bad = child("bad", free_port(), mode="crash")
    with trio.move_on_after(2) as waited:  # a supervisor's ChildDied would cancel it
        await _wait_healthy([bad], {"bad": crashed}, 30, lambda *a: None)
    assert waited.cancelled_caught


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
async def test_sigterm_or_sighup_stops_every_child(tmp_path: Path, sig: signal.Signals) -> None:
    """What ``timeout``, systemd, ``docker stop`` and Kubernetes send (SIGTERM), or a closed
    terminal (SIGHUP), stops the deployment as Ctrl-C does: every child, even one that
    ignores SIGTERM itself, within its shutdown bound; launch says which signal it was."""
    rec = Recorder()
    plan = Plan(
        [child("stubborn", free_port(), mode="stubborn"), child("proxy", free_port())], "u", "m"
    )

    async def ready(p: Plan) -> None:
        os.kill(os.getpid(), sig)  # as the service manager would
        await trio.sleep_forever()

    with trio.fail_after(30):
        by = await launch(
            plan, startup_timeout=20, shutdown_timeout=1, out=rec.out, progress=rec.progress,
            log_dir=tmp_path, when_ready=ready, stop_on=(signal.SIGTERM, signal.SIGHUP),
        )  # fmt: skip
    assert by is sig
    assert len(rec.pids()) == 2
    assert not any(alive(pid) for pid in rec.pids())


async def test_cancel_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    rec = Recorder()
    plan = Plan(
        [child("stubborn", free_port(), mode="stubborn"), child("proxy", free_port())], "u", "m"
    )

    async def ready(p: Plan) -> None:
        await trio.sleep_forever()

    with trio.fail_after(30):
        with trio.move_on_after(3):  # stands in for Ctrl-C
            await launch(
                plan, startup_timeout=20, shutdown_timeout=1, out=rec.out, progress=rec.progress,
                log_dir=tmp_path, when_ready=ready,
            )  # fmt: skip
    assert len(rec.pids()) == 2
    assert not any(alive(pid) for pid in rec.pids())


async def test_startup_timeout_is_bounded_and_stops_children(tmp_path: Path) -> None:
    rec = Recorder()
    plan = Plan([child("slow", free_port(), delay=60)], "u", "m")

    async def never(p: Plan) -> None:
        raise AssertionError("not ready")

    with trio.fail_after(30), pytest.raises(ExceptionGroup) as info:
        await launch(
            plan, startup_timeout=1, shutdown_timeout=2, out=rec.out, progress=rec.progress,
            log_dir=tmp_path, when_ready=never,
        )  # fmt: skip
    matched, _ = info.value.split(NotHealthy)
    assert matched is not None
    (late,) = matched.exceptions
    assert isinstance(late, NotHealthy) and late.names == ["slow"] and late.limit == 1
    assert not any(alive(pid) for pid in rec.pids())


def test_default_plan_is_1p1d_on_cpu_with_our_connector() -> None:
    env = {"HOME": "/home/me"}  # the launching process's environment, passed on to each
    plan = plan_deployment(LaunchConfig(proxy_port=0), "/models/tiny", env=env, served_name="tiny")
    names = [c.name for c in plan.children]
    assert names == ["prefill-0", "decode-0", "proxy"]
    assert all(c.env["HOME"] == "/home/me" and c.env["HF_HUB_OFFLINE"] for c in plan.children)
    p, d, proxy = plan.children
    assert '"kv_role": "kv_producer"' in " ".join(p.argv)
    assert '"kv_role": "kv_consumer"' in " ".join(d.argv)
    assert "--enforce-eager" in p.argv and "--dtype" in p.argv
    assert (
        p.env["VLLM_CPU_OMP_THREADS_BIND"] != d.env["VLLM_CPU_OMP_THREADS_BIND"]
        or (os.cpu_count() or 1) == 1
    )
    assert proxy.argv[proxy.argv.index("--prefill") + 1].count("@http://127.0.0.1:") == 1
    assert plan.model_name == "tiny"


def test_the_plans_ports_are_outside_the_ephemeral_range_and_never_given_twice() -> None:
    # The servers bind them a minute or more later, while their own processes take ephemeral
    # ports for connections: the proxy of a CI run found its port taken ("Address already in use").
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    config = LaunchConfig(prefill=2, decode=2, both=2, proxy_port=0)
    plan = plan_deployment(config, "/m", env={})
    ports = [int(c.base_url.rsplit(":", 1)[1]) for c in plan.children]
    for child in plan.children[:-1]:  # every vLLM server; P's and the engines' run a bootstrap
        kv = json.loads(child.argv[child.argv.index("--kv-transfer-config") + 1])
        if kv["kv_role"] != "kv_consumer":
            ports.append(kv["kv_connector_extra_config"]["bootstrap_port"])
    ports += [free_port() for _ in range(200)]
    assert not [p for p in ports if low <= p <= high]
    assert len(set(ports)) == len(ports)


def test_a_free_port_is_still_found_where_the_ephemeral_range_is_every_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(plan_module, "_ephemeral_range", lambda: (1024, 65535))
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free


def test_gpu_plan_pins_devices_and_protocol() -> None:
    config = LaunchConfig(
        prefill=2, decode=1, prefill_gpus=("0", "1"), decode_gpus=("2",), protocol="nvlink_intra"
    )
    plan = plan_deployment(config, "/models/real", env={}, single=True)
    envs = {c.name: c.env.get("CUDA_VISIBLE_DEVICES") for c in plan.children}
    assert envs == {
        "prefill-0": "0",
        "prefill-1": "1",
        "decode-0": "2",
        "single": "2",
        "proxy": None,
    }
    assert all("--enforce-eager" not in c.argv for c in plan.children)
    assert '"protocol": "nvlink_intra"' in " ".join(plan.children[0].argv)


def test_bad_config_is_refused() -> None:
    with pytest.raises(BadDeployConfig, match="prefill_gpus"):
        LaunchConfig(prefill=2, prefill_gpus=("0",))
    with pytest.raises(BadDeployConfig, match="at least one"):
        LaunchConfig(decode=0)
    with pytest.raises(msgspec.ValidationError, match="at least one"):  # as launch --config
        msgspec.convert({"decode": 0}, LaunchConfig)
    for slo in (-1.0, math.nan):
        with pytest.raises(BadDeployConfig, match="slo_tpot_ms"):
            LaunchConfig(slo_tpot_ms=slo)
        with pytest.raises(BadDeployConfig, match="slo_ttft_ms"):
            LaunchConfig(slo_ttft_ms=slo)
    with pytest.raises(msgspec.ValidationError, match="placement"):
        msgspec.convert({"placement": "nowhere"}, LaunchConfig)


def test_a_secure_plan_wires_every_component_with_fresh_private_credentials(
    tmp_path: Path,
) -> None:
    run = make_secrets(tmp_path / "secrets")
    assert stat.S_IMODE(run.directory.stat().st_mode) == 0o700
    for path in run.directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text().strip()) >= 40
    assert {p.name for p in run.directory.iterdir()} >= {"proxy.key", "engine.key"}
    assert run.api_key not in repr(run) and run.engine_key not in repr(run)
    with pytest.raises(UnsafeSecretsDir, match="new, private"):
        make_secrets(run.directory)  # never into a directory that already holds files
    assert make_secrets(tmp_path / "other").api_key != run.api_key  # fresh for each run
    config = LaunchConfig(proxy_port=0, secure=True)
    plan = plan_deployment(config, "/models/tiny", env={}, served_name="tiny", run_secrets=run)
    p, d, proxy = plan.children
    for server in (p, d):
        kv = json.loads(server.argv[server.argv.index("--kv-transfer-config") + 1])
        extra = kv["kv_connector_extra_config"]
        assert extra["side_channel_secret_file"] == str(run.side_channel)
        assert extra["bootstrap_token_file"] == str(run.bootstrap_token)
        assert server.env["VLLM_API_KEY"] == run.engine_key  # the engines want a key too
    p_bootstrap = proxy.argv[proxy.argv.index("--prefill") + 1].split("@")[1]
    d_kv = json.loads(d.argv[d.argv.index("--kv-transfer-config") + 1])
    assert d_kv["kv_connector_extra_config"]["trusted_bootstraps"] == [p_bootstrap]
    assert proxy.env["PDACTORS_ENGINE_API_KEY"] == run.engine_key
    assert proxy.argv[proxy.argv.index("--bootstrap-token-file") + 1] == str(run.bootstrap_token)
    assert proxy.env["PDACTORS_PROXY_API_KEY"] == run.api_key
    assert plan.engine_key == run.engine_key  # for a client that asks the engines directly
    keys = (run.api_key, run.engine_key)
    assert not [a for c in plan.children for a in c.argv if any(k in a for k in keys)]  # not in ps
    with pytest.raises(BadDeployConfig, match="needs its secrets"):
        plan_deployment(config, "/models/tiny", env={})
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")


async def test_each_childs_output_goes_to_its_own_log_and_a_crash_names_it(tmp_path: Path) -> None:
    ok_port = free_port()
    # "bad" crashes once "ok" serves: "ok" has written its line (a crash at once could stop
    # it before its interpreter started, leaving its log empty on a loaded machine).
    bad = child("bad", free_port(), mode="crash", after=ok_port)
    plan = Plan([child("ok", ok_port), bad], "u", "m")

    async def never(p: Plan) -> None:
        raise AssertionError("not ready")

    with trio.fail_after(30), pytest.raises(ExceptionGroup) as info:
        await launch(
            plan, startup_timeout=20, shutdown_timeout=5, progress=lambda *a: None,
            log_dir=tmp_path, when_ready=never,
        )  # fmt: skip
    matched, _ = info.value.split(ChildDied)
    assert matched is not None
    died = [e for e in matched.exceptions if isinstance(e, ChildDied)]
    assert died and died[0].log == tmp_path / "bad.log"
    for name in ("ok", "bad"):  # nothing forwarded without `out`, everything in the file
        (line,) = (tmp_path / f"{name}.log").read_text().splitlines()
        assert line.startswith("child ") and line.endswith(" starting")


def proxy_options(argv: list[str]) -> dict[str, object]:
    """``argv`` (``python -m pdactors.cli proxy ...``) parsed by the proxy command's own parser,
    in this process: its options as the command would get them, nothing started."""
    assert argv[1:4] == ["-m", "pdactors.cli", "proxy"]
    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    proxy = group.commands["proxy"]
    with proxy.make_context("proxy", argv[4:]) as ctx:
        return dict(ctx.params)


def test_the_proxy_gets_the_launchs_placement_and_slo() -> None:
    config = LaunchConfig(proxy_port=0, placement="whole-on-p", slo_tpot_ms=40.0, slo_ttft_ms=300.0)
    *_, proxy = plan_deployment(config, "/models/tiny", env={}).children
    options = proxy_options(proxy.argv)
    assert (options["placement"], options["slo_tpot_ms"]) == ("whole-on-p", 40.0)
    assert options["slo_ttft_ms"] == 300.0
    *_, proxy = plan_deployment(LaunchConfig(proxy_port=0), "/models/tiny", env={}).children
    options = proxy_options(proxy.argv)
    assert options["placement"] == default_of(ProxyConfig, "placement")  # the proxy's own
    assert options["slo_tpot_ms"] == default_of(ProxyConfig, "slo_tpot_ms")
    assert options["slo_ttft_ms"] == default_of(ProxyConfig, "slo_ttft_ms")


def kv_config(child: Child) -> dict[str, Any]:
    return dict(json.loads(child.argv[child.argv.index("--kv-transfer-config") + 1]))


def test_servers_of_both_roles_are_kv_both_each_with_a_bootstrap_and_the_proxys_engines(
    tmp_path: Path,
) -> None:
    """``launch --both 2``: two kv_both servers (no P, no D), each running a bootstrap, on cores
    of their own, given to the proxy as engines of every role; in a secure run each trusts
    both bootstraps (a D may pull from either). Beside P and D servers, they join them."""
    run = make_secrets(tmp_path / "secrets")
    config = LaunchConfig(proxy_port=0, prefill=0, decode=0, both=2, secure=True)
    plan = plan_deployment(config, "/models/tiny", env={}, run_secrets=run)
    assert [c.name for c in plan.children] == ["engine-0", "engine-1", "proxy"]
    *engines, proxy = plan.children
    kvs = [kv_config(e) for e in engines]
    assert [kv["kv_role"] for kv in kvs] == ["kv_both", "kv_both"]
    assert [kv["engine_id"] for kv in kvs] == ["engine-0", "engine-1"]
    boots = [f"http://127.0.0.1:{kv['kv_connector_extra_config']['bootstrap_port']}" for kv in kvs]
    assert len(set(boots)) == 2
    assert all(kv["kv_connector_extra_config"]["trusted_bootstraps"] == boots for kv in kvs)
    options = proxy_options(proxy.argv)
    assert not options["prefill"] and not options["decode"]
    assert options["engine"] == [f"{e.base_url}@{b}" for e, b in zip(engines, boots, strict=True)]
    cores = [e.env["VLLM_CPU_OMP_THREADS_BIND"] for e in engines]
    assert cores[0] != cores[1] or (os.cpu_count() or 1) == 1
    mixed = plan_deployment(LaunchConfig(proxy_port=0, both=1), "/models/tiny", env={})
    assert [c.name for c in mixed.children] == ["prefill-0", "decode-0", "engine-0", "proxy"]
    with pytest.raises(BadDeployConfig, match="both roles"):
        LaunchConfig(prefill=0, decode=0)
    with pytest.raises(BadDeployConfig, match="both_gpus"):
        LaunchConfig(both=2, both_gpus=("0",))


def test_launch_both_renders_a_pool_for_k8s(tmp_path: Path) -> None:
    """`pdactors launch --both 2 --render k8s`: the engines' objects and the proxy's, no P or
    D ones (tests/test_k8s.py checks their wiring)."""
    args = ["launch", "--model", "/models/m", "--render", "k8s", "--out", str(tmp_path)]
    done = CliRunner().invoke(app, [*args, "--both", "2"])
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in tmp_path.glob("*.yaml")) == [
        "00-pdactors-engine-service.yaml", "01-pdactors-engine-statefulset.yaml",
        "02-pdactors-proxy-deployment.yaml", "03-pdactors-proxy-service.yaml",
    ]  # fmt: skip


def test_launch_takes_placement_and_slo_options(tmp_path: Path) -> None:
    """`pdactors launch --placement P --slo-tpot-ms MS`, parsed in this process; --render k8s
    starts nothing and shows the proxy command launch built."""
    args = ["launch", "--model", "/models/m", "--render", "k8s", "--out", str(tmp_path)]
    slo = ["--slo-tpot-ms", "12.5", "--slo-ttft-ms", "90"]
    done = CliRunner().invoke(app, [*args, "--placement", "local", *slo])
    assert done.exit_code == 0, done.output
    (proxy,) = [
        m
        for m in map(yaml.safe_load, (p.read_text() for p in sorted(tmp_path.glob("*.yaml"))))
        if m["kind"] == "Deployment"
    ]
    argv = proxy["spec"]["template"]["spec"]["containers"][0]["command"]
    assert argv[argv.index("--placement") + 1] == "local"
    assert argv[argv.index("--slo-tpot-ms") + 1] == "12.5"
    assert argv[argv.index("--slo-ttft-ms") + 1] == "90.0"
    refused = CliRunner().invoke(app, [*args, "--placement", "nowhere"])
    assert refused.exit_code == 2 and "placement" in refused.output


def test_the_run_folder_cannot_shadow_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Python started in the temp folder after a launch (``python -m
    vllm.entrypoints.openai.api_server``) still imports the real ``pdactors``: a folder named
    ``pdactors`` there would be imported as the package instead (a namespace package, with no
    ``RankInfo``)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # tempfile's documented override
    run = _run_dir(None)
    (top,) = tmp_path.iterdir()
    assert run.is_dir() and run.parent == top == scratch_dir()  # the native logs' folder too
    assert not top.name.isidentifier()
    done = subprocess.run(
        [sys.executable, "-c", "from pdactors import RankInfo; import pdactors; "
         "print(pdactors.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == pdactors.__file__
