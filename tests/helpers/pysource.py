"""Python sources parsed into ASTs in a child interpreter of their own (:func:`parse_files`).

CPython 3.11 before 3.11.8 (this project's CI runs 3.11.7) keeps the AST constructor's recursion
depth in per-interpreter state. An ``ast.parse`` that starts while another one is converting its tree
resets that depth, and the first one then fails with ``SystemError: AST constructor recursion depth
mismatch`` (python/cpython#106905). In a test process the second parse is close at hand: 3.11 formats
every traceback's caret markers with ``ast.parse``, in whatever thread logs an exception, and in a
finalizer that the garbage collector runs in the middle of the first conversion. A child interpreter
that only parses has neither, so the tests that read the project's sources parse them there.
"""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["parse_files", "parse_sources"]

_CHILD = ("import ast, pickle, sys; sources = pickle.load(sys.stdin.buffer); "
          "pickle.dump([ast.parse(s, filename=f) for f, s in sources], sys.stdout.buffer)")


def parse_sources(sources: Sequence[tuple[str, str]]) -> list[ast.Module]:
    """The ASTs of ``sources`` ((file name, source) pairs), in order. A source that does not parse
    fails the call with the child's ``SyntaxError`` message."""
    out = subprocess.run([sys.executable, "-c", _CHILD], input=pickle.dumps(list(sources)), capture_output=True,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"parsing {len(sources)} sources failed:\n{out.stderr.decode(errors='replace')}")
    return pickle.loads(out.stdout)


def parse_files(paths: Iterable[Path]) -> dict[Path, ast.Module]:
    """``path -> AST`` of each file of ``paths`` (UTF-8 Python), parsed in one child interpreter."""
    paths = list(paths)
    trees = parse_sources([(str(p), p.read_text(encoding="utf-8")) for p in paths])
    return dict(zip(paths, trees))
