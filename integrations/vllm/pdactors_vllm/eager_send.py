"""P's eager send, planned on the scheduler side (pure bookkeeping, no IO): each prefill's
block ids followed through the steps' scheduler outputs, and, in the step whose chunk completes
the prompt *and* ends the request (its one output token is sampled in it: ``max_tokens`` 1, as
proxies send P), the prompt's blocks put in that step's metadata (``eager``). The worker hands
them to the sender at the end of that step's forward (``wait_for_save``): one whole forward
earlier than from ``request_finished``. Why only then (preemption, async scheduling):
docs/architecture.md, "Eager send".

A followed request's marks are ``PREFILLING`` (:mod:`pdactors_vllm.request_marks`): they hold
the request and its block table per KV-cache group so far.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pdactors_vllm.metadata import KVGroup, PdActorsMetadata, SendSpec, prompt_blocks, traceparent
from pdactors_vllm.request_marks import Event, Marks, State

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = ["plan_eager"]


def plan_eager(
    out: SchedulerOutput,
    marks_of: Mapping[str, Marks],
    groups: Sequence[KVGroup],
    meta: PdActorsMetadata,
) -> None:
    """Follow the block ids of P's prefills (``marks_of``: req id -> marks) in ``out``; put in
    ``meta.eager`` those whose prompt completes this step when the step also ends them (their
    one output token is sampled in it). A prefill whose prompt completes while it decodes on
    is no longer followed: it is sent at ``request_finished``."""
    done: list[tuple[Marks, str, int]] = []  # (marks, req id, tokens computed after)
    for new in out.scheduled_new_reqs:
        if (marks := _prefilling(marks_of, new.req_id)) is not None:
            marks.tables = [list(table) for table in new.block_ids]
            done.append((marks, new.req_id, new.num_computed_tokens))
    cached = out.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        if (marks := _prefilling(marks_of, req_id)) is None:
            continue
        new_ids = cached.new_block_ids[i]
        if req_id in cached.resumed_req_ids:
            tables = new_ids if new_ids is not None else [[] for _ in groups]
            marks.tables = [list(table) for table in tables]
        elif new_ids is not None:
            for table, more in zip(marks.tables, new_ids, strict=True):
                table.extend(more)
        done.append((marks, req_id, cached.num_computed_tokens[i]))
    for entry, req_id, computed in done:
        request, blocks, transfer_id = entry.request, entry.tables, entry.transfer_id
        after = computed + out.num_scheduled_tokens.get(req_id, 0)
        if after < request.num_prompt_tokens:
            continue  # a chunk of the prompt: more to come
        if request.num_output_tokens + 1 < request.max_tokens:
            entry.move(Event.UNTRACK)  # it decodes on (and may be preempted): sent when
            continue  # it finishes
        # Only blocks vLLM keeps once the request ends: a sliding window's older blocks
        # are freed then, while the write may still be reading.
        assert transfer_id is not None  # set when the blocks were allocated
        sent = prompt_blocks(groups, request.num_prompt_tokens, blocks)
        meta.eager[req_id] = SendSpec(transfer_id, sent, traceparent(request))
        entry.move(Event.SEND_EAGER)


def _prefilling(marks_of: Mapping[str, Marks], req_id: str) -> Marks | None:
    """P: the marks of a prefill followed for an eager send (None: not followed)."""
    marks = marks_of.get(req_id)
    return marks if marks is not None and marks.state is State.PREFILLING else None
