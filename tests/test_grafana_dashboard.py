"""docs/grafana/pdactors-dashboard.json names only metrics and labels that exist.

The proxy's come from its own registry (:class:`pdactors.proxy._state.Metrics`, built here, no
IO); the connector's from the vLLM adapter's source (``pdactors_vllm/metrics.py``, read with
``ast``: importing it needs vLLM), so renaming a metric on either side fails this test.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdactors.core.compat import IDENTITY_FIELDS
from pdactors.proxy._state import Metrics
from pdactors.wire import COMPAT_INFO

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "pdactors-dashboard.json"
ADAPTER_METRICS = ROOT / "integrations" / "vllm" / "pdactors_vllm" / "metrics.py"

#: Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = frozenset({"instance", "job"})
#: vLLM's labels on every connector metric: ``PrometheusStatLogger``'s ``labelnames``
#: (vllm/v1/metrics/loggers.py), which it hands to ``KVConnectorPromMetrics``.
VLLM_LABELS = frozenset({"model_name", "engine"})

# --------------------------------------------------------------------------- what exists


def proxy_series() -> dict[str, frozenset[str]]:
    """Every sample name the proxy's /metrics can show, with its labels: one child of each
    labelled metric is made so that collect() yields its samples (``_total``, ``_bucket``...)."""
    metrics = Metrics()
    for collector in vars(metrics).values():
        names = getattr(collector, "_labelnames", ())  # prometheus_client keeps them here only
        if names:
            collector.labels(*["x"] * len(names))
    out: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in out.items()}


def adapter_series() -> dict[str, frozenset[str]]:
    """The connector's sample names on vLLM's /metrics, with their labels, as the adapter
    registers them: each name table (``COUNTERS``, ``DURATIONS``) goes through the metric class
    its comprehension calls (``self._counter_cls`` or ``self._histogram_cls``)."""
    tree = ast.parse(ADAPTER_METRICS.read_text())
    tables: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            target = node.targets[0]
            if isinstance(target, ast.Name):
                table = ast.literal_eval(node.value)
                tables[target.id] = [name for name, _doc in table.values()]
    classes = {"_counter_cls", "_histogram_cls", "_gauge_cls"}  # vLLM's, on the base class
    aliases: dict[str, str] = {}  # ``histogram_cls: Any = self._histogram_cls``
    for assign in ast.walk(tree):
        if isinstance(assign, ast.AnnAssign | ast.Assign):
            target = assign.target if isinstance(assign, ast.AnnAssign) else assign.targets[0]
            value = assign.value
            if isinstance(target, ast.Name) and isinstance(value, ast.Attribute):
                if value.attr in classes:
                    aliases[target.id] = value.attr
    kinds: dict[str, str] = {}
    for comp in ast.walk(tree):
        if not isinstance(comp, ast.DictComp):
            continue
        iterated = comp.generators[0].iter  # ``TABLE.items()``
        assert isinstance(iterated, ast.Call) and isinstance(iterated.func, ast.Attribute)
        assert isinstance(iterated.func.value, ast.Name)
        called = set()
        for call in ast.walk(comp.value):
            if isinstance(call, ast.Call):
                func = call.func
                if isinstance(func, ast.Attribute) and func.attr in classes:
                    called.add(func.attr)
                elif isinstance(func, ast.Name) and func.id in aliases:
                    called.add(aliases[func.id])
        assert len(called) == 1, ast.unparse(comp)
        kinds[iterated.func.value.id] = called.pop()
    assert set(kinds) == {"COUNTERS", "DURATIONS"}, kinds  # a new table: teach this test
    suffixes = {"_counter_cls": ("_total",), "_histogram_cls": ("_bucket", "_sum", "_count")}
    out: dict[str, frozenset[str]] = {}
    for table, kind in kinds.items():
        for name in tables[table]:
            for suffix in suffixes[kind]:
                out[name + suffix] = VLLM_LABELS | ({"le"} if suffix == "_bucket" else set())
    # the info gauge: labelled by ``identity_labels`` (role, the identity fields, relax)
    out[COMPAT_INFO] = VLLM_LABELS | {"role", *IDENTITY_FIELDS, "relax"}
    return out


def known_series() -> dict[str, frozenset[str]]:
    proxy, adapter = proxy_series(), adapter_series()
    assert not proxy.keys() & adapter.keys()
    return {name: labels | TARGET_LABELS for name, labels in (proxy | adapter).items()}


# --------------------------------------------------------------------------- PromQL


#: Words of PromQL that are not metric names: functions and aggregations (followed by ``(``
#: and dropped as such) are not listed, only keywords that may stand before something else.
KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
     "unless", "offset", "inf", "nan"}
)  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_VARIABLE = re.compile(r"\$\{?\w+\}?")
_WORD = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?")
_MATCHER_LABEL = re.compile(r"\s*([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def parse(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names (in matchers and groupings) of a PromQL
    expression or a Grafana ``label_values(metric, label)`` query."""
    assert expr.count("(") == expr.count(")"), expr
    assert expr.count("{") == expr.count("}"), expr
    labels: set[str] = set()
    text = _VARIABLE.sub("", _STRING.sub('""', expr))
    for match in _GROUPING.finditer(text):
        labels |= {name.strip() for name in match.group(2).split(",") if name.strip()}
    text = _GROUPING.sub(" ", text)
    for match in _MATCHERS.finditer(text):
        for matcher in match.group(1).split(","):
            if matcher.strip():
                found = _MATCHER_LABEL.match(matcher)
                assert found, (matcher, expr)
                labels.add(found.group(1))
    text = _RANGE.sub(" ", _MATCHERS.sub(" ", text))
    names = {
        m.group(1)
        for m in _WORD.finditer(text)
        if m.group(2) is None and m.group(1).lower() not in KEYWORDS
    }
    label_values = re.fullmatch(r"\s*label_values\(\s*([\w:]+)\s*,\s*(\w+)\s*\)\s*", expr)
    if label_values:
        names, labels = {label_values.group(1)}, {label_values.group(2)}
    return names, labels


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(where, query, legend) for each panel target and each query variable."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"], target.get("legendFormat", "")
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield f"${variable['name']}", query["query"] if isinstance(query, dict) else query, ""


