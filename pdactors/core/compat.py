"""Whether a peer's KV means what ours does: two :class:`~pdactors.wire.Compat` descriptions
compared field by field, in the order the struct declares them.

Sans-IO and pure: the sender and the receiver call :func:`judge` and act on its
:class:`Verdict`. The rules, as data the tests enumerate:

* no description on either side (an older peer, or the library used without the adapter):
  accepted, as before descriptions existed;
* a field empty on either side (not known there): not compared;
* the first field that differs and is not relaxed refuses the peer, and is the one named;
* a relaxed field that differs is accepted, and reported (the caller logs it: never silently).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal

from pdactors.errors import ConfigError
from pdactors.wire import Compat

__all__ = [
    "COMPAT_FIELDS",
    "IDENTITY_FIELDS",
    "Identity",
    "Mismatch",
    "Verdict",
    "check_relax",
    "identity",
    "judge",
    "mismatches",
]

#: The fields compared, in order (the first that differs is named).
COMPAT_FIELDS: Final[tuple[str, ...]] = Compat.__struct_fields__

#: The fields that say which model an engine answers with (not how its KV is laid out): what
#: vLLM's API server process knows, exported on D's ``/metrics`` for the proxy, which pairs
#: only a P and a D whose identities agree (:mod:`pdactors.proxy._pairs`).
IDENTITY_FIELDS: Final[tuple[str, ...]] = ("model", "weights", "dtype")

_SHORT = 24  # values longer than this are shown by their first 12 characters


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Field ``field`` differs: ``mine`` here, ``theirs`` at the peer."""

    field: str
    mine: str | int
    theirs: str | int

    def reason(self, me: Literal["P", "D"]) -> str:
        """The refusal's text, P's value first: ``incompatible peer: weights differ (P 3f2a…,
        D 9c1b…)``. Long values are cut to their first characters, unless that would hide
        the difference."""
        p, d = (self.mine, self.theirs) if me == "P" else (self.theirs, self.mine)
        sp, sd = _short(p), _short(d)
        if sp == sd:
            sp, sd = str(p), str(d)
        verb = "differ" if self.field.endswith("s") else "differs"
        return f"incompatible peer: {self.field} {verb} (P {sp}, D {sd})"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What :func:`judge` found: the mismatch that refuses the peer (None: accepted), and the
    relaxed ones (accepted, to be reported)."""

    refused: Mismatch | None
    relaxed: tuple[Mismatch, ...]


def _short(value: str | int) -> str:
    text = str(value)
    return text if len(text) <= _SHORT else text[:12] + "…"


def mismatches(mine: Compat | None, theirs: Compat | None) -> list[Mismatch]:
    """The fields known on both sides that differ, in :data:`COMPAT_FIELDS` order (none when
    either side has no description)."""
    if mine is None or theirs is None:
        return []
    found = []
    for name in COMPAT_FIELDS:
        a, b = getattr(mine, name), getattr(theirs, name)
        if a and b and a != b:
            found.append(Mismatch(name, a, b))
    return found


def judge(mine: Compat | None, theirs: Compat | None, relax: Iterable[str] = ()) -> Verdict:
    """Compare ``theirs`` with ``mine``; the fields named in ``relax`` may differ."""
    relaxed = frozenset(relax)
    found = mismatches(mine, theirs)
    refused = next((m for m in found if m.field not in relaxed), None)
    return Verdict(refused, tuple(m for m in found if m.field in relaxed))


def identity(compat: Compat | None) -> Compat | None:
    """``compat``'s :data:`IDENTITY_FIELDS` alone (the rest not known: not compared)."""
    if compat is None:
        return None
    return Compat(**{name: getattr(compat, name) for name in IDENTITY_FIELDS})


def check_relax(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` as a tuple of fields that may differ. Raises
    :class:`~pdactors.errors.ConfigError` naming one that is no field."""
    names = tuple(names)
    if unknown := [n for n in names if n not in COMPAT_FIELDS]:
        raise ConfigError(
            f"compat_relax names {unknown[0]!r}, which is not a compatibility field "
            f"(fields: {', '.join(COMPAT_FIELDS)})"
        )
    return names


@dataclass(frozen=True, slots=True)
class Identity:
    """An engine's identity fields (the rest of ``compat`` empty) and, for D, the fields its
    ``compat_relax`` lets differ: what the proxy pairs P and D by
    (:mod:`pdactors.proxy._pairs`)."""

    compat: Compat
    relax: tuple[str, ...] = ()
