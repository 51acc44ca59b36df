"""Every path flag of every subcommand, generated from the argument parser (a new flag is swept the
day it is added): each takes a kind from ``hivepath.paths``, and the wrong kinds of path for it (a
regular file where a directory is expected, a directory where a file is, a path under a regular
file, a place nothing can be created, a missing input, a non-UTF-8 text file, a file that is not
PEM) are refused by the real ``hivepath`` process before any work starts: exit 2, one line naming
the flag and the path, no traceback, nothing created. A ``HIVEPATH_*`` variable that gives a path
is refused the same way, naming the variable. The sweep calls ``hivepath``'s entry point in this
process (``helpers.cli``: hundreds of commands); :func:`test_the_installed_command_refuses_the_same_way`
checks that the installed command, as a process, gives the same line and exit status. Root passes permission bits, so the unwritable places
swept are the ones root cannot write either: under a regular file, ``/proc``."""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
from pathlib import Path

import pytest

from peer.localnet import hivepath_cmd
from helpers.cli import run_cli
from hivepath.cli import build_parser
from hivepath.paths import (
    MANIFEST_FILE,
    FromVariable,
    PathKind,
    certificate,
    database,
    dataset,
    key_file,
    private_key,
    read_dir,
    source,
    text_file,
    write_dir,
)
from hivepath.settings import ALL_SETTINGS


