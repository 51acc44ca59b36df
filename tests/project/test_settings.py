"""One place per package for ``HIVEPATH_*`` variables: the table in ``docs/cli.md`` is the
one the code generates, every variable any source names is in it, and only the settings modules read
variables from the environment."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.procs import ROOT
from hivepath.settings import ALL_SETTINGS, CLI_SETTINGS, IMAGE_SETTINGS, markdown_table, setting, update_markdown
from models.errors import ConfigError
from peer.settings import KINDS, PEER_SETTINGS, PROCESS_SETTINGS, Setting

VAR = re.compile(r"\bHIVEPATH_[A-Z0-9_]*[A-Z0-9]\b")
READS_ENV = re.compile(r"""(environ(\.get)?\s*[(\[]|getenv\s*\()\s*f?["']HIVEPATH_""")
SETTINGS_MODULES = {ROOT / "peer" / "settings.py", ROOT / "hivepath" / "settings.py"}
DOC = ROOT / "docs" / "cli.md"


def _source_files() -> list[Path]:
    files = [p for top in ("peer", "coordinator", "hivepath") for p in (ROOT / top).rglob("*.py")]
    files += [p for p in (ROOT / "deploy").rglob("*") if p.is_file() and p.suffix != ".json"]
    return sorted(files)


def test_the_committed_table_is_the_generated_one():
    text = DOC.read_text()
    assert markdown_table() in text
    assert update_markdown(text) == text, "regenerate it: python -m hivepath.settings --update docs/cli.md"


def test_the_module_prints_the_table():
    r = subprocess.run([sys.executable, "-m", "hivepath.settings", "--markdown"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout == markdown_table(), r.stderr


def test_update_needs_the_markers():
    with pytest.raises(ValueError, match="no .* block"):
        update_markdown("# a page without the table\n")


def test_every_variable_in_the_source_is_in_the_table_and_back():
    names = [s.name for s in ALL_SETTINGS]
    assert len(names) == len(set(names)), "each variable once"
    used: dict[str, str] = {}
    for path in _source_files():
        for var in VAR.findall(path.read_text(errors="replace")):
            used.setdefault(var, str(path.relative_to(ROOT)))
    assert len(used) >= 40
    missing = {v: where for v, where in used.items() if v not in names}
    assert not missing, f"variables named in the source but not in hivepath.settings or peer.settings: {missing}"
    unused = sorted(set(names) - set(used))
    assert not unused, f"table entries no source names: {unused}"


def test_only_the_settings_modules_read_variables():
    readers = [str(p.relative_to(ROOT)) for p in _source_files()
               if p.suffix == ".py" and p not in SETTINGS_MODULES and p.parent.name != "deploy"
               and READS_ENV.search(p.read_text())]
    assert not readers, f"read HIVEPATH_* through peer.settings or hivepath.settings instead: {readers}"
    assert READS_ENV.search('os.environ.get("HIVEPATH_X", "1")') and READS_ENV.search("os.getenv('HIVEPATH_X')")


def test_the_coordinator_package_reads_no_environment():
    readers = [p.name for p in (ROOT / "coordinator").rglob("*.py")
               if re.search(r"\b(environ|getenv)\b", p.read_text())]
    assert not readers, readers


def test_health_check_defaults_match_the_table():
    """deploy/healthcheck.py stays a standalone stdlib script; its defaults are the table's."""
    text = (ROOT / "deploy" / "healthcheck.py").read_text()
    defaults = re.findall(r"""environ\.get\(\s*["'](HIVEPATH_\w+)["']\s*,\s*["']([^"']*)["']\s*\)""", text)
    assert len(defaults) >= 4
    for var, default in defaults:
        if var == "HIVEPATH_ARCHIVE_DIR":
            assert "default /data/archive there" in setting(var).read_by
            continue
        assert str(setting(var).default) == default, var


def test_tables_split_by_who_reads():
    assert {s.name for s in PEER_SETTINGS} >= {"HIVEPATH_SPOT", "HIVEPATH_PROGRESS_INTERVAL"}
    assert all(s.read_by.startswith("deploy/") for s in IMAGE_SETTINGS)
    assert all(s.kind in KINDS and s.doc for s in ALL_SETTINGS)
    assert {s.flag for s in CLI_SETTINGS if s.flag} >= {"--coordinator", "--log-level"}
    assert {s.flag for s in PROCESS_SETTINGS if s.flag} >= {"--status-port", "--work-dir", "--keep", "--spot"}


def test_reading_a_setting():
    s = Setting("HIVEPATH_EXAMPLE", "list", ["a"], "an example", flag="--example")
    assert s.read({}) == ["a"] and s.read({"HIVEPATH_EXAMPLE": "  "}) == ["a"], "unset or blank: the default"
    first = s.read({})
    first.append("b")
    assert s.read({}) == ["a"], "the table's default is never shared"
    assert s.read({"HIVEPATH_EXAMPLE": "x, y z"}) == ["x", "y", "z"]
    flag = Setting("HIVEPATH_FLAG", "boolean", False, "a switch")
    assert flag.read({"HIVEPATH_FLAG": "On"}) is True and flag.read({"HIVEPATH_FLAG": "0"}) is False
    number = Setting("HIVEPATH_N", "number", 1.0, "a number", flag="--n-seconds")
    with pytest.raises(ConfigError) as e:
        number.read({"HIVEPATH_N": "soon"})
    assert e.value.field == "n-seconds" and "HIVEPATH_N='soon' is not a valid number" in str(e.value)
    with pytest.raises(ValueError, match="kind"):
        Setting("HIVEPATH_BAD", "float", 1.0, "not a kind")


# -- one declaration per setting ------------------------------------------------------------------


def test_a_declaration_holds_its_own_default():
    from models.settings import count

    with pytest.raises(ValueError, match="HIVEPATH_BAD: default 0 is not an integer >= 1"):
        Setting("HIVEPATH_BAD", "integer", 0, "out of its range", range=count())
    with pytest.raises(ValueError, match="HIVEPATH_BAD: default 'x' is not one of a, b"):
        Setting("HIVEPATH_BAD", "text", "x", "not a choice", choices=("a", "b"))
    assert Setting("HIVEPATH_OK", "integer", None, "no default", range=count()).range_text() == "an integer >= 1"


def _declared_flags():
    """``(command words, action, setting)`` of every flag whose help names a declared variable."""
    import argparse

    from hivepath.cli import build_parser

    env = re.compile(r"\(env (HIVEPATH_[A-Z0-9_]*[A-Z0-9])(=1|; default [^()]*)?\)$")
    todo = [((), build_parser())]
    while todo:
        words, parser = todo.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(words + (name,), sub) for name, sub in action.choices.items()]
                continue
            found = env.search(" ".join((action.help or "").split()))
            if found and action.option_strings:
                yield words, action, setting(found.group(1)), found.group(2) or ""


def test_every_flag_is_built_from_its_declaration(monkeypatch):
    """A flag that names its variable takes the declaration's range, choices and default, and its help
    ends with the variable and the default as declared: none is written a second time."""
    from hivepath.settings import shown_default

    for s in ALL_SETTINGS:
        monkeypatch.delenv(s.name, raising=False)
    seen = set()
    for words, action, s, tail in _declared_flags():
        where = f"hivepath {' '.join(words)} {action.option_strings[-1]}"
        if words[:1] == ("coordinator",):
            continue  # the operator commands' --coordinator has a default of its own (127.0.0.1)
        seen.add(s.name)
        if s.kind == "boolean":
            assert tail == "=1" and action.default is s.default, where
            continue
        assert tail == (f"; default {shown_default(s)}" if shown_default(s) else ""), where
        if s.choices:
            assert list(action.choices) == list(s.choices), where
        if s.range is not None and action.option_strings[-1] == s.flag:
            assert action.type.describe() == s.range.describe(), where
        assert action.default == s.default, where
    assert len(seen) >= 30 and {"HIVEPATH_ARCHIVE_KEEP", "HIVEPATH_STALL_TIMEOUT", "HIVEPATH_STATUS_PORT"} <= seen


def test_the_options_take_the_declared_defaults():
    """What the peer's processes run with when their options are built in code (the demo, the tests)
    is what the command line runs with when nothing is given."""
    import dataclasses

    from peer.node import ArchiveOptions, PeerOptions, SpotOptions
    from peer.node.local_status import DEFAULT_STALL_TIMEOUT, DEFAULT_STATUS_PORT
    from peer.node.startup import NetworkOptions
    from peer.settings import default

    def defaults(cls) -> dict:
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    network, join, archive, spot = (defaults(c) for c in (NetworkOptions, PeerOptions, ArchiveOptions, SpotOptions))
    fields = [
        (network, "host_maddrs", "HIVEPATH_HOST_MADDRS"), (network, "lane_port", "HIVEPATH_LANE_PORT"),
        (network, "stall_timeout", "HIVEPATH_STALL_TIMEOUT"), (network, "coordinator_timeout", "HIVEPATH_COORDINATOR_TIMEOUT"),
        (join, "device", "HIVEPATH_DEVICE"), (join, "progress", "HIVEPATH_PROGRESS"),
        (join, "drain_timeout", "HIVEPATH_DRAIN_TIMEOUT"), (join, "measure_seconds", "HIVEPATH_MEASURE_SECONDS"),
        (join, "max_steps", "HIVEPATH_MAX_STEPS"), (join, "cpu_limit", "HIVEPATH_CPU_LIMIT"),
        (join, "keep_checkpoints", "HIVEPATH_KEEP_CHECKPOINTS"), (archive, "keep", "HIVEPATH_ARCHIVE_KEEP"),
        (archive, "eval_documents", "HIVEPATH_ARCHIVE_EVAL_DOCS"), (archive, "eval_interval", "HIVEPATH_ARCHIVE_EVAL_INTERVAL"),
        (spot, "provider", "HIVEPATH_SPOT"), (spot, "poll_interval", "HIVEPATH_SPOT_POLL_INTERVAL"),
    ]
    for table, name, var in fields:
        declared = default(var)
        assert table[name] == (tuple(declared) if isinstance(declared, list) else declared), (name, var)
    assert (DEFAULT_STALL_TIMEOUT, DEFAULT_STATUS_PORT) == (default("HIVEPATH_STALL_TIMEOUT"),
                                                            default("HIVEPATH_STATUS_PORT"))


def test_the_transport_limits_are_written_once():
    """The peer's keepalive and the coordinator's ping policy and message sizes come from
    ``protos.transport``; the coordinator accepts the peers' pings."""
    from coordinator import server
    from peer.coordinator_client import calls
    from peer.coordinator_client.transport import KEEPALIVE_OPTIONS
    from protos import transport

    assert transport.MIN_PING_INTERVAL_MS <= transport.PING_INTERVAL_MS
    options = dict(KEEPALIVE_OPTIONS)
    assert options["grpc.keepalive_time_ms"] == transport.PING_INTERVAL_MS
    assert options["grpc.keepalive_timeout_ms"] == transport.PING_TIMEOUT_MS
    assert calls.MAX_REPLY_BYTES == transport.MAX_REPLY_BYTES
    assert (server.MAX_MESSAGE_BYTES, server.KEEPALIVE_MIN_INTERVAL_MS) == (transport.MAX_REQUEST_BYTES,
                                                                           transport.MIN_PING_INTERVAL_MS)
