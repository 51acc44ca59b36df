"""The docs say what the code does (fast, no processes): every ``hivepath ...`` command line in the
README and ``docs/`` parses with the current command line, every relative link (and its ``#anchor``)
resolves, and every default the deploy page's variable tables state is the one the images run with.

Command lines are taken from fenced blocks (from the word ``hivepath`` to the end of the line, so
``docker compose ... exec peer hivepath peer status`` counts) and from inline code spans. Prose writes
alternatives as ``ban/unban``, ``serve / status``, ``path|stage|trainer`` and options as ``[--json]``:
each alternative is checked, an optional part with and without it. A span that ends in a flag whose
value the prose leaves out (``hivepath demo --small-peers``) checks that the flag exists, and one of
command words only (``hivepath coordinator serve``) that the command exists. Paths are
not looked at (a doc's ``--from runs/r1`` need not exist here): the path kinds of
:mod:`hivepath.paths` are replaced by ``str`` in the parser the lines are checked against, and every
``HIVEPATH_*`` variable is unset while they are.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import itertools
import os
import re
import shlex
from pathlib import Path
from typing import Iterator, Optional
from unittest import mock

import pytest

from helpers.procs import ROOT
from hivepath.cli import build_parser
from hivepath.paths import PathKind
from hivepath.settings import ALL_SETTINGS, setting

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^ *```[\w-]*\n(.*?)^ *```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    return FENCE.sub("", text)


def command_lines(doc: Path) -> Iterator[tuple[str, str]]:
    """``(where, line)`` for every ``hivepath ...`` command line of ``doc``."""
    text = doc.read_text(encoding="utf-8")
    for block in FENCE.finditer(text):
        body = re.sub(r"\\\n\s*", " ", block.group(1))
        for line in body.splitlines():
            found = re.search(r"(?:^|[\s$])(hivepath (?:[a-z][\w-]*).*)$", line.strip())
            if found:
                yield f"{doc.name} block", found.group(1)
    for span in re.finditer(r"`'?(hivepath [^`']+)'?`", _prose(text)):
        yield f"{doc.name} inline", " ".join(span.group(1).split())


def variants(line: str) -> list[list[str]]:
    """The argument lists a doc line stands for: shell comments dropped, ``a/b``, ``a / b`` and
    ``a|b`` alternatives (``a/b`` only among the command words) and ``[--opt]`` optional parts
    expanded, and ``hivepath COMMAND`` made every command."""
    line = re.sub(r"\s+#.*$", "", line)
    line = re.split(r"\s(?:\d?>>?|&&?|\|\|?|;)(?:\s|$)", line)[0]  # the shell's redirections, pipes, lists
    line = re.sub(r"\s+/\s+", "/", line)
    optional = re.findall(r"\[([^\]]+)\]", line)
    base = re.sub(r"\s*\[[^\]]+\]", "", line)
    lines = [base] + [f"{base} {' '.join(chosen)}" for n in range(1, len(optional) + 1)
                      for chosen in itertools.combinations(optional, n)]
    commands = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)][0].choices
    out = []
    for one in lines:
        words = shlex.split(one)[1:]
        choices = []
        for i, w in enumerate(words):
            if i == 0 and w == "COMMAND":
                choices.append(list(commands))
            elif "|" in w:
                choices.append(w.split("|"))
            elif i < 2 and re.fullmatch(r"[a-z-]+(/[a-z-]+)+", w):
                choices.append(w.split("/"))
            else:
                choices.append([w])
        out.extend(list(p) for p in itertools.product(*choices))
    return out


PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*|.*\.\.\.")
"""A value a doc leaves for the reader: ``N``, ``PEER_ID``, ``3f0c2a...``."""


@functools.lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    """The command line, built once with no ``HIVEPATH_*`` variable set, path kinds made ``str``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIVEPATH_")}
    with mock.patch.dict(os.environ, env, clear=True):
        return _shape_only(build_parser())


