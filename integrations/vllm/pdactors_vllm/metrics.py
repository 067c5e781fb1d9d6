"""PdActorsConnector's metrics through vLLM's connector-stats hooks, shown on vLLM's /metrics.

Workers report :class:`PdActorsStats` each step (``get_kv_connector_stats``), and so does D's
scheduler side (its idle gate's sleeps); vLLM sums them across workers and hands the sum to
:class:`PdActorsPromMetrics.observe` in the API server.

From start-up (vLLM builds :class:`PdActorsPromMetrics` with its stat loggers, before any
request) the API server also exports which model it answers with: the info gauge
:data:`~pdactors.wire.COMPAT_INFO`, labelled with the identity fields of the compatibility
description (:func:`identity_labels`), which the proxy reads to pair only a P and a D that
answer alike. Not with ``--disable-log-stats`` (no stat logger, no ``/metrics`` of vLLM's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from pdactors.core.compat import IDENTITY_FIELDS
from pdactors.wire import COMPAT_INFO
from pdactors_vllm.compat import dtype_of, model_digest, weights_of
from pdactors_vllm.settings import settings_from_extra_config

__all__ = ["COUNTERS", "DURATIONS", "PdActorsPromMetrics", "PdActorsStats", "identity_labels"]

log = logging.getLogger("pdactors.vllm")

#: name in the stats -> (Prometheus name, help)
COUNTERS = {
    "sent": ("vllm:pdactors_transfers_sent", "KV transfers P wrote into D (P workers)."),
    "bytes_sent": ("vllm:pdactors_bytes_sent", "KV bytes P wrote into D (P workers)."),
    "descriptors_sent": (
        "vllm:pdactors_descriptors_sent",
        "Mooncake descriptors P wrote, after coalescing (P workers).",
    ),
    "eager_sent": (
        "vllm:pdactors_eager_sends",
        "Prompts whose KV P handed over at the end of the forward that computed it (P).",
    ),
    "streamed_sent": (
        "vllm:pdactors_streamed_sends",
        "KV transfers written layer by layer while P computed them (P, setting layerwise).",
    ),
    "expired": ("vllm:pdactors_transfers_expired", "Finished prefills no D pulled in time (P)."),
    "received": ("vllm:pdactors_pulls_received", "KV pulls that landed (D workers)."),
    "landed_early": (
        "vllm:pdactors_pulls_landed_early",
        "Of the pulls received, those P's write thread reported landed before its side-channel "
        "answer (D, the fast completion path: verify_kv off).",
    ),
    "failed": (
        "vllm:pdactors_pulls_failed",
        "KV pulls that failed, timed out or were aborted (D).",
    ),
    "recomputed": (
        "vllm:pdactors_pull_fallbacks",
        "Failed KV pulls whose prompt D computes itself instead (D, on_pull_failure recompute).",
    ),
    "bad_frames": (
        "vllm:pdactors_side_channel_bad_frames",
        "Side-channel frames P refused: undecodable, or over a limit (P).",
    ),
    "peers_cut_off": (
        "vllm:pdactors_side_channel_peers_cut_off",
        "Side-channel peers P cut off for not reading their replies (P).",
    ),
    "messages_dropped": (
        "vllm:pdactors_side_channel_dropped",
        "Side-channel messages P dropped: from peers it cut off, or replies to peers gone (P).",
    ),
    "notices_sent": (
        "vllm:pdactors_done_notices_sent",
        "Fast completion notices P's write threads sent to D (P).",
    ),
    "notices_dropped": (
        "vllm:pdactors_done_notices_dropped",
        "Fast completion notices P could not send; the PullDone after them stands (P).",
    ),
    "notices_refused": (
        "vllm:pdactors_done_notices_refused",
        "Pulls whose done_to address P refused (not a numeric udp://ip:port) (P).",
    ),
    "protocol_errors": (
        "vllm:pdactors_side_channel_protocol_errors",
        "Answers from P workers D could not use: error replies, undecodable frames (D).",
    ),
}
DURATIONS = {
    "write_seconds": ("vllm:pdactors_write_seconds", "Time of one KV write, plan included (P)."),
    "pull_seconds": (
        "vllm:pdactors_pull_seconds",
        "Time from D's pull to P's answer, waiting for P's prefill included (D).",
    ),
    "idle_sleep_seconds": (
        "vllm:pdactors_idle_sleep_seconds",
        "Time D's engine core slept between steps while every request waited for KV (D).",
    ),
}
_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class PdActorsStats(KVConnectorStats):
    """One interval's counters (ints) and durations (lists of seconds), summed over workers."""

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data[key] = [*self.data.get(key, []), *value]
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if isinstance(value, list):
                out[f"{key}_count"] = len(value)
                if value:
                    out[f"{key}_avg"] = sum(value) / len(value)
            else:
                out[key] = value
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def reset(self) -> None:
        self.data = {}


