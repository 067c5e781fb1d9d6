"""Worker side of PdActorsConnector: KV-cache registration and the actors in one Trio thread.

vLLM calls these hooks synchronously on its own thread; none of them waits on the network.
Work goes into the Trio thread with :meth:`TrioHost.post` (queued, returns at once); results
come back through sets guarded by a lock, filled by tasks in the Trio thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
import trio

from pdactors import (
    BlockLayout,
    BootstrapConfig,
    DataPlaneConfig,
    Layout,
    Liveness,
    RankInfo,
    Receiver,
    ReceiverConfig,
    Sender,
    SenderConfig,
    open_mooncake,
    serve_bootstrap,
    serve_receiver,
    serve_sender,
    timeline,
)
from pdactors.errors import PdError
from pdactors.host import TrioHost
from pdactors_vllm import idle
from pdactors_vllm.scheduler_side import PdActorsMetadata, PullSpec, SendSpec
from pdactors_vllm.settings import ConnectorSettings

__all__ = ["KVRegistration", "TransferCounters", "WorkerSide", "layout_from_kv_caches"]

log = logging.getLogger("pdactors.vllm")

SHUTDOWN_TIMEOUT = 10.0
#: Restarts of the actors after their Trio thread died (1 s, 2 s, 4 s apart), then give up.
RESTART_LIMIT = 3


class KVRegistration(NamedTuple):
    layout: Layout
    memory: list[tuple[int, int]]  # (address, bytes) to register with the data plane
    layer_regions: dict[str, tuple[int, ...]]  # vLLM layer name -> its regions in the layout


def layout_from_kv_caches(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    group_of: Mapping[str, int] | None = None,
) -> KVRegistration:
    """vLLM's per-layer KV tensors → our :class:`Layout`, the memory to register, and which
    regions hold each layer (for layer-wise streaming).

    ``group_of``: each layer's KV-cache group (vLLM's ``kv_cache_groups``; none: one group).
    Every layer must have one; its regions move that group's blocks.

    A tensor whose first dimension is the block count is one region (vLLM CPU:
    ``[blocks, kv_heads, block_size, 2*head]``); one whose second dimension is, with K and V
    first (``[2, blocks, ...]``), is two. Regions are ordered by layer name and carry it, so a
    P pipeline stage (some layers) writes each into D's region of the same name.
    Memory is registered by underlying storage, so views of one allocation count once.
    """
    regions: list[BlockLayout] = []
    names: list[str] = []
    storages: dict[int, int] = {}
    layer_regions: dict[str, tuple[int, ...]] = {}
    groups: list[int] = []
    for name in sorted(kv_caches):
        cache = kv_caches[name]
        storage = cache.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        if cache.shape[0] == num_blocks:
            parts = [cache]
        elif cache.ndim > 1 and cache.shape[1] == num_blocks:
            parts = list(cache.unbind(0))
        else:
            raise PdError(f"KV cache {name} of shape {tuple(cache.shape)} has no block dimension")
        if group_of is not None and name not in group_of:
            raise PdError(f"KV cache {name} is in no KV-cache group vLLM named")
        layer_regions[name] = tuple(range(len(regions), len(regions) + len(parts)))
        groups += [group_of[name] if group_of is not None else 0] * len(parts)
        names += [name] if len(parts) == 1 else [f"{name}[{k}]" for k in range(len(parts))]
        for part in parts:
            if not part[0].is_contiguous():
                raise PdError(f"KV cache {name}: a block is not contiguous in memory")
            regions.append(
                BlockLayout(
                    base=part.data_ptr(),
                    num_blocks=num_blocks,
                    block_bytes=part[0].nbytes,
                    stride=part.stride(0) * part.element_size(),
                )
            )
    layout = Layout(tuple(regions), tuple(names), tuple(groups) if any(groups) else ())
    return KVRegistration(layout, sorted(storages.items()), layer_regions)


@dataclass
class TransferCounters:
    """What this worker's actors did since the last report (for vLLM's connector stats)."""

    sent: int = 0
    bytes_sent: int = 0
    descriptors_sent: int = 0
    eager_sent: int = 0
    streamed_sent: int = 0
    received: int = 0
    failed: int = 0
    expired: int = 0
    write_seconds: list[float] = field(default_factory=list)
    pull_seconds: list[float] = field(default_factory=list)

    def take(self) -> dict[str, Any]:
        """The counters as connector-stats data; resets them."""
        data = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            setattr(self, f.name, [] if f.name.endswith("_seconds") else 0)
        return data


@dataclass(frozen=True, slots=True)
class WorkerPlace:
    """Where this worker sits: engine, role and parallel ranks."""

    engine_id: str
    is_producer: bool
    is_consumer: bool
    ranks: RankInfo
    runs_bootstrap: bool
    kv_heads: int = 0  # the model's KV heads in all (heterogeneous TP needs them)


class WorkerSide:
    """The actors of one vLLM worker process, in a :class:`TrioHost` thread.

    If that thread dies, the death is logged with its traceback, every transfer in flight ends
    at the next ``get_finished`` (pulls as failed, so vLLM's ``kv_load_failure_policy``
    applies; sends as finished, so P frees its blocks), transfers handed over meanwhile fail at
    once with a log line, and the actors are restarted in the background (a new data plane
    and side channel; P registers its new address). After :data:`RESTART_LIMIT` failed restarts
    every transfer fails, loudly, until the server is restarted.
    """

    def __init__(self, settings: ConnectorSettings, place: WorkerPlace) -> None:
        self.settings = settings
        self.place = place
        self._host: TrioHost | None = None
        self._sender: Sender | None = None
        self._receiver: Receiver | None = None
        self._lock = threading.Lock()
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._send_req: dict[str, str] = {}  # transfer id -> P request id (Trio thread only)
        self._recv_req: dict[str, str] = {}  # transfer id -> D request id (Trio thread only)
        self._unapplied: deque[PdActorsMetadata] = deque()  # posted, not yet run (lock)
        self._results_ready = threading.Event()  # set when any of the three sets grows
        self._down: str | None = None  # why the actors are not running (lock)
        self._layout: Layout | None = None
        self._memory: list[tuple[int, int]] = []
        self._cuda = False  # the KV lives on a GPU: a step's forward ends asynchronously
        self._layer_regions: dict[str, tuple[int, ...]] = {}
        #: this step's prompts streamed layer by layer (vLLM thread only): transfer ids
        self._streaming: list[str] = []
        self._recved_tids: dict[str, str] = {}  # req id -> transfer id, until reported (lock)
        self.counters = TransferCounters()
        if settings.timeline:
            timeline.enable()
        if settings.quiet_busy_waits:
            idle.install(busy=True)  # the worker's own wait for each step's input

    # ------------------------------------------------------------------ start and stop

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        group_of: Mapping[str, int] | None = None,
    ) -> Layout:
        """Start the data plane with vLLM's KV memory (``group_of``: each layer's KV-cache
        group), then the actors this role needs. Returns the layout the actors move."""
        registered = layout_from_kv_caches(kv_caches, num_blocks, group_of)
        layout, memory, self._layer_regions = registered
        if self.settings.protocol == "nvlink_intra":
            # Mooncake installs its intra-node NVLink transport only when this is set.
            os.environ.setdefault("MC_INTRANODE_NVLINK", "1")
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        self._layout, self._memory = layout, memory
        self._cuda = any(cache.is_cuda for cache in kv_caches.values())
        self._start_host()
        return layout

    def _start_host(self) -> None:
        host = TrioHost(name=f"pdactors-{self.place.engine_id}", on_death=self._on_death)
        try:
            host.start(self._serve)
        except BaseException:
            host.close(timeout=SHUTDOWN_TIMEOUT)
            raise
        self._host = host

    async def _serve(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        s, place = self.settings, self.place
        layout, memory = self._layout, self._memory
        assert layout is not None
        plane_config = DataPlaneConfig(
            protocol=s.protocol,
            device_name=s.device_name,
            hostname=s.host,
            workers=s.sender_workers,
        )
        # A handshake a starved peer cannot answer is a heartbeat it cannot answer: one bound.
        hung = s.heartbeat_timeout
        liveness = Liveness(heartbeat_timeout=hung, connect_timeout=hung)
        async with open_mooncake(plane_config) as plane, trio.open_nursery() as nursery:
            plane.register(memory)
            token = s.bootstrap_token()
            transport = s.side_channel(producer=place.is_producer, consumer=place.is_consumer)
            if place.runs_bootstrap:
                config = BootstrapConfig(
                    host=s.bootstrap_host,
                    port=s.bootstrap_port,
                    token=token,
                    certfile=s.bootstrap_certfile,
                    keyfile=s.bootstrap_keyfile,
                )
                await nursery.start(serve_bootstrap, config)
            if place.is_producer:
                sender_config = SenderConfig(
                    engine_id=place.engine_id,
                    ranks=place.ranks,
                    host=s.host,
                    bootstrap_url=s.bootstrap_url,
                    ready_timeout=s.ready_timeout,
                    unclaimed_ttl=s.unclaimed_ttl,
                    register_timeout=s.register_timeout,
                    liveness=liveness,
                    kv_heads=place.kv_heads,
                    bootstrap_token=token,
                    bootstrap_ca_file=s.bootstrap_ca_file,
                )
                self._sender = await nursery.start(
                    partial(serve_sender, transport=transport), sender_config, plane, layout
                )
                nursery.start_soon(self._collect_sent, self._sender)
            if place.is_consumer:
                receiver_config = ReceiverConfig(
                    engine_id=place.engine_id,
                    ranks=place.ranks,
                    pull_timeout=s.pull_timeout,
                    lookup_timeout=s.lookup_timeout,
                    liveness=liveness,
                    kv_heads=place.kv_heads,
                    bootstrap_token=token,
                    bootstrap_ca_file=s.bootstrap_ca_file,
                    trusted_bootstraps=(*s.trusted_bootstraps, s.bootstrap_url),
                )
                self._receiver = await nursery.start(
                    partial(serve_receiver, transport=transport), receiver_config, plane, layout
                )
                nursery.start_soon(self._collect_received, self._receiver)
            task_status.started()

    def shutdown(self) -> None:
        """Stop the actors and the engine (bounded by :data:`SHUTDOWN_TIMEOUT`)."""
        with self._lock:
            self._down = "the connector was shut down"
        if self._host is not None:
            host, self._host = self._host, None
            host.close(timeout=SHUTDOWN_TIMEOUT)

    # ------------------------------------------------------------------ the Trio thread died

    def _on_death(self, error: BaseException) -> None:
        """Called in the dead Trio thread (no Trio task runs any more): end every transfer."""
        reason = f"the connector's Trio thread died ({type(error).__name__}: {error})"
        with self._lock:
            self._down = reason
            unapplied = list(self._unapplied)
            self._unapplied.clear()
            pulls, self._recv_req = set(self._recv_req.values()), {}
            sends, self._send_req = set(self._send_req.values()), {}
            self._add_results(sent=sends, failed=pulls)
        for meta in unapplied:
            self._fail_meta(meta, reason)
        log.error(
            "PdActorsConnector worker %s: %s; %d pulls failed, %d sends released; restarting",
            self.place.engine_id, reason, len(pulls), len(sends),
        )  # fmt: skip
        threading.Thread(target=self._restart, name="pdactors-restart", daemon=True).start()

    def _add_results(
        self,
        *,
        sent: set[str] | frozenset[str] = frozenset(),
        recved: set[str] | frozenset[str] = frozenset(),
        failed: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        """Add requests to the next ``get_finished`` (call with ``self._lock`` held); wakes an
        idle step that waits for results."""
        self._finished_sending |= sent
        self._finished_recving |= recved
        self._failed_recving |= failed
        if sent or recved or failed:
            self._results_ready.set()

    def _fail_meta(self, meta: PdActorsMetadata, reason: str) -> None:
        """The actors cannot take this step's work: its pulls fail, its sends are released."""
        pulls = {req for req, pull in meta.pulls.items() if not pull.notify_only}
        sends = set(meta.ready) | set(meta.streams)
        with self._lock:
            self._add_results(sent=sends, failed=pulls)
        if pulls or sends:
            log.warning(
                "PdActorsConnector worker %s: %d pulls failed and %d sends released: %s",
                self.place.engine_id, len(pulls), len(sends), reason,
            )  # fmt: skip

    def _restart(self) -> None:
        old = self._host
        if old is not None:
            try:
                old.close(timeout=SHUTDOWN_TIMEOUT)
            except PdError:
                pass  # it died: that is why we are here, and it was logged
        for attempt in range(RESTART_LIMIT):
            time.sleep(2.0**attempt)
            try:
                self._start_host()
            except Exception as exc:  # logged; the next attempt may succeed
                log.error("PdActorsConnector: restart %d failed: %s", attempt + 1, exc)
                continue
            with self._lock:
                self._down = None
            log.warning("PdActorsConnector worker %s: actors restarted", self.place.engine_id)
            return
        log.error(
            "PdActorsConnector worker %s: gave up restarting the actors; every transfer fails "
            "until the server is restarted",
            self.place.engine_id,
        )

    # ------------------------------------------------------------------ each step (vLLM thread)

    def begin_step(self, meta: PdActorsMetadata) -> None:
        """The step's metadata is bound, before its forward: hand P's work to the actors (none
        of it depends on this forward) and, with ``layerwise``, start streaming the prompts
        this forward completes. Returns at once."""
        streams = meta.eager if self.settings.layerwise and self.place.is_producer else {}
        self._streaming = [send.transfer_id for send in streams.values()]
        if meta.pending or meta.ready or meta.dropped or streams:
            p_side = PdActorsMetadata(
                pending=meta.pending, ready=meta.ready, dropped=meta.dropped, streams=streams
            )
            self._submit(p_side)

    def start_load_kv(self, meta: PdActorsMetadata) -> None:
        """Hand this step's pulls and aborts to the actors; returns at once."""
        if meta.pulls or meta.aborts:
            self._submit(PdActorsMetadata(pulls=meta.pulls, aborts=meta.aborts))

    def save_kv_layer(self, layer_name: str) -> None:
        """Layer-wise: this step's forward has written ``layer_name``'s KV; stream it."""
        if not self._streaming or (regions := self._layer_regions.get(layer_name)) is None:
            return
        event = self._forward_event()
        host = self._host
        if host is not None:
            try:
                host.post(self._layer_done, list(self._streaming), regions, event)
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
        with self._lock:
            self.counters.eager_sent += len(meta.eager)
        self._submit(PdActorsMetadata(ready=dict(meta.eager)), self._forward_event())

    def _forward_event(self) -> torch.cuda.Event | None:
        """On a GPU, an event recorded now on the forward's stream: once it has completed, the
        KV the forward wrote so far is in memory. None on a CPU (the forward is synchronous)."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event

    def _submit(self, meta: PdActorsMetadata, event: torch.cuda.Event | None = None) -> None:
        with self._lock:
            down, host = self._down, self._host
            if down is None:
                self._unapplied.append(meta)
        if down is not None or host is None:
            self._fail_meta(meta, down or "the connector's actors are not running")
            return
        try:
            host.post(self._apply, meta, event)
        except PdError:
            pass  # it died just now: _on_death fails what was not applied, this meta included

    def get_transfer_results(self, *, wait: bool = False) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call.

        Failed pulls are in ``finished_recving`` too: vLLM then applies its
        ``kv_load_failure_policy`` and never leaves the request waiting. With ``wait`` (an
        idle step), waits up to ``idle_wait_ms`` for a result when none is there yet, and
        returns as soon as one arrives.
        """
        if wait and not self._results_ready.is_set():
            self._results_ready.wait(self.settings.idle_wait_ms / 1000)
        with self._lock:
            self._results_ready.clear()
            sent, self._finished_sending = self._finished_sending, set()
            recvd, self._finished_recving = self._finished_recving, set()
            failed, self._failed_recving = self._failed_recving, set()
            tids = [self._recved_tids.pop(r) for r in recvd if r in self._recved_tids]
        for tid in tids:
            timeline.mark(tid, "reported")
        return sent, recvd | failed, failed

    # ------------------------------------------------------------------ in the Trio thread

    def _apply(self, meta: PdActorsMetadata, event: torch.cuda.Event | None = None) -> None:
        with self._lock:
            self._unapplied.remove(meta)
        sender, receiver = self._sender, self._receiver
        if sender is not None:
            for tid in meta.pending:
                _logged(sender.transfer_pending, tid)
            for req_id, send in meta.streams.items():
                self._send_req[send.transfer_id] = req_id  # a death releases it from now on
                _logged(sender.transfer_streaming, send.transfer_id, send.block_ids)
            if meta.ready:
                # Known here from now on, so that a death of this thread releases them too.
                self._send_req |= {send.transfer_id: r for r, send in meta.ready.items()}
                self._ready(sender, meta.ready, _waiter(event))
            for tid in meta.dropped:
                _logged(sender.transfer_dropped, tid, "the prefill ended without its KV")
        if receiver is not None:
            for req_id, pull in meta.pulls.items():
                self._start_pull(receiver, req_id, pull)
            for tid in meta.aborts.values():
                _logged(receiver.abort, tid, "the request was aborted on D")

    def _ready(
        self, sender: Sender, sends: dict[str, SendSpec], complete: Callable[[], object] | None
    ) -> None:
        for req_id, send in sends.items():
            self._send_req[send.transfer_id] = req_id
            ready = _logged(
                sender.transfer_ready, send.transfer_id, send.block_ids, complete=complete
            )
            if not ready:
                del self._send_req[send.transfer_id]  # never sent: P may free the blocks
                with self._lock:
                    self._add_results(sent={req_id})

    def _layer_done(
        self, tids: list[str], regions: tuple[int, ...], event: torch.cuda.Event | None
    ) -> None:
        if (sender := self._sender) is not None:
            complete = _waiter(event)
            for tid in tids:
                sender.layer_ready(tid, regions, complete=complete)

    def _start_pull(self, receiver: Receiver, req_id: str, pull: PullSpec) -> None:
        started = _logged(
            receiver.start_pull,
            pull.transfer_id,
            bootstrap_url=pull.bootstrap_url,
            engine_id=pull.engine_id,
            block_ids=pull.block_ids,
        )
        if pull.notify_only:
            return
        if started:
            self._recv_req[pull.transfer_id] = req_id
        else:  # e.g. a pull for this transfer id is in flight: it goes on, this one fails
            with self._lock:
                self._add_results(failed={req_id})

    async def _collect_sent(self, sender: Sender) -> None:
        seen_bytes = seen_descriptors = seen_sent = seen_expired = seen_streamed = 0
        while True:
            released = await sender.wait_finished()
            reqs = {self._send_req.pop(tid) for tid in released if tid in self._send_req}
            stats = sender.statistics()
            writes = list(sender.write_seconds)
            sender.write_seconds.clear()
            with self._lock:
                self._add_results(sent=reqs)
                c = self.counters
                c.sent += stats.sent - seen_sent
                c.expired += stats.expired - seen_expired
                c.bytes_sent += sender.bytes_sent - seen_bytes
                c.descriptors_sent += sender.descriptors_sent - seen_descriptors
                c.streamed_sent += sender.streamed_sent - seen_streamed
                c.write_seconds += writes
            seen_sent, seen_expired = stats.sent, stats.expired
            seen_bytes, seen_descriptors = sender.bytes_sent, sender.descriptors_sent
            seen_streamed = sender.streamed_sent

    async def _collect_received(self, receiver: Receiver) -> None:
        while True:
            results = await receiver.wait_results()
            for tid, reason in results.failed.items():
                if tid in self._recv_req:
                    log.warning("KV pull %s failed: %s", tid, reason)
                else:  # a notify-only pull (P just frees its KV): nobody waits for it
                    log.info("KV release notice %s to P failed: %s", tid, reason)
            ok_tids = {t: self._recv_req.pop(t) for t in results.finished if t in self._recv_req}
            ok = set(ok_tids.values())
            failed = {self._recv_req.pop(t) for t in results.failed if t in self._recv_req}
            with self._lock:
                if timeline.enabled():
                    self._recved_tids.update({r: t for t, r in ok_tids.items()})
                self._add_results(recved=ok, failed=failed)
                self.counters.received += len(ok)
                self.counters.failed += len(failed)
                self.counters.pull_seconds += receiver.pull_seconds
            receiver.pull_seconds.clear()

    def take_counters(self) -> dict[str, Any]:
        """Counters since the last call (any thread)."""
        with self._lock:
            return self.counters.take()


def _waiter(event: torch.cuda.Event | None) -> Callable[[], object] | None:
    """What the sender's write thread calls to wait for the forward's kernels up to ``event``
    (None on a CPU, where the forward is synchronous). The wait happens in the thread that
    then makes the engine call: no hop between the GPU finishing and the write starting."""
    return None if event is None else event.synchronize


def _logged(fn: Callable[..., None], *args: Any, **kwargs: Any) -> bool:
    """Call ``fn``; say whether it worked. Engine-reported events the actors refuse
    (IllegalTransition, a duplicate transfer id) are logged; anything else is logged with its
    traceback. Neither is fatal: the caller fails that one transfer."""
    try:
        fn(*args, **kwargs)
    except PdError as exc:
        log.warning("%s%r refused: %s", fn.__name__, args, exc)
        return False
    except Exception as exc:  # a bug: this transfer fails, the others go on
        log.error("%s%r failed: %s", fn.__name__, args, exc, exc_info=exc)
        return False
    return True
