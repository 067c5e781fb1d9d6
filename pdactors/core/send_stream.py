"""A layer-wise streamed write, as a state of its transfer's record in the send table.

P computes a prompt's KV layer by layer; when D's pull is already waiting, the sender writes
each layer as P reports it complete. The :class:`Stream` record holds what that write needs —
the layers reported and not yet taken, P's last word, the write task's wake-up — and
:func:`stream_event` moves it as
:data:`~pdactors.core.send_rules.STREAM_TRANSITIONS` says. Sans-IO: the wake-up is opaque.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdactors.core.send_rules import StreamEvent, StreamState, next_stream_state

__all__ = ["Complete", "Layer", "Stream", "Wake", "stream_event", "take_layers"]

#: A blocking wait for KV to be complete in memory (e.g. a CUDA event's ``synchronize``).
Complete = Callable[[], object]
#: Regions of a streamed transfer whose KV P computed, and the wait for it (None: in memory).
Layer = tuple[tuple[int, ...], Complete | None]


@dataclass(frozen=True, slots=True)
class Wake:
    """Wake the streamed write waiting on ``waiter`` (opaque here: the actor's wake-up)."""

    waiter: object


@dataclass(slots=True, eq=False)
class Stream:
    """A transfer written while P computes it: what the write task reads and waits for."""

    state: StreamState = StreamState.COMPUTING
    #: Layers P reported complete that the write task has not taken yet.
    layers: list[Layer] = field(default_factory=list)
    rest_complete: Complete | None = None  # the wait for the KV not streamed yet
    failed: str = ""  # why P dropped it
    waiter: object = None  # the write task's wake-up while it waits for a layer


def stream_event(
    transfer_id: str,
    stream: Stream,
    event: StreamEvent,
    *,
    layer: Layer | None = None,
    complete: Complete | None = None,
    failed: str = "",
) -> tuple[Stream | None, list[Wake]]:
    """Move ``stream`` as the rules say: the stream after it (None: closed, both P and the
    write are done with it) and the write task's wake-up when P's word changed what it waits
    for. Raises :class:`~pdactors.errors.IllegalTransition` for a pair the rules lack."""
    before = stream.state
    state = next_stream_state(transfer_id, before, event)
    if state is None:
        return None, []
    stream.state = state
    if before is not StreamState.COMPUTING or event is StreamEvent.WRITER_ENDED:
        return stream, []  # P's KV was complete (or dropped) already, or nobody waits
    if layer is not None:
        stream.layers.append(layer)
    if state is StreamState.FINISHING:
        stream.rest_complete = complete
    elif state is StreamState.DROPPED:
        stream.failed = failed
    waiter, stream.waiter = stream.waiter, None
    return stream, [Wake(waiter)] if waiter is not None else []


def take_layers(stream: Stream, waiter: object) -> list[Layer]:
    """The layers queued for the write task; when there are none and P still computes,
    ``waiter`` is handed back in a :class:`Wake` at P's next word."""
    layers, stream.layers = stream.layers, []
    if not layers and stream.state is StreamState.COMPUTING:
        stream.waiter = waiter
    return layers
