"""One place per package for ``HIVEPATH_*`` variables (issue 21): the table in ``docs/cli.md`` is the
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
from peer.settings import KINDS, PEER_SETTINGS, Setting

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
    assert {s.flag for s in CLI_SETTINGS if s.flag} >= {"--coordinator", "--status-port", "--work-dir"}


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
