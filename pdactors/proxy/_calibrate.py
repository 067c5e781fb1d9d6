"""The placement seeded from a measurement, not a prior: each engine is calibrated as it comes
into rotation (issue 39, "right from the first request").

When the health loop finds an engine ready to enter the rotation — the proxy just started, or
the engine came back (restarted, resumed) — and the proxy holds no request on it, the proxy
first sends it a few probe requests of its own, as a client would: streamed completions of a
few tokens, one to warm it up (not learnt), then :data:`REPEATS` per prompt length of
:data:`PROBE_TOKENS` (those that fit the model's ``max_model_len``). What the faster of a
length's probes took to its first token, for its prompt tokens, and the gaps between its tokens
go to the placer (:meth:`~pdactors.core.placement.Placer.first_token`,
:meth:`~pdactors.core.placement.Placer.steps`), so the first client request is placed on what
the engine does, not on the prior. The faster, because a probe that met other work on the
engine or its machine (another proxy calibrating it at the same time, processes starting)
measured that work too, not only the engine's cost (measured in bench/vllm_pd.py, which starts
four proxies at once: a D's first probe, of 29 tokens, took 61 ms and its next, of 225, 46
ms; P's of the same lengths 20 and 44 ms). The prompts are random
words (a new draw each probe: no prefix-cache hit makes one look cheap), as many as the
warm-up's tokens per word say make the length; their token counts are the engine's own
(``usage``).

A probe that fails or takes longer than its bound (10 s, or ``health_timeout`` when longer)
ends the calibration (logged at INFO): the engine enters the rotation anyway and its
estimates learn from its traffic, as without calibration. What is not calibrated: D's catch-up
after P's token (it needs a P and a transfer; the prior holds until P-first requests teach
it).
"""

from __future__ import annotations

import itertools
import logging
import random
from typing import Any, Final

import httpx
import msgspec
import trio

from pdactors.core.placement import Placer
from pdactors.errors import describe

__all__ = ["PROBE_TOKENS", "REPEATS", "calibrate"]

log = logging.getLogger("pdactors.proxy")

#: The prompt lengths probed (prompt tokens, about: the engine counts them).
PROBE_TOKENS: Final = (32, 256, 1024)
#: Probes per length; the faster one is learnt.
REPEATS: Final = 2
#: The warm-up's prompt, in words (it also gives the tokenizer's tokens per word).
_WARM_UP_WORDS: Final = 16
#: Tokens each probe asks for: its gaps give the engine's decode step.
_PROBE_OUTPUT: Final = 8
_WORDS: Final = (
    "river", "mountain", "lantern", "harbor", "meadow", "copper", "violet", "thunder",
    "orchard", "compass", "glacier", "saddle", "quarry", "falcon", "ember", "willow",
    "canyon", "marble", "pepper", "tundra", "anchor", "beacon", "cobalt", "dune",
)  # fmt: skip


class _ProbeFailed(Exception):
    pass


async def calibrate(
    http: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    placer: Placer,
    per_probe: float,
) -> None:
    """Probe the engine at ``url`` and teach ``placer`` what it measured (see the module's
    doc), each probe within ``per_probe`` seconds. Never raises for the engine's failures
    (logged at INFO)."""
    try:
        model, max_len = await _model(http, url, headers, per_probe)
        # The warm-up also tells the tokens per word of this model's tokenizer.
        warm, _, _ = await _probe(http, url, headers, model, _WARM_UP_WORDS, per_probe)
        per_word = max(warm / _WARM_UP_WORDS, 0.1)
        learnt = []
        for target in (n for n in PROBE_TOKENS if n + 2 * _PROBE_OUTPUT <= max_len):
            words = max(1, int(target / per_word))
            probes = [
                await _probe(http, url, headers, model, words, per_probe) for _ in range(REPEATS)
            ]
            tokens, first, gaps = min(probes, key=lambda probe: probe[1])
            placer.first_token(url, tokens, first)
            if gaps:
                placer.steps(url, sum(gaps) / len(gaps), len(gaps))
            took = "/".join(f"{probe[1] * 1e3:.1f}" for probe in probes)
            learnt.append(f"{tokens} tokens {first * 1e3:.1f} ms (of {took})")
    except _ProbeFailed as exc:
        log.info("proxy: %s not calibrated (%s): its estimates start from the prior", url, exc)
        return
    log.info("proxy: %s calibrated: first token after %s", url, ", ".join(learnt) or "nothing")


async def _model(
    http: httpx.AsyncClient, url: str, headers: dict[str, str], per_probe: float
) -> tuple[str, int]:
    """The engine's model name and its ``max_model_len`` (a large one when not given)."""
    try:
        with trio.fail_after(per_probe):
            resp = await http.get(f"{url}/v1/models", headers=headers)
        if resp.status_code != 200:
            raise _ProbeFailed(f"GET /v1/models answered HTTP {resp.status_code}")
        (first, *_) = msgspec.json.decode(resp.content)["data"]
        return str(first["id"]), int(first.get("max_model_len") or 1 << 20)
    except (httpx.HTTPError, trio.TooSlowError) as exc:
        raise _ProbeFailed(f"GET /v1/models: {describe(exc)}") from exc
    except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
        raise _ProbeFailed(f"GET /v1/models: unreadable answer ({type(exc).__name__})") from exc


async def _probe(
    http: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    model: str,
    words: int,
    per_probe: float,
) -> tuple[int, float, list[float]]:
    """One streamed probe of about ``words`` prompt tokens: its prompt tokens (the engine's
    count), the seconds to its first token, and the gaps between its tokens."""
    rng = random.Random()
    body = {
        "model": model,
        "prompt": " ".join(rng.choice(_WORDS) for _ in range(words)),
        "max_tokens": _PROBE_OUTPUT, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    times: list[float] = []
    usage: dict[str, Any] = {}
    try:
        with trio.fail_after(per_probe):
            sent = trio.current_time()
            call = http.stream("POST", f"{url}/v1/completions", json=body, headers=headers)
            async with call as r:
                if r.status_code != 200:
                    raise _ProbeFailed(f"a probe got HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = msgspec.json.decode(line[6:])
                    if event.get("choices"):
                        times.append(trio.current_time())
                    usage = event.get("usage") or usage
    except (httpx.HTTPError, trio.TooSlowError) as exc:
        raise _ProbeFailed(f"a probe failed: {describe(exc)}") from exc
    except (msgspec.DecodeError, AttributeError) as exc:
        raise _ProbeFailed(f"a probe's answer is unreadable ({type(exc).__name__})") from exc
    tokens = usage.get("prompt_tokens")
    if not times or not isinstance(tokens, int):
        raise _ProbeFailed("a probe's answer had no token or no usage")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return tokens, times[0] - sent, gaps
