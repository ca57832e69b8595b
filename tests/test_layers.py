"""The layers of ``delayq/`` (docs/internals.md): no import cycle, and the backend layer at the bottom.

The imports are read from the source with ``ast``: module-level imports, imports inside functions and
imports under ``if TYPE_CHECKING:`` all count, since each of them ties two modules together. A last test
imports every module on its own, in a fresh interpreter, with the package's ``__init__`` left out: the
order in which ``delayq/__init__.py`` happens to import its modules hides a cycle between a module and a
package's ``__init__``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import delayq

PACKAGE = Path(delayq.__file__).parent

LEAVES = {"delayq.errors", "delayq.clock", "delayq.schema", "delayq.serializers", "delayq.humanize"}
"""The bottom of the stack (DESIGN.md "Layout"): they import no other delayq module but each other and
``delayq.dialects.types``, the column types whose DDL differs per backend (a leaf of the dialects)."""

DIALECT_LEAVES = {"delayq.dialects.types", "delayq.dialects._pg_listen"}
"""Modules of ``delayq.dialects`` that import nothing of delayq."""


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("delayq", *path.relative_to(PACKAGE).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


MODULES = _module_names()


def _imported(module: str, path: Path) -> set[tuple[str, int]]:
    """The delayq modules ``module`` imports, anywhere in its source, each with a line that does."""
    is_package = path.name == "__init__.py"
    found: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                anchor = here[: len(here) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            # ``from a import b`` imports the module a.b when there is one, else a name of a.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for target in targets:
            while target and target not in MODULES:  # ``import a.b.c`` of a name: its module
                target = target.rpartition(".")[0]
            if target.startswith("delayq") and target != module:
                found.add((target, node.lineno))
    return found


GRAPH = {m: _imported(m, p) for m, p in MODULES.items()}


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in {t for t, _ in GRAPH[v]}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def _edges_within(component: list[str]) -> list[str]:
    inside = set(component)
    return [f"{m} -> {t} (line {line})" for m in component for t, line in sorted(GRAPH[m]) if t in inside]


def test_the_graph_sees_imports_in_functions_and_under_type_checking() -> None:
    """The reader is not blind to the imports that used to hold cycles apart."""
    assert "delayq.cli._app" in {t for t, _ in GRAPH["delayq.cli"]}  # imported inside a function
    assert "delayq.migrations" in {t for t, _ in GRAPH["delayq.cli._setup"]}  # the module, not the package
    assert "delayq.schema" in {t for t, _ in GRAPH["delayq.dialects.base"]}  # under TYPE_CHECKING
    assert "delayq.topics._status" in {t for t, _ in GRAPH["delayq.topics.statements"]}


def test_no_import_cycle_inside_delayq() -> None:
    cycles = _cycles()
    assert not cycles, "import cycles:\n" + "\n".join("  " + "; ".join(_edges_within(c)) for c in cycles)


def test_the_dialects_import_nothing_above_them() -> None:
    upward = [
        f"{m} -> {t} (line {line})"
        for m in GRAPH
        if m.startswith("delayq.dialects")
        for t, line in sorted(GRAPH[m])
        if not t.startswith("delayq.dialects") and t not in LEAVES
    ]
    assert not upward, "delayq.dialects imports modules above it:\n" + "\n".join(upward)


DRIVERS = {"delayq.worker", "delayq.aio", "delayq.aio.worker", "delayq.cli", "delayq"}
"""What sits above the runtime core (DESIGN.md "Layout"): its two drivers and what uses them."""


def test_the_runtime_core_imports_neither_driver() -> None:
    """``delayq/runtime/`` is below ``Worker`` and ``AsyncWorker``: they compose it, it knows neither."""
    upward = [
        f"{m} -> {t} (line {line})"
        for m in GRAPH
        if m.startswith("delayq.runtime")
        for t, line in sorted(GRAPH[m])
        if t in DRIVERS or t.startswith(("delayq.aio", "delayq.cli"))
    ]
    assert not upward, "delayq.runtime imports a driver:\n" + "\n".join(upward)


@pytest.mark.parametrize("leaf", sorted(LEAVES | DIALECT_LEAVES))
def test_the_leaves_import_only_leaves(leaf: str) -> None:
    allowed = LEAVES | {"delayq.dialects.types"} if leaf in LEAVES else set()
    above = sorted(f"{t} (line {line})" for t, line in GRAPH[leaf] if t not in allowed)
    assert not above, f"{leaf} imports " + ", ".join(above)


@pytest.mark.slow  # (subprocesses: the full profile; the fast one stays under 8 minutes)
def test_every_module_imports_on_its_own() -> None:
    """``python -c "import delayq.x"`` works for every module x, whatever was imported before it."""
    script = textwrap.dedent(
        """
        import importlib, sys, types, warnings
        warnings.simplefilter("ignore")
        root, names, failed = sys.argv[1], sys.argv[2:], []
        for name in names:
            for loaded in [k for k in sys.modules if k == "delayq" or k.startswith("delayq.")]:
                del sys.modules[loaded]
            package = types.ModuleType("delayq")  # the package without its __init__'s imports
            package.__path__ = [root]
            sys.modules["delayq"] = package
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if (exc.name or "").partition(".")[0] == "delayq":
                    failed.append(f"{name}: {exc}")
                # else: an optional dependency that is not installed (pyspark, say)
            except ImportError as exc:
                failed.append(f"{name}: {exc}")
        print("\\n".join(failed))
        sys.exit(1 if failed else 0)
        """
    )
    names = sorted(m for m in MODULES if m != "delayq")
    done = subprocess.run(
        [sys.executable, "-c", script, str(PACKAGE), *names], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


STATEMENT_BUILDERS = {"select", "insert", "update", "delete", "union", "union_all", "text"}
"""SQLAlchemy's constructors of statements: ``sa.select(...)`` and the like."""