def _actions(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """``(command words, action)`` of every flag and positional that takes a value."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, prefix + (name,))
        elif action.nargs != 0:
            yield prefix, action


def _name(action: argparse.Action) -> str:
    """How argparse names the action in its errors: the first flag, or a positional's metavar."""
    return action.option_strings[0] if action.option_strings else action.metavar or action.dest


ACTIONS = list(_actions(build_parser()))
PATHS = [(cmd, a) for cmd, a in ACTIONS if isinstance(a.type, PathKind)]
IDS = [f"{' '.join(cmd)} {_name(a)}" for cmd, a in PATHS]

PATH_FLAG = re.compile(r"^--(dir|db|out|data|identity|key|from|config|run-config|tls-.+|.+-dir|.+-file)$")
PATH_METAVAR = re.compile(r"^(DIR|FILE|PATH|OUT|SRC|.+\.TOML)$")
PATH_HELP = re.compile(r"\b(file|files|directory|directories|dir)\b", re.I)
NOT_A_PATH = {"--token": "the token itself (its help says to prefer a file)"}


def _looks_like_a_path(action: argparse.Action) -> bool:
    if set(action.option_strings) & set(NOT_A_PATH):
        return False
    return (any(PATH_FLAG.match(o) for o in action.option_strings) or bool(PATH_METAVAR.match(action.metavar or ""))
            or bool(PATH_HELP.search(action.help or "")))


def test_no_path_flag_is_unchecked():
    plain = [f"{' '.join(cmd)} {_name(a)}" for cmd, a in ACTIONS
             if _looks_like_a_path(a) and not isinstance(a.type, PathKind)]
    assert not plain, f"use a kind from hivepath.paths: {plain}"
    assert not [a for _, a in ACTIONS if a.option_strings == ["--path"] and isinstance(a.type, PathKind)], \
        "--path is a lattice path (0,1), not a file"
    assert len(PATHS) >= 39  # the sweep is real: the parser has this many path flags and positionals
    assert _looks_like_a_path(argparse.Action(["--cache-dir"], "x")) and _looks_like_a_path(
        argparse.Action(["--thing"], "x", metavar="FILE")) and not _looks_like_a_path(argparse.Action(["--path"], "x"))


# -- the sweep ------------------------------------------------------------------------------------

RUN_TOML = 'preset = "tiny"\n'
CERT_PEM = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUQ2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n"

COMPANIONS = {
    ("archive",): ["--coordinator", "127.0.0.1:1", "--token", "t", "--dir", "{tmp}/archive"],
    ("peer", "join"): ["--coordinator", "127.0.0.1:1", "--token", "t", "--work-dir", "{tmp}/work"],
    ("coordinator", "serve"): ["--run-config", "{tmp}/run.toml", "--db", "{tmp}/state.db", "--token", "t"],
    ("coordinator", "status"): ["--token", "t"],
    ("coordinator", "drain"): ["PEER", "--token", "t"],
    ("coordinator", "ban"): ["PEER", "--token", "t"],
    ("coordinator", "unban"): ["PEER", "--token", "t"],
    ("data", "prepare"): ["--out", "{tmp}/prepared"],
    ("demo",): ["--out", "{tmp}/demo"],
    ("eval",): ["--from", "{tmp}/run"],
    ("export",): ["--from", "{tmp}/run", "--path", "0,0", "--out", "{tmp}/export"],
    ("generate",): ["hello", "--from", "{tmp}/run"],
    ("train-local",): ["--out", "{tmp}/trained"],
}
"""Per command, the other arguments of a command line that would otherwise run (and write): the
swept flag is refused by argparse, before the command could start."""


def _companions(cmd: tuple[str, ...], flag: str, tmp: Path) -> list[str]:
    words, out = COMPANIONS.get(cmd, []), []
    i = 0
    while i < len(words):
        if words[i].startswith("--") and i + 1 < len(words) and not words[i + 1].startswith("--"):
            if words[i] != flag:
                out += [words[i], words[i + 1].format(tmp=tmp)]
            i += 2
        else:
            out.append(words[i])
            i += 1
    return out


def _place(tmp: Path) -> dict[str, Path]:
    """The files and directories a sweep case points at, under ``tmp``."""
    (tmp / "run").mkdir()
    (tmp / "home").mkdir()
    (tmp / "a-dir").mkdir()
    (tmp / "run.toml").write_text(RUN_TOML)
    (tmp / "a-file").write_text("just text\n")
    (tmp / "binary").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    return {"file": tmp / "a-file", "dir": tmp / "a-dir", "binary": tmp / "binary"}


def _wrong_paths(kind: PathKind, tmp: Path, where: dict[str, Path]) -> list[tuple[str, str]]:
    """``(what, path)``: the wrong kinds of path for ``kind`` (``where``: made by :func:`_place`)."""
    cases = [("under a regular file", str(where["file"] / "sub"))]
    if kind.expects == "dir":
        cases.append(("a regular file", str(where["file"])))
    if kind.expects == "file":
        cases.append(("a directory", str(where["dir"])))
    if kind.must_exist:
        cases.append(("missing", str(tmp / "missing")))
    else:
        cases.append(("on /proc", "/proc/hivepath-sweep/x"))
    if kind.text:
        cases.append(("not UTF-8", str(where["binary"])))
    if kind.pem:
        cases.append(("not PEM", str(where["file"])))
    return cases


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIVEPATH_")}
    return {**env, **extra}


def _refused(cmd: tuple[str, ...], args: list[str], tmp: Path, env: dict[str, str]) -> str:
    before = _tree(tmp)
    out = run_cli(*cmd, *args, env=env, cwd=tmp)
    err = out.stderr.strip()
    assert out.returncode == 2, (out.returncode, err)
    assert "\n" not in err and "Traceback" not in err and err.startswith("hivepath: error: "), err
    assert _tree(tmp) == before, f"a refused command created {sorted(set(_tree(tmp)) - set(before))}"
    assert not Path("/proc/hivepath-sweep").exists()
    return err


@pytest.mark.parametrize("cmd,action", PATHS, ids=IDS)
def test_wrong_path_is_refused(cmd, action, tmp_path):
    name = _name(action)
    for what, bad in _wrong_paths(action.type, tmp_path, _place(tmp_path)):
        args = _companions(cmd, name, tmp_path) + ([name, bad] if action.option_strings else [bad])
        err = _refused(cmd, args, tmp_path, _env(HOME=str(tmp_path / "home")))
        assert f"argument {name}: {bad}: " in err, (what, err)
        assert f"pass {action.type.what}" in err, (what, err)


def test_the_installed_command_refuses_the_same_way(tmp_path):
    """The sweep's in-process calls against the real process: the same one line on stderr, exit 2,
    no traceback, for a flag and for a variable."""
    missing = tmp_path / "missing.toml"
    for args, env in ((["coordinator", "serve", "--run-config", str(missing)], _env()),
                      (["peer", "join", "--coordinator", "h:1", "--token", "t"],
                       _env(HIVEPATH_WORK_DIR=str(tmp_path / "f" / "w")))):
        (tmp_path / "f").write_text("a file")
        inside = run_cli(*args, env=env, cwd=tmp_path)
        process = subprocess.run(hivepath_cmd(*args), capture_output=True, text=True, timeout=60, cwd=tmp_path,
                                 env=env, stdin=subprocess.DEVNULL)
        assert process.returncode == inside.returncode == 2, (process.returncode, process.stderr, inside)
        assert process.stderr == inside.stderr and process.stderr.count("\n") == 1, (process.stderr, inside.stderr)
        assert "Traceback" not in process.stderr and process.stderr.startswith("hivepath: error: ")


VARIABLES = [(cmd, a, s.name) for cmd, a in PATHS for s in ALL_SETTINGS
             if s.kind == "path" and s.flag in a.option_strings and f"env {s.name}" in (a.help or "")]


@pytest.mark.parametrize("cmd,action,var", VARIABLES, ids=[f"{' '.join(c)} {v}" for c, _, v in VARIABLES])
def test_wrong_path_in_a_variable_is_refused(cmd, action, var, tmp_path):
    name = _name(action)
    what, bad = _wrong_paths(action.type, tmp_path, _place(tmp_path))[1]  # the wrong type: a file for a directory, or back
    err = _refused(cmd, _companions(cmd, name, tmp_path), tmp_path, _env(HOME=str(tmp_path / "home"), **{var: bad}))
    assert f"argument {name}: {bad} (from {var}): " in err and f"set {var} to " in err, (what, err)


def test_the_variables_swept_are_every_path_variable_of_a_flag():
    swept = {v for _, _, v in VARIABLES}
    assert swept == {"HIVEPATH_WORK_DIR", "HIVEPATH_DATA", "HIVEPATH_IDENTITY", "HIVEPATH_TLS_CA",
                     "HIVEPATH_ARCHIVE_DIR"}, swept


@pytest.mark.parametrize("bad", ["binary", "dir"])
def test_wrong_token_file_variable_is_one_line(tmp_path, bad):
    where = _place(tmp_path)
    err = _refused(("coordinator", "status"), [], tmp_path, _env(HIVEPATH_TOKEN_FILE=str(where[bad])))
    assert f"token file {where[bad]} (HIVEPATH_TOKEN_FILE) " in err
    assert ("is not UTF-8 text" if bad == "binary" else "is a directory") in err


def test_memory_database_and_good_paths_pass_argparse(tmp_path):
    where = _place(tmp_path)
    args = build_parser().parse_args(["coordinator", "serve", "--run-config", str(tmp_path / "run.toml"), "--db",
                                      ":memory:", "--token-file", str(where["file"])])
    assert args.db == ":memory:" and args.run_config == str(tmp_path / "run.toml")
    (where["dir"] / MANIFEST_FILE).write_text("{}")
    args = build_parser().parse_args(["peer", "join", "--work-dir", str(tmp_path / "new" / "work"), "--data",
                                      str(where["dir"]), "--identity", str(tmp_path / "new" / "work" / "id.key")])
    assert args.work_dir == str(tmp_path / "new" / "work") and not (tmp_path / "new").exists()


# -- the kinds, in process ------------------------------------------------------------------------


def _refuses(kind: PathKind, path, *words: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as e:
        kind(str(path))
    message = str(e.value)
    assert all(w in message for w in words), message
    return message


def test_a_directory_to_write_is_probed_not_created(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    assert write_dir()(str(target)) == str(target)
    assert os.listdir(tmp_path) == [], "the probe is removed and nothing else is made"
    assert write_dir()(str(tmp_path)) == str(tmp_path) and os.listdir(tmp_path) == []
    (tmp_path / "f").write_text("x")
    _refuses(write_dir(), tmp_path / "f", "is a regular file, expected a directory")
    _refuses(write_dir(), tmp_path / "f" / "a" / "b", f"cannot be created: {tmp_path / 'f'} is a regular file")
    _refuses(write_dir(), "/proc/hivepath/x", "cannot be created: /proc ")  # root too: a probe, not os.access
    _refuses(write_dir(atomic=True), "/proc/self", ": /proc ")  # replaced, so its parent is written
    _refuses(write_dir(), "/sys/hivepath", "cannot be created: /sys ")
    _refuses(write_dir(), "/dev/null", "is a device, pipe or socket, expected a directory")
    _refuses(write_dir(), "", "an empty path")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    _refuses(write_dir(), tmp_path / "dangling", "is a symbolic link to nothing, expected a directory")
    _refuses(text_file(), tmp_path / "dangling", "is a symbolic link to nothing, expected a file")


def test_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run").mkdir()
    assert read_dir()("~/run") == str(tmp_path / "run")


def test_files_to_read(tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    (tmp_path / "nul").write_bytes(b"abc\x00def")
    (tmp_path / "latin1").write_bytes("caf\xe9".encode("latin-1"))
    assert text_file()(str(tmp_path / "token")) == str(tmp_path / "token")
    _refuses(text_file(), tmp_path / "nul", "is binary, not text (a NUL byte at offset 3)")
    _refuses(text_file(), tmp_path / "latin1", "is not UTF-8 text (byte 0xe9 at offset 3)", "pass a UTF-8 text file")
    _refuses(text_file(), tmp_path / "missing", "does not exist")
    _refuses(text_file(), tmp_path, "is a directory, expected a file")
    _refuses(text_file(), "/dev/null", "is a device, pipe or socket")
    assert source()(str(tmp_path)) and source()(str(tmp_path / "token"))
    _refuses(source(), tmp_path / "token" / "x", f"does not exist ({tmp_path / 'token'} is a regular file")


def _real_pem(tmp_path: Path) -> dict[str, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hivepath test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    files = {"cert": tmp_path / "cert.pem", "key": tmp_path / "key.pem", "encrypted": tmp_path / "enc.pem",
             "public": tmp_path / "pub.pem"}
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    files["encrypted"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.BestAvailableEncryption(b"pw")))
    files["public"].write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                              serialization.PublicFormat.SubjectPublicKeyInfo))
    return files


def test_tls_files_are_pem_of_the_right_kind(tmp_path):
    pem = _real_pem(tmp_path)
    assert certificate()(str(pem["cert"])) and private_key()(str(pem["key"]))
    both = tmp_path / "both.pem"
    both.write_text(pem["key"].read_text() + pem["cert"].read_text())
    assert certificate()(str(both)) and private_key()(str(both)), "one file may hold the key and the chain"
    _refuses(private_key(), pem["cert"], "holds a PEM certificate, not a private key", "pass a PEM private key file")
    _refuses(certificate(), pem["key"], "holds a PEM private key, not a certificate")
    _refuses(certificate(), pem["public"], "holds a PEM public key, not a certificate")
    _refuses(private_key(), pem["encrypted"], "holds an encrypted private key")
    (tmp_path / "cut.pem").write_text(pem["cert"].read_text()[:80])
    _refuses(certificate(), tmp_path / "cut.pem", "no -----END line")
    (tmp_path / "bad64.pem").write_text(CERT_PEM.replace("MIIB", "M!IB"))
    _refuses(certificate(), tmp_path / "bad64.pem", "is not base64")
    (tmp_path / "mixed.pem").write_text(CERT_PEM.replace("END CERTIFICATE", "END PRIVATE KEY"))
    _refuses(certificate(), tmp_path / "mixed.pem", "BEGIN CERTIFICATE ends with END PRIVATE KEY")
    (tmp_path / "text.pem").write_text("not a certificate\n")
    _refuses(certificate(), tmp_path / "text.pem", "is not PEM (no -----BEGIN CERTIFICATE----- block)")


def test_datasets(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / MANIFEST_FILE).write_text("{}")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    assert dataset()(str(tmp_path / "ds")) and dataset(prepare=True)(str(tmp_path / "ds"))
    _refuses(dataset(), tmp_path / "empty", f"holds no {MANIFEST_FILE}: not a prepared dataset")
    _refuses(dataset(), tmp_path / "nowhere", "does not exist: not a prepared dataset")
    assert dataset(prepare=True)(str(tmp_path / "empty")) and dataset(prepare=True)(str(tmp_path / "new" / "ds"))
    _refuses(dataset(prepare=True), tmp_path / "other", "neither a prepared dataset nor an empty directory")
    from models.data import MANIFEST_FILE as models_manifest

    assert MANIFEST_FILE == models_manifest


def test_files_created_if_missing(tmp_path):
    assert database()(":memory:") == ":memory:" and database()(str(tmp_path / "state.db"))
    _refuses(database(), tmp_path / "no" / "state.db", f"its directory {tmp_path / 'no'} does not exist")
    _refuses(database(), tmp_path, "is a directory, expected a file")
    _refuses(database(), "/proc/state.db", ": /proc ")
    pem = _real_pem(tmp_path)
    assert key_file(pem="private key")(str(pem["key"])) and key_file(pem="private key")(str(tmp_path / "new.key"))
    _refuses(key_file(pem="private key"), pem["cert"], "holds a PEM certificate, not a private key")
    _refuses(key_file(), tmp_path / "no" / "id.key", "does not exist (create it first)")
    assert key_file(lock=True, parent_exists=False)(str(tmp_path / "work" / "id.key")), "made with its work directory"
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in pem.values())


def test_a_value_from_a_variable_names_it(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(argparse.ArgumentTypeError) as e:
        write_dir()(FromVariable(str(tmp_path / "f"), "HIVEPATH_WORK_DIR"))
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'f'} (from HIVEPATH_WORK_DIR): is a regular file")
    assert "set HIVEPATH_WORK_DIR to a directory" in message
    assert type(write_dir()(FromVariable(str(tmp_path), "HIVEPATH_WORK_DIR"))) is str
