"""bench/mutate_core.py's mutator (issue 40), without running a mutant: which changes it makes,
that each one compiles and changes the module, and that its map of tests names real files."""

from __future__ import annotations

import ast
from pathlib import Path

from bench.mutate_core import CORE, ROOT, TESTS, find_mutants, mutant_code, mutated_tree

SOURCE = '''
T = {
    (A, E.X): (B, Do.ONE),
    (B, E.Y): (None, Do.TWO),
}
LIMIT = 64


def f(x, log):
    """Not mutated."""
    log.info("x %d", 3)
    if x < 2 and x.ready:
        x.state = None
    return min(x, 1)
'''


def test_the_mutants_of_a_table_and_a_function() -> None:
    assert [(line, what) for line, what, _ in find_mutants(SOURCE)] == [
        (3, "T[(A, E.X)]: removed"),
        (3, "T[(A, E.X)]: B → None"),  # the next state the table names (a key's included)
        (3, "T[(A, E.X)]: Do.ONE → Do.TWO"),  # the next effect
        (4, "T[(B, E.Y)]: removed"),
        (4, "T[(B, E.Y)]: None → A"),
        (4, "T[(B, E.Y)]: Do.TWO → Do.ONE"),
        # a named constant, the docstring and the log line are left alone
        (12, "`x < 2 and x.ready`: and ↔ or"),
        (12, "`x < 2`: < → <="),
        (12, "`2` → `3` in `x < 2`"),
        (13, "drop `x.state = None`"),
        (14, "`min(x, 1)`: min → max"),
        (14, "`1` → `2` in `min(x, 1)`"),
    ]


def test_every_mutant_of_a_table_compiles_and_changes_the_module() -> None:
    path = CORE / "exchange_rules.py"
    source = path.read_text()
    original = ast.dump(ast.parse(source))
    found = find_mutants(source)
    assert len(found) > 40
    for index in range(len(found)):
        assert ast.dump(mutated_tree(source, index)) != original, found[index][1]
        mutant_code(path, index)


def test_every_mutated_module_and_test_file_exists() -> None:
    for module, args in TESTS.items():
        assert (CORE / f"{module}.py").is_file(), module
        files = [a for a in args if a.endswith(".py")]
        assert files and all(Path(ROOT / f).is_file() for f in files), (module, files)