def _shape_only(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with every path kind replaced by ``str``, in every subcommand."""
    for action in parser._actions:
        if isinstance(action.type, PathKind):
            action.type = str
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _shape_only(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser that ``argv``'s leading command words select."""
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
    return parser


def parse_problem(argv: list[str], whole: bool = True) -> Optional[str]:
    """None if ``argv`` parses with the current command line, else argparse's message. A flag's value
    that is a :data:`PLACEHOLDER` is any value; ``whole=False`` (a line quoted in prose) lets required
    flags be left out."""
    parser = _parser()
    command = _subparser(parser, argv)
    flags = command._option_string_actions
    placeholders = {flags[flag]: flags[flag].type for flag, value in zip(argv, argv[1:])
                    if flag in flags and PLACEHOLDER.fullmatch(value)}
    try:
        for action in placeholders:
            action.type = str
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                parser.parse_args(argv)
                return None
            except SystemExit as e:
                if e.code == 0:  # --help
                    return None
        message = err.getvalue().strip()
        if "arguments are required" in message and (not whole or command.prog.split()[1:] == argv):
            return None  # prose naming a command or a part of a command line
        last = argv[-1] if argv else ""
        if last in flags and f"argument {last}" in message and "expected one argument" in message:
            return None  # prose naming a flag without its value
        return message
    finally:
        for action, kind in placeholders.items():
            action.type = kind


def _all_lines() -> list[tuple[str, str]]:
    return [item for doc in DOCS for item in command_lines(doc)]


def test_the_docs_hold_command_lines_to_check():
    lines = _all_lines()
    assert len(lines) > 80
    assert ("README.md block", "hivepath peer join --coordinator coord.example.org:7700 --token-file run.token") in lines
    assert any(line.startswith("hivepath peer status") for where, line in lines if where == "deploy.md block")


@pytest.mark.parametrize("where,line", _all_lines(), ids=lambda v: v[:70] if isinstance(v, str) else v)
def test_every_doc_command_line_parses(where, line):
    for argv in variants(line):
        problem = parse_problem(argv, whole=where.endswith("block"))
        assert problem is None, f"{where}: {line!r} as {argv}: {problem}"


def test_the_checker_refuses_a_wrong_flag_and_a_missing_command():
    assert parse_problem(["peer", "status", "--status-port", "7703"]) is not None
    assert parse_problem(["peer", "status", "--port", "7703"]) is None
    assert parse_problem(["coordinator", "frobnicate"]) is not None
    assert parse_problem(["demo", "--minutes", "zero"]) is not None
    assert parse_problem(["demo", "--small-peers"]) is None
    assert parse_problem(["coordinator", "serve"]) is None
    assert parse_problem(["coordinator", "serve", "--port", "7700"]) is not None  # --run-config, --db
    assert parse_problem(["coordinator", "serve", "--port", "7700"], whole=False) is None
    assert parse_problem(["demo", "--small-peers", "N"]) is None
    assert parse_problem(["demo", "--small-peers", "n"]) is not None
    assert ["eval", "--help"] in variants("hivepath COMMAND --help")
    assert variants("hivepath data fetch --out data/x") == [["data", "fetch", "--out", "data/x"]]
    assert variants("hivepath demo --minutes 3 > demo.log 2>&1") == [["demo", "--minutes", "3"]]
    assert variants("hivepath peer status --json | jq .round") == [["peer", "status", "--json"]]
    assert variants("hivepath peer join --work-dir ~/.hivepath-a &") == [["peer", "join", "--work-dir", "~/.hivepath-a"]]
    assert [a for a in variants("hivepath coordinator ban/unban PEER_ID")] == [
        ["coordinator", "ban", "PEER_ID"], ["coordinator", "unban", "PEER_ID"]]
    assert variants("hivepath data info data/mine [--json]   # who") == [
        ["data", "info", "data/mine"], ["data", "info", "data/mine", "--json"]]


def code_hints() -> list[tuple[str, str]]:
    """``(file, line)`` for every ``'hivepath ...'`` a message of the product code quotes (string
    literals continued on the next line joined), its ``%d``/``{...}`` fields made placeholders;
    hints whose command words are fields are left out."""
    hints = []
    for package in ("hivepath", "peer", "coordinator", "models"):
        for file in sorted((ROOT / package).rglob("*.py")):
            source = re.sub(r"([\"'])\s*\n\s*[fr]?\1", "", file.read_text(encoding="utf-8"))
            for quoted in re.findall(r"'(hivepath [^']+)'", source):
                line = re.sub(r"%\w|\{[^}]*\}", "N", quoted)
                if "N" not in line.split()[1:3]:
                    hints.append((str(file.relative_to(ROOT)), line))
    return hints


@pytest.mark.parametrize("where,line", code_hints(), ids=lambda v: v[:70] if isinstance(v, str) else v)
def test_every_command_a_message_names_parses(where, line):
    for argv in variants(line):
        problem = parse_problem(argv, whole=False)
        assert problem is None, f"{where}: {line!r} as {argv}: {problem}"


# -- links ----------------------------------------------------------------------------------------


def github_anchors(doc: Path) -> set[str]:
    """The ``#anchors`` GitHub makes for ``doc``'s headings (lower case, punctuation dropped, spaces
    to hyphens, ``-1``, ``-2`` for repeats)."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _prose(doc.read_text(encoding="utf-8")), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def broken_links(doc: Path) -> list[str]:
    problems = []
    for target in LINK.findall(_prose(doc.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            problems.append(f"{target}: no {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in github_anchors(file):
            problems.append(f"{target}: {file.name} has no heading #{anchor}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_relative_link_resolves(doc):
    assert broken_links(doc) == []


def test_the_link_checker_sees_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top `x`\n\n## Top x\n\n[ok](#top-x-1) [img](img/none.png) [b](b.md#nope)\n"
                                   "```\n[in a block](nowhere.md)\n```\n")
    (tmp_path / "b.md").write_text("# B\n")
    with mock.patch(f"{__name__}.ROOT", tmp_path):
        assert broken_links(tmp_path / "a.md") == ["img/none.png: no img/none.png", "b.md#nope: b.md has no heading #nope"]


# -- stated defaults ------------------------------------------------------------------------------


def _image_env(dockerfile: str) -> dict[str, str]:
    """The ``HIVEPATH_*`` variables an image sets (its ``ENV`` lines)."""
    text = (ROOT / "deploy" / dockerfile).read_text(encoding="utf-8").replace("\\\n", " ")
    env = {}
    for line in re.findall(r"^ENV (.*)$", text, re.M):
        env.update(re.findall(r"(HIVEPATH_\w+)=(\S+)", line))
    return env


def deploy_table_rows() -> list[tuple[str, str, str]]:
    """``(section, variable, default cell)`` of the variable tables of docs/deploy.md."""
    rows, section = [], ""
    for line in (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            section = line.lstrip("# ")
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `HIVEPATH_") else []
        if len(cells) >= 3:
            names = re.findall(r"`(HIVEPATH_\w+)`", cells[0])
            values = re.findall(r"`[^`]*`", cells[1]) if len(names) > 1 else [cells[1]]
            for name, value in itertools.zip_longest(names, values, fillvalue=""):
                rows.append((section, name, value))  # `A`, `B` | `1`, `2`: one value each
    return rows


IMAGES = ("Dockerfile.coordinator", "Dockerfile.peer", "Dockerfile.peer-cuda")


def _code_default(section: str, name: str) -> object:
    """What a container of ``section``'s images runs with when ``name`` is not set: the image's ``ENV``,
    else the code's default; ``set by the image`` where the images differ."""
    if section == "Every container":
        values = {_image_env(image).get(name) for image in IMAGES}
        if len(values) > 1:
            return "set by the image"
    image = "Dockerfile.coordinator" if section.startswith("Coordinator") else "Dockerfile.peer"
    env = _image_env(image) if not section.startswith("Compose") else {}
    if name in env:
        return env[name]
    return setting(name).default


def _same(stated: str, default: object) -> bool:
    if isinstance(default, list):
        default = " ".join(default)
    if isinstance(default, bool):
        return stated in (("1", "true") if default else ("0", "false"))
    if isinstance(default, (int, float)):
        try:
            return float(stated) == float(default)
        except ValueError:
            return False
    return stated == str(default)


def test_the_deploy_tables_state_the_code_defaults():
    rows = deploy_table_rows()
    assert len(rows) > 30
    known = {s.name for s in ALL_SETTINGS}
    for section, name, cell in rows:
        assert name in known, f"docs/deploy.md names {name}, which no code reads"
        default = _code_default(section, name)
        stated = re.match(r"`([^`]*)`", cell)
        if default == "set by the image":
            assert cell == default, f"docs/deploy.md states {cell!r} for {name}, which each image sets its own way"
            continue
        if default is None or default == []:
            assert not re.fullmatch(r"`?[\d.]+`?", cell), (
                f"docs/deploy.md states {cell!r} for {name}, which has no fixed default in the code")
        else:
            assert stated, f"docs/deploy.md gives no default for {name} (the code's: {default!r})"
            assert _same(stated.group(1), default), (
                f"docs/deploy.md ({section}) states {stated.group(1)!r} for {name}; the code's is {default!r}")



PROSE_DEFAULT = re.compile(r"`(HIVEPATH_[A-Z0-9_]+|--[a-z][a-z-]*)`[^.()`]{0,30}?[(,]\s*default (\d+(?:\.\d+)?)\b")
"""A default stated in prose: ``HIVEPATH_X`` or ``--flag``, then ``, default N`` or ``(default N``."""


def _flag_defaults() -> dict[str, list]:
    """Every ``hivepath`` flag -> the defaults it has across the commands (without ``HIVEPATH_*`` set)."""
    out: dict[str, list] = {}
    parsers = [_parser()]
    while parsers:
        p = parsers.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
            for flag in action.option_strings:
                if action.default not in out.setdefault(flag, []):
                    out[flag].append(action.default)
    return out


def test_every_default_stated_in_prose_is_the_codes():
    flags = _flag_defaults()
    checked = 0
    for doc in DOCS:
        for name, stated in PROSE_DEFAULT.findall(" ".join(_prose(doc.read_text(encoding="utf-8")).split())):
            if name.startswith("--"):
                defaults = flags.get(name)
                if not defaults or len(defaults) > 1:
                    continue  # not a flag of hivepath (a benchmark's), or one with a default per command
                [default] = defaults
            else:
                default = setting(name).default
            assert _same(stated, default), f"{doc.name} states default {stated} for {name}; the code's is {default!r}"
            checked += 1
    assert checked >= 5
