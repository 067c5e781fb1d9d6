"""Quiet waits (pdactors_vllm.idle): a busy wait spins only at first, then naps a share of the
time it has waited; each new wait starts spinning again. A fake clock stands in for time."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdactors_vllm import idle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.naps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(idle.time, "monotonic", c.monotonic)
    monkeypatch.setattr(idle.time, "sleep", c.sleep)
    monkeypatch.setattr(idle._waits, "last", 0.0, raising=False)
    monkeypatch.setattr(idle, "contended", lambda: True)  # another task wants the CPU
    return c


def spin(clock: Clock, seconds: float, step: float = 1e-6) -> list[str]:
    """Call the busy nap until ``seconds`` of the fake clock have passed: what each call did."""
    did: list[str] = []

    def original() -> None:  # vLLM's sched_yield: a microsecond of spinning
        did.append("spin")
        clock.now += step

    end = clock.now + seconds
    while clock.now < end:
        naps = len(clock.naps)
        idle._busy_nap(original)
        if len(clock.naps) > naps:
            did.append("nap")
    return did


def test_a_wait_spins_first_then_naps_a_share_of_what_it_waited(clock: Clock) -> None:
    did = spin(clock, 0.050)  # a 50 ms forward pass
    spins = did.index("nap")
    assert spins == pytest.approx(idle.SPIN_S / 1e-6, rel=0.05)  # 0.2 ms of spinning
    assert set(did[spins:]) == {"nap"}  # then naps only
    assert max(clock.naps) == idle.NAP  # capped
    # each nap is at most NAP_SHARE of the time waited before it: late by at most that much
    waited = idle.SPIN_S
    for nap in clock.naps:
        assert nap <= idle.NAP_SHARE * waited * 1.01
        waited += nap
    assert len(clock.naps) < 200  # ~60 growing naps, then ~100 of 0.5 ms: not ~50,000 spins


def test_without_another_task_wanting_a_cpu_a_wait_only_spins(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone request's decode steps: nobody else wants a CPU, so a nap would only make the
    answer later; the wait spins as vLLM's does. Once another task wants one, it naps."""
    monkeypatch.setattr(idle, "contended", lambda: False)
    assert set(spin(clock, 0.005)) == {"spin"}
    monkeypatch.setattr(idle, "contended", lambda: True)
    assert "nap" in spin(clock, 0.0005)


@pytest.mark.parametrize(
    ("loadavg", "cpus", "expected"),
    [
        (b"0.50 0.40 0.30 2/345 9876\n", 2, False),  # the reader and one more on 2 CPUs
        (b"3.10 2.00 1.00 3/345 9876\n", 2, True),  # one task waits for a CPU
        (b"garbage", 2, True),  # unreadable: nap, as before
    ],
)
def test_contention_is_more_runnable_tasks_than_cpus_and_read_at_most_once_a_ms(
    clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    loadavg: bytes,
    cpus: int,
    expected: bool,
) -> None:
    monkeypatch.undo()  # the real contended(), on the fake clock
    monkeypatch.setattr(idle.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(idle._waits, "checked_until", 0.0, raising=False)
    path = tmp_path / "loadavg"
    path.write_bytes(loadavg)
    monkeypatch.setattr(idle, "_LOADAVG", str(path))
    monkeypatch.setattr(idle, "_CPUS", cpus)
    assert idle.contended() is expected
    path.write_bytes(b"9.00 9.00 9.00 1/345 9876\n")  # the host calms down...
    assert idle.contended() is expected  # ...seen only once the reading is a ms old
    clock.now += idle.CONTENTION_TTL
    assert idle.contended() is False


def test_each_new_wait_spins_again(clock: Clock) -> None:
    spin(clock, 0.010)
    clock.now += 0.005  # the answer came; the process worked 5 ms before its next wait
    assert spin(clock, 0.0001)[:3] == ["spin"] * 3


# ---------------------------------------------------------------- idle steps: vLLM's own poll


@pytest.fixture
def condition(monkeypatch: pytest.MonkeyPatch):
    """A reader and a writer of vLLM's real ``SpinCondition`` over an in-process socket, the
    reader's class patched by :func:`idle._install_idle_wait` (a subclass, so vLLM's own class
    stays as it is), vLLM's ``sched_yield`` counted and the reader's polls recorded."""
    zmq = pytest.importorskip("zmq")
    shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")

    class Condition(shm_broadcast.SpinCondition):
        pass

    yields: list[None] = []
    assert idle._install_idle_wait(Condition, lambda: yields.append(None))
    monkeypatch.setattr(shm_broadcast, "sched_yield", lambda: yields.append(None))
    context = zmq.Context()
    address = f"inproc://idle-{id(context)}"
    writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = Condition(is_reader=True, context=context, notify_address=address)
    polls: list[int | None] = []
    poll = reader.poller.poll

    def recorded(timeout: int | None = None) -> list:
        polls.append(timeout)
        return poll(timeout)

    monkeypatch.setattr(reader.poller, "poll", recorded)
    reader.record_read()  # it read just now: vLLM would spin for busy_loop_s
    yield reader, writer, yields, polls
    idle.end()
    for c in (reader, writer):
        c.local_notify_socket.close(linger=0)
    reader.read_cancel_socket.close(linger=0)
    reader.write_cancel_socket.close(linger=0)
    context.term()


def test_outside_an_idle_step_a_recent_reader_spins_as_vllm_does(condition) -> None:
    reader, _writer, yields, polls = condition
    reader.wait(timeout_ms=None)
    assert (len(yields), polls) == (1, [])


def test_during_an_idle_step_a_reader_blocks_on_the_writers_ping_not_a_spin(condition) -> None:
    reader, writer, yields, polls = condition
    busy = reader.busy_loop_s
    idle.begin()
    writer.notify()  # the worker's answer: its write pings the reader
    reader.wait(timeout_ms=None)
    assert yields == []  # no spin
    assert polls == [idle.IDLE_POLL_MS]  # one poll, bounded: a lost ping costs at most that
    assert reader.busy_loop_s == busy  # vLLM's setting is back
    reader.wait(timeout_ms=2)  # a caller's shorter timeout is kept
    assert polls[-1] == 2 and yields == []


def test_a_busy_reader_spins_then_naps_and_each_read_starts_a_new_wait(
    condition, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``quiet_busy_waits``: a reader's wait spins for SPIN_S, then naps; the first call after
    a read starts a new wait that spins again, however soon it comes (a decode step's worker
    waits again well under a millisecond after its last read: taken for the same wait, every
    step napped)."""
    reader, _writer, yields, _polls = condition
    monkeypatch.setattr(idle, "_busy_quiet", True)
    reader.last_read = clock.now  # vLLM's record_read, on the fake clock

    def waits(seconds: float, step: float = 1e-6) -> tuple[int, int]:
        """Call wait until ``seconds`` pass: (spins, naps)."""
        spins, naps, end = len(yields), len(clock.naps), clock.now + seconds
        while clock.now < end:
            before = len(yields)
            reader.wait(timeout_ms=None)
            if len(yields) > before:
                clock.now += step  # a spin: a microsecond
        return len(yields) - spins, len(clock.naps) - naps

    spins, naps = waits(0.005)  # a 5 ms forward
    assert spins == pytest.approx(idle.SPIN_S / 1e-6, rel=0.05) and naps > 0
    assert max(clock.naps) <= idle.NAP
    for _step in range(3):  # reads, then waits again 0.1 ms later: a new wait each time
        clock.now += 0.0001
        reader.last_read = clock.now
        spins, naps = waits(0.0001)
        assert (naps, spins) == (0, pytest.approx(100, abs=2))
