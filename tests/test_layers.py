"""The import rules between the layers, checked on the source (every import, lazy ones too),
and the size of a module.

Every module of ``pdactors`` and of the vLLM adapter (``integrations/vllm/pdactors_vllm``)
belongs to one layer (``LAYERS``; a module no layer names fails). A module imports modules of
its own layer and of the tiers below it (``TIERS``); the layers of one tier do not import each
other. Bottom up:

==================================  ==========================================================
``errors``                          every deliberate error (``errors.py``)
``wire``                            the types on every wire
``core``                            the tables: plain synchronous code, time passed in
``config`` | ``support``            frozen configs (``config.py``, ``proxy_config.py``) |
                                    helpers that know no layer (the timeline, ``TrioHost``,
                                    ``_once``, ``_pulse``, ``_http_client``)
``transport`` | ``dataplane`` |     the side channel | KV bytes | HTTP serving | the
``web`` | ``bootstrap_client``      bootstrap's HTTP client
``actors``                          sender, receiver, bootstrap
``proxy`` | ``testing``             the OpenAI proxy | the harness and its fault injectors
``api`` | ``cli_setup``             ``pdactors/__init__.py`` (re-exports) | the commands'
                                    process setup (logging, native logs, the timeline's env)
``deploy``                          ``pdactors launch`` and ``--render k8s``
``edge``                            the commands: ``cli.py`` (argv) and ``_cli_tools.py``
``adapter``                         ``pdactors_vllm``, inside vLLM's processes
==================================  ==========================================================

Beside the tiers:

* ``errors``, ``wire``, ``core`` and the adapter's scheduler side (bookkeeping) import no IO:
  no trio, no sockets, no threads, no environment.
* Nothing in ``pdactors`` imports vLLM or torch; only the adapter does.
* The proxy never touches KV: it imports neither the data plane, nor the block plans, nor the
  side channel's transports (``Transport`` and its implementations); it may open the
  trio⇄ZMQ sockets of ``pdactors.transport.zmq`` themselves, to follow vLLM's KV events.
* Only ``pdactors.cli``, the edge that reads argv, imports ``pdactors.deploy``.
* The adapter, in vLLM's engine processes, imports neither the proxy nor the command line
  (``cli``, ``_cli_tools``, ``_cli_setup``): it reads its own settings.
* No module imports one that imports it back.
* No module of the library or the adapter is over ``MAX_LINES`` lines: a longer one holds more
  than one job (the tests are not held to it: a test file follows its subject's cases).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pdactors"
ADAPTER = ROOT / "integrations" / "vllm" / "pdactors_vllm"

#: layer -> the modules it holds; a package's name holds its submodules too, but the root
#: ``pdactors`` holds only its ``__init__`` (the public API).
LAYERS: dict[str, tuple[str, ...]] = {
    "errors": ("pdactors.errors",),
    "wire": ("pdactors.wire",),
    "core": ("pdactors.core",),
    "config": ("pdactors.config", "pdactors.proxy_config"),
    "support": (
        "pdactors.timeline",  # per-transfer marks (every actor and the adapter)
        "pdactors.host",  # TrioHost: a trio run for synchronous callers (the adapter)
        "pdactors._once",  # the first time a key is seen, or once per interval
        "pdactors._pulse",  # a re-armable wake-up
        "pdactors._http_client",  # httpx under trio (the bootstrap client, the proxy)
    ),
    "transport": ("pdactors.transport",),
    "dataplane": ("pdactors.dataplane",),
    "web": ("pdactors.web",),
    "bootstrap_client": ("pdactors.bootstrap_client",),
    "actors": ("pdactors.actors",),
    "proxy": ("pdactors.proxy",),
    "testing": ("pdactors.testing",),
    "api": ("pdactors",),
    "cli_setup": ("pdactors._cli_setup",),
    "deploy": ("pdactors.deploy",),
    "edge": (
        "pdactors.cli",
        "pdactors._cli_tools",
        "pdactors._cli_admin",
        "pdactors._cli_doors",
        "pdactors._cli_proxy",
    ),
    "adapter": ("pdactors_vllm",),
}
#: Bottom up; a layer imports its own modules and those of lower tiers, never a sibling's.
TIERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("wire",),
    ("core",),
    ("config", "support"),
    ("transport", "dataplane", "web", "bootstrap_client"),
    ("actors",),
    ("proxy", "testing"),
    ("api", "cli_setup"),
    ("deploy",),
    ("edge",),
    ("adapter",),
)
RANK = {layer: rank for rank, tier in enumerate(TIERS) for layer in tier}
PROJECT_ROOTS = frozenset({"pdactors", "pdactors_vllm"})

IO_MODULES = frozenset(
    {"trio", "zmq", "socket", "threading", "subprocess", "asyncio", "os", "httpx", "h11"}
    | {"mooncake", "selectors", "signal", "multiprocessing", "queue"}
)
#: The modules that do no IO: these layers, and the adapter's scheduler-side bookkeeping.
PURE_LAYERS = frozenset({"errors", "wire", "core"})
PURE_ADAPTER = frozenset(
    f"pdactors_vllm.{m}" for m in ("scheduler_side", "eager_send", "request_marks", "metadata")
)
NEVER_IN_PDACTORS = frozenset({"vllm", "torch"})
KV_MODULES = ("pdactors.dataplane", "pdactors.core.plan", "pdactors.core.tp", "pdactors.transport")
#: What of ``KV_MODULES`` the proxy may import: sockets, not the side channel.
PROXY_MAY: tuple[str, ...] = ("pdactors.transport.zmq",)
#: layer -> modules of lower tiers it still must not import, and why
APART: dict[str, tuple[tuple[str, ...], str]] = {
    "proxy": (KV_MODULES, "the proxy touches KV"),
    "adapter": (
        ("pdactors.proxy", *LAYERS["edge"], *LAYERS["cli_setup"]),
        "the adapter imports the proxy or the command line",
    ),
}
DEPLOY = "pdactors.deploy"
DEPLOY_IMPORTED_BY = frozenset({"pdactors.cli"})  # besides its own modules

MAX_LINES = 400
#: path (from the repository root) -> why it may be longer; empty: none may.
OVER_MAX_LINES: dict[str, str] = {}


def _module_name(path: Path) -> str:
    """``pdactors/core/plan.py`` → ``pdactors.core.plan``; the adapter's files by the name
    they are imported as (``pdactors_vllm.connector``)."""
    base = ADAPTER.parent if path.is_relative_to(ADAPTER) else ROOT
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> str | None:
    """The layer holding ``module`` (a project module's name), or None: it has none."""
    for layer, names in LAYERS.items():
        for name in names:
            if module == name or (name != "pdactors" and _under(module, name)):
                return layer
    return None


def _from_base(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module of ``from <base> import ...`` in module ``importer``."""
    if not node.level:
        return node.module or ""
    package = importer if is_package else importer.rpartition(".")[0]
    parts = package.split(".")
    parts = parts[: len(parts) - node.level + 1]
    return ".".join([*parts, node.module] if node.module else parts)


def _imports(path: Path, name: str | None = None) -> set[str]:
    """Every module ``path`` imports, absolute, wherever the import statement sits (for
    ``from m import x``: both ``m`` and ``m.x``)."""
    name = name or _module_name(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _from_base(node, name, path.name == "__init__.py")
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _project_imports(path: Path, known: set[str], name: str | None = None) -> set[str]:
    """The project modules ``path`` imports, anywhere in it: ``from pdactors import timeline``
    is ``pdactors.timeline`` (a module), ``from pdactors import Layout`` is ``pdactors`` (a
    name of its ``__init__``)."""
    name = name or _module_name(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, name, path.name == "__init__.py")
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
    return {m for m in found if m.split(".")[0] in PROJECT_ROOTS}


def _problems(name: str, path: Path, known: set[str]) -> list[str]:
    """Every rule of this module's docstring that module ``name`` (at ``path``) breaks."""
    layer = layer_of(name)
    if layer is None:
        return [f"{name} belongs to no layer: add it to LAYERS"]
    problems = []
    roots = {m.split(".")[0] for m in _imports(path, name)}
    if layer != "adapter" and roots & NEVER_IN_PDACTORS:
        problems.append(f"{name} imports {sorted(roots & NEVER_IN_PDACTORS)}")
    if (layer in PURE_LAYERS or name in PURE_ADAPTER) and roots & IO_MODULES:
        problems.append(f"{name} does IO: it imports {sorted(roots & IO_MODULES)}")
    for module in sorted(_project_imports(path, known, name)):
        other = layer_of(module)
        if other is None:
            problems.append(f"{name} imports {module}, which belongs to no layer")
        elif other != layer and RANK[other] >= RANK[layer]:
            where = "beside" if RANK[other] == RANK[layer] else "above"
            problems.append(f"{name} ({layer}) imports {module} ({other}), a layer {where} it")
        allowed = layer == "proxy" and module in PROXY_MAY
        if layer in APART and not allowed and any(_under(module, m) for m in APART[layer][0]):
            problems.append(f"{APART[layer][1]}: {name} imports {module}")
        if _under(module, DEPLOY) and layer != "deploy" and name not in DEPLOY_IMPORTED_BY:
            problems.append(f"only {sorted(DEPLOY_IMPORTED_BY)} import {DEPLOY}: {name} does")
    return problems


SOURCES = sorted(PACKAGE.rglob("*.py")) + sorted(ADAPTER.rglob("*.py"))
KNOWN = {_module_name(p) for p in SOURCES}


def test_the_sources_are_found() -> None:
    assert {"pdactors.core.send_table", "pdactors.wire", "pdactors", "pdactors.cli"} <= KNOWN
    assert {"pdactors_vllm.connector", "pdactors_vllm.scheduler_side"} <= KNOWN
    assert PURE_ADAPTER <= KNOWN


@pytest.mark.parametrize("path", SOURCES, ids=_module_name)
def test_layer_rules(path: Path) -> None:
    assert _problems(_module_name(path), path, KNOWN) == []


def test_every_layer_is_in_one_tier_and_names_modules_that_exist() -> None:
    assert sorted(RANK) == sorted(LAYERS)
    assert sum(len(tier) for tier in TIERS) == len(LAYERS)
    named = [name for names in LAYERS.values() for name in names]
    assert len(named) == len(set(named))
    assert set(named) <= KNOWN, set(named) - KNOWN
    used = {layer_of(name) for name in KNOWN}  # (a module of none: test_layer_rules)
    assert set(LAYERS) <= used, set(LAYERS) - used


#: (module, its source, what the checker says of it): one made-up module per rule.
BROKEN = [
    ("pdactors.core.new", "def f():\n    import trio\n", "does IO: it imports ['trio']"),
    ("pdactors.core.new", "import pdactors.actors.sender\n", "(actors), a layer above it"),
    ("pdactors.actors.new", "from pdactors import Layout\n", "pdactors (api), a layer above"),
    ("pdactors.transport.new", "from pdactors.dataplane import DataPlane\n", "layer beside"),
    ("pdactors.config", "from pdactors import _once\n", "(support), a layer beside it"),
    ("pdactors.proxy.new", "from pdactors.core import plan\n", "the proxy touches KV"),
    ("pdactors.proxy.new", "from pdactors.transport.base import T\n", "the proxy touches KV"),
    ("pdactors.testing.new", "import torch\n", "imports ['torch']"),
    ("pdactors_vllm.new", "from pdactors.proxy import serve_proxy\n", "the adapter imports"),
    ("pdactors._cli_tools", "import pdactors.deploy\n", "import pdactors.deploy: pdactors._cli"),
    ("pdactors_vllm.scheduler_side", "import threading\n", "does IO"),
    ("pdactors.newmodule", "", "belongs to no layer: add it to LAYERS"),
    ("pdactors_vllm.new", "import pdactors.newmodule\n", "newmodule, which belongs to no layer"),
]


@pytest.mark.parametrize(("name", "text", "said"), BROKEN, ids=[f"{n}:{s}" for n, _, s in BROKEN])
def test_the_rules_catch_a_violation(tmp_path: Path, name: str, text: str, said: str) -> None:
    """The checker itself, on a made-up module: each rule is seen, in a lazy import too."""
    source = tmp_path / "mod.py"
    source.write_text(text)
    problems = _problems(name, source, KNOWN | {name})
    assert len(problems) == 1 and said in problems[0], problems


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("pdactors.actors.new", "import msgspec\n\ndef f():\n    import trio\n    import os\n"),
        ("pdactors.actors.new", "from pdactors import timeline\n"),  # a module, not the API
        ("pdactors.proxy.new", "from pdactors.core import placement\n"),
        ("pdactors_vllm.new", "import torch\nfrom pdactors import Layout\n"),
        ("pdactors.cli", "from pdactors.deploy import launch_command\n"),
    ],
)
def test_the_rules_let_a_lawful_module_be(tmp_path: Path, name: str, text: str) -> None:
    source = tmp_path / "mod.py"
    source.write_text(text)
    assert _problems(name, source, KNOWN | {name}) == []


