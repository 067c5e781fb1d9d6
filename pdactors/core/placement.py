"""Placement per request: have P compute the prompt (disaggregated), let D do it (local), or
let P serve the request whole (``whole-on-p``).

The proxy's ``placement="auto"`` asks :class:`Placer` for each request. It estimates, from what
the proxy measured while it ran, what each choice costs in milliseconds of the client's wait:

* **disaggregated**: P's time to its first token for the prompt tokens already waiting on P
  plus this prompt's (:class:`CostModel` of P, fitted on P's answers), plus ``stall_weight``
  times D's catch-up (from D's request to D's first chunk: the pull and D's step; fitted on
  the P-first flow's continuations) — the request's own second token waits for it;
* **local**: D's time to a first token for its waiting prompt tokens plus this one (D's
  :class:`CostModel`, fitted on local requests), one of D's decode steps when D is decoding
  (the prompt waits for the running step; D's step is the mean gap between its streamed
  chunks), plus ``stall_weight`` times the pause its prefill puts on each request D is
  decoding (D's per-token cost × prompt tokens × requests D decodes).

In a pool of engines of every role (P decodes for the pool too), a **lone request** (nothing in
flight on either engine) is served whole by the engine whose estimated time to a first token
is lower: D (local), or P (``whole-on-p``, reason ``p_faster``) when P's is under
:data:`_WHOLE_SHARE` of D's — disaggregating it would give the client the same first token
(P's) and a later second one (D's catch-up), and keep both engines busy for one request. A
dedicated P is not made to decode so: the next requests of a burst would wait behind its
decode steps.

Otherwise the cheaper one wins, except that once in 16 decisions the choice not taken for
that long is taken (reason ``explore``): each model keeps following what its engine does now.
With a TTFT objective (``slo_ttft_ms``), when only one choice's estimated time to the client's
first token meets it — D's queue, running step and prompt for local; P's for disaggregated,
plus D's catch-up unless P's token goes first — that one is taken (reason ``slo_ttft``; no
exploring). When neither meets it although the prompt would on an idle engine (the queues make
it miss: the engines are overloaded), it is served whole by the engine with fewer requests in
flight (ties: the lower estimate), D (``local``) or P (``whole-on-p``), reason ``overloaded``:
no transfer, no catch-up and one engine's time instead of two, so that the queues drain for
the requests behind it as least-outstanding replicas' would. A prompt that misses the
objective even on an idle engine is placed by the estimates as without one.

**Roles per request.** Both choices leave the decode to D, so at high rates D's clients get
their tokens slower than the operator's TPOT objective while P idles between prefills. When D
is decoding and the time per token its last streams' clients got (the mean gap from a
client's first chunk, P's token in the P-first flow, to its last: D's catch-up included) has
reached :data:`_SHED_SHARE` of ``slo_tpot_ms``, and P's clients got theirs faster (P decodes
the requests it serves whole) and P decodes no more requests than D (the times per token are
known only once streams end: the count keeps a burst from piling onto P meanwhile), the
request goes to P whole (reason ``d_decode_full``): P
prefills and decodes it, D takes no part. P's decodes then count against P as D's do against
D: a prompt P computes waits for P's running step and pauses each request P decodes.

``stall_weight`` is what a millisecond of delay to a decoding request is worth against a
millisecond of TTFT: a pause of ``t`` ms adds ``t / L`` to the mean TPOT of a request of ``L``
output tokens, so with SLOs of TTFT ≤ 200 ms and TPOT ≤ 25 ms and 64-token answers the two are
even at ``200 / (25·64) ≈ 0.125``; the default (0.25) protects decodes twice as much. Short
prompts go local as soon as D's catch-up costs more than their pause; long ones go to P unless
P's queue makes them wait longer than D would.

The prompt's length is exact for token-id prompts; for text it is the prompt's characters over
the characters per token seen in P's answers (``prompt_token_ids``), 4 before any.

Everything here is pure (no IO, no clock): the proxy passes times in seconds of trio's clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = ["CostModel", "Decision", "EngineLoad", "Placer", "TokenCount", "prompt_size"]

Where = Literal["local", "disaggregated", "whole-on-p"]

#: Before any measurement: time to first token ≈ 20 ms + 0.1 ms per prompt token (a small
#: model on one CPU core), and D's catch-up ≈ 20 ms + 0.02 ms per token.
_PRIOR_TTFT: Final = (20.0, 0.1)
_PRIOR_CATCH_UP: Final = (20.0, 0.02)
#: How much the prior weighs, in observations, and how fast older observations fade (each new
#: one multiplies the weight of those before by this: ~20 observations of memory).
_PRIOR_WEIGHT: Final = 2.0
_FORGET: Final = 0.95
#: Where the prior's second point sits, in prompt tokens.
_PRIOR_SPAN: Final = 1000.0
_CHARS_PER_TOKEN_PRIOR: Final = 4.0
#: One decision in this many takes the choice the estimates did not pick (when the other one
#: has not been taken for that long): the engine's model is refreshed by what it does now.
_EXPLORE: Final = 16
#: A lone request goes to P whole when P's estimated time to a first token is under this share
#: of D's (estimates move by a few per cent between engines that are the same; by default the
#: decode engine serves it).
_WHOLE_SHARE: Final = 0.9
#: The time per token D's clients got, as a share of the TPOT objective, from which a request
#: whose D is decoding goes to P whole (P's clients getting theirs faster).
_SHED_SHARE: Final = 0.8


def _choice(where: Where, d_url: str, p_url: str) -> tuple[str, str]:
    """The engine whose model a choice refreshes: D's for local, P's else (P computes the
    prompt, whole or for D)."""
    return ("d", d_url) if where == "local" else ("p", p_url)


class CostModel:
    """``ms ≈ a + b·tokens``: least squares over the observations, the older ones fading, with
    a prior that holds it where observations are few or all of one size."""

    def __init__(self, a: float, b: float) -> None:
        self._prior = (a, b)
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.observations = 0

    def observe(self, tokens: float, ms: float) -> None:
        f = _FORGET
        self._w = self._w * f + 1
        self._x = self._x * f + tokens
        self._y = self._y * f + ms
        self._xx = self._xx * f + tokens * tokens
        self._xy = self._xy * f + tokens * ms
        self.observations += 1

    def fit(self) -> tuple[float, float]:
        """``(a, b)``, both ≥ 0."""
        a0, b0 = self._prior
        pw, span = _PRIOR_WEIGHT / 2, _PRIOR_SPAN
        w = self._w + 2 * pw
        x = self._x + pw * span
        y = self._y + pw * (2 * a0 + b0 * span)
        xx = self._xx + pw * span * span
        xy = self._xy + pw * span * (a0 + b0 * span)
        var = w * xx - x * x
        b = max(0.0, (w * xy - x * y) / var) if var > 0 else b0
        a = max(0.0, (y - b * x) / w)
        return a, b

    def predict(self, tokens: float) -> float:
        a, b = self.fit()
        return a + b * tokens


class TokenCount:
    """Characters per prompt token, learned from P's answers (text prompts only)."""

    def __init__(self) -> None:
        self.chars_per_token = _CHARS_PER_TOKEN_PRIOR

    def observe(self, chars: int, tokens: int) -> None:
        if chars > 0 and tokens > 0:
            self.chars_per_token = 0.8 * self.chars_per_token + 0.2 * (chars / tokens)

    def tokens(self, size: tuple[int | None, int]) -> int:
        ids, chars = size
        if ids is not None:
            return ids
        return max(1, round(chars / self.chars_per_token))


