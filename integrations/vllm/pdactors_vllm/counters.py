"""The worker's transfer counters for vLLM's connector stats, and the diffing that turns the
actors' running totals (read, never reset) into what is new since the last read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pdactors import Receiver, Sender, SideChannelStats

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
    # P's side channel (SideChannelStats) and D's fast completion notices it sent
    bad_frames: int = 0
    peers_cut_off: int = 0
    messages_dropped: int = 0
    notices_sent: int = 0
    notices_dropped: int = 0
    notices_refused: int = 0
    protocol_errors: int = 0  # D: answers from P workers it could not use
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
    side: SideChannelStats = field(default_factory=SideChannelStats)

    def add_new(self, sender: Sender, counters: TransferCounters) -> None:
        """Add what ``sender`` did since the last call to ``counters``."""
        stats, writes = sender.statistics(), sender.write_statistics()
        side, was = sender.side_channel_statistics(), self.side
        counters.bad_frames += side.bad_frames - was.bad_frames
        counters.peers_cut_off += side.peers_cut_off - was.peers_cut_off
        counters.messages_dropped += side.dropped - was.dropped
        counters.notices_sent += side.notices_sent - was.notices_sent
        counters.notices_dropped += side.notices_dropped - was.notices_dropped
        counters.notices_refused += side.notices_refused - was.notices_refused
        self.side = side
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
    """A receiver's delivered pulls and protocol errors as last read (Trio thread)."""

    pulls: int = 0
    protocol_errors: int = 0

    def add_new(self, receiver: Receiver, counters: TransferCounters) -> None:
        """Add the durations of the pulls ``receiver`` delivered since the last call, and the
        answers from P it could not use."""
        pulls = receiver.pull_statistics()
        counters.pull_seconds += pulls.since(self.pulls)
        counters.protocol_errors += receiver.protocol_errors - self.protocol_errors
        self.pulls, self.protocol_errors = pulls.count, receiver.protocol_errors
