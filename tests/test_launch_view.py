"""What ``pdactors launch`` shows: figures read from real metric expositions, the live table's
states, the smoke verdict, and a failed component's log tail."""

from __future__ import annotations

import io
from pathlib import Path

from prometheus_client import generate_latest
from rich.console import Console

from pdactors.deploy import ChildDied, LaunchView, NotHealthy, Smoke, Stats, log_tail, metric_total
from pdactors.deploy.command import _report_failure
from pdactors.proxy._state import Metrics

# What a vLLM server's /metrics says (names as vLLM exports the connector's counters).
PREFILL = """\
# TYPE vllm:pdactors_transfers_sent counter
vllm:pdactors_transfers_sent_total{engine="0",model_name="tiny"} 3.0
# TYPE vllm:pdactors_bytes_sent counter
vllm:pdactors_bytes_sent_total{engine="0",model_name="tiny"} 3145728.0
"""
DECODE = """\
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 7.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 90.0
"""


def test_stats_come_from_the_proxys_own_metric_names_and_vllms() -> None:
    metrics = Metrics()
    metrics.requests.labels("completions", "ok").inc(4)
    metrics.requests.labels("completions", "error").inc()
    metrics.in_flight.inc(2)
    metrics.ttft.labels("p0", "d0").observe(0.030)
    metrics.ttft.labels("p0", "d0").observe(0.050)
    stats = Stats()
    stats.add_proxy(generate_latest(metrics.registry).decode())
    stats.add_prefill([PREFILL, PREFILL])
    stats.add_decode([DECODE])
    assert (stats.requests, stats.in_flight, stats.ttft_count) == (5, 2, 2)
    assert abs(stats.ttft_sum - 0.080) < 1e-9
    assert (stats.transfers, stats.kv_bytes, stats.d_local_prompt_tokens) == (6, 6 * 2**20, 7)
    line = stats.line()
    assert "requests 5 (2 in flight)" in line and "KV transfers 6 (6.0 MiB)" in line
    assert "time to first token 40 ms" in line and "prompt tokens D computed 7" in line
    assert metric_total(DECODE, "vllm:prompt_tokens_by_source_total", source="nope") == 0


def render(view: LaunchView) -> str:
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(view)
    return out.getvalue()


def test_the_table_follows_each_component_from_waiting_to_healthy() -> None:
    out = io.StringIO()
    view = LaunchView(Console(file=out, width=120, color_system=None))
    view.add("prefill-0", "http://127.0.0.1:1")
    view.add("proxy", "http://127.0.0.1:2")
    assert "prefill-0" in render(view) and "waiting" in render(view)
    view.progress("prefill-0", 1.0, False)
    assert "starting" in render(view)
    view.progress("prefill-0", 41.2, True)
    view.progress("prefill-0", 42.0, True)  # said once
    table = render(view)
    assert "healthy" in table and "41 s" in table and "waiting" in table  # the proxy still waits
    assert out.getvalue().count("prefill-0 healthy after 41 s") == 1


def test_the_smoke_passes_only_when_answers_match_kv_moved_and_d_computed_nothing() -> None:
    moved = Stats(transfers=4, kv_bytes=2**20, d_local_prompt_tokens=0)
    ok = Smoke(4, 4, 0.040, 0.090, moved)
    assert ok.passed
    lines = ok.lines()
    assert lines[0] == "smoke: 4/4 answers through the proxy equal the single server's — PASS"
    assert "single 40 ms, PD 90 ms (×2.2) (P's token), second token 0 ms" in lines[1]
    assert "4 transfers, 1.00 MiB" in lines[2] and ": 0 (P's first token" in lines[3]
    auto = Smoke(4, 4, 0.040, 0.090, moved, second_pd=0.1, ttft_auto=0.044,
                 auto_placed={"local": 3, "disaggregated": 1})  # fmt: skip
    assert "second token 100 ms" in auto.lines()[1]
    assert auto.lines()[2] == (
        "  with the proxy's own placement: 44 ms (×1.1) (1 disaggregated, 3 local)"
    )
    assert not Smoke(3, 4, 0.04, 0.09, moved).passed
    assert not Smoke(4, 4, 0.04, 0.09, Stats(transfers=0, kv_bytes=0)).passed
    local = Stats(transfers=4, kv_bytes=2**20, d_local_prompt_tokens=12)
    assert not Smoke(4, 4, 0.04, 0.09, local).passed
    assert not Smoke(4, 4, 0.04, 0.09, local, proxied=5).passed  # more than P's tokens
    assert Smoke(4, 4, 0.04, 0.09, Stats(transfers=4, kv_bytes=1, d_local_prompt_tokens=5),
                 proxied=5).passed  # fmt: skip
    assert Smoke(3, 4, 0.04, 0.09, moved).lines()[0].endswith("— FAIL")


def test_a_dead_component_is_reported_with_the_tail_of_its_log(tmp_path: Path) -> None:
    log = tmp_path / "decode-0.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "RuntimeError: out of memory\n")
    assert log_tail(log, 3) == ["line 98", "line 99", "RuntimeError: out of memory"]
    assert log_tail(tmp_path / "missing.log") == []
    out = io.StringIO()
    group = ExceptionGroup("x", [ExceptionGroup("y", [ChildDied("decode-0", 1, log)])])
    _report_failure(Console(file=out, width=200, color_system=None), group)
    text = out.getvalue()
    assert "decode-0 exited with code 1" in text and "RuntimeError: out of memory" in text
    assert str(log) in text and "line 79" not in text  # the tail, not the whole log


def test_components_not_healthy_in_time_are_named() -> None:
    out = io.StringIO()
    group = ExceptionGroup("x", [NotHealthy(["prefill-0", "decode-0"], 300.0)])
    _report_failure(Console(file=out, width=200, color_system=None), group)
    assert "✗ NotHealthy: not healthy within 300 s: prefill-0, decode-0" in out.getvalue()


def test_the_smokes_figures_are_counted_from_its_start() -> None:
    """What the engines did before the smoke's requests (the proxy's calibration probes, D
    computing their prompts) is not the smoke's: the counts are taken since its start."""
    before = Stats(requests=2, transfers=1, kv_bytes=10, d_local_prompt_tokens=1500)
    after = Stats(requests=12, in_flight=1, transfers=6, kv_bytes=30, d_local_prompt_tokens=1504)
    since = after.since(before)
    assert (since.requests, since.in_flight, since.transfers) == (10, 1, 5)
    assert (since.kv_bytes, since.d_local_prompt_tokens) == (20, 4)
