"""The ``[k8s]`` table of ``pdactors launch --config`` (:class:`K8sConfig`), apart from
:mod:`pdactors.deploy.k8s` so that :class:`~pdactors.deploy.launch_config.LaunchConfig` can hold
it without importing the renderer."""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from pdactors.deploy.errors import BadDeployConfig

__all__ = ["K8sConfig"]

_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


class K8sConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[k8s]`` table: what only Kubernetes needs.

    ``image`` must have pdactors and pdactors-vllm installed (vLLM's image does not: build
    one FROM it, docs/deploy.md); ``proxy_image`` (default: ``image``) needs only pdactors.
    ``gpus_per_prefill`` / ``gpus_per_decode`` / ``gpus_per_engine`` (engines of every role:
    ``both``): ``gpu_resource`` requested per server, and
    ``--tensor-parallel-size`` when above 1 (0: CPU, with the launcher's CPU flags).
    RDMA (``protocol = "rdma"``): ``rdma_resource`` (a device plugin's resource, e.g.
    ``rdma/rdma_shared_device_a``, ``rdma_per_server`` of it) and/or ``host_network``; the
    servers get ``IPC_LOCK`` to pin their KV memory. ``model_pvc``: a PersistentVolumeClaim
    mounted read-only at ``model_mount``. ``env`` and ``pod_annotations`` (e.g. a Multus
    network) go to every P and D pod; ``vllm_args`` after the top-level ``vllm_args``.
    Raises :class:`~pdactors.deploy.errors.BadDeployConfig` for names and counts that do not fit.
    """

    name: str = "pdactors"
    namespace: str = "default"
    cluster_domain: str = "cluster.local"
    image: str = "vllm/vllm-openai:latest"
    proxy_image: str = ""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    gpus_per_prefill: int = 1
    gpus_per_decode: int = 1
    gpus_per_engine: int = 1
    gpu_resource: str = "nvidia.com/gpu"
    rdma_resource: str = ""
    rdma_per_server: int = 1
    host_network: bool = False
    shm_size: str = "16Gi"
    model_pvc: str = ""
    model_mount: str = "/models"
    served_model_name: str = ""
    vllm_args: tuple[str, ...] = ()
    env: dict[str, str] = msgspec.field(default_factory=dict)
    pod_annotations: dict[str, str] = msgspec.field(default_factory=dict)
    prefill_node_selector: dict[str, str] = msgspec.field(default_factory=dict)
    decode_node_selector: dict[str, str] = msgspec.field(default_factory=dict)
    engine_node_selector: dict[str, str] = msgspec.field(default_factory=dict)
    proxy_replicas: int = 1
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    secret_name: str = "pdactors-secrets"

    def __post_init__(self) -> None:
        # StatefulSet pods get a controller-revision-hash label of NAME-prefill-<10 chars>,
        # and a label value is at most 63 characters.
        for what, value, most in (("name", self.name, 40), ("namespace", self.namespace, 63)):
            if not _LABEL.fullmatch(value) or len(value) > most:
                raise BadDeployConfig(
                    f"k8s.{what} {value!r} must be a DNS label (a-z, 0-9, '-') of at most {most}"
                )
        counts = (self.gpus_per_prefill, self.gpus_per_decode, self.gpus_per_engine)
        if min(*counts, self.rdma_per_server) < 0:
            raise BadDeployConfig("k8s GPU and RDMA counts must not be negative")
        if self.proxy_replicas < 1:
            raise BadDeployConfig("k8s.proxy_replicas must be at least 1")