SQL_HOMES = ("delayq.queue", "delayq.topics", "delayq.dialects")
"""Where statements over delayq's tables are built (docs/internals.md, "Map")."""

OWN_TABLES: dict[str, str] = {
    "delayq.cron._store": "the schedules table is cron's own; the runs go through DelayedQueue's operations",
    "delayq.cron._views": "the schedules table is cron's own; the runs go through delayq.queue._views",
    "delayq.migrations": "Alembic's version table, read to tell the schema's revision",
    "delayq.schema": "no statement: the predicate of the partial priority index (DDL, in sa.text)",
}
"""Modules outside ``SQL_HOMES`` that build statements, each over a table that is not the queue's or a topic's."""


def _statements_built(path: Path) -> list[tuple[str, int]]:
    """The calls ``sa.<builder>(…)`` / ``sqlalchemy.<builder>(…)`` (and of a builder imported by name) in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    by_name = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "sqlalchemy"
        for alias in node.names
        if alias.name in STATEMENT_BUILDERS
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in STATEMENT_BUILDERS and isinstance(f.value, ast.Name):
            if f.value.id in ("sa", "sqlalchemy"):
                found.append((f.attr, node.lineno))
        elif isinstance(f, ast.Name) and f.id in by_name:
            found.append((f.id, node.lineno))
    return found


def test_the_sql_of_the_queue_and_topic_tables_lives_in_the_queue_topics_and_dialects_packages() -> None:
    """Cron, browse, top, the CLI and Spark reach the queue's and the topics' rows through operations of
    ``delayq.queue`` and ``delayq.topics``: they build no statement of their own (but over their own tables)."""
    outside = [
        f"{m} builds sa.{name}() (line {line})"
        for m, path in sorted(MODULES.items())
        if not m.startswith(SQL_HOMES) and m not in OWN_TABLES
        for name, line in _statements_built(path)
    ]
    assert not outside, "statements built outside delayq/queue, delayq/topics, delayq/dialects:\n" + "\n".join(outside)


def test_the_modules_allowed_their_own_statements_still_build_some() -> None:
    """``OWN_TABLES`` holds no stale entry, and the check sees the statements it is about."""
    assert all(why and _statements_built(MODULES[m]) for m, why in OWN_TABLES.items())
    assert "select" in {name for name, _ in _statements_built(MODULES["delayq.queue._views"])}
