"""Worker side of PdActorsConnector: vLLM's worker hooks → the mailbox → the Trio thread.

vLLM calls these hooks synchronously on its own thread; none of them waits on the network.
Work goes into the Trio thread with :meth:`TrioHost.post` (queued, returns at once) and is held
by the :class:`~pdactors_vllm.mailbox.Mailbox` until applied there; results come back through
the mailbox. The jobs around it each have a module: the KV tensors' layout (``kv_layout``),
the actors' configs (``actor_configs``), the actors in the Trio thread (``actors``), restart
supervision (``supervisor``) and the counters (``counters``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from pdactors import Layout, RunHasher, Xxh3Hasher, timeline
from pdactors.errors import PdError
from pdactors.host import TrioHost
from pdactors_vllm import idle
from pdactors_vllm.actor_configs import WorkerPlace, actor_configs, verify_kv_for
from pdactors_vllm.actors import WorkerActors
from pdactors_vllm.compat import with_kv_dtype
from pdactors_vllm.counters import TransferCounters
from pdactors_vllm.device_sums import TorchRunHasher
from pdactors_vllm.gil import lower_switch_interval
from pdactors_vllm.idle_gate import Waker
from pdactors_vllm.kv_layout import KVRegistration, layout_from_kv_caches
from pdactors_vllm.mailbox import Mailbox, StepWork
from pdactors_vllm.scheduler_side import PdActorsMetadata
from pdactors_vllm.settings import ConnectorSettings, TraceExport
from pdactors_vllm.supervisor import SHUTDOWN_TIMEOUT, Supervisor

if TYPE_CHECKING:
    from pdactors_vllm.tracing import TransferTracer

__all__ = ["KVRegistration", "WorkerPlace", "WorkerSide", "kv_hasher", "layout_from_kv_caches"]

log = logging.getLogger("pdactors.vllm")


def kv_hasher(kv_caches: Iterable[torch.Tensor]) -> RunHasher:
    """What computes the KV checksums of these KV tensors: xxh3 of host memory when they are
    there (the sums every host deployment sends), torch ops on their device when they are on
    a GPU (:mod:`pdactors_vllm.device_sums`)."""
    caches = list(kv_caches)
    if any(cache.is_cuda for cache in caches):
        return TorchRunHasher(caches)
    return Xxh3Hasher()


class WorkerSide:
    """The actors of one vLLM worker process, in a :class:`TrioHost` thread.

    If that thread dies, the death is logged with its traceback, every transfer in flight ends
    at the next ``get_finished`` (pulls as failed, so vLLM's ``kv_load_failure_policy``
    applies; sends as finished, so P frees its blocks), transfers handed over meanwhile fail at
    once with a log line, and the actors are restarted in the background (a new data plane
    and side channel; P registers its new address) by the
    :class:`~pdactors_vllm.supervisor.Supervisor`; after its last failed restart every
    transfer fails, loudly, until the server is restarted. None restarts after
    :meth:`shutdown`.
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        place: WorkerPlace,
        trace: TraceExport | None = None,
    ) -> None:
        """``trace``: where the transfers' spans go (None: no spans, no OpenTelemetry)."""
        self.settings = settings
        self.place = place
        self._trace = trace
        self._tracer: TransferTracer | None = None
        self._waker = Waker()  # D: pings the engine core's idle gate for each result
        self._mailbox = Mailbox(on_result=self._waker.wake)
        self._actors: WorkerActors | None = None
        self._supervisor: Supervisor | None = None
        self._cuda = False  # the KV lives on a GPU: a step's forward ends asynchronously
        self._layer_regions: dict[str, tuple[int, ...]] = {}
        #: this step's prompts streamed layer by layer (vLLM thread only): transfer ids
        self._streaming: list[str] = []
        if settings.timeline:
            timeline.enable()
        if settings.quiet_busy_waits:
            idle.install(busy=True)  # the worker's own wait for each step's input
        lower_switch_interval(settings.gil_switch_ms)

    @property
    def host(self) -> TrioHost | None:
        """The Trio thread's host while it runs (for tests and fault injection)."""
        return None if self._supervisor is None else self._supervisor.host

    @property
    def down(self) -> str | None:
        """Why the actors are not running (None: they are)."""
        return self._mailbox.down

    # ------------------------------------------------------------------ start and stop

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        group_of: Mapping[str, int] | None = None,
    ) -> Layout:
        """Start the data plane with vLLM's KV memory (``group_of``: each layer's KV-cache
        group), then the actors this role needs. Returns the layout the actors move."""
        layout, memory, self._layer_regions = layout_from_kv_caches(kv_caches, num_blocks,
                                                                    group_of)  # fmt: skip
        self.place = replace(self.place, compat=with_kv_dtype(self.place.compat, kv_caches))
        self._cuda = any(cache.is_cuda for cache in kv_caches.values())
        configs = actor_configs(self.settings, self.place, host_kv=not self._cuda)
        hasher = kv_hasher(kv_caches.values())
        if self._cuda:
            verify = verify_kv_for(self.settings, host_kv=False)
            log.info("KV checksums of %s: %s on %s (verify_kv %s)", self.place.engine_id,
                     repr(hasher.header) if verify != "off" else "off",
                     next(iter(kv_caches.values())).device, self.settings.verify_kv)  # fmt: skip
        if self._trace is not None and self._tracer is None:
            from pdactors_vllm.tracing import TransferTracer  # OpenTelemetry: only when on

            self._tracer = TransferTracer(self._trace, self.place.engine_id)
        self._actors = WorkerActors(self.settings, self.place, configs, layout, memory,
                                    self._mailbox, hasher, self._tracer)  # fmt: skip
        name = f"PdActorsConnector worker {self.place.engine_id}"
        self._supervisor = Supervisor(name, self._start_host, on_up=self._up)
        self._supervisor.start()
        return layout

    def _start_host(self) -> TrioHost:
        assert self._actors is not None
        host = TrioHost(name=f"pdactors-{self.place.engine_id}", on_death=self._on_death)
        try:
            host.start(self._actors.serve)
        except BaseException:
            host.close(timeout=SHUTDOWN_TIMEOUT)
            raise
        return host

    def _up(self) -> None:
        self._mailbox.set_down(None)

    def shutdown(self) -> None:
        """Stop the actors and the engine (bounded by :data:`SHUTDOWN_TIMEOUT`); no restart
        starts them again."""
        self._mailbox.set_down("the connector was shut down")
        if self._supervisor is not None:
            self._supervisor.close(timeout=SHUTDOWN_TIMEOUT)
        self._waker.close()
        if self._tracer is not None:
            self._tracer.close()

    def _on_death(self, error: BaseException) -> None:
        """Called in the dead Trio thread (no Trio task runs any more): end every transfer."""
        reason = f"the connector's Trio thread died ({type(error).__name__}: {error})"
        unapplied = self._mailbox.set_down(reason)
        assert self._actors is not None
        sends, pulls = self._actors.release_all()
        self._mailbox.add(sent=sends, failed=pulls)
        for work in unapplied:
            self._fail(work, reason)
        log.error(
            "PdActorsConnector worker %s: %s; %d pulls failed, %d sends released; restarting",
            self.place.engine_id, reason, len(pulls), len(sends),
        )  # fmt: skip
        if self._supervisor is not None:
            self._supervisor.died()

    def _fail(self, work: StepWork, reason: str) -> None:
        """The actors cannot take this step's work: its pulls fail, its sends are released."""
        sends, pulls = work.releases()
        self._mailbox.add(sent=sends, failed=pulls)
        if pulls or sends:
            log.warning(
                "PdActorsConnector worker %s: %d pulls failed and %d sends released: %s",
                self.place.engine_id, len(pulls), len(sends), reason,
            )  # fmt: skip

    # ------------------------------------------------------------------ each step (vLLM thread)

    def begin_step(self, meta: PdActorsMetadata) -> None:
        """The step's metadata is bound, before its forward: hand P's work to the actors (none
        of it depends on this forward) and, with ``layerwise``, start streaming the prompts
        this forward completes. Returns at once."""
        idle.end()  # this step's input came: the wait for it is over
        if meta.wake is not None:
            self._waker.connect(meta.wake)
        streams = meta.eager if self.settings.layerwise and self.place.is_producer else {}
        self._streaming = [send.transfer_id for send in streams.values()]
        if meta.pending or meta.ready or meta.dropped or streams:
            self._submit(
                StepWork(
                    pending=meta.pending, ready=meta.ready, dropped=meta.dropped, streams=streams
                )
            )

    def start_load_kv(self, meta: PdActorsMetadata) -> None:
        """Hand this step's pulls and aborts to the actors; returns at once."""
        if meta.pulls or meta.aborts:
            self._submit(StepWork(pulls=meta.pulls, aborts=meta.aborts))

    def save_kv_layer(self, layer_name: str) -> None:
        """Layer-wise: this step's forward has written ``layer_name``'s KV; stream it."""
        if not self._streaming or (regions := self._layer_regions.get(layer_name)) is None:
            return
        event = self._forward_event()
        host = self.host
        if host is not None and self._actors is not None:
            try:
                host.post(self._actors.layer_done, list(self._streaming), regions, event)
            except PdError:
                pass  # the thread died: its death ends these transfers

    def wait_for_save(self, meta: PdActorsMetadata) -> None:
        """Eager send: this step's forward has computed the prompts in ``meta.eager``; hand
        their blocks to the sender. Returns at once: on a GPU the sender gets them once the
        forward's kernels are done (an event recorded now), and this thread never waits."""
        self._streaming = []
        if not meta.eager:
            return
        for send in meta.eager.values():
            timeline.mark(send.transfer_id, "p_computed")
        eager = len(meta.eager)

        def count(c: TransferCounters) -> None:
            c.eager_sent += eager

        self._mailbox.count(count)
        self._submit(StepWork(ready=dict(meta.eager)), self._forward_event())

    def _forward_event(self) -> torch.cuda.Event | None:
        """On a GPU, an event recorded now on the forward's stream: once it has completed, the
        KV the forward wrote so far is in memory. None on a CPU (the forward is synchronous)."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event

    def _submit(self, work: StepWork, event: torch.cuda.Event | None = None) -> None:
        down = self._mailbox.hold(work)
        host, actors = self.host, self._actors
        if down is not None or host is None or actors is None:
            if down is None:  # held, yet nothing will apply it
                self._mailbox.applied(work)
            self._fail(work, down or "the connector's actors are not running")
            return
        try:
            host.post(actors.apply, work, event)
        except PdError:
            pass  # it died just now: _on_death fails what was not applied, this work included

    def get_transfer_results(
        self, *, wait: bool = False, quiet_after: bool = False
    ) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call.

        Failed pulls are in ``finished_recving`` too: vLLM then applies its
        ``kv_load_failure_policy`` and never leaves the request waiting. With ``wait`` (an
        idle step), waits up to ``idle_wait_ms`` for a result when none is there yet, and
        returns as soon as one arrives. With ``quiet_after`` (an idle step, or one the engine
        core slept before: the next may come as late), the wait for the next step's input
        blocks on vLLM's write notification instead of spinning.
        """
        results = self._mailbox.take(self.settings.idle_wait_ms / 1000 if wait else 0.0)
        if quiet_after and self.settings.quiet_busy_waits:
            idle.begin()  # the engine core pauses before the next step: wait for it quietly
        return results

    def take_counters(self) -> dict[str, Any]:
        """Counters since the last call (any thread)."""
        return self._mailbox.take_counters()
