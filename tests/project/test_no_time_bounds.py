"""No test asserts an upper bound on a measured elapsed time.

A bound such as ``assert time.monotonic() - t0 < 5.0`` passes on an idle workstation and fails on a
loaded 2-core CI runner, so it tests the machine, not the code. What such a bound means to check is a
behaviour (the call returned the error without retrying, the group formed without the archive peer), a
count (one attempt, not three) or an ordering; a performance claim belongs in a benchmark's key under
``bench/``. Waiting for a condition with a deadline is fine: ``assert time.monotonic() < deadline``
inside the wait loop bounds a clock reading, not a measured duration.

The scan below reads every test module's syntax tree. A value is *measured elapsed time* when it is a
difference whose left side is a clock reading (``time.monotonic()``, ``time.time()``,
``time.perf_counter()``, ``loop.time()``, or a name assigned from one), a name assigned such a value, a
list such values were appended to, a result key or attribute named for a duration (``seconds``,
``elapsed``, ``duration_s``, ``took``, ``wall_s``), or ``max``/``min``/``round``/``float``/``sum`` of one.
An assert that puts such a value on the small side of ``<``/``<=`` (or the large side of ``>``/``>=``)
fails this test.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.pysource import parse_files, parse_sources

TESTS = Path(__file__).resolve().parents[1]

CLOCK_FUNCTIONS = {"monotonic", "time", "perf_counter", "monotonic_ns", "perf_counter_ns", "time_ns"}
"""Attribute or function names whose call reads a clock (``time.monotonic()``, ``loop.time()``)."""

DURATION_NAMES = {"elapsed", "took", "duration", "durations", "seconds", "wall", "wall_s", "spent", "waited"}
"""Names, attributes and result keys that by convention hold a measured duration."""

DURATION_SUFFIXES = ("_elapsed", "_took", "_duration", "_duration_s", "_wall_s")

PASS_THROUGH = {"max", "min", "round", "float", "int", "sum", "abs", "sorted", "median", "mean"}
"""Functions whose result is a duration when their argument is one."""


def _is_clock_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in CLOCK_FUNCTIONS and not node.args


def _duration_name(name: str) -> bool:
    return name in DURATION_NAMES or name.endswith(DURATION_SUFFIXES)


class _Scope(ast.NodeVisitor):
    """One function's (or the module's) clock-valued and duration-valued names, then its bad asserts."""

    def __init__(self) -> None:
        self.clocks: set[str] = set()
        self.durations: set[str] = set()
        self.findings: list[tuple[int, str]] = []

    def is_clock(self, node: ast.AST) -> bool:
        if _is_clock_call(node):
            return True
        if isinstance(node, ast.Name):
            return node.id in self.clocks
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.is_clock(node.left) or self.is_clock(node.right)
        return False

    def is_duration(self, node: ast.AST) -> bool:
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Sub):
                return self.is_clock(node.left) or self.is_duration(node.left)
            if isinstance(node.op, (ast.Add, ast.Mult, ast.Div, ast.FloorDiv)):
                return self.is_duration(node.left) or (
                    isinstance(node.op, (ast.Add, ast.Mult)) and self.is_duration(node.right)
                )
            return False
        if isinstance(node, ast.Name):
            return node.id in self.durations or _duration_name(node.id)
        if isinstance(node, ast.Attribute):
            return _duration_name(node.attr)
        if isinstance(node, ast.Subscript):
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                return _duration_name(key.value)
            return self.is_duration(node.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PASS_THROUGH:
            return any(self.is_duration(arg) for arg in node.args)
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
            return self.is_duration(node.elt)
        if isinstance(node, (ast.List, ast.Tuple)):
            return any(self.is_duration(elt) for elt in node.elts)
        return False

    def _bind(self, target: ast.AST, value: ast.AST) -> None:
        if not isinstance(target, ast.Name):
            return
        if self.is_clock(value):
            self.clocks.add(target.id)
        elif self.is_duration(value):
            self.durations.add(target.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._bind(target, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._bind(node.target, node.value)
        self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self._bind(node.target, node.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        # durations.append(time.monotonic() - t0) makes `durations` a list of measured durations
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in {"append", "extend"}
            and isinstance(func.value, ast.Name)
            and any(self.is_duration(arg) for arg in node.args)
        ):
            self.durations.add(func.value.id)
        self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> None:
        for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            operands = [compare.left, *compare.comparators]
            for op, small, large in zip(compare.ops, operands, operands[1:]):
                if isinstance(op, (ast.Gt, ast.GtE)):
                    small, large = large, small
                elif not isinstance(op, (ast.Lt, ast.LtE)):
                    continue
                if self.is_duration(small) and not self.is_duration(large):
                    self.findings.append((node.lineno, ast.unparse(compare)))
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        inner = _Scope()
        inner.clocks |= self.clocks
        inner.durations |= self.durations
        for stmt in node.body:
            inner.visit(stmt)
        self.findings += inner.findings

    visit_AsyncFunctionDef = visit_FunctionDef


def time_bounds(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, comparison) of every assert in ``tree`` (a parsed module) bounding a measured elapsed time
    from above."""
    scope = _Scope()
    scope.visit(tree)
    return sorted(scope.findings)


def _parsed(source: str) -> ast.Module:
    return parse_sources([("<test>", source)])[0]


def test_scan_finds_elapsed_upper_bounds():
    flagged = """
import time
def test_a():
    t0 = time.monotonic()
    assert time.monotonic() - t0 < 5.0
def test_b():
    t0 = time.perf_counter()
    elapsed = round(time.perf_counter() - t0, 2)
    assert 0.4 < elapsed < 10.0
def test_c(loop):
    durations = []
    start = loop.time()
    durations.append(loop.time() - start)
    assert max(durations) <= 30
def test_d(rec, timeout):
    assert rec["seconds"] < timeout
def test_e():
    healed_at = time.time()
    merged = time.time()
    took = merged - healed_at
    assert 60 >= took
"""
    assert [line for line, _ in time_bounds(_parsed(flagged))] == [5, 9, 14, 16, 21]


def test_scan_allows_deadlines_lower_bounds_and_counts():
    allowed = """
import time
def test_a(cond):
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, "never happened"
def test_b():
    t0 = time.monotonic()
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.5
    assert elapsed > 0
def test_c(attempts, notice):
    assert attempts <= 1
    assert notice.seconds_left() <= 91
"""
    assert time_bounds(_parsed(allowed)) == []


def test_no_test_bounds_elapsed_time_from_above():
    found = []
    for path, tree in parse_files(sorted(TESTS.rglob("*.py"))).items():
        for line, comparison in time_bounds(tree):
            found.append(f"{path.relative_to(TESTS.parent)}:{line}: assert {comparison}")
    assert not found, (
        "these asserts bound a measured elapsed time from above, which fails on a loaded machine; assert"
        " the behaviour, count or ordering the bound stood for, and move performance claims to a"
        " benchmark key under bench/:\n" + "\n".join(found)
    )
