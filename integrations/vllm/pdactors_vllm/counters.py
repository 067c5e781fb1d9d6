"""The worker's transfer counters for vLLM's connector stats, and the diffing that turns the
actors' running totals (read, never reset) into what is new since the last read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pdactors import Receiver, Sender

__all__ = ["ReceiverReadings", "SenderReadings", "TransferCounters"]


@dataclass
class TransferCounters:
    """What this worker's actors did since the last report (for vLLM's connector stats)."""

    sent: int = 0
    bytes_sent: int = 0
    descriptors_sent: int = 0
    eager_sent: int = 0
    streamed_sent: int = 0
    received: int = 0
    landed_early: int = 0  # of those received: reported by P's notice (fast completion path)
    failed: int = 0
    recomputed: int = 0  # failed pulls whose prompt D computes itself (on_pull_failure)
    expired: int = 0
    write_seconds: list[float] = field(default_factory=list)
    pull_seconds: list[float] = field(default_factory=list)

    def take(self) -> dict[str, Any]:
        """The counters as connector-stats data; resets them."""
        data = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            setattr(self, f.name, [] if f.name.endswith("_seconds") else 0)
        return data


@dataclass
class SenderReadings:
    """A sender's running totals as last read (Trio thread), so that each read adds to the
    counters only what is new: the sender's own state is never reset from outside."""

    sent: int = 0
    expired: int = 0
    bytes_sent: int = 0
    descriptors_sent: int = 0
    streamed_sent: int = 0
    writes: int = 0

    def add_new(self, sender: Sender, counters: TransferCounters) -> None:
        """Add what ``sender`` did since the last call to ``counters``."""
        stats, writes = sender.statistics(), sender.write_statistics()
        counters.sent += stats.sent - self.sent
        counters.expired += stats.expired - self.expired
        counters.bytes_sent += sender.bytes_sent - self.bytes_sent
        counters.descriptors_sent += sender.descriptors_sent - self.descriptors_sent
        counters.streamed_sent += sender.streamed_sent - self.streamed_sent
        counters.write_seconds += writes.since(self.writes)
        self.sent, self.expired, self.writes = stats.sent, stats.expired, writes.count
        self.bytes_sent, self.descriptors_sent = sender.bytes_sent, sender.descriptors_sent
        self.streamed_sent = sender.streamed_sent


@dataclass
class ReceiverReadings:
    """A receiver's delivered pulls as last read (Trio thread)."""

    pulls: int = 0

    def add_new(self, receiver: Receiver, counters: TransferCounters) -> None:
        """Add the durations of the pulls ``receiver`` delivered since the last call."""
        pulls = receiver.pull_statistics()
        counters.pull_seconds += pulls.since(self.pulls)
        self.pulls = pulls.count
