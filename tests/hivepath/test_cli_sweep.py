"""Every numeric flag of every subcommand, generated from the argument parser (a new flag is swept the
day it is added): each takes a range-checked type, and a value out of its range, a non-number or a
NaN is refused before any work starts: exit 2, one line naming the flag, no traceback. A
``HIVEPATH_*`` variable out of range is refused the same way. The sweep calls ``hivepath``'s entry
point in this process (``helpers.cli``); the malformed addresses below run the installed command."""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest

from peer.localnet import hivepath_cmd
from helpers.cli import run_cli
from hivepath.cli import build_parser
from hivepath.numbers import Number
from hivepath.settings import ALL_SETTINGS


def _flags(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags(sub, prefix + (name,))
        elif action.option_strings:
            yield prefix, action


FLAGS = list(_flags(build_parser()))
NUMERIC = [(cmd, a) for cmd, a in FLAGS if isinstance(a.type, Number)]
IDS = [f"{' '.join(cmd)} {a.option_strings[0]}" for cmd, a in NUMERIC]


def _below(kind: Number) -> str:
    """A value just out of ``kind``'s range, from below (every range here has a lower bound)."""
    assert kind.low is not None
    if kind.kind is int:
        return str(int(kind.low) - 1)
    return str(kind.low) if kind.low_open else str(kind.low - 0.5)


def test_no_numeric_flag_is_unchecked():
    plain = [f"{' '.join(cmd)} {a.option_strings[0]}" for cmd, a in FLAGS if a.type in (int, float)]
    assert not plain, f"use a range from hivepath.numbers: {plain}"
    assert len(NUMERIC) >= 35  # the sweep is real: the parser has this many numeric flags


def _refused(cmd: tuple[str, ...], args: list[str], flag: str, env: dict | None = None) -> str:
    out = run_cli(*cmd, *args, env={**os.environ, **(env or {})})  # in process: hundreds of commands
    err = out.stderr.strip()
    assert out.returncode == 2, (out.returncode, err)
    assert "\n" not in err and "Traceback" not in err and flag.lstrip("-") in err, err
    return err


@pytest.mark.parametrize("cmd,action", NUMERIC, ids=IDS)
def test_numeric_flag_out_of_range_is_refused(cmd, action):
    flag = action.option_strings[0]
    for bad in (_below(action.type), "not-a-number", "nan"):
        err = _refused(cmd, [flag, bad], flag)
        assert "must be" in err


_REQUIRED = {("peer", "join"): ["--coordinator", "127.0.0.1:1", "--token", "t"]}
ENV = [(cmd, a, s.name) for cmd, a in NUMERIC for s in ALL_SETTINGS
       if s.flag in a.option_strings and cmd in _REQUIRED]


@pytest.mark.parametrize("cmd,action,var", ENV, ids=[v for _, _, v in ENV])
def test_variable_out_of_range_is_refused(cmd, action, var):
    assert ENV, "peer join has numeric flags set by variables"
    err = _refused(cmd, _REQUIRED[cmd], action.option_strings[0], env={var: _below(action.type)})
    assert var in err


# -- addresses and conflicting flags: bad input, refused at once (exit 2), not after retries -------

_JOIN = ("peer", "join", "--token", "t")


@pytest.mark.parametrize("args,names", [
    ((*_JOIN, "--coordinator", "coord example.org"), "not HOST[:PORT]"),
    ((*_JOIN, "--coordinator", "coord.example.org:0"), "port must be 1-65535"),
    ((*_JOIN, "--coordinator", "coord.example.org:70000"), "port must be 1-65535"),
    ((*_JOIN, "--coordinator", "grpc://coord.example.org:7700"), "has a scheme"),
    ((*_JOIN, "--coordinator", "c:7700", "--initial-peers", "/ip4/1.2.3/tcp/x"), "--initial-peers"),
    ((*_JOIN, "--coordinator", "c:7700", "--host-maddrs", "0.0.0.0:7710"), "--host-maddrs"),
    ((*_JOIN, "--coordinator", "c:7700", "--client-mode", "--announce-maddrs", "/ip4/10.0.0.1/tcp/7710"),
     "--client-mode"),
    (("coordinator", "status", "--token", "t", "--coordinator", "coord example.org"), "not HOST[:PORT]"),
], ids=["space", "port-0", "port-out-of-range", "scheme", "initial-peers", "host-maddrs", "client-mode-announce",
        "operator-command"])
def test_malformed_addresses_and_conflicts_are_bad_input(args, names):
    out = subprocess.run(hivepath_cmd(*args), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    err = out.stderr.strip()
    assert out.returncode == 2 and "\n" not in err and "Traceback" not in err and names in err, (out.returncode, err)
