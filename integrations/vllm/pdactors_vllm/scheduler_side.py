"""Scheduler side of PdActorsConnector: pure bookkeeping, no IO, no threads. (What its idle
marks do in the engine core's process — vLLM's waits patched, D's sleep between idle steps —
is :mod:`pdactors_vllm.quiet_steps`, installed beside it by the connector.)

It turns vLLM's scheduler hooks into one :class:`PdActorsMetadata` per step, which vLLM hands to
every worker. Observable behaviour follows upstream's MooncakeConnector (the same
``kv_transfer_params``), without its gaps:

* P (``do_remote_decode``): the prefill is announced as pending when its blocks are allocated.
  *Eager send* (the default; :mod:`pdactors_vllm.eager_send`): in the step whose chunk
  completes the prompt, when that step also ends the request (``max_tokens`` 1, as proxies
  send P), the prompt's blocks go to the worker with that step's metadata (``eager``), and the
  worker hands them to the sender at the end of the step's forward (``wait_for_save``) — one
  whole forward earlier than from ``request_finished``. The request then finishes in that
  step's ``update_from_output``: the blocks are kept until the worker reports the write ended,
  whatever the end (an abort drops the transfer; a write in flight runs to its end first).
  Otherwise, at finish — ``length`` *or* ``stop`` (a first token that is EOS still delivers
  the KV) — the blocks are kept and handed to the worker. Either way the response carries
  ``kv_transfer_params`` for D; any other end (abort, error) drops the transfer, and a
  waiting D hears at once.
* D (``do_remote_prefill``): the prompt's uncached tokens are reported as loaded
  asynchronously; D's block ids go to the worker once; a full local prefix hit or an abort
  before scheduling still tells P to free its blocks (an empty pull); an abort while the KV is
  in flight aborts the pull (vLLM keeps D's blocks until the worker reports it ended).

The connector's marks on a request (the pull made once, the pending announcement, the eager
send, the transfer id it made up, the held-back token) are one :class:`Marks` record per
request with its own transition table (:mod:`pdactors_vllm.request_marks`); vLLM's
``kv_transfer_params`` dict is only read.

Block ids travel per KV-cache group (vLLM's hybrid KV cache manager: ``SupportsHMA``). A
full-attention group moves the prompt's blocks; a sliding-window group only those its window
keeps (:meth:`KVGroup.kept`: what vLLM's ``remove_skipped_blocks`` leaves, on both sides);
vLLM's null block (out of the window, or padding) is never moved.

Models with recurrent state (Mamba, gated delta-net: a ``state`` group, whose live pages
move: one per request, or per prefix-cache block, nulls dropped) follow upstream's contract:
a state cannot be rewound by a token, so P computes the prompt but its last token (it drops
it when the request arrives, :meth:`on_new_request`) and D pulls N - 1 tokens, then
computes the last one from P's state.

``first_token_from_p`` (``pdactors proxy``'s default flow: the client's first token is P's):
P computes the whole prompt (no hold-back) and drops the transfer of a request that stops at
its token (no D will pull it); D's prompt ends with P's token, so D pulls all but that token
and computes it itself, whatever the model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from pdactors import timeline
from pdactors.errors import BadTransferParams
from pdactors.wire import BlockIds, KVTransferParams
from pdactors_vllm.eager_send import plan_eager
from pdactors_vllm.metadata import (
    NULL_BLOCK,
    KVGroup,
    PdActorsMetadata,
    PullSpec,
    SendSpec,
    prompt_blocks,
    traceparent,
)
from pdactors_vllm.request_marks import Event, Marks, State
from pdactors_vllm.settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["NULL_BLOCK", "KVGroup", "PdActorsMetadata", "PullSpec", "SchedulerSide", "SendSpec"]

log = logging.getLogger("pdactors.vllm")

# P ends that still deliver the KV: the prompt was computed in full.
_DELIVER = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class SchedulerSide:
    """Bookkeeping for one engine's scheduler (P, D, or both for ``kv_both``)."""

    def __init__(
        self,
        settings: ConnectorSettings,
        engine_id: str,
        block_size: int,
        groups: Sequence[KVGroup] | None = None,
    ) -> None:
        """``groups``: vLLM's KV-cache groups, in order (default: one full-attention group of
        ``block_size``)."""
        self.settings = settings
        self.engine_id = engine_id
        self.groups = tuple(groups) if groups else (KVGroup(block_size),)
        #: P computes, and D pulls, the prompt but its last token (recurrent state)
        self.holds_back_last = any(g.state and g.transfer for g in self.groups)
        self._meta = PdActorsMetadata()
        #: req id -> the connector's marks on it, from its first hook to request_finished
        self._marks: dict[str, Marks] = {}
        #: P: req ids whose blocks vLLM keeps for a write (request_finished said so) until
        #: the worker reports the write ended (``finished_sending``)
        self._held: set[str] = set()
        if settings.timeline:
            timeline.enable()

    # ------------------------------------------------------------------ D: how much is remote

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = self._params(request)
        if params is None or not params.do_remote_prefill or self._moved(request):
            return 0, False  # after the first allocation: one transfer per request
        if not params.remote_complete:
            return 0, False  # warned in update_state_after_alloc
        remote = self._pulled(request, params) - num_computed_tokens
        return (remote, True) if remote > 0 else (0, False)

    def _pulled(self, request: Request, params: KVTransferParams) -> int:
        """D: the prompt tokens whose KV (and state) P computed for it: all but the last with
        recurrent state (a one-token prompt: none; D computes it, P is told to free), or when
        the last is P's first token (``first_token_from_p``)."""
        n = request.num_prompt_tokens
        return n - 1 if self.holds_back_last or params.first_token_from_p else n

    def on_new_request(self, request: Request) -> None:
        """P, a model with recurrent state: drop the prompt's last token (D computes it from
        the state after the others) and produce one token, once per request (upstream's
        ``_truncate_mamba_request_for_prefill``)."""
        params = self._params(request) if self.holds_back_last else None
        marks = self._marks.get(request.request_id)
        if (
            params is None
            or not params.do_remote_decode
            or params.first_token_from_p  # D continues after P's token: the state covers all
            or (marks is not None and marks.held_back)
            or request.num_prompt_tokens < 2
        ):
            return
        # Always, whatever P's request asks (prompt logprobs too): D pulls n - 1 tokens and
        # applies the last itself, so a state over all n would apply it twice, silently.
        if request.prompt_token_ids is not None:
            request.prompt_token_ids.pop()
        elif request.prompt_embeds is not None:
            request.prompt_embeds = request.prompt_embeds[:-1]
        request._all_token_ids.pop()
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        self._marks.setdefault(request.request_id, Marks()).held_back = True

    def _moved(self, request: Request) -> bool:
        """The request's marks have left ``NEW`` (its blocks were allocated once)."""
        marks = self._marks.get(request.request_id)
        return marks is not None and marks.state is not State.NEW

    # ------------------------------------------------------------------ blocks were allocated

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = self._params(request)
        if params is not None and params.release_transfer_ids:
            self._release(request.request_id, params.release_transfer_ids)
        if params is None or not (params.do_remote_prefill or params.do_remote_decode):
            return
        marks = self._marks.setdefault(request.request_id, Marks())
        if marks.state is not State.NEW:
            return  # allocated again after preemption: one transfer per request
        if params.do_remote_prefill:
            if not params.remote_complete:
                log.warning(
                    "request %s: kv_transfer_params %s lack remote_engine_id, "
                    "remote_bootstrap_addr or transfer_id; computing the prompt locally",
                    request.request_id,
                    request.kv_transfer_params,
                )
                marks.move(Event.SETTLE)
                return
            if num_external_tokens > 0:
                # The uncached tail of the prompt: the blocks vLLM just allocated for it
                # (local prefix hits end at a block boundary of every group).
                n = self._pulled(request, params)
                hit = n - num_external_tokens
                tables = blocks.get_block_ids()
                wanted = tuple(
                    group.moved(table, n, first=hit // group.block_size)
                    for group, table in zip(self.groups, tables, strict=True)
                )
                self._pull(request.request_id, params, wanted, trace=traceparent(request))
                marks.transfer_id = _tid(params)
                marks.move(Event.PULL)
            else:
                # Everything was in D's prefix cache: P only needs to free its KV.
                self._pull(request.request_id, params, (), notify_only=True)
                marks.move(Event.SETTLE)
        else:
            # Routers that call P first may send no transfer id: make one, return it at finish.
            transfer_id = params.transfer_id or request.request_id
            marks.transfer_id = transfer_id
            self._meta.pending.append(transfer_id)
            timeline.mark(transfer_id, "p_scheduled")
            if self.settings.eager_send:
                marks.move(Event.TRACK)
                marks.request, marks.tables = request, [[] for _ in self.groups]
            else:
                marks.move(Event.ANNOUNCE)

    def _release(self, req_id: str, transfer_ids: list[str]) -> None:
        """P: the proxy gave up D's leg of ``transfer_ids`` (request ``req_id`` says so): the
        KV kept for them is freed now, not at ``unclaimed_ttl``; KV readied later is freed
        at once. Said once per request (allocated again after preemption: nothing new)."""
        marks = self._marks.setdefault(req_id, Marks())
        if marks.released:
            return
        marks.released = True
        log.info("request %s: the proxy gave up D's pull of %d transfers, their KV is freed: %s",
                 req_id, len(transfer_ids), ", ".join(transfer_ids))  # fmt: skip
        self._meta.dropped.extend(transfer_ids)

    def _params(self, request: Request) -> KVTransferParams | None:
        """The request's ``kv_transfer_params`` read as upstream's keys; None when it has
        none, or when they cannot be read: then the request is served as if it had none (P
        computes and keeps nothing for a D, D computes the prompt itself), with one warning
        naming it."""
        raw = request.kv_transfer_params
        if not raw:
            return None
        try:
            return KVTransferParams.from_dict(raw)
        except BadTransferParams as exc:
            marks = self._marks.setdefault(request.request_id, Marks())
            if not marks.warned:
                marks.warned = True
                log.warning("request %s: %s; served without a KV transfer", request.request_id,
                            exc)  # fmt: skip
            return None

    def _pull(
        self,
        req_id: str,
        params: KVTransferParams,
        block_ids: BlockIds,
        *,
        notify_only: bool = False,
        trace: str | None = None,
    ) -> None:
        assert params.remote_engine_id and params.remote_bootstrap_addr  # remote_complete
        self._meta.pulls[req_id] = PullSpec(
            transfer_id=_tid(params),
            engine_id=params.remote_engine_id,
            bootstrap_url=params.remote_bootstrap_addr,
            block_ids=block_ids,
            notify_only=notify_only,
            traceparent=trace,
        )

    # ------------------------------------------------------------------ each step

    def build_connector_meta(self, scheduler_output: SchedulerOutput | None) -> PdActorsMetadata:
        """This step's metadata. A step that schedules no token while a transfer's end is
        owed (D's pull in flight, P's blocks kept for a write) is marked ``idle`` when quiet
        idle steps are on: the worker waits for that end. Any other empty step (under async
        scheduling, the one planned after the last request ended) is not: waiting there
        would only delay the next request."""
        meta, self._meta = self._meta, PdActorsMetadata()
        if scheduler_output is not None and self._marks:
            plan_eager(scheduler_output, self._marks, self.groups, meta)
        scheduled = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        meta.idle = scheduled == 0 and self.settings.idle_wait_ms > 0 and self._owed()
        return meta

    def _owed(self) -> bool:
        """A transfer's end is still to come: a pull in flight, or blocks kept for a write."""
        return bool(self._held) or self.pulling() > 0

    def pulling(self) -> int:
        """D: how many requests wait for their pull."""
        return sum(marks.state is State.PULLING for marks in self._marks.values())

    def has_pending_block_frees(self) -> bool:
        """While a prompt whose KV went out eagerly has not been seen finished, vLLM must not
        preempt to make room (it waits a step instead: this request's blocks come free when
        its write ends). Under async scheduling vLLM plans step N + 1 before it processes
        step N's output, when the request that ended in step N still looks running: a
        preemption then would free blocks the write is reading."""
        return any(marks.state is State.EAGER for marks in self._marks.values())

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._held.difference_update(output.finished_sending or ())
        for req_id in output.finished_recving or ():
            marks = self._marks.get(req_id)
            if marks is not None and marks.state is State.PULLING:
                marks.move(Event.LAND)

    # ------------------------------------------------------------------ the end of a request

    def _window_passed(self, request: Request) -> bool:
        """P computed past the prompt far enough that vLLM freed blocks of a sliding window
        that the prompt's last token still reaches (what D asks for)."""
        n, computed = request.num_prompt_tokens, request.num_computed_tokens
        return computed > n and any(
            g.window and g.transfer and g.kept(computed).start > g.kept(n).start
            for g in self.groups
        )

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's block table per KV-cache group (vLLM's
        ``request_finished_all_groups``)."""
        req_id = request.request_id
        params = self._params(request)
        marks = self._marks.pop(req_id, None) or Marks()  # the request's end: forgotten
        if params is None:
            return False, None
        if params.do_remote_prefill:
            if marks.state is State.NEW and params.remote_complete:
                # D: finished before it was ever scheduled (aborted): P only needs to free
                # its KV.
                self._pull(req_id, params, (), notify_only=True)
            elif marks.state is State.PULLING and request.status not in _DELIVER:
                # D: the KV is still in flight. vLLM keeps the blocks until the worker reports
                # the pull ended; abort it so that happens now, not at the timeout.
                assert marks.transfer_id is not None
                self._meta.aborts[req_id] = marks.transfer_id
            return False, None
        transfer_id = marks.transfer_id or params.transfer_id
        if not params.do_remote_decode or transfer_id is None:
            return False, None
        # A request whose first token ends it (EOS, a stop string) when that token is the
        # client's (first_token_from_p): the proxy asks no D, nothing will pull the KV.
        delivers = request.status in _DELIVER and not (
            params.first_token_from_p and request.status == RequestStatus.FINISHED_STOPPED
        )
        if marks.state is State.EAGER:
            # The KV went to the worker with this step's forward: the blocks stay until it
            # reports the write ended (an abort's drop waits for a write in flight).
            self._held.add(req_id)
            if not delivers:
                self._meta.dropped.append(transfer_id)
                return True, None
        elif not delivers or not any(block_ids):
            self._meta.dropped.append(transfer_id)
            return False, None
        elif self._window_passed(request):
            log.warning(
                "transfer %s: P decoded %d tokens past the prompt, and vLLM has freed the "
                "start of a sliding window D needs; dropped (send P max_tokens 1)",
                transfer_id,
                request.num_computed_tokens - request.num_prompt_tokens,
            )
            self._meta.dropped.append(transfer_id)
            return False, None
        else:
            # The prompt's KV fills ceil(prompt / block) blocks; later blocks hold no prompt KV.
            sent = prompt_blocks(self.groups, request.num_prompt_tokens, block_ids)
            self._meta.ready[req_id] = SendSpec(transfer_id, sent, traceparent(request))
            timeline.mark(transfer_id, "p_finished")
            self._held.add(req_id)
        for_d = KVTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.engine_id,
            remote_bootstrap_addr=self.settings.bootstrap_url,
            transfer_id=transfer_id,
        )
        return True, for_d.to_dict()


def _tid(params: KVTransferParams) -> str:
    assert params.transfer_id is not None  # remote_complete, or set at allocation
    return params.transfer_id
