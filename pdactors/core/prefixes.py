"""Prefix-aware routing (``routing="prefix_aware"``), sans-IO: which engine of a pool was sent
the longest start of a prompt, as the proxy remembers what it sent where, weighed against load.

*What a prompt is keyed on.* The proxy routes a request before any engine has seen it, so it
has the request's body, not its tokens (vLLM tokenizes; the P-first flow learns the ids only
from P's answer, after P was chosen). A prompt is therefore keyed on what the body holds: its
token ids in blocks of :data:`BLOCK_IDS` when the client sent ids, else its characters in blocks
of :data:`BLOCK_CHARS` (a chat: each message's role and text, in order, so a conversation's next
turn starts with its last turn's prompt). A block's key hashes the block with the key before it
(a chain, like vLLM's own block hashes): equal keys at block *k* mean equal prompts up to the end
of block *k* (a hash collision only routes a request sub-optimally). An engine's *match* is the
number of leading blocks whose keys it was sent. Only the first :data:`MAX_BLOCKS` blocks are
keyed, so one huge body costs bounded work. Characters stand for tokens: a block of 64
characters is ~16 tokens of English text, vLLM's block size on GPUs.

*What is remembered.* :class:`PrefixIndex` holds ``(engine, key)`` entries, least recently sent
first out, at most ``max_blocks`` of them, none older than ``max_age`` seconds — an
approximation of the engines' prefix caches, which evict on their own. It is never asked to be
right: an entry for blocks an engine has evicted, or for an engine that restarted, only routes
a request to where recomputing is needed anyway. An engine's entries are dropped when the proxy
learns it restarted (:meth:`PrefixIndex.forget`).

*The rule* (:func:`choose`, after sglang's and vllm-router's cache-aware policy): the engine
with the longest match, unless it has more than ``imbalance`` requests in flight beyond the
least-loaded engine — then the least-loaded one (a hot prefix spills, and the next turn finds
it on both); with no match anywhere, the least-loaded one. Ties go round robin.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "BLOCK_CHARS",
    "BLOCK_IDS",
    "MAX_BLOCKS",
    "Candidate",
    "PrefixIndex",
    "Why",
    "choose",
    "prefix_keys",
    "prompt_ids",
    "prompt_text",
]

#: Characters per block of a text prompt (~16 tokens).
BLOCK_CHARS: Final = 64
#: Token ids per block of a prompt sent as ids.
BLOCK_IDS: Final = 16
#: Blocks keyed per prompt at most (256 Ki characters, 64 Ki ids).
MAX_BLOCKS: Final = 4096

#: Why :func:`choose` chose: the longest match, the least-loaded engine because the best
#: match had too many requests in flight, or the least-loaded because nobody matched.
Why = Literal["prefix", "spill", "no_match"]


def prefix_keys(body: dict[str, Any], chat: bool) -> list[int]:
    """The chained keys of a (validated) request's prompt blocks, at most :data:`MAX_BLOCKS`;
    a last, partial block counts (a prompt shorter than a block has one key)."""
    ids = prompt_ids(body) if not chat else None
    if ids is not None:
        pieces: Sequence[Any] = [
            tuple(ids[i : i + BLOCK_IDS])
            for i in range(0, min(len(ids), BLOCK_IDS * MAX_BLOCKS), BLOCK_IDS)
        ]
    else:
        text = prompt_text(body, chat)[: BLOCK_CHARS * MAX_BLOCKS]
        pieces = [text[i : i + BLOCK_CHARS] for i in range(0, len(text), BLOCK_CHARS)]
    keys: list[int] = []
    key = 0
    for piece in pieces:
        key = hash((key, piece))
        keys.append(key)
    return keys


def prompt_ids(body: dict[str, Any]) -> list[int] | None:
    """A completion body's prompt as token ids (alone or a list of one), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # a list of one prompt of ids
    if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
        return prompt
    return None


def prompt_text(body: dict[str, Any], chat: bool) -> str:
    """A body's prompt text (a chat's messages, role and text, in order); "" when it has none."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else ""
    parts: list[str] = []
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            continue
        # A separator that text seldom holds keeps "ab"+"c" apart from "a"+"bc".
        parts.append(f"\x1e{message.get('role')}\x1f")
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
    return "".join(parts)


class PrefixIndex:
    """What the proxy sent to which engine: ``(engine, block key)`` entries, least recently
    sent first out, at most ``max_blocks``, each forgotten ``max_age`` seconds after it was
    last sent. Times are the caller's clock (seconds)."""

    def __init__(self, max_blocks: int, max_age: float) -> None:
        if max_blocks < 1 or not max_age > 0:
            raise ValueError("max_blocks must be >= 1 and max_age > 0")
        self.max_blocks = max_blocks
        self.max_age = max_age
        self._sent: OrderedDict[tuple[str, int], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sent)

    def sent(self, engine: str, keys: Sequence[int], now: float) -> None:
        """Note that the prompt of ``keys`` was sent to ``engine`` at ``now``."""
        # Last block first: a prompt's first blocks are the most recently sent, so the
        # bound evicts a prompt's tail before its head (a match counts leading blocks).
        for key in reversed(keys):
            entry = (engine, key)
            self._sent[entry] = now
            self._sent.move_to_end(entry)
        self._trim(now)

    def matched(self, engine: str, keys: Sequence[int], now: float) -> int:
        """How many leading blocks of ``keys`` ``engine`` was sent within ``max_age``."""
        oldest = now - self.max_age
        n = 0
        for key in keys:
            when = self._sent.get((engine, key))
            if when is None or when < oldest:
                break
            n += 1
        return n

    def forget(self, engine: str) -> int:
        """Drop ``engine``'s entries (it restarted: its cache is empty); how many there were."""
        gone = [entry for entry in self._sent if entry[0] == engine]
        for entry in gone:
            del self._sent[entry]
        return len(gone)

    def _trim(self, now: float) -> None:
        while len(self._sent) > self.max_blocks:
            self._sent.popitem(last=False)
        oldest = now - self.max_age
        while self._sent:
            entry, when = next(iter(self._sent.items()))
            if when >= oldest:
                break
            del self._sent[entry]


@dataclass(frozen=True, slots=True)
class Candidate:
    """An engine in rotation as :func:`choose` weighs it."""

    index: int  # its place in the pool
    load: int  # requests in flight on it
    matched: int  # leading blocks of the prompt it was sent


def choose(candidates: Sequence[Candidate], imbalance: int) -> tuple[int, Why]:
    """The index of the engine to use and why. ``candidates`` (not empty) come in
    round-robin order: the first of equals wins. The longest match wins unless its load
    exceeds the least load by more than ``imbalance``."""
    least = min(candidates, key=lambda c: (c.load, -c.matched))
    best = max(candidates, key=lambda c: (c.matched, -c.load))
    if best.matched == 0:
        return least.index, "no_match"
    if best.load - least.load > imbalance:
        return least.index, "spill"
    return best.index, "prefix"
