"""The scheduler side's per-request table, enumerated: every (state, event) pair either moves
as the table says or raises IllegalTransition and leaves the record as it was."""

from __future__ import annotations

import itertools

import pytest

from pdactors.errors import IllegalTransition
from pdactors_vllm.request_marks import TRANSITIONS, Event, Marks, State


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Event)))
def test_every_pair_moves_or_raises(state: State, event: Event) -> None:
    marks = Marks(state=state, transfer_id="t")
    if (state, event) in TRANSITIONS:
        marks.move(event)
        assert marks.state is TRANSITIONS[state, event]
    else:
        with pytest.raises(IllegalTransition):
            marks.move(event)
        assert marks.state is state


def test_the_table_reaches_every_state_from_new() -> None:
    reached, frontier = {State.NEW}, [State.NEW]
    while frontier:
        state = frontier.pop()
        for (source, _), target in TRANSITIONS.items():
            if source is state and target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == set(State)


def test_leaving_prefilling_drops_the_followed_request() -> None:
    marks = Marks()
    marks.move(Event.TRACK)
    marks.request, marks.tables = object(), [[1, 2]]
    marks.move(Event.SEND_EAGER)
    assert marks.request is None and marks.tables == []
