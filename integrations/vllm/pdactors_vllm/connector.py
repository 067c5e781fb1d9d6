"""PdActorsConnector: vLLM's KV-connector interface, dispatched to the scheduler or worker side.

Load it by name (``"kv_connector": "PdActorsConnector"``, registered by the vLLM plugin in
:mod:`pdactors_vllm.plugin`) or by path (``"kv_connector_module_path":
"pdactors_vllm.connector"``). Settings: :class:`~pdactors_vllm.settings.ConnectorSettings`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pdactors import RankInfo
from pdactors_vllm.compat import engine_compat
from pdactors_vllm.errors import ConnectorConfigError, WrongRoleError
from pdactors_vllm.gil import default_switch_ms
from pdactors_vllm.idle_gate import IdleGate
from pdactors_vllm.kv_report import PREFIX, kv_layout_report, show_with_vllm_logs
from pdactors_vllm.metrics import PdActorsPromMetrics, PdActorsStats
from pdactors_vllm.model_shape import architecture_of, kv_groups, kv_heads_of, refuse_unserved
from pdactors_vllm.quiet_steps import QuietSteps
from pdactors_vllm.scheduler_side import PdActorsMetadata, SchedulerSide
from pdactors_vllm.settings import ConnectorSettings, settings_from_extra_config, trace_export
from pdactors_vllm.worker_side import WorkerPlace, WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PdActorsConnector", "kv_groups", "worker_place"]

log = logging.getLogger("pdactors.vllm")


class PdActorsConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode disaggregation over pdactors' Trio actors and Mooncake.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, so a model with
    sliding-window and full-attention layers has a KV-cache group of each, and the
    connector moves each group's blocks (a window's only: :class:`KVGroup`)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if vllm_config.model_config is not None:
            # Also here: vLLM skips the layout hook when VLLM_KV_CACHE_LAYOUT is set.
            refuse_unserved(vllm_config)
        transfer = self._kv_transfer_config
        settings = settings_from_extra_config(dict(transfer.kv_connector_extra_config))
        if settings.gil_switch_ms is None:  # by where the engine runs (pdactors_vllm.gil)
            device = vllm_config.device_config.device_type
            settings = msgspec.structs.replace(settings, gil_switch_ms=default_switch_ms(device))
        self.settings = settings
        apply_pull_failure_policy(transfer, self.settings)
        assert transfer.engine_id is not None  # vLLM fills in a uuid when none is given
        self.engine_id = transfer.engine_id
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        show_with_vllm_logs()
        groups = kv_groups(kv_cache_config, architecture_of(vllm_config.model_config))
        self._groups = groups
        self.quiet: QuietSteps | None = None  # the engine core's (scheduler role only)
        if role == KVConnectorRole.SCHEDULER:
            block_size = vllm_config.cache_config.block_size
            self.scheduler_side = SchedulerSide(self.settings, self.engine_id, block_size, groups)
            gate = IdleGate.of(self.settings) if transfer.is_kv_consumer else None
            self.quiet = QuietSteps(self.settings, gate)
        else:
            # The edge: before this worker's Trio thread (and Mooncake's) exists.
            for key, value in self.settings.mooncake_environment().items():
                os.environ.setdefault(key, value)
            place = _place(vllm_config, self.engine_id, self.settings.model_fingerprint)
            trace = trace_export(
                self.settings, vllm_config.observability_config.otlp_traces_endpoint
            )
            self.worker_side = WorkerSide(self.settings, place, trace)

    # ------------------------------------------------------------------ scheduler side

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise WrongRoleError("PdActorsConnector: scheduler hook called on a worker")
        return self.scheduler_side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        side = self._scheduler()
        meta = side.build_connector_meta(scheduler_output)
        if self.quiet is not None:
            scheduled = getattr(scheduler_output, "total_num_scheduled_tokens", None)
            self.quiet.step(meta, scheduled, side.pulling())
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.quiet is not None:
            self.quiet.output()
        self._scheduler().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, (block_ids,))

    def has_pending_block_frees(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_block_frees()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def on_new_request(self, request: Request) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.on_new_request(request)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A pull restores the request's own blocks in every transferred group (not only
        the prefix-cacheable ones a hash-addressed store would)."""
        return self._kv_cache_config.transfer_group_ids

    # ------------------------------------------------------------------ worker side

    def _worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise WrongRoleError("PdActorsConnector: worker hook called on the scheduler")
        return self.worker_side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        config = self._kv_cache_config
        group_of = {
            name: g for g, group in enumerate(config.kv_cache_groups) for name in group.layer_names
        }
        layout = self._worker().register_kv_caches(kv_caches, config.num_blocks, group_of)
        worker = self._worker()
        report = kv_layout_report(
            self.engine_id,
            worker.place.ranks,
            config,
            self._groups,
            layout,
            prefix_caching=bool(self._vllm_config.cache_config.enable_prefix_caching),
        )
        log.info("%s%s", PREFIX, json.dumps(report))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdActorsMetadata)
        self._worker().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for per layer."""

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None:
            assert isinstance(connector_metadata, PdActorsMetadata)
            self.worker_side.begin_step(connector_metadata)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Layer-wise streaming (setting ``layerwise``): this layer's KV is computed."""
        self._worker().save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """Eager send: hand the prompts this step completed to the sender (never blocks)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdActorsMetadata)
        self._worker().wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._connector_metadata
        if not isinstance(meta, PdActorsMetadata):
            meta = PdActorsMetadata()  # no step bound yet: a busy one
        sent, recvd, failed = self._worker().get_transfer_results(
            wait=meta.idle, quiet_after=meta.idle or meta.slept
        )
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=recvd, failed_recving=failed
        )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker_side is not None:
            stats = PdActorsStats(data=self.worker_side.take_counters())
        elif self.quiet is not None and self.quiet.gate is not None:
            stats = PdActorsStats(data={"idle_sleep_seconds": self.quiet.gate.take_sleeps()})
        else:
            return None
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return PdActorsStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PdActorsPromMetrics:
        return PdActorsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Heads outermost in each block (``LBHNC``, vLLM's ``HND``; what vLLM CPU always
        uses), so a TP rank's head range is one contiguous span per block and P and D of
        different TP sizes can exchange head slices, as upstream's MooncakeConnector asks.

        Also the first hook vLLM calls with the whole config (the engine core resolves the
        layout before it sizes the KV cache), so a model this connector cannot serve is
        refused here, by name (:func:`refuse_unserved`), before vLLM's own, vaguer error."""
        model_config = vllm_config.model_config
        if model_config is None:
            return None
        refuse_unserved(vllm_config)
        return None if model_config.use_mla else "LBHNC"

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.quiet is not None:
            self.quiet.close()


