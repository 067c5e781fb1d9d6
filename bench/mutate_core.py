"""Mutation check of pdactors/core (issue 40): how many small breaks of the core's tables and
rules its fast tests catch.

A mutant is one small change to one module of ``pdactors/core``, made on its syntax tree:

* a table entry (a module-level dict literal, or one merged into a table with ``|=``): removed;
  its next state (the value, or the value's first item) replaced by the next state the table
  names (in the order it names them, a key's state included); its effect (any further item of
  the value) by the next effect it uses; an item removed from a module-level set literal;
* a comparison flipped (``<`` → ``<=``, ``==`` → ``!=``, ``is`` → ``is not``, ``in`` → ``not
  in`` …), ``and`` ↔ ``or``, a ``not`` dropped, the condition of an ``if``/``while``/``x if c
  else y``/comprehension negated, ``min`` ↔ ``max``, ``+`` ↔ ``-`` (and ``*`` ↔ ``//``), a
  number + 1, ``True`` ↔ ``False``;
* inside a function, a statement with an effect replaced by ``pass``: a call, an assignment to an
  attribute or item, ``+=``, ``del``, ``raise``.

Left alone: docstrings, strings, annotations, ``__all__``, log calls, and module-level named
constants (``MAX_BLOCKS = 64``: tests rightly name them, not their value).

Each mutant runs the module's tests (:data:`TESTS`, the fast sans-IO ones) with ``-x``: a
failure, an error or a timeout kills it; a pass means it survived, which points at a rule no
test pins. The tree is copied once to a temporary directory; each run is a fork of this process
(pytest, trio and hypothesis already imported, pdactors not) that serves the mutated module
through an import hook, so nothing is written to the working tree. Hypothesis runs derandomized
with no example database, so a score repeats.

    python bench/mutate_core.py                     # every module, 2 at a time: 15-27 min here
    python bench/mutate_core.py exchange_rules pull_rules send_rules --survivors  # 1.6 min
    python bench/mutate_core.py --list              # count the mutants, run nothing
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "pdactors" / "core"

_PULL = ["tests/test_pull_rules.py", "tests/test_pull_table.py", "tests/test_pull_fences.py"]
_SEND = ["tests/test_send_rules.py", "tests/test_send_table.py", "tests/test_pull_fences.py"]

#: Module of pdactors/core → pytest's arguments for the tests that run against its mutants (the
#: most pointed first: ``-x`` stops at the first failure). Modules not here are not mutated.
TESTS: dict[str, list[str]] = {
    "exchange_rules": ["tests/test_exchange.py"],
    "exchange": ["tests/test_exchange.py"],
    "exchange_next": ["tests/test_exchange.py"],
    "exchange_answer": ["tests/test_exchange.py"],
    "exchange_effects": ["tests/test_exchange.py"],
    "pull_rules": _PULL,
    "pull_records": [*_PULL, "tests/test_epochs.py"],
    "pull_table": [*_PULL, "tests/test_epochs.py"],
    "send_rules": _SEND,
    "send_stream": _SEND,
    "send_records": [*_SEND, "tests/test_epochs.py"],
    "send_moves": [*_SEND, "tests/test_epochs.py"],
    "send_timers": [*_SEND, "tests/test_sender_deadlines.py"],
    "send_table": [*_SEND, "tests/test_epochs.py"],
    "epochs": ["tests/test_epochs.py"],
    "placement": ["tests/test_placement.py"],
    "prefixes": ["tests/test_prefix_routing.py"],
    "registry": [
        *("tests/test_rank_leases.py", "tests/test_bootstrap.py", "tests/test_http_doors.py"),
        "tests/test_compat.py",
        *("-k", "test_rank_leases or test_compat or registry or lease or expir or bounded"),
    ],
    "compat": ["tests/test_compat.py"],
    "plan": ["tests/test_plan.py"],
    "tp": ["tests/test_plan.py"],
}

#: Never imported here: each fork imports them, with the mutant in place.
OURS = ("pdactors", "pdactors_vllm", "tests", "bench")

_COMPARE: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_ARITH: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult,
}
_SYMBOL = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.FloorDiv: "//",
    ast.Div: "/",
}
_LOGGERS = ("log", "_log", "logger", "_logger", "LOG")
_SKIP_FIELDS = ("annotation", "returns", "type_comment", "decorator_list")


@dataclass(frozen=True)
class Mutant:
    module: str
    index: int  # its place in the order :func:`find_mutants` yields them for the module
    line: int
    what: str


Apply = Callable[[], None]


def _short(node: ast.AST, limit: int = 70) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _is_log_call(node: ast.AST) -> bool:
    call = node.value if isinstance(node, ast.Expr) else node
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id in _LOGGERS
    )


def _is_field_option(node: ast.AST, parent: ast.AST) -> bool:
    """``compare=False`` in ``field(...)``: how a dataclass shows a field, not a rule."""
    return (
        isinstance(node, ast.keyword)
        and isinstance(parent, ast.Call)
        and isinstance(parent.func, ast.Name)
        and parent.func.id == "field"
        and node.arg != "default"
    )


def _names(targets: Sequence[ast.expr]) -> set[str]:
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _set_in(parent: ast.AST, field: str, index: int | None, new: ast.AST) -> None:
    if index is None:
        setattr(parent, field, new)
    else:
        getattr(parent, field)[index] = new


class _Finder:
    """Every mutation point of one module's tree, in a fixed order (a fresh parse of the same
    source yields the same list, so a mutant is its index)."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str, Apply]] = []

    def add(self, line: int, what: str, apply: Apply) -> None:
        self.found.append((line, what, apply))

    def module(self, tree: ast.Module) -> None:
        self.body(tree, "body", in_def=False)

    def body(self, parent: ast.AST, field: str, *, in_def: bool) -> None:
        stmts: list[ast.stmt] = getattr(parent, field)
        for i, stmt in enumerate(stmts):
            if in_def and self._has_effect(stmt):
                self.add(stmt.lineno, f"drop `{_short(stmt)}`", self._drop(stmts, i))
            self.stmt(stmt, in_def=in_def)

    @staticmethod
    def _has_effect(stmt: ast.stmt) -> bool:
        if isinstance(stmt, ast.Expr):
            return isinstance(stmt.value, ast.Call) and not _is_log_call(stmt)
        if isinstance(stmt, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            return isinstance(stmt, ast.AugAssign) or any(
                isinstance(t, ast.Attribute | ast.Subscript) for t in targets
            )
        return isinstance(stmt, ast.Delete | ast.Raise)

    @staticmethod
    def _drop(stmts: list[ast.stmt], i: int) -> Apply:
        def apply() -> None:
            stmts[i] = ast.copy_location(ast.Pass(), stmts[i])

        return apply

    def stmt(self, stmt: ast.stmt, *, in_def: bool) -> None:
        if isinstance(stmt, ast.Expr) and (
            isinstance(stmt.value, ast.Constant) or _is_log_call(stmt)
        ):
            return  # a docstring, a log line
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            return
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            return
        if not in_def and isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if "__all__" in _names(targets):
                return
            if isinstance(stmt.value, ast.Constant):
                return  # a named constant
            if isinstance(stmt.value, ast.Dict):
                self.table(stmt.value, _short(targets[0], 30))
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            self.body(stmt, "body", in_def=True)
            return
        for field, value in ast.iter_fields(stmt):
            if field in _SKIP_FIELDS:
                continue
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self.body(stmt, field, in_def=in_def)
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, ast.excepthandler):
                        self.body(item, "body", in_def=in_def)
                    elif isinstance(item, ast.AST):
                        self.expr(item, stmt, field, i)
            elif isinstance(value, ast.AST):
                self.expr(value, stmt, field, None)

    def table(self, table: ast.Dict, name: str) -> None:
        """Each entry removed; its next state, and its effect, replaced by the next one."""
        width = {len(v.elts) if isinstance(v, ast.Tuple) else 1 for v in table.values}
        items = width.pop() if len(width) == 1 else 1

        def part(node: ast.expr, k: int) -> ast.expr:
            return node.elts[k] if items > 1 and isinstance(node, ast.Tuple) else node

        pools: list[list[str]] = []
        for k in range(items):
            seen = [ast.unparse(part(v, k)) for v in table.values]
            if k == 0:  # the states a key starts from are states too
                seen += [
                    ast.unparse(key.elts[0])
                    for key in table.keys
                    if isinstance(key, ast.Tuple) and key.elts
                ]
            pools.append(list(dict.fromkeys(seen)))
        for i, (key, value) in enumerate(zip(table.keys, table.values, strict=True)):
            if key is None:
                continue
            entry = f"{name}[{_short(key, 60)}]"
            self.add(key.lineno, f"{entry}: removed", self._remove_entry(table, i))
            for k in range(items):
                now = ast.unparse(part(value, k))
                pool = pools[k]
                others = [pool[(pool.index(now) + 1) % len(pool)]] if len(pool) > 1 else []
                for other in others:
                    self.add(
                        value.lineno,
                        f"{entry}: {now} → {other}",
                        self._replace_part(table, i, k if items > 1 else None, other),
                    )

    @staticmethod
    def _remove_entry(table: ast.Dict, i: int) -> Apply:
        def apply() -> None:
            del table.keys[i]
            del table.values[i]

        return apply

    @staticmethod
    def _replace_part(table: ast.Dict, i: int, k: int | None, source: str) -> Apply:
        def apply() -> None:
            new = ast.parse(source, mode="eval").body
            value = table.values[i]
            if k is None:
                table.values[i] = ast.copy_location(new, value)
            else:
                assert isinstance(value, ast.Tuple)
                value.elts[k] = ast.copy_location(new, value.elts[k])

        return apply

    def expr(self, node: ast.AST, parent: ast.AST, field: str, index: int | None) -> None:
        if _is_log_call(node) or _is_field_option(node, parent):
            return
        self.mutate(node, parent, field, index)
        if isinstance(node, ast.Lambda):
            self.expr(node.body, node, "body", None)
            return
        for child_field, value in ast.iter_fields(node):
            if child_field in _SKIP_FIELDS:
                continue
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, ast.AST):
                        self.expr(item, node, child_field, i)
            elif isinstance(value, ast.AST):
                self.expr(value, node, child_field, None)

    def mutate(self, node: ast.AST, parent: ast.AST, field: str, index: int | None) -> None:
        line = getattr(node, "lineno", getattr(parent, "lineno", 0))
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                new = _COMPARE[type(op)]
                what = f"`{_short(node)}`: {_SYMBOL[type(op)]} → {_SYMBOL[new]}"
                self.add(line, what, self._set_op(node.ops, i, new))
        elif isinstance(node, ast.BoolOp):
            new_bool = ast.Or if isinstance(node.op, ast.And) else ast.And
            what = f"`{_short(node)}`: and ↔ or"
            self.add(line, what, self._set_attr(node, "op", new_bool()))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            what = f"`{_short(node)}`: not dropped"
            self.add(line, what, self._replace(parent, field, index, node.operand))
        elif isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            new_op = _ARITH[type(node.op)]
            what = f"`{_short(node)}`: {_SYMBOL[type(node.op)]} → {_SYMBOL[new_op]}"
            self.add(line, what, self._set_attr(node, "op", new_op()))
        elif isinstance(node, ast.AugAssign) and type(node.op) in _ARITH:
            new_op = _ARITH[type(node.op)]
            what = f"`{_short(node)}`: {_SYMBOL[type(node.op)]}= → {_SYMBOL[new_op]}="
            self.add(line, what, self._set_attr(node, "op", new_op()))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            swap = {"min": "max", "max": "min"}.get(node.func.id)
            if swap:
                what = f"`{_short(node)}`: {node.func.id} → {swap}"
                self.add(line, what, self._set_attr(node.func, "id", swap))
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            what = f"`{node.value}` → `{not node.value}` in `{_short(parent)}`"
            self.add(line, what, self._set_attr(node, "value", not node.value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            what = f"`{node.value}` → `{node.value + 1}` in `{_short(parent)}`"
            self.add(line, what, self._set_attr(node, "value", node.value + 1))
        elif isinstance(node, ast.Set) and isinstance(parent, ast.Call | ast.Assign):
            for i, elt in enumerate(node.elts):
                self.add(line, f"`{_short(elt)}` removed from `{_short(node)}`", self._pop(node, i))
        if (
            field in ("test", "ifs")
            and isinstance(node, ast.expr)
            and not isinstance(node, ast.Compare | ast.BoolOp | ast.UnaryOp | ast.Constant)
        ):
            negated = ast.UnaryOp(op=ast.Not(), operand=node)
            self.add(
                line, f"`{_short(node)}`: negated", self._replace(parent, field, index, negated)
            )

    @staticmethod
    def _set_op(ops: list[ast.cmpop], i: int, new: type[ast.cmpop]) -> Apply:
        def apply() -> None:
            ops[i] = new()

        return apply

    @staticmethod
    def _set_attr(node: ast.AST, attr: str, value: object) -> Apply:
        def apply() -> None:
            setattr(node, attr, value)

        return apply

    @staticmethod
    def _replace(parent: ast.AST, field: str, index: int | None, new: ast.AST) -> Apply:
        def apply() -> None:
            _set_in(parent, field, index, new)

        return apply

    @staticmethod
    def _pop(node: ast.Set, i: int) -> Apply:
        def apply() -> None:
            del node.elts[i]

        return apply


def find_mutants(source: str) -> list[tuple[int, str, Apply]]:
    """The mutation points of ``source``: (line, what, apply) for a tree parsed from it; each
    ``apply`` changes that tree only."""
    tree = ast.parse(source)
    finder = _Finder()
    finder.module(tree)
    return finder.found


def mutated_tree(source: str, index: int) -> ast.Module:
    """``source`` parsed, with its ``index``-th mutation applied."""
    tree = ast.parse(source)
    finder = _Finder()
    finder.module(tree)
    finder.found[index][2]()
    return ast.fix_missing_locations(tree)


def mutant_code(path: Path, index: int) -> types.CodeType:
    """The code of ``path`` with its ``index``-th mutation applied."""
    return compile(mutated_tree(path.read_text(), index), str(path), "exec")


class _Serve(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves one module's mutated code in place of its file."""

    def __init__(self, fullname: str, path: str, code: types.CodeType) -> None:
        self.fullname, self.path, self.code = fullname, path, code

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.fullname:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=self.path)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__file__ = self.path
        exec(self.code, module.__dict__)


def _child(
    tree: Path, module: str, code: types.CodeType | None, tests: list[str], log: Path
) -> int:
    """In the fork: run ``tests`` in the copied tree with ``code`` served as ``module``."""
    import hypothesis
    import pytest

    os.setpgid(0, 0)
    sink = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(sink, 1)
    os.dup2(sink, 2)
    os.chdir(tree)
    sys.path.insert(0, str(tree))
    sys.dont_write_bytecode = False  # the copy's own caches: each fork after the first reads them
    if code is not None:
        path = str(tree / "pdactors" / "core" / f"{module}.py")
        sys.meta_path.insert(0, _Serve(f"pdactors.core.{module}", path, code))
    hypothesis.settings.register_profile("mutants", database=None, derandomize=True)
    hypothesis.settings.load_profile("mutants")
    args = ["-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-o", "addopts="]
    # hypothesis and pytest_trio were imported before pytest could rewrite their asserts
    args += ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    return int(pytest.main([*args, "--rootdir", str(tree), *tests]))


@dataclass
class _Running:
    pid: int
    mutant: Mutant | None
    started: float


def run_all(
    tree: Path, jobs: Sequence[tuple[Mutant | None, str]], *, parallel: int, timeout: float
) -> Iterator[tuple[Mutant | None, str, int, float, Path]]:
    """Run each (mutant, module) — ``None``: the module unmutated — in a fork; yield (mutant,
    module, exit status, seconds, its output) as each ends: -1 for a timeout."""
    pending = list(reversed(jobs))
    running: dict[int, tuple[_Running, str]] = {}
    while pending or running:
        while pending and len(running) < parallel:
            mutant, module = pending.pop()
            code = mutant_code(CORE / f"{module}.py", mutant.index) if mutant else None
            pid = os.fork()
            if pid == 0:  # the fork
                rc = 3
                try:
                    rc = _child(tree, module, code, TESTS[module], _log(tree, os.getpid()))
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(rc)
            running[pid] = (_Running(pid, mutant, time.monotonic()), module)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for run, module in list(running.values()):
                if now - run.started > timeout:
                    os.killpg(run.pid, signal.SIGKILL)
                    os.waitpid(run.pid, 0)
                    del running[run.pid]
                    yield run.mutant, module, -1, now - run.started, _log(tree, run.pid)
                    _log(tree, run.pid).unlink(missing_ok=True)
            time.sleep(0.01)
            continue
        run, module = running.pop(pid)
        rc = os.waitstatus_to_exitcode(status)
        yield run.mutant, module, rc, time.monotonic() - run.started, _log(tree, pid)
        _log(tree, pid).unlink(missing_ok=True)


def warm_up(modules: Sequence[str]) -> None:
    """Import here every module that the tests of ``modules`` import, except ours, so that each
    fork starts warm."""
    tests = sorted({t for m in modules for t in TESTS[m] if t.endswith(".py")})
    names = [t.removesuffix(".py").replace("/", ".") for t in tests]
    probe = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); import pytest, hypothesis, pytest_trio; "
        f"import tests.conftest, {', '.join(names)}; print(' '.join(sys.modules))"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in found:
        if name.split(".")[0] not in OURS and name != "__main__":
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def _log(tree: Path, pid: int) -> Path:
    """Where the fork ``pid`` writes its output (deleted once its fate is known)."""
    return tree.parent / f"{pid}.log"


def copy_tree(into: Path) -> Path:
    tree = into / "tree"
    skip = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache", "vllm")
    for part in ("pdactors", "tests"):
        shutil.copytree(ROOT / part, tree / part, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"of {', '.join(TESTS)} (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=0, help="s per run (default 5 x clean)")
    parser.add_argument("--list", action="store_true", help="count the mutants, run nothing")
    parser.add_argument("--survivors", action="store_true", help="print every survivor")
    parser.add_argument("--json", type=Path, help="write every mutant and its fate here")
    opts = parser.parse_args()
    modules = opts.modules or list(TESTS)
    unknown = [m for m in modules if m not in TESTS]
    if unknown:
        parser.error(f"not mutated: {unknown}")

    mutants: dict[str, list[Mutant]] = {}
    for module in modules:
        found = find_mutants((CORE / f"{module}.py").read_text())
        mutants[module] = [Mutant(module, i, line, what) for i, (line, what, _) in enumerate(found)]
    if opts.list:
        for module, ms in mutants.items():
            print(f"{module:16} {len(ms):5}")
        print(f"{'total':16} {sum(map(len, mutants.values())):5}")
        return

    warm_up(modules)
    assert not any(m.split(".")[0] in OURS for m in sys.modules)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutate_core.") as tmp:
        tree = copy_tree(Path(tmp))
        clean: dict[str, float] = {}
        for _, module, rc, took, log in run_all(
            tree, [(None, m) for m in modules], parallel=opts.jobs, timeout=600
        ):
            if rc != 0:
                print(log.read_text()[-3000:])
                sys.exit(f"{module}: its tests fail unmutated (exit {rc}); fix that first")
            clean[module] = took
        timeout = opts.timeout or max(20.0, 5 * max(clean.values()))
        print(f"clean runs pass ({', '.join(f'{m} {s:.1f}s' for m, s in clean.items())});")
        print(f"timeout {timeout:.0f}s per mutant, {opts.jobs} at a time")
        jobs = [(mutant, m) for m in modules for mutant in mutants[m]]
        fate: dict[Mutant, str] = {}
        for n, (mutant, _, rc, _, log) in enumerate(
            run_all(tree, jobs, parallel=opts.jobs, timeout=timeout), 1
        ):
            assert mutant is not None
            if rc in (3, 4, 5):
                print(log.read_text()[-3000:])
                sys.exit(f"{mutant}: pytest could not run it (exit {rc}): a bug here")
            fate[mutant] = "survived" if rc == 0 else "timeout" if rc == -1 else "killed"
            if n % 100 == 0:
                print(f"  {n}/{len(jobs)} run, {time.monotonic() - started:.0f}s", flush=True)

    print(f"\n{'module':16} {'killed':>7} {'total':>6} {'score':>6}")
    total_killed = 0
    for module, ms in mutants.items():
        killed = sum(fate[m] != "survived" for m in ms)
        total_killed += killed
        print(f"{module:16} {killed:7} {len(ms):6} {killed / max(len(ms), 1):6.1%}")
    total = sum(map(len, mutants.values()))
    print(f"{'all':16} {total_killed:7} {total:6} {total_killed / max(total, 1):6.1%}")
    print(f"{time.monotonic() - started:.0f}s")
    survivors = [m for ms in mutants.values() for m in ms if fate[m] == "survived"]
    if opts.survivors and survivors:
        print("\nsurvivors:")
        for m in survivors:
            print(f"  pdactors/core/{m.module}.py:{m.line}: {m.what}")
    if opts.json:
        rows = [{**vars(m), "fate": fate[m]} for ms in mutants.values() for m in ms]
        opts.json.write_text(json.dumps(rows, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
