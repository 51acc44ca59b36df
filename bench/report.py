"""Regenerate the summary tables of ``docs/BENCHMARKS.md`` from ``bench/results/*.json``.

Run: ``python -m bench.report`` rewrites the generated blocks; ``python -m bench.report --check``
changes nothing and exits 1 when a block differs from what the results say.

Two blocks, each between ``<!-- bench.report NAME -->`` and ``<!-- /bench.report NAME -->``:

- ``summary``: one row per figure of :data:`bench.report_rows.ROWS`: the measured value read from
  its result file, the target and whether it is met, and the commit the result records.
- ``freshness``: one row per result file: its commit, whether the tree was dirty, when it ran, the
  command, and whether it is **stale**.

A result is stale when the code its benchmark measures (the module's ``MEASURES``) differs between
the commit it records and the working tree (``git diff``, and files not yet tracked), when it records
no commit, or when that commit is not in this clone. A Python file whose edits are to comments and
docstrings only (the same syntax tree once string statements are left out, :func:`same_code`) has
not changed what runs and does not make a result stale. A result measured on a dirty tree is stale
unless that code is unchanged since its commit (the uncommitted edits were then elsewhere).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

from bench.report_rows import NOT_RUN_YET, ROWS, Row

__all__ = ["Freshness", "freshness", "measures", "render", "main", "same_code"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "BENCHMARKS.md"
BLOCK = re.compile(r"(<!-- bench\.report (\w+) -->\n)(.*?)(<!-- /bench\.report \2 -->)", re.S)


def _git(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60)


class _DropStrings(ast.NodeTransformer):
    """Leaves out every statement that is only a string (docstrings, attribute docstrings)."""

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list):
                kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                                and isinstance(s.value.value, str))]
                setattr(node, field, kept or ([ast.Pass()] if field == "body" else []))
        return node


def same_code(old: str, new: str) -> bool:
    """Whether two versions of a Python source run the same: equal syntax trees once comments (the
    parser drops them), layout and string statements are left out. A source that does not parse is
    compared as text."""
    try:
        trees = [ast.dump(_DropStrings().visit(ast.parse(src))) for src in (old, new)]
    except SyntaxError:
        return old == new
    return trees[0] == trees[1]


def _code_changed(commit: str, path: str, root: Path) -> bool:
    """Whether ``path`` runs differently in the working tree than at ``commit`` (added, removed, or
    other than a ``.py`` file whose edits are to comments and docstrings only)."""
    if not path.endswith(".py"):
        return True
    then = _git("show", f"{commit}:{path}", root=root)
    now = root / path
    if then.returncode != 0 or not now.is_file():
        return True
    return not same_code(then.stdout, now.read_text())


@lru_cache(maxsize=None)
def measures(bench: str) -> tuple[str, ...]:
    """The ``MEASURES`` tuple of ``bench/BENCH.py``, read from its source (nothing is imported). An
    entry ``*other.MEASURES`` takes in what ``bench/other.py`` measures (a variant of that benchmark)."""
    path = ROOT / "bench" / f"{bench}.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MEASURES" for t in node.targets):
            if not isinstance(node.value, ast.Tuple):
                break
            value: list[str] = []
            for elt in node.value.elts:
                if (isinstance(elt, ast.Starred) and isinstance(elt.value, ast.Attribute)
                        and elt.value.attr == "MEASURES" and isinstance(elt.value.value, ast.Name)):
                    value.extend(measures(elt.value.value.id))
                else:
                    value.append(ast.literal_eval(elt))
            if value and all(isinstance(p, str) for p in value):
                return tuple(value)
    raise ValueError(f"bench/{bench}.py declares no MEASURES tuple of paths")


@dataclass(frozen=True)
class Freshness:
    """Whether one result still describes the code."""

    commit: str
    """The commit the result records ('' when none)."""
    dirty: bool
    """The tree had uncommitted changes when it ran."""
    changed: tuple[str, ...]
    """The measured paths that changed since ``commit`` (top-level entries of ``MEASURES``)."""
    why: str
    """Why it is stale ('' when it is not)."""

    @property
    def stale(self) -> bool:
        return bool(self.why)


@lru_cache(maxsize=None)
def freshness(commit: str, dirty: bool, paths: tuple[str, ...], root: Path = ROOT) -> Freshness:
    """Compare the measured ``paths`` at ``commit`` with the working tree of the repository at ``root``."""
    if not commit or commit == "unknown":
        return Freshness("", dirty, (), "no commit recorded")
    if _git("cat-file", "-e", f"{commit}^{{commit}}", root=root).returncode != 0:
        return Freshness(commit, dirty, (), "its commit is not in this clone")
    out = _git("diff", "--name-only", commit, "--", *paths, root=root)
    if out.returncode != 0:
        raise RuntimeError(f"git diff {commit} failed: {out.stderr.strip()}")
    files = [f for f in out.stdout.split() if _code_changed(commit, f, root)]
    files += _git("ls-files", "--others", "--exclude-standard", "--", *paths, root=root).stdout.split()
    changed = tuple(p for p in paths if any(f == p or f.startswith(p.rstrip("/") + "/") for f in files))
    why = f"changed since: {', '.join(changed)}" if changed else ""
    return Freshness(commit, dirty, changed, why)


def _load(name: str) -> dict[str, Any]:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run python -m bench.{name} or drop its rows")
    return json.loads(path.read_text())


def _value(result: dict[str, Any], key: str) -> Any:
    value: Any = result
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _fmt(value: Any) -> str:
    if value is None:
        return "not in the result"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) >= 1e-3 else f"{value:.2e}"
    return str(value)


def _target(row: Row) -> str:
    if row.target is None:
        return "-"
    op, want = row.target
    return f"{op} {_fmt(want)}"


def _met(row: Row, value: Any) -> str:
    if row.target is None:
        return ""
    if value is None or isinstance(value, (str, dict, list)):
        return "unknown"
    op, want = row.target
    ok = {"<=": value <= want, ">=": value >= want, "==": value == want, "<": value < want}[op]
    return "met" if ok else "**missed**"


def _fresh(name: str, bench: str) -> Freshness:
    result = _load(name)
    return freshness(result.get("commit", ""), bool(result.get("dirty", False)), measures(bench))


def _commit_cell(f: Freshness) -> str:
    commit = f"`{f.commit[:7]}`" if f.commit else "none"
    if f.dirty:
        commit += " (dirty)"
    return commit + (" **stale**" if f.stale else "")


def render_summary() -> str:
    """The summary table: one row per :data:`ROWS` entry."""
    lines = ["| benchmark | result | key | what | measured | target | | commit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in ROWS:
        if row.result in NOT_RUN_YET and not (RESULTS / f"{row.result}.json").exists():
            lines.append(f"| `bench.{row.bench}` | `{row.result}.json` | `{row.key}` | {row.what} | not run yet | "
                         f"{_target(row)} | | - |")
            continue
        value = _value(_load(row.result), row.key)
        lines.append(f"| `bench.{row.bench}` | `{row.result}.json` | `{row.key}` | {row.what} | {_fmt(value)} | "
                     f"{_target(row)} | {_met(row, value)} | {_commit_cell(_fresh(row.result, row.bench))} |")
    return "\n".join(lines) + "\n"


def _bench_of(name: str, result: dict[str, Any]) -> str:
    """The module that writes result ``name``: the one its rows name, else the one its command ran."""
    for row in ROWS:
        if row.result == name:
            return row.bench
    m = re.search(r"bench\.(\w+)", str(result.get("command", "")))
    if m:
        return m.group(1)
    stem = name
    while stem and not (ROOT / "bench" / f"{stem}.py").exists():
        stem = stem.rpartition("_")[0]
    if not stem:
        raise ValueError(f"no benchmark module writes bench/results/{name}.json (no row, command or module names it)")
    return stem


def render_freshness() -> str:
    """One row per result file: its provenance and whether it is stale."""
    lines = ["| result | benchmark | commit | ran (UTC) | seconds | command | stale because |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for path in sorted(RESULTS.glob("*.json")):
        name, result = path.stem, json.loads(path.read_text())
        bench = _bench_of(name, result)
        f = freshness(result.get("commit", ""), bool(result.get("dirty", False)), measures(bench))
        when = result.get("started_unix") or result.get("unix_time")
        ran = datetime.datetime.fromtimestamp(when, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M") if when else "-"
        command = f"`{result['command']}`" if result.get("command") else "not recorded"
        seconds = _fmt(result.get("duration_s")) if "duration_s" in result else "-"
        lines.append(f"| `{name}.json` | `bench.{bench}` | {_commit_cell(f)} | {ran} | {seconds} | {command} | "
                     f"{f.why or '-'} |")
    return "\n".join(lines) + "\n"


RENDERERS = {"summary": render_summary, "freshness": render_freshness}


def render(text: str) -> str:
    """``text`` with every generated block rewritten; an unknown or missing block is an error."""
    found = set()

    def block(m: re.Match) -> str:
        name = m.group(2)
        if name not in RENDERERS:
            raise ValueError(f"unknown generated block '{name}' in {DOC.name}; known: {', '.join(RENDERERS)}")
        found.add(name)
        return m.group(1) + RENDERERS[name]() + m.group(4)

    out = BLOCK.sub(block, text)
    missing = sorted(set(RENDERERS) - found)
    if missing:
        raise ValueError(f"{DOC.name} has no generated block {', '.join(missing)}: add "
                         + " ".join(f"'<!-- bench.report {n} -->' ... '<!-- /bench.report {n} -->'" for n in missing))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a generated block is out of date")
    ap.add_argument("--doc", type=Path, default=DOC, help=f"the document (default {DOC.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    try:
        text = args.doc.read_text()
        new = render(text)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"bench.report: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != text:
            print(f"bench.report: the generated tables of {args.doc} are out of date; run python -m bench.report",
                  file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.doc.write_text(new)
        print(f"bench.report: rewrote the generated tables of {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
