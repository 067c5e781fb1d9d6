"""What the scheduler side remembers of each request, as one small record per request with
its transition table as data (no IO, no vLLM: h11's ``_state.py`` is the model).

vLLM's own ``kv_transfer_params`` dict is read, never written: the connector's marks (the
prompt token held back, the pending announcement, the pull made once, the eager send, the
generated transfer id) live here, from the request's first hook to ``request_finished``.

The states and the events that move them (any other pair raises
:class:`~pdactors.errors.IllegalTransition`); ``request_finished`` forgets a record in any
state:

P (``do_remote_decode``):
  NEW --announce--> ANNOUNCED        blocks allocated, prefill announced (no eager send)
  NEW --track--> PREFILLING          … and followed step by step for an eager send
  PREFILLING --untrack--> ANNOUNCED  the prompt completed, the request decodes on
  PREFILLING --send_eager--> EAGER   the KV went to the worker with a step's forward
D (``do_remote_prefill``):
  NEW --pull--> PULLING              D's blocks allocated, the pull handed to the worker
  NEW --settle--> SETTLED            nothing to pull (D's prefix cache, or params lacking)
  PULLING --land--> LANDED           the worker reported the pull ended
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pdactors.errors import IllegalTransition

__all__ = ["TRANSITIONS", "Event", "Marks", "State"]


class State(enum.Enum):
    NEW = "new"
    ANNOUNCED = "announced"
    PREFILLING = "prefilling"
    EAGER = "eager"
    PULLING = "pulling"
    SETTLED = "settled"
    LANDED = "landed"


class Event(enum.Enum):
    ANNOUNCE = "announce"
    TRACK = "track"
    UNTRACK = "untrack"
    SEND_EAGER = "send_eager"
    PULL = "pull"
    SETTLE = "settle"
    LAND = "land"


#: (state, event) -> next state; every pair not here is illegal.
TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.NEW, Event.ANNOUNCE): State.ANNOUNCED,
    (State.NEW, Event.TRACK): State.PREFILLING,
    (State.PREFILLING, Event.UNTRACK): State.ANNOUNCED,
    (State.PREFILLING, Event.SEND_EAGER): State.EAGER,
    (State.NEW, Event.PULL): State.PULLING,
    (State.NEW, Event.SETTLE): State.SETTLED,
    (State.PULLING, Event.LAND): State.LANDED,
}


@dataclass(slots=True)
class Marks:
    """One request's marks. ``transfer_id``: P's (the router's, or the request id when it sent
    none), D's pull; ``request`` and ``tables`` (P, ``PREFILLING``): the request and its block
    table per KV-cache group so far; ``held_back``: P dropped the prompt's last token;
    ``warned``: its unreadable params were logged; ``released``: (P) the transfers it named
    for P to free were handed to the worker."""

    state: State = State.NEW
    transfer_id: str | None = None
    request: Any = None
    tables: list[list[int]] = field(default_factory=list)
    held_back: bool = False
    warned: bool = False
    released: bool = False

    def move(self, event: Event) -> None:
        """Take ``event``. Raises :class:`IllegalTransition` when the state does not allow it."""
        try:
            self.state = TRANSITIONS[self.state, event]
        except KeyError:
            raise IllegalTransition(
                f"request marks: {event.value} is illegal in state {self.state.value}"
            ) from None
        if self.state is not State.PREFILLING:
            self.request, self.tables = None, []
