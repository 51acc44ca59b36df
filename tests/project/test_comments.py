"""Comments and docstrings of the shipped packages say what the code does and why, never which issue
or session a piece came from: read with :mod:`tokenize`, so only comments and docstrings count (an
error text or a flag's help that a user reads is not checked here)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from helpers.procs import ROOT

PACKAGES = ("peer", "coordinator", "models", "hivepath", "protos")

TRACKER = re.compile(r"\b(issues?|sessions?)\s+#?\d+", re.IGNORECASE)
"""A reference to the project's tracker or to a working session: ``issue 19``, ``issues 5 and 23``,
``session 28``."""

EXEMPT: set[str] = set()
"""Files excused from the check; each must still hold a hit (:func:`test_exemptions_are_still_needed`
fails when one has none), so an excuse does not outlive its reason."""

_STATEMENT_START = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and every string that stands alone as a statement (module,
    class, function and attribute docstrings)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    out = []
    previous = tokenize.NEWLINE
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING and previous in _STATEMENT_START:
            after = tokens[i + 1].type if i + 1 < len(tokens) else tokenize.ENDMARKER
            if after in (tokenize.NEWLINE, tokenize.ENDMARKER, tokenize.COMMENT):
                out.append((tok.start[0], tok.string))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return out


def tracker_hits(path: Path) -> list[str]:
    """``path:line: match`` for each comment or docstring of ``path`` that names an issue or session."""
    rel = path.relative_to(ROOT).as_posix()
    return [f"{rel}:{line + text[:m.start()].count(chr(10))}: {m.group(0)}"
            for line, text in comments_and_docstrings(path.read_text(encoding="utf-8"))
            for m in TRACKER.finditer(text)]


def _sources() -> list[Path]:
    return sorted(p for top in PACKAGES for p in (ROOT / top).rglob("*.py"))


def test_the_reader_finds_comments_and_docstrings_only():
    source = ('"""Module (issue 1)."""\n'
              'X = 1\n'
              '"""Attribute docstring, session 2."""\n'
              'def f():\n'
              '    """Function, issues 3 and 4."""\n'
              '    # a comment about issue 5\n'
              '    return "an error text naming issue 6"\n'
              'Y = ("issue 7"\n'
              '     "joined")\n')
    texts = [text for _, text in comments_and_docstrings(source)]
    assert [bool(TRACKER.search(t)) for t in texts] == [True, True, True, True]
    assert not any("issue 6" in t or "issue 7" in t for t in texts)


def test_no_comment_or_docstring_names_an_issue_or_session():
    hits = [h for p in _sources() if p.relative_to(ROOT).as_posix() not in EXEMPT for h in tracker_hits(p)]
    assert not hits, ("say what the code does and why, not which issue or session it came from:\n"
                      + "\n".join(hits))


def test_exemptions_are_still_needed():
    clean = sorted(rel for rel in EXEMPT if not tracker_hits(ROOT / rel))
    assert not clean, f"no hits left in {clean}: drop them from EXEMPT"
