"""A rolling restart of every engine under steady load (issue 41): failed requests and the
goodput dip, for a 1P1D and a 2P2D deployment of ``pdactors launch``.

Per layout (``--layouts``, P x D): ``pdactors launch --prefill P --decode D`` with its other
defaults (the embedded tiny model, the proxy's defaults), a few warm-up requests, then an
open-loop Poisson load at ``--rate`` requests per second (prompts of ``--prompt-lens`` token
ids, greedy, streamed, ``--max-tokens`` tokens with ``ignore_eos``). After ``--before`` seconds
the launcher gets ``SIGUSR1``: every engine in turn is drained at the proxy, restarted and
resumed (:mod:`pdactors.deploy.restart`); the load goes on until ``--after`` seconds after the
launcher says every engine restarted. Each request belongs to the phase it was sent in
(before, during, after the restart). Per phase: requests sent, failed (an HTTP error, an error
event, cut short), TTFT p50/p99, TPOT p50, and goodput (requests that met the SLO —
TTFT <= ``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms`` — per second of the phase); the dip is
the goodput during the restart over the goodput before it.

    python bench/rolling_restart.py [--layouts 1x1 2x2] [--rate 2] [--before 30] [--after 30]

The engines share this machine's cores (``pdactors launch`` places them), so a 2P2D run has
half the compute per engine of a 1P1D one: compare phases within a layout, not layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.vllm.test_e2e import prompt_ids

ENV = {**os.environ, "MC_LOG_LEVEL": "ERROR"}


@dataclass(frozen=True)
class Outcome:
    sent: float  # monotonic
    ttft: float  # seconds; nan when it failed
    tpot: float
    error: str | None


def stream(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, str | None]:
    """TTFT and TPOT (seconds) of one streamed greedy completion, or why it failed."""
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.monotonic()
    first = last = float("nan")
    tokens = 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300,
                          trust_env=False) as resp:  # fmt: skip
            if resp.status_code != 200:
                return first, last, f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return first, last, f"error event: {event['error']}"
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices"):
                    now = time.monotonic() - start
                    first = now if first != first else first
                    last = now
    except httpx.HTTPError as exc:
        return first, last, repr(exc)
    if tokens != max_tokens:
        return first, last, f"cut short: {tokens} of {max_tokens} tokens"
    return first, (last - first) / max(tokens - 1, 1), None


class Launch:
    """``pdactors launch`` with ``P`` prefill and ``D`` decode servers; what it says is kept."""

    def __init__(self, prefill: int, decode: int) -> None:
        cmd = [sys.executable, "-m", "pdactors.cli", "launch", "--proxy-port", "0",
               "--prefill", str(prefill), "--decode", str(decode)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=ENV, start_new_session=True)  # fmt: skip
        assert self.proc.stderr is not None
        self.said: list[str] = []
        for line in self.proc.stderr:
            self.said.append(line)
            if line.startswith("proxy: http://"):
                self.url = line.split()[1]
                break
        else:
            raise SystemExit(f"launch exited with {self.proc.wait()}:\n{''.join(self.said)}")
        self._reader = threading.Thread(target=lambda: self.said.extend(self.proc.stderr or ()),
                                        daemon=True)  # fmt: skip
        self._reader.start()

    def said_so(self, what: str) -> bool:
        return any(what in line for line in self.said)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def run(layout: str, args: argparse.Namespace) -> None:
    n_p, n_d = (int(n) for n in layout.split("x"))
    launch = Launch(n_p, n_d)
    try:
        for i in range(4):  # warm-up (not measured)
            stream(launch.url, prompt_ids(200, seed=9000 + i), args.max_tokens)
        rng = np.random.default_rng(args.seed)
        lo, hi = args.prompt_lens
        outcomes: list[Outcome] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            sent = time.monotonic()
            prompt = prompt_ids(int(rng.integers(lo, hi + 1)), seed=args.seed * 1000 + i)
            ttft, tpot, error = stream(launch.url, prompt, args.max_tokens)
            with lock:
                outcomes.append(Outcome(sent, ttft, tpot, error))

        start = time.monotonic()
        marks: dict[str, float] = {}
        with ThreadPoolExecutor(256) as pool:
            i, at = 0, start
            while True:
                now = time.monotonic()
                if "restart" not in marks and now - start >= args.before:
                    launch.proc.send_signal(signal.SIGUSR1)
                    marks["restart"] = now
                if "restarted" not in marks and launch.said_so("every engine restarted"):
                    marks["restarted"] = now
                if "restarted" in marks and now - marks["restarted"] >= args.after:
                    break
                if "restart" in marks and now - marks["restart"] > args.restart_timeout:
                    raise SystemExit(f"no restart within {args.restart_timeout} s:\n"
                                     + "".join(launch.said[-20:]))  # fmt: skip
                if now >= at:
                    pool.submit(one, i)
                    i += 1
                    at += float(rng.exponential(1 / args.rate))
                time.sleep(min(0.05, max(0.0, at - time.monotonic())))
            end = time.monotonic()
        phases = [("before", start, marks["restart"]), ("during", marks["restart"],
                  marks["restarted"]), ("after", marks["restarted"], end)]  # fmt: skip
        print(f"\n### {n_p}P{n_d}D, {args.rate:g} req/s, restart took "
              f"{marks['restarted'] - marks['restart']:.0f} s\n")  # fmt: skip
        print("| phase | seconds | sent | failed | TTFT p50 / p99 ms | TPOT p50 ms | goodput/s |")
        print("|---|---|---|---|---|---|---|")
        goodput: dict[str, float] = {}
        for name, t0, t1 in phases:
            mine = [o for o in outcomes if t0 <= o.sent < t1]
            ok = [o for o in mine if o.error is None]
            ttft = np.array([o.ttft for o in ok]) * 1e3
            tpot = np.array([o.tpot for o in ok]) * 1e3
            met = int(np.sum((ttft <= args.slo_ttft_ms) & (tpot <= args.slo_tpot_ms)))
            goodput[name] = met / (t1 - t0)
            print(f"| {name} | {t1 - t0:.0f} | {len(mine)} | {len(mine) - len(ok)} | "
                  f"{_pct(ttft, 50)} / {_pct(ttft, 99)} | {_pct(tpot, 50)} | "
                  f"{goodput[name]:.2f} |")  # fmt: skip
        failed = [o.error for o in outcomes if o.error]
        dip = goodput["during"] / goodput["before"] if goodput["before"] else float("nan")
        print(f"\nfailed: {len(failed)} of {len(outcomes)}; goodput during / before: {dip:.2f}")
        for error in failed[:5]:
            print(f"  {error}"[:300])
    finally:
        launch.stop()


def _pct(values: np.ndarray, q: float) -> str:
    return f"{np.percentile(values, q):.0f}" if len(values) else "–"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=["1x1", "2x2"])
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-lens", type=int, nargs=2, default=(100, 600))
    ap.add_argument("--before", type=float, default=30.0)
    ap.add_argument("--after", type=float, default=30.0)
    ap.add_argument("--restart-timeout", type=float, default=900.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=41)
    args = ap.parse_args()
    for layout in args.layouts:
        run(layout, args)


if __name__ == "__main__":
    main()