def apply_pull_failure_policy(transfer: Any, settings: ConnectorSettings) -> None:
    """Make vLLM's ``kv_load_failure_policy`` what ``on_pull_failure`` says, for this engine.

    vLLM's scheduler creates its connector and only then reads the policy from the same
    ``kv_transfer_config`` (vLLM 0.32, ``Scheduler.__init__``): ``"recompute"`` (our default)
    is written there, so a failed pull puts its request back with nothing computed and D
    computes the prompt itself; ``"fail"`` leaves vLLM's policy as the operator set it (its
    default ``fail``: the request ends with an error). vLLM keeps no record of which fields
    were given, so an explicit ``kv_load_failure_policy: "fail"`` cannot be told from the
    default: fail-fast is asked for with ``on_pull_failure: "fail"``. Raises
    :class:`ConnectorConfigError` for ``on_pull_failure: "fail"`` with
    ``kv_load_failure_policy: "recompute"`` (each says the opposite)."""
    if settings.on_pull_failure == "fail":
        if transfer.kv_load_failure_policy == "recompute":
            raise ConnectorConfigError(
                "PdActorsConnector: on_pull_failure 'fail' contradicts vLLM's "
                "kv_load_failure_policy 'recompute'; set one of them"
            )
        return
    transfer.kv_load_failure_policy = "recompute"


def _place(vllm_config: VllmConfig, engine_id: str, fingerprint: str) -> WorkerPlace:
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    transfer = vllm_config.kv_transfer_config
    assert transfer is not None
    pp = get_pp_group()
    place = worker_place(
        vllm_config.parallel_config,
        transfer,
        engine_id,
        tp_rank=get_tensor_model_parallel_rank(),
        tp_size=get_tensor_model_parallel_world_size(),
        pp_rank=pp.rank_in_group,
        pp_size=pp.world_size,
    )
    kv_heads = kv_heads_of(vllm_config.model_config)
    compat = engine_compat(vllm_config, fingerprint, kv_heads)  # once per worker, at start
    return dataclasses.replace(place, kv_heads=kv_heads, compat=compat)


def worker_place(
    parallel: Any,
    transfer: Any,
    engine_id: str,
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
) -> WorkerPlace:
    """Where this worker sits: its ranks, and whether it runs the bootstrap.

    The DP rank is upstream's: ``data_parallel_index`` (vLLM sets ``data_parallel_rank`` to 0
    in every engine of a dense model's DP deployment), or ``data_parallel_rank_local`` when each
    node's engines are managed alone (hybrid or external load balancing). One bootstrap per
    deployment: the TP 0 / PP 0 worker of DP index 0 (of each node's first local engine with
    local load balancing) runs it, and every other registers there.
    """
    dp_rank = dp_rank_of(parallel)
    settings = settings_from_extra_config(dict(transfer.kv_connector_extra_config))
    runs_bootstrap = (
        transfer.is_kv_producer
        and not settings.external_bootstrap
        and tp_rank == 0
        and pp_rank == 0
        and dp_rank == 0
    )
    return WorkerPlace(
        engine_id=engine_id,
        is_producer=transfer.is_kv_producer,
        is_consumer=transfer.is_kv_consumer,
        ranks=RankInfo(
            dp_rank=dp_rank, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size
        ),
        runs_bootstrap=runs_bootstrap,
    )


def dp_rank_of(parallel: Any) -> int:
    """This engine's DP rank as the bootstrap knows it (upstream's rule)."""
    if parallel.local_engines_only:
        return int(parallel.data_parallel_rank_local or 0)
    return int(parallel.data_parallel_index)
