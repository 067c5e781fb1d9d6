"""A D whose every request waits for KV sleeps between steps, woken by what ends the wait.

vLLM's engine core steps as long as it holds a request, even when every one of them waits for
KV (``WAITING_FOR_REMOTE_KVS``): each empty step costs the engine core, the worker and the API
server (which gets the step's statistics) a little CPU, and with the worker waiting
``idle_wait_ms`` (20 ms) per step a waiting D still cost 16–22 % of a core. Waiting longer in
the worker would make a new request wait as long, since the engine core reads its input only
between steps.

So the engine core itself sleeps, in :meth:`IdleGate.sleep`, called while it builds a step's
metadata, when that step schedules nothing and every unfinished request is one of this
connector's pulls:

* a pull's end (landed, failed, timed out, P gone: every one reaches the worker's
  :class:`~pdactors_vllm.mailbox.Mailbox`) wakes it at once: the worker's :class:`Waker`
  pings the gate's socket for each result it adds;
* a new request or an abort wakes it at once: the gate waits on the engine core's input
  queue's own condition (``queue.Queue.not_empty``, which every ``put`` notifies), and a
  listener thread turns each ping into a notification of that same condition;
* nothing else can start work while every request waits for KV; ``idle_sleep_ms`` bounds the
  sleep all the same.

A ping whose result the worker already reported only costs one more empty step; a ping that
comes while no one sleeps is remembered, so the next sleep ends at once: no wake-up is lost.
The engine core's input queue is vLLM's private ``EngineCoreProc.input_queue``, found once by
looking up the calling frames for the engine; where it is not found (an in-process
``EngineCore``, another vLLM), the gate never sleeps and the worker's ``idle_wait_ms`` wait
applies as before.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from typing import Any

import zmq

from pdactors_vllm.settings import ConnectorSettings

__all__ = ["IdleGate", "Waker"]

log = logging.getLogger("pdactors.vllm")


def find_engine() -> Any | None:
    """The engine core that is calling us: the first caller whose ``self`` holds vLLM's input
    queue and scheduler (None: none does)."""
    frame = sys._getframe(1)
    while frame is not None:
        engine = frame.f_locals.get("self")
        if isinstance(getattr(engine, "input_queue", None), queue.Queue) and hasattr(
            engine, "scheduler"
        ):
            return engine
        frame = frame.f_back  # type: ignore[assignment]
    return None


class IdleGate:
    """The engine core's side: a socket the workers ping, a thread that turns each ping into a
    wake-up of the engine core's input queue, and the sleep between idle steps. Socket and
    thread are opened at the first step that finds vLLM's engine core (never elsewhere)."""

    def __init__(self, host: str, sleep_ms: float) -> None:
        self.sleep_s = sleep_ms / 1000
        self.host = host
        #: where the workers' :class:`Waker` connect (sent to them in each step's metadata;
        #: None until the gate is open)
        self.address: str | None = None
        self._context: zmq.Context[Any] | None = None
        self._socket: zmq.Socket[Any] | None = None
        self._inputs: queue.Queue[Any] | None = None  # the engine core's input queue
        self._engine: Any | None = None
        self._looked = False
        self._closed = False
        self._pinged = False  # a worker added results since the last sleep (under the mutex)
        self._listener: threading.Thread | None = None
        self._slept: list[float] = []  # seconds of each sleep since take_sleeps (engine core)

    @classmethod
    def of(cls, settings: ConnectorSettings) -> IdleGate | None:
        """D's gate as ``settings`` ask (None: ``idle_sleep_ms`` is 0)."""
        return cls(settings.host, settings.idle_sleep_ms) if settings.idle_sleep_ms > 0 else None

    def sleep(self, pulls: int) -> str | None:
        """Sleep until a worker pings, new input arrives, or ``idle_sleep_ms`` passes — if
        every unfinished request is one of the ``pulls`` this connector waits for and the
        gate is open. Returns what ended the sleep (``"ping"``, ``"input"`` or ``"bound"``;
        None: it did not sleep). The first call looks for the engine core and opens the gate;
        it does not sleep (the workers learn the gate's address from this step's metadata)."""
        if not self._looked:
            self._looked = True
            self._open()
            return None
        engine, inputs = self._engine, self._inputs
        if engine is None or inputs is None or pulls == 0 or self._closed:
            return None
        if engine.scheduler.get_num_unfinished_requests() != pulls:
            return None  # something else may become ready: keep stepping
        start = time.monotonic()
        try:
            return self._wait(inputs, start + self.sleep_s)
        finally:
            self._slept.append(time.monotonic() - start)

    def take_sleeps(self) -> list[float]:
        """How long each sleep since the last call lasted, in seconds (the engine core's
        thread, like :meth:`sleep`)."""
        slept, self._slept = self._slept, []
        return slept

    def close(self) -> None:
        """Stop the listener and close the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._context is None:
            return
        if self._listener is None and self._socket is not None:
            self._socket.close(linger=0)
        self._context.term()  # the listener's recv raises ContextTerminated: it closes
        if self._listener is not None:
            self._listener.join(timeout=5)

    def _wait(self, inputs: queue.Queue[Any], deadline: float) -> str:
        with inputs.mutex:  # queue.Queue's own lock: its put() notifies not_empty
            while not self._pinged and not inputs.queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    return "bound"
                inputs.not_empty.wait(left)
            # Every ping follows its results into the mailbox: this step reports them all.
            woken_by, self._pinged = ("ping" if self._pinged else "input"), False
            return woken_by

    def _open(self) -> None:
        engine = find_engine()
        if engine is None or self._closed:
            log.info("PdActorsConnector: no engine core input queue found; idle steps "
                     "wait in the worker (idle_wait_ms) instead")  # fmt: skip
            return
        self._context = zmq.Context()
        self._socket = socket = self._context.socket(zmq.PULL)
        socket.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://{self.host}:{socket.bind_to_random_port(f'tcp://{self.host}')}"
        self._engine, self._inputs = engine, engine.input_queue
        self._listener = threading.Thread(
            target=self._listen, args=(socket, engine.input_queue), name="pdactors-idle-gate",
            daemon=True,
        )  # fmt: skip
        self._listener.start()
        log.info("PdActorsConnector: D's engine core sleeps between idle steps (at most %g ms)",
                 self.sleep_s * 1000)  # fmt: skip

    def _listen(self, socket: zmq.Socket[Any], inputs: queue.Queue[Any]) -> None:
        """The listener thread (the socket's only user from now on): each ping wakes a sleep
        or, when none sleeps, makes the next one end at once (no wake-up is lost)."""
        try:
            while True:
                socket.recv()
                while True:  # take every ping: one step reports all their results
                    try:
                        socket.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                with inputs.mutex:
                    self._pinged = True
                    inputs.not_empty.notify_all()  # a blocked get() just looks again
        except zmq.ContextTerminated:
            pass
        finally:
            socket.close(linger=0)


class Waker:
    """The worker's side: pings the engine core's gate when a transfer result comes (any
    thread; never blocks)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._context: zmq.Context[Any] | None = None
        self._socket: zmq.Socket[Any] | None = None
        self.address: str | None = None

    def connect(self, address: str) -> None:
        """Ping the gate at ``address`` from now on (the address in the step's metadata)."""
        if address == self.address:
            return
        with self._lock:
            self._close()
            self._context = zmq.Context()
            self._socket = self._context.socket(zmq.PUSH)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.SNDHWM, 4)  # one ping wakes it: more are not needed
            self._socket.connect(address)
            self.address = address

    def wake(self) -> None:
        with self._lock:
            if self._socket is None:
                return
            try:
                self._socket.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # pings are queued already: the gate wakes for those

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._context is not None:
            self._context.term()
        self._socket = self._context = None
        self.address = None