def test_the_deploy_rule_sees_its_package() -> None:
    """The rule above is not vacuous: the deploy package exists and ``cli`` imports it."""
    assert {f"{DEPLOY}.command", f"{DEPLOY}.plan", f"{DEPLOY}.k8s"} <= KNOWN
    assert any(_under(m, DEPLOY) for m in _imports(PACKAGE / "cli.py"))


def _module_level_imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports when it is imported (type-checking-only
    imports included: they must not form a cycle either; imports inside functions excluded)."""
    found: set[str] = set()
    name = _module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If | ast.Try):
            nodes.extend(node.body + node.orelse + getattr(node, "finalbody", []))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, name, path.name == "__init__.py")
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
    return found & known


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = {_module_name(p): _module_level_imports(p, KNOWN) for p in SOURCES}
    assert "pdactors.proxy._completions" in graph["pdactors.proxy._app"]  # the walk reads imports
    assert "pdactors_vllm.request_marks" in graph["pdactors_vllm.scheduler_side"]
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " → ".join((*path[path.index(name) :], name))
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("path", SOURCES, ids=_module_name)
def test_no_module_is_over_the_line_limit(path: Path) -> None:
    key = path.relative_to(ROOT).as_posix()
    if key not in OVER_MAX_LINES:
        assert _lines(path) <= MAX_LINES, f"{key}: {_lines(path)} lines; give a job its module"


def test_each_line_limit_exception_is_still_needed() -> None:
    for key in OVER_MAX_LINES:
        assert _lines(ROOT / key) > MAX_LINES, f"{key} fits now: remove its exception"


def test_only_the_proxys_tracing_module_imports_opentelemetry() -> None:
    """OpenTelemetry is optional (``pdactors[tracing]``) and costs nothing when off: one
    module of the library names it, and imports it in functions only (its module-level
    imports are for type checking); tests/test_tracing.py runs the proxy off without it."""
    importers = {
        _module_name(p)
        for p in PACKAGE.rglob("*.py")
        if any(m.startswith("opentelemetry") for m in _imports(p))
    }
    assert importers == {"pdactors.proxy._tracing"}
    tree = ast.parse((PACKAGE / "proxy" / "_tracing.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not any(n.startswith("opentelemetry") for n in names), ast.dump(node)