class PdActorsPromMetrics(KVConnectorPromMetrics):
    """Registers the counters and histograms above, labelled per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, (name, doc) in COUNTERS.items()
        }
        histogram_cls: Any = self._histogram_cls  # typed by vLLM as any of the three kinds
        self._histograms = {
            key: create_metric_per_engine(
                histogram_cls(
                    name=name, documentation=doc, labelnames=labelnames, buckets=_BUCKETS
                ),
                per_engine_labelvalues,
            )
            for key, (name, doc) in DURATIONS.items()
        }
        identity = identity_labels(vllm_config)
        gauge_cls: Any = self._gauge_cls  # typed by vLLM as any of the three kinds
        info = gauge_cls(
            name=COMPAT_INFO,
            documentation="Which model this engine answers with (PdActorsConnector's compatibility "
            "description: model config digest, weights fingerprint, dtype; role and compat_relax); "
            "always 1. The proxy pairs only a P and a D whose labels agree.",
            multiprocess_mode="mostrecent",
            labelnames=[*labelnames, *identity],
        )
        for values in per_engine_labelvalues.values():
            info.labels(*values, *identity.values()).set(1)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            counter: Any = per_engine[engine_idx]
            if transfer_stats_data.get(key):
                counter.inc(transfer_stats_data[key])
        for key, per_engine in self._histograms.items():
            histogram: Any = per_engine[engine_idx]
            for seconds in transfer_stats_data.get(key, ()):
                histogram.observe(seconds)


def identity_labels(vllm_config: Any) -> dict[str, str]:
    """The info gauge's own labels: ``role`` (``kv_role``), the identity fields as this engine's
    workers register them (:func:`pdactors_vllm.compat.engine_compat`) and ``relax``
    (``compat_relax``, comma-separated). Never raises: a field that cannot be computed is
    logged and exported empty (not compared, as in the workers' description)."""
    transfer, model = vllm_config.kv_transfer_config, vllm_config.model_config
    fingerprint, relax = "", ""
    try:
        settings = settings_from_extra_config(dict(transfer.kv_connector_extra_config or {}))
        fingerprint, relax = settings.model_fingerprint, ",".join(settings.compat_relax)
    except Exception as exc:  # the workers refuse a bad config by name; the gauge goes on
        log.warning("PdActorsConnector: compat info without the connector's settings: %s", exc)
    compute: dict[str, Callable[[], str]] = {
        "model": lambda: model_digest(model),
        "weights": lambda: weights_of(vllm_config, fingerprint),
        "dtype": lambda: dtype_of(model),
    }
    labels = {"role": str(getattr(transfer, "kv_role", "") or "")}
    for name in IDENTITY_FIELDS:
        try:
            labels[name] = compute[name]()
        except Exception as exc:  # never break the server for a label: export what we have
            log.warning("PdActorsConnector: compat info: cannot compute %s (%s: %s); exported "
                        "empty (not compared)", name, type(exc).__name__, exc)  # fmt: skip
            labels[name] = ""
    labels["relax"] = relax
    return labels
