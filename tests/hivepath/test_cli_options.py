"""The thin command line: building the parser imports nothing heavy, every command reads
the run token with one precedence (``--token``, ``--token-file``, ``HIVEPATH_TOKEN``,
``HIVEPATH_TOKEN_FILE``), and every flag that names a variable takes its default from it."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from helpers.procs import ROOT
from peer.localnet import hivepath_cmd
from hivepath.cli import build_parser
from hivepath.options import read_token
from hivepath.settings import ALL_SETTINGS, setting
from models.errors import HivepathError

HEAVY = ("torch", "hivemind", "grpc", "numpy", "rich")
ENV_IN_HELP = re.compile(r"\benv (HIVEPATH_[A-Z0-9_]*[A-Z0-9])\b")
SAMPLES = {"text": "sample", "path": "/sample/path", "integer": "17", "number": "2.5", "boolean": "yes",
           "list": "/ip4/10.0.0.1/tcp/1 /ip4/10.0.0.2/tcp/2"}
OWN_DEFAULT = {("coordinator", "--coordinator"): "127.0.0.1:7700"}
"""Flags whose command documents a default of its own for an unset variable: (command, flag) -> default."""


def test_building_the_parser_imports_neither_torch_nor_hivemind():
    code = ("import json, sys, hivepath.cli\nhivepath.cli.build_parser()\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
    r = subprocess.run([sys.executable, "-c", "import sys, torch; print('torch' in sys.modules)"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.stdout.strip() == "True", "the check can see torch when it is imported"


def test_help_lists_every_command():
    r = subprocess.run(hivepath_cmd("--help"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for command in ("archive", "coordinator", "data", "demo", "eval", "export", "generate", "peer", "train-local"):
        assert re.search(rf"^\s+{command}\s", r.stdout, re.M), command


# -- the run token ----------------------------------------------------------------------------


def test_token_precedence_flags_before_variables(tmp_path):
    flag_file, env_file = tmp_path / "flag.token", tmp_path / "env.token"
    flag_file.write_text("from-flag-file\n")
    env_file.write_text("  from-env-file \n")
    env = {"HIVEPATH_TOKEN": "from-env", "HIVEPATH_TOKEN_FILE": str(env_file)}
    assert read_token("from-flag", str(flag_file), env) == "from-flag"
    assert read_token(None, str(flag_file), env) == "from-flag-file"
    assert read_token(None, None, env) == "from-env"
    assert read_token(None, None, {"HIVEPATH_TOKEN_FILE": str(env_file)}) == "from-env-file"
    assert read_token("from-flag", None, {"HIVEPATH_TOKEN_FILE": str(tmp_path / "missing")}) == "from-flag", \
        "a variable is not even read when a flag gives the token"
    with pytest.raises(HivepathError, match="no run token.*--token.*HIVEPATH_TOKEN_FILE"):
        read_token(None, None, {"HIVEPATH_TOKEN": "  "})


@pytest.mark.parametrize("content, problem", [(None, "does not exist"), ("  \n", "is empty"),
                                              (b"\xff\xfe", "is not UTF-8 text")])
@pytest.mark.parametrize("source", ["--token-file", "HIVEPATH_TOKEN_FILE"])
def test_bad_token_file_is_one_line_naming_it(tmp_path, content, problem, source):
    path = tmp_path / "token"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(HivepathError) as e:
        if source == "--token-file":
            read_token(None, str(path), {"HIVEPATH_TOKEN": "from-env"})
        else:
            read_token(None, None, {"HIVEPATH_TOKEN_FILE": str(path)})
    message = str(e.value)
    assert str(path) in message and source in message and problem in message and "\n" not in message
    assert e.value.exit_code == 2


def _parsers(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, words + (name,))


def test_token_flags_have_no_default_even_with_the_variables_set(monkeypatch, tmp_path):
    monkeypatch.setenv("HIVEPATH_TOKEN", "from-env")
    monkeypatch.setenv("HIVEPATH_TOKEN_FILE", str(tmp_path / "token"))
    commands = []
    for words, parser in _parsers(build_parser()):
        flags = {opt: a for a in parser._actions for opt in a.option_strings}
        if "--token" in flags:
            commands.append(" ".join(words))
            assert flags["--token"].default is None and flags["--token-file"].default is None, words
    assert {"peer join", "archive", "coordinator serve", "coordinator status", "coordinator drain"} <= set(commands)


@pytest.mark.parametrize("command", [["peer", "join", "--coordinator", "127.0.0.1:1"], ["archive", "--dir", "ARCHIVE",
                                     "--coordinator", "127.0.0.1:1"], ["coordinator", "status"]])
def test_commands_share_the_token_file_error(tmp_path, command):
    missing = tmp_path / "nope.token"
    command = [str(tmp_path / "archive") if w == "ARCHIVE" else w for w in command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIVEPATH_")}
    r = subprocess.run(hivepath_cmd(*command, "--token-file", str(missing)), capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"hivepath: error: argument --token-file: {missing}: does not exist; pass a UTF-8 text")
    assert r.stderr.count("\n") == 1 and not (tmp_path / "archive").exists(), r.stderr


# -- flags and their variables ------------------------------------------------------------------


def _env_flags(parser: argparse.ArgumentParser):
    """``(command words, flag, variable, default)`` of every flag whose help says ``env HIVEPATH_X``."""
    for words, p in _parsers(parser):
        for action in p._actions:
            m = ENV_IN_HELP.search(action.help or "")
            if m and action.option_strings:
                yield words, action.option_strings[-1], m.group(1), action.default


def test_every_flag_reads_the_variable_its_help_names(monkeypatch):
    for s in ALL_SETTINGS:
        monkeypatch.delenv(s.name, raising=False)
    unset = list(_env_flags(build_parser()))
    assert len(unset) >= 25
    for words, flag, var, default in unset:
        expected = OWN_DEFAULT.get((words[0] if words else "", flag), setting(var).default)
        assert default == expected, f"hivepath {' '.join(words)} {flag}: default {default!r}, table says {expected!r}"
    for var in {v for _, _, v, _ in unset}:
        monkeypatch.setenv(var, SAMPLES[setting(var).kind])
    for words, flag, var, default in _env_flags(build_parser()):
        s = setting(var)
        assert default == s.parse(SAMPLES[s.kind]), f"hivepath {' '.join(words)} {flag} does not read {var}"


def test_a_flag_beats_its_variable(monkeypatch):
    monkeypatch.setenv("HIVEPATH_DRAIN_TIMEOUT", "7")
    monkeypatch.setenv("HIVEPATH_HOST_MADDRS", "/ip4/10.0.0.1/tcp/9")
    args = build_parser().parse_args(["peer", "join"])
    assert (args.drain_timeout, args.host_maddrs) == (7.0, ["/ip4/10.0.0.1/tcp/9"])
    args = build_parser().parse_args(["peer", "join", "--drain-timeout", "3", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"])
    assert (args.drain_timeout, args.host_maddrs) == (3.0, ["/ip4/127.0.0.1/tcp/0"])


def test_a_bad_variable_is_one_line_naming_it():
    env = {**os.environ, "HIVEPATH_MAX_STEPS": "many"}
    r = subprocess.run(hivepath_cmd("peer", "join", "--help"), capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "HIVEPATH_MAX_STEPS='many' is not a valid integer" in r.stderr and "max-steps" in r.stderr


def test_help_states_the_tables_default():
    """A help text that says ``(env HIVEPATH_X; default D)`` says the default the flag really has."""
    said = re.compile(r"env (HIVEPATH_[A-Z0-9_]*[A-Z0-9])[^;()]*; default ([^;()]+)")
    checked = 0
    for words, parser in _parsers(build_parser()):
        for action in parser._actions:
            for var, text in said.findall(" ".join((action.help or "").split())):
                default = OWN_DEFAULT.get((words[0] if words else "", action.option_strings[-1]), setting(var).default)
                if default is None:
                    continue  # a default described in words (e.g. identity.key in the work directory)
                text = text.strip()
                if isinstance(default, list):
                    default = " ".join(default)
                same = float(text) == default if isinstance(default, (int, float)) else text == str(default)
                flag = action.option_strings[-1]
                assert same, f"hivepath {' '.join(words)} {flag}: help says {text!r}, is {default!r}"
                checked += 1
    assert checked >= 12