def prompt_size(body: dict[str, Any], chat: bool) -> tuple[int | None, int]:
    """``(token ids, characters)`` of a (validated) request's prompt: the number of ids when
    the prompt is token ids (characters then 0), else None and the characters of its text."""
    if chat:
        chars = 0
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        chars += len(part["text"])
        return None, chars
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a list of one prompt
    if isinstance(prompt, list):
        return len(prompt), 0
    return None, len(prompt) if isinstance(prompt, str) else 0


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request's prompt is computed, why, and the two estimates (ms) behind it."""

    where: Where
    reason: str
    tokens: int
    local_ms: float
    disaggregated_ms: float
    whole_ms: float | None = None  # P serving it whole (None: not weighed)


@dataclass(slots=True)
class EngineLoad:
    """What the proxy knows of one engine's load when it places a request."""

    waiting_tokens: int  # prompt tokens sent to it whose first token has not come back
    decoding: int  # requests in flight on it that it decodes
    requests: int = 0  # requests in flight on it, prefilling or decoding (both its roles)


class Placer:
    """The proxy's placement per request (``placement="auto"``), and what it learns."""

    def __init__(self, stall_weight: float, *, p_first: bool = True) -> None:
        self.stall_weight = stall_weight
        self.p_first = p_first  # the client's first token is P's (the P-first flow)
        self._ttft: dict[str, CostModel] = {}  # engine URL -> its time to a first token
        self._catch_up: dict[str, CostModel] = {}  # D URL -> its P-first continuation
        self._step_ms: dict[str, float] = {}  # D URL -> mean gap between its chunks
        #: decoding engine URL -> the mean time per chunk its clients got, from their first
        #: (P's token, in the P-first flow) to the last: what a TPOT objective is met by
        self._tpot_ms: dict[str, float] = {}
        self.count = TokenCount()
        #: (role, engine URL) -> decisions since a choice that refreshes its model was taken
        self._skipped: dict[tuple[str, str], int] = {}

    def _model(self, url: str) -> CostModel:
        return self._ttft.setdefault(url, CostModel(*_PRIOR_TTFT))

    def decide(
        self,
        tokens: int,
        p_url: str,
        p: EngineLoad,
        d_url: str,
        d: EngineLoad,
        *,
        slo_tpot_ms: float | None = None,
        slo_ttft_ms: float | None = None,
        p_decodes: bool = False,
    ) -> Decision:
        """Where a prompt of ``tokens`` goes, P and D loaded as given. ``slo_tpot_ms``: the
        TPOT objective, from which P may serve the request whole (None: it may not);
        ``slo_ttft_ms``: the TTFT objective — when only one choice's estimated time to the
        client's first token meets it, that one is taken (None: not weighed); ``p_decodes``:
        P is an engine of every role, which decodes for the pool anyway, so that a lone
        request may go to it whole."""
        p_model, d_model = self._model(p_url), self._model(d_url)
        catch_up = self._catch_up.setdefault(d_url, CostModel(*_PRIOR_CATCH_UP))
        w = self.stall_weight
        p_ttft = p_model.predict(p.waiting_tokens + tokens) + self._step(p_url, p)
        d_ttft = d_model.predict(d.waiting_tokens + tokens) + self._step(d_url, d)
        on_p = p_ttft + self._stall(p_url, p, tokens)
        disaggregated = on_p + w * catch_up.predict(tokens)
        local = d_ttft + self._stall(d_url, d, tokens)
        if slo_tpot_ms is not None and d.decoding:
            d_tpot = self._tpot_ms.get(d_url, 0.0)  # 0 before D's first stream ended
            p_tpot = self._tpot_ms.get(p_url, 0.0) if p.decoding else 0.0
            full = d_tpot > 0 and d_tpot >= _SHED_SHARE * slo_tpot_ms
            if full and p_tpot < d_tpot and p.decoding <= d.decoding:
                return Decision("whole-on-p", "d_decode_full", tokens, local, disaggregated, on_p)
        if p_decodes and not (p.decoding or p.waiting_tokens or d.decoding or d.waiting_tokens):
            # Nothing in flight on either (a lone request): the engine that answers it
            # sooner serves it whole, with no transfer and no catch-up before its second
            # token; disaggregation pays only for a prompt that would wait or pause decodes.
            alone: Where = "whole-on-p" if p_ttft < _WHOLE_SHARE * d_ttft else "local"
            return self._explored(alone, "d_idle" if alone == "local" else "p_faster",
                                  tokens, d_url, p_url, local, disaggregated, on_p)  # fmt: skip
        # The client's first token: P's in the P-first flow, else D's after its catch-up.
        first_disaggregated = p_ttft if self.p_first else p_ttft + catch_up.predict(tokens)
        meets = (d_ttft <= slo_ttft_ms, first_disaggregated <= slo_ttft_ms) if slo_ttft_ms else ()
        overloaded = meets == (False, False) and (
            min(p_model.predict(tokens), d_model.predict(tokens)) <= (slo_ttft_ms or 0)
        )  # estimated only when neither placement meets the objective
        if overloaded:
            # Overloaded: the prompt would meet the objective on an idle engine, but the
            # queues make it miss wherever it goes. Serve it whole (no transfer, no catch-up,
            # one engine's time) on the engine with fewer requests in flight, as
            # least-outstanding replicas would (ties: the lower estimate). Counts, not the
            # estimates: they follow at once, where each engine's fit lags and differs in kind
            # (P's fitted on prefills, D's on prompts queued behind decodes).
            fewer = p.requests < d.requests if p.requests != d.requests else on_p < local
            where: Where = "whole-on-p" if fewer else "local"
            self._taken(where, d_url, p_url)
            return Decision(where, "overloaded", tokens, local, disaggregated, on_p)
        if meets and meets[0] != meets[1]:  # only one choice meets the TTFT objective
            where = "local" if meets[0] else "disaggregated"
            self._taken(where, d_url, p_url)
            return Decision(where, "slo_ttft", tokens, local, disaggregated)
        where = "local" if local < disaggregated else "disaggregated"
        if where == "local":
            reason = "d_idle" if not d.decoding else "p_queue" if p.waiting_tokens else "short"
        else:
            reason = "d_busy" if d.decoding else "p_faster"
        return self._explored(where, reason, tokens, d_url, p_url, local, disaggregated)

    def _explored(
        self, where: Where, reason: str, tokens: int, d_url: str, p_url: str,
        local: float, disaggregated: float, whole: float | None = None,
    ) -> Decision:  # fmt: skip
        """The decision for ``where``, unless the choice not taken has not been taken for
        ``_EXPLORE`` decisions: then that one (reason ``explore``), so that its engine's model
        follows what that engine does now, not what it did when last chosen (P's model is
        refreshed by P's prefills, whole or not; exploring it disaggregates)."""
        other: Where = "disaggregated" if where == "local" else "local"
        if self._skipped.get(_choice(other, d_url, p_url), 0) + 1 >= _EXPLORE:
            where, reason = other, "explore"
        self._taken(where, d_url, p_url)
        return Decision(where, reason, tokens, local, disaggregated, whole)

    def _taken(self, where: Where, d_url: str, p_url: str) -> None:
        """``where`` was chosen: the other choice was skipped once more."""
        other: Where = "local" if where != "local" else "disaggregated"
        self._skipped[_choice(where, d_url, p_url)] = 0
        key = _choice(other, d_url, p_url)
        self._skipped[key] = self._skipped.get(key, 0) + 1

    def _step(self, url: str, load: EngineLoad) -> float:
        """The running step a prompt waits for on an engine that is decoding."""
        return self._step_ms.get(url, 0.0) if load.decoding else 0.0

    def _stall(self, url: str, load: EngineLoad, tokens: int) -> float:
        """``stall_weight`` times the pause a prompt of ``tokens`` puts on each request the
        engine decodes."""
        if not load.decoding:
            return 0.0
        _, per_token = self._model(url).fit()
        return self.stall_weight * load.decoding * per_token * tokens

    # ------------------------------------------------------------------ what it learns

    def first_token(self, url: str, tokens_ahead: int, seconds: float) -> None:
        """An engine gave a prompt's first token ``seconds`` after it was sent, with
        ``tokens_ahead`` prompt tokens (its own included) waiting on it then."""
        self._ttft.setdefault(url, CostModel(*_PRIOR_TTFT)).observe(tokens_ahead, seconds * 1e3)

    def caught_up(self, d_url: str, tokens: int, seconds: float) -> None:
        """D's first chunk of a P-first continuation came ``seconds`` after its request."""
        model = self._catch_up.setdefault(d_url, CostModel(*_PRIOR_CATCH_UP))
        model.observe(tokens, seconds * 1e3)

    def steps(
        self, d_url: str, seconds: float, gaps: int = 1, per_chunk: float | None = None
    ) -> None:
        """One of D's streams had ``gaps`` gaps between its chunks, ``seconds`` each on
        average, and its client ``per_chunk`` seconds per chunk from its first (None: as
        ``seconds``): as many updates of each running mean (each keeps 0.9 of the mean
        before)."""
        keep = 0.9**gaps
        for means, ms in (
            (self._step_ms, seconds * 1e3),
            (self._tpot_ms, (seconds if per_chunk is None else per_chunk) * 1e3),
        ):
            old = means.get(d_url)
            means[d_url] = ms if old is None else keep * old + (1 - keep) * ms

    def describe(self) -> dict[str, Any]:
        """The fitted models, for ``GET /health``'s detail and the logs."""
        out: dict[str, Any] = {"chars_per_token": round(self.count.chars_per_token, 2)}
        for name, models in (("ttft", self._ttft), ("catch_up", self._catch_up)):
            out[name] = {
                url: {"a_ms": round(a, 2), "ms_per_token": round(b, 4), "n": m.observations}
                for url, m in models.items()
                for a, b in [m.fit()]
            }
        out["step_ms"] = {url: round(ms, 2) for url, ms in self._step_ms.items()}
        out["tpot_ms"] = {url: round(ms, 2) for url, ms in self._tpot_ms.items()}
        return out
