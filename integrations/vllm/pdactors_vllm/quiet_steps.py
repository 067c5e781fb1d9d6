"""The engine core's side of quiet steps, installed by the connector beside its scheduler side.

The scheduler side (:mod:`pdactors_vllm.scheduler_side`) is bookkeeping: it marks a step
``idle`` when it schedules nothing while a transfer's end is owed. What that changes in the
engine core's process lives here:

* vLLM's waits patched to nap (:mod:`pdactors_vllm.idle`), and the GIL's switch interval
  (:mod:`pdactors_vllm.gil`), both once, when the connector is made;
* each step's idle flag raised or lowered (:func:`pdactors_vllm.idle.begin` / ``end``);
* on D, the sleep between idle steps (:class:`~pdactors_vllm.idle_gate.IdleGate`), which may
  turn an idle step into one the engine core slept before.
"""

from __future__ import annotations

from pdactors_vllm import idle
from pdactors_vllm.gil import lower_switch_interval
from pdactors_vllm.idle_gate import IdleGate
from pdactors_vllm.metadata import PdActorsMetadata
from pdactors_vllm.settings import ConnectorSettings

__all__ = ["QuietSteps"]


class QuietSteps:
    """Quiet steps for one engine core (P, D, or both); ``gate``: D's sleep between idle
    steps (None: none)."""

    def __init__(self, settings: ConnectorSettings, gate: IdleGate | None = None) -> None:
        self.gate = gate
        if settings.idle_wait_ms > 0 or settings.quiet_busy_waits:
            idle.install(busy=settings.quiet_busy_waits)  # this is the engine core's process
        lower_switch_interval(settings.gil_switch_ms)

    def step(self, meta: PdActorsMetadata, scheduled: int | None, pulling: int) -> None:
        """This step's metadata is built (``scheduled`` tokens, ``pulling`` requests waiting
        for their pull): sleep first if the gate says so, then raise or lower the idle
        flag. Blocks the engine core for the gate's sleep."""
        if self.gate is not None:
            quiet = scheduled == 0 and not meta.has_work()
            if quiet and self.gate.sleep(pulling) is not None:
                meta.idle = False  # the engine core waited: the worker answers at once,
                meta.slept = True  # then waits quietly: the next step may be as late
            meta.wake = self.gate.address
        if meta.idle:
            idle.begin()
        else:
            idle.end()

    @staticmethod
    def output() -> None:
        """The step's output came back: spin at full speed again."""
        idle.end()

    def close(self) -> None:
        if self.gate is not None:
            self.gate.close()  # D's idle gate's socket
