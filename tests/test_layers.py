"""The import rules between the layers, checked on the source (every import, lazy ones too).

* The core (pure state machines and arithmetic) and the wire types import no IO: no trio, no
  sockets, no threads, no environment.
* Nothing in ``pdactors`` imports vLLM or torch; only ``integrations/vllm`` does.
* The proxy never touches KV: it imports neither the data plane, nor the block plans, nor the
  side channel's transports.
* The lower layers never import the ones above them. Bottom up: ``wire`` (the types on every
  wire), ``core`` (the tables), ``transport`` / ``dataplane`` / ``web`` (side channel, KV bytes,
  HTTP serving), ``actors`` (sender, receiver, bootstrap), ``proxy``, ``deploy``.
* The deployment tooling (``pdactors.deploy``) is the top: nothing in the library imports it but
  ``pdactors.cli``, the edge that reads argv.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pdactors"

IO_MODULES = frozenset(
    {"trio", "zmq", "socket", "threading", "subprocess", "asyncio", "os", "httpx", "h11"}
    | {"mooncake", "selectors", "signal", "multiprocessing"}
)
NEVER_IN_PDACTORS = frozenset({"vllm", "torch"})
KV_MODULES = ("pdactors.dataplane", "pdactors.core.plan", "pdactors.core.tp", "pdactors.transport")

# (package prefix, imports it must not make): a prefix matches the module and its submodules.
_IO_LAYERS = ("pdactors.transport", "pdactors.dataplane", "pdactors.web")
_TOP = ("pdactors.actors", "pdactors.proxy", "pdactors.deploy", "pdactors.testing")
UPWARD = {
    "pdactors.wire": ("pdactors.core", *_IO_LAYERS, *_TOP),
    "pdactors.core": (*_IO_LAYERS, *_TOP),
    "pdactors.transport": ("pdactors.dataplane", "pdactors.web", *_TOP),
    "pdactors.dataplane": ("pdactors.transport", "pdactors.web", *_TOP),
    "pdactors.web": ("pdactors.transport", "pdactors.dataplane", *_TOP),
    "pdactors.actors": ("pdactors.deploy", "pdactors.testing", "pdactors.proxy"),
    "pdactors.proxy": ("pdactors.deploy", "pdactors.testing"),
}
DEPLOY = "pdactors.deploy"
DEPLOY_IMPORTED_BY = frozenset({"pdactors.cli"})  # besides its own modules


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute, wherever the import statement sits."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                name = _module_name(path)
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_the_sources_are_found() -> None:
    names = {_module_name(p) for p in SOURCES}
    assert {"pdactors.core.send_table", "pdactors.core.pull_table", "pdactors.wire"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: _module_name(p))
def test_layer_rules(path: Path) -> None:
    name = _module_name(path)
    imports = _imports(path)
    roots = {m.split(".")[0] for m in imports}
    assert not roots & NEVER_IN_PDACTORS, f"{name} imports {roots & NEVER_IN_PDACTORS}"
    if _under(name, "pdactors.core") or _under(name, "pdactors.wire"):
        assert not roots & IO_MODULES, f"{name} does IO: it imports {roots & IO_MODULES}"
    if _under(name, "pdactors.proxy"):
        touching = {m for m in imports for kv in KV_MODULES if _under(m, kv)}
        assert not touching, f"the proxy touches KV: {name} imports {touching}"
    for prefix, banned in UPWARD.items():
        if _under(name, prefix):
            upward = {m for m in imports for b in banned if _under(m, b)}
            assert not upward, f"{name} imports a layer above it: {upward}"
    if not _under(name, DEPLOY) and name not in DEPLOY_IMPORTED_BY:
        deploy = {m for m in imports if _under(m, DEPLOY)}
        assert not deploy, f"only {sorted(DEPLOY_IMPORTED_BY)} import {DEPLOY}: {name} does"


def test_the_deploy_rule_sees_its_package() -> None:
    """The rule above is not vacuous: the deploy package exists and ``cli`` imports it."""
    names = {_module_name(p) for p in SOURCES}
    assert {f"{DEPLOY}.command", f"{DEPLOY}.plan", f"{DEPLOY}.k8s"} <= names
    assert any(_under(m, DEPLOY) for m in _imports(PACKAGE / "cli.py"))


def test_the_rules_catch_a_violation(tmp_path: Path) -> None:
    """The checker itself: an IO import in a core-like module is seen, a lazy one too."""
    source = tmp_path / "mod.py"
    source.write_text("import msgspec\n\ndef f():\n    import trio\n    from os import path\n")
    found = {m.split(".")[0] for m in _imports(source)}
    assert {"trio", "os"} <= found & IO_MODULES


def _module_level_imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports when it is imported (type-checking-only
    imports included: they must not form a cycle either; imports inside functions excluded)."""
    found: set[str] = set()
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If | ast.Try):
            nodes.extend(node.body + node.orelse + getattr(node, "finalbody", []))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, node.module] if node.module else parts)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
    return found & known


def test_no_module_imports_one_that_imports_it_back() -> None:
    known = {_module_name(p) for p in SOURCES}
    graph = {_module_name(p): _module_level_imports(p, known) for p in SOURCES}
    assert "pdactors.proxy._completions" in graph["pdactors.proxy._app"]  # the walk reads imports
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


def test_only_the_proxys_tracing_module_imports_opentelemetry() -> None:
    """OpenTelemetry is optional (``pdactors[tracing]``) and costs nothing when off: one
    module of the library names it, and imports it in functions only (its module-level
    imports are for type checking); tests/test_tracing.py runs the proxy off without it."""
    importers = {
        _module_name(p) for p in SOURCES if any(m.startswith("opentelemetry") for m in _imports(p))
    }
    assert importers == {"pdactors.proxy._tracing"}
    tree = ast.parse((PACKAGE / "proxy" / "_tracing.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not any(n.startswith("opentelemetry") for n in names), ast.dump(node)
