"""D's idle gate (pdactors_vllm.idle_gate): the engine core sleeps between idle steps until a
worker's ping (a transfer result), new input, or its bound — over real ZMQ sockets, with a
stand-in for vLLM's engine core (its input queue and scheduler count) found in the frames."""

from __future__ import annotations

import queue
import threading

import pytest

from pdactors_vllm.idle_gate import IdleGate, Waker
from pdactors_vllm.mailbox import Mailbox

FOREVER_MS = 120_000  # a sleep no test may reach: it would mean a lost wake-up


class Scheduler:
    def __init__(self, unfinished: int) -> None:
        self.unfinished = unfinished

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished


class Engine:
    """What the gate reads of vLLM's EngineCoreProc, calling the gate from its own frame."""

    def __init__(self, unfinished: int) -> None:
        self.input_queue: queue.Queue[object] = queue.Queue()
        self.scheduler = Scheduler(unfinished)

    def step(self, gate: IdleGate, pulls: int) -> str | None:
        return gate.sleep(pulls)


@pytest.fixture
def engine() -> Engine:
    return Engine(unfinished=1)


@pytest.fixture
def gate(engine: Engine):
    g = IdleGate("127.0.0.1", FOREVER_MS)
    assert g.address is None  # nothing opened before vLLM's engine core is found
    assert engine.step(g, pulls=1) is None  # the first step opens it and does not sleep
    assert g.address is not None
    yield g
    g.close()


@pytest.fixture
def waker(gate: IdleGate):
    w = Waker()
    assert gate.address is not None
    w.connect(gate.address)  # the worker, from the step's metadata
    yield w
    w.close()


def test_a_result_added_while_it_sleeps_wakes_it(
    engine: Engine, gate: IdleGate, waker: Waker
) -> None:
    engine.scheduler.unfinished = 3
    mailbox = Mailbox(on_result=waker.wake)
    # The Trio thread adds the result while the engine core sleeps (or just before: the
    # ping is remembered, the answer is the same).
    adder = threading.Thread(target=mailbox.add, kwargs={"recved": {"r1"}})
    threading.Timer(0.05, adder.start).start()
    assert engine.step(gate, pulls=3) == "ping"
    adder.join(timeout=5)
    assert mailbox.take() == (set(), {"r1"}, set())


def test_a_result_added_before_it_sleeps_is_not_lost(
    engine: Engine, gate: IdleGate, waker: Waker
) -> None:
    Mailbox(on_result=waker.wake).add(failed={"r1"})
    assert engine.step(gate, pulls=1) == "ping"


def test_new_input_wakes_it(engine: Engine, gate: IdleGate) -> None:
    engine.scheduler.unfinished = 2
    threading.Timer(0.05, engine.input_queue.put, args=(("ADD", "req"),)).start()
    assert engine.step(gate, pulls=2) == "input"


def test_a_ping_while_nobody_sleeps_ends_the_next_sleep_at_once(
    engine: Engine, gate: IdleGate, waker: Waker
) -> None:
    engine.input_queue.put(("ADD", "req"))
    assert engine.step(gate, pulls=1) == "input"
    engine.input_queue.get_nowait()
    waker.wake()  # a result while the engine core steps
    assert engine.step(gate, pulls=1) == "ping"


def test_it_does_not_sleep_unless_every_request_waits_for_its_pull(
    engine: Engine, gate: IdleGate
) -> None:
    engine.scheduler.unfinished = 3
    assert engine.step(gate, pulls=2) is None  # another request may be ready
    engine.scheduler.unfinished = 0
    assert engine.step(gate, pulls=0) is None  # nothing to wait for


def test_without_vllms_engine_in_the_frames_it_never_sleeps() -> None:
    g = IdleGate("127.0.0.1", FOREVER_MS)
    try:
        assert g.sleep(pulls=1) is None
        assert g.address is None  # nothing was opened
        assert Engine(unfinished=1).step(g, pulls=1) is None  # it looked once: not again
    finally:
        g.close()


def test_its_bound_ends_a_sleep_nothing_wakes(engine: Engine) -> None:
    g = IdleGate("127.0.0.1", 1)
    try:
        assert engine.step(g, pulls=1) is None  # opens
        assert engine.step(g, pulls=1) == "bound"
        (slept,) = g.take_sleeps()  # what D's /metrics shows (vllm:pdactors_idle_sleep_seconds)
        assert slept >= 0.001
        assert g.take_sleeps() == []  # taken once
    finally:
        g.close()


def test_close_stops_the_listener(engine: Engine) -> None:
    g = IdleGate("127.0.0.1", FOREVER_MS)
    assert engine.step(g, pulls=1) is None
    listener = g._listener
    assert listener is not None and listener.is_alive()
    g.close()
    assert not listener.is_alive()
    g.close()  # again: nothing
    assert engine.step(g, pulls=1) is None  # a closed gate never sleeps


def test_the_mailbox_calls_back_only_when_results_grow() -> None:
    calls: list[None] = []
    mailbox = Mailbox(on_result=lambda: calls.append(None))
    mailbox.add(recved={"r1"})
    mailbox.add(recved={"r1"})  # already there
    mailbox.count(lambda counters: None)
    assert len(calls) == 1


def test_a_waker_before_connect_and_after_close_does_nothing(engine: Engine) -> None:
    g = IdleGate("127.0.0.1", 200)  # a sleep ends by its bound unless a ping comes
    w = Waker()
    try:
        assert engine.step(g, pulls=1) is None  # opens
        assert g.address is not None
        w.wake()  # not connected yet: no ping is kept for later
        w.connect(g.address)
        assert engine.step(g, pulls=1) == "bound"
        w.wake()  # connected: it wakes the gate
        assert engine.step(g, pulls=1) == "ping"
        w.close()
        w.close()  # again: nothing
        assert w.address is None
        w.wake()  # closed: no ping
        assert engine.step(g, pulls=1) == "bound"
    finally:
        w.close()
        g.close()