# --------------------------------------------------------------------------- tests


def test_the_parser_on_examples_written_by_hand() -> None:
    assert parse(
        'histogram_quantile(0.99, sum by (le, decode) (rate(a_bucket{instance=~"$p",x!="ok"}'
        "[$__rate_interval])))"
    ) == ({"a_bucket"}, {"le", "decode", "instance", "x"})
    assert parse("sum(rate(vllm:b_total[5m])) / (sum(rate(c[1m])) + 1e3)") == (
        {"vllm:b_total", "c"},
        set(),
    )
    assert parse('max by (role) (up{job="or"}) and on (instance) d offset 5m') == (
        {"up", "d"},
        {"role", "job", "instance"},
    )
    assert parse("label_values(vllm:pdactors_compat_info, instance)") == (
        {"vllm:pdactors_compat_info"},
        {"instance"},
    )


def test_what_exists_is_read_from_both_sides() -> None:
    """Guards the oracle itself: a registry or an adapter table read as empty would pass
    everything."""
    proxy, adapter = proxy_series(), adapter_series()
    assert proxy["pdactors_proxy_migrations_total"] == {"to"}
    assert proxy["pdactors_proxy_ttft_seconds_bucket"] == {"prefill", "decode", "le"}
    assert "pdactors_proxy_requests_in_flight" in proxy
    assert adapter["vllm:pdactors_pulls_failed_total"] == VLLM_LABELS
    assert "vllm:pdactors_pull_seconds_bucket" in adapter
    assert "vllm:pdactors_pull_seconds_total" not in adapter


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]


QUERIES = list(queries(json.loads(DASHBOARD.read_text())))


def test_the_dashboard_covers_proxy_and_connector() -> None:
    used = set().union(*(parse(query)[0] for _, query, _ in QUERIES))
    assert len(used) >= 20
    assert {m for m in used if m.startswith("pdactors_proxy_")}
    assert {m for m in used if m.startswith("vllm:pdactors_")}


@pytest.mark.parametrize(("where", "query", "legend"), QUERIES, ids=[q[0] for q in QUERIES])
def test_every_metric_and_label_it_names_exists(where: str, query: str, legend: str) -> None:
    known = known_series()
    names, labels = parse(query)
    assert names, f"{where}: no metric found in {query!r}"
    for name in names:
        assert name in known, f"{where}: no metric {name!r} ({query!r})"
        missing = (labels | set(_LEGEND_LABEL.findall(legend))) - known[name]
        assert not missing, f"{where}: {name} has no label {sorted(missing)} ({query!r})"
