"""The path flags' types: every path a flag takes is of a kind, checked before any work starts.

A plain ``str`` accepts a regular file where a directory is expected, a directory where a file is, a
place nothing can be written (under a regular file, ``/proc``, a read-only mount) or a binary token
file, and the command fails part-way with a traceback, sometimes after training. A flag of
``hivepath`` that takes a path takes one of these kinds instead (``tests/hivepath/test_cli_paths.py`` fails on
a plain ``str`` and sends every one of them the wrong kinds of path):

======================  ====================================================================
:func:`text_file`       an existing regular file of UTF-8 text (a token file, a run.toml)
:func:`certificate`     an existing PEM file holding a certificate (TLS)
:func:`private_key`     an existing PEM file holding an unencrypted private key (TLS)
:func:`source`          an existing file or directory to read (``data prepare``'s sources)
:func:`read_dir`        an existing directory to read (a run directory, an export)
:func:`dataset`         a prepared dataset (a directory holding manifest.json); with
                        ``prepare=True`` also a place to prepare one when it holds none
:func:`write_dir`       a directory written into, created if missing (``atomic``: written
                        beside and renamed into place, so its parent must take new entries)
:func:`database`        the coordinator's SQLite file (or ``:memory:``) in an existing directory
:func:`key_file`        a key read if present, created if missing (``--key``, ``--identity``)
======================  ====================================================================

Root passes every permission bit, so writing is tested for real: a directory that must take new
entries gets a probe directory made in it and removed at once (``/proc``, ``/sys`` and read-only
mounts refuse it), and a file that must be rewritten is opened for writing (not written). A refused
path is an argparse error, one line and exit 2, naming the flag, the path, what is wrong and what to
pass. A flag's default that came from a ``HIVEPATH_*`` variable (a :class:`FromVariable`, made by
:func:`hivepath.settings.env_default`) is checked by argparse the same way, naming the variable.

Stdlib only: building the parser imports this, and the coordinator's image holds it without ``models``.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import os
import re
import stat
from pathlib import Path
from typing import Optional

__all__ = ["PathKind", "FromVariable", "MANIFEST_FILE", "text_file", "certificate", "private_key", "source",
           "read_dir", "dataset", "write_dir", "database", "key_file"]

MANIFEST_FILE = "manifest.json"
"""What makes a directory a prepared dataset: :data:`models.data.MANIFEST_FILE` (not imported: numpy)."""

MEMORY_DB = ":memory:"
"""The ``--db`` that keeps the coordinator's state in memory only."""


class FromVariable(str):
    """A flag's default that came from the ``HIVEPATH_*`` variable :attr:`variable`: a kind that
    refuses it names the variable, which the user set, rather than only the flag, which they did not."""

    variable: str

    def __new__(cls, text: str, variable: str) -> "FromVariable":
        value = super().__new__(cls, text)
        value.variable = variable
        return value


class PathKind:
    """An argparse type: a path of one kind. Called with the flag's text, it returns the path with
    ``~`` expanded, or raises :class:`argparse.ArgumentTypeError` saying what is wrong and what to pass.

    ``expects`` is what the path must be or become (``file``, ``dir`` or ``either``), ``must_exist``
    whether it is only read, ``text`` whether it must be UTF-8, ``pem`` the kind of PEM block it must
    hold (``certificate``, ``private key``): the sweep in ``tests/hivepath/test_cli_paths.py`` picks the wrong
    paths to send each flag from these.
    """

    def __init__(self, what: str, expects: str, *, must_exist: bool = False, text: bool = False, pem: str = ""):
        self.what, self.expects, self.must_exist, self.text, self.pem = what, expects, must_exist, text, pem
        self.__name__ = what  # argparse names the type in some messages

    def __call__(self, text: str) -> str:
        variable = getattr(text, "variable", "")
        shown = f"{text} (from {variable})" if variable else text
        fix = f"set {variable} to {self.what}" if variable else f"pass {self.what}"
        if not text:
            raise argparse.ArgumentTypeError(f"an empty path; {fix}")
        if "\0" in text:
            raise argparse.ArgumentTypeError(f"{shown!r}: a NUL byte in a path; {fix}")
        path = os.path.expanduser(str(text))
        problem = self.problem(Path(path))
        if problem:
            raise argparse.ArgumentTypeError(f"{shown}: {problem}; {fix}")
        return str(path)

    def problem(self, path: Path) -> Optional[str]:
        """What is wrong with ``path`` for this kind (``"is a directory"``), or None when it fits."""
        state = _state(path)
        if self.expects == "dir":
            return self._dir_problem(path, state)
        if self.expects == "either":
            if state in ("file", "dir"):
                return _unreadable(path, directory=state == "dir")
            return _wrong_type(state, "a file or a directory") if state in _ODD else _not_there(path, state)
        return self._file_problem(path, state)

    def _file_problem(self, path: Path, state: str) -> Optional[str]:
        if state == "file":
            return _content_problem(path, self.text, self.pem) if self.must_exist else _unreadable(path, False)
        if state == "dir" or state in _ODD:
            return _wrong_type(state, "a file")
        if self.must_exist:
            return _not_there(path, state)
        return _cannot_create(path)

    def _dir_problem(self, path: Path, state: str) -> Optional[str]:
        if state == "dir":
            return _unreadable(path, directory=True) if self.must_exist else _refuses_entries(path)
        if state == "file" or state in _ODD:
            return _wrong_type(state, "a directory")
        if self.must_exist:
            return _not_there(path, state)
        return _cannot_create(path)


class _Dataset(PathKind):
    def __init__(self, prepare: bool):
        what = ("a prepared dataset, or a directory to prepare one in" if prepare
                else "a directory written by 'hivepath data prepare'")
        super().__init__(what, "dir", must_exist=not prepare)
        self.prepare = prepare

    def problem(self, path: Path) -> Optional[str]:
        state = _state(path)
        if state == "dir" and (path / MANIFEST_FILE).is_file():
            return _unreadable(path, directory=True)
        if not self.prepare:
            if state == "dir":
                return f"holds no {MANIFEST_FILE}: not a prepared dataset"
            if state == "missing":
                return "does not exist: not a prepared dataset"
            return self._dir_problem(path, state)
        # prepared here when it holds none: written beside and renamed into place (models.data.prepare),
        # which refuses a directory holding anything else
        if state == "dir":
            problem = _unreadable(path, directory=True)
            if problem:
                return problem
            with os.scandir(path) as entries:
                if any(entries):
                    return f"holds files but no {MANIFEST_FILE}: neither a prepared dataset nor an empty directory"
            return _refuses_entries(_parent(path))
        return self._dir_problem(path, state)


class _WriteDir(PathKind):
    def __init__(self, atomic: bool):
        super().__init__("a directory to create or write into", "dir")
        self.atomic = atomic

    def problem(self, path: Path) -> Optional[str]:
        state = _state(path)
        if state == "dir" and self.atomic:
            return _refuses_entries(_parent(path))  # replaced by a directory written beside it
        return self._dir_problem(path, state)


class _Database(PathKind):
    def __init__(self):
        super().__init__(f"a file in an existing directory, or {MEMORY_DB}", "file")

    def __call__(self, text: str) -> str:
        return MEMORY_DB if text == MEMORY_DB else super().__call__(text)

    def problem(self, path: Path) -> Optional[str]:
        state = _state(path)
        if state == "dir" or state in _ODD:
            return _wrong_type(state, "a file")
        # SQLite creates no directory, and writes its journal (and the coordinator its <db>.key) beside the file
        problem = _parent_problem(path)
        if problem or state != "file":
            return problem
        return _unreadable(path, directory=False, write=True)


class _KeyFile(PathKind):
    def __init__(self, pem: str, lock: bool, parent_exists: bool):
        what = f"a PEM {pem} file, or a place to create one" if pem else "a key file, or a place to create one"
        super().__init__(what, "file", text=bool(pem), pem=pem)
        self.lock, self.parent_exists = lock, parent_exists

    def problem(self, path: Path) -> Optional[str]:
        state = _state(path)
        if state == "file":
            problem = _content_problem(path, self.text, self.pem)
            return problem or (_refuses_entries(_parent(path)) if self.lock else None)
        if state in ("missing", "under") and self.parent_exists:
            return _parent_problem(path)
        return self._file_problem(path, state)


def text_file() -> PathKind:
    """An existing regular file of UTF-8 text: a token file, a run config."""
    return PathKind("a UTF-8 text file", "file", must_exist=True, text=True)


def certificate() -> PathKind:
    """An existing PEM file holding at least one certificate (a TLS certificate chain or CA)."""
    return PathKind("a PEM certificate file", "file", must_exist=True, text=True, pem="certificate")


def private_key() -> PathKind:
    """An existing PEM file holding an unencrypted private key (gRPC takes no passphrase)."""
    return PathKind("a PEM private key file", "file", must_exist=True, text=True, pem="private key")


def source() -> PathKind:
    """An existing file or directory to read (documents for ``data prepare``)."""
    return PathKind("an existing file or directory", "either", must_exist=True)


def read_dir() -> PathKind:
    """An existing directory to read: a run directory, an export, a checkpoint root."""
    return PathKind("an existing directory", "dir", must_exist=True)


def dataset(prepare: bool = False) -> PathKind:
    """A prepared dataset: a directory holding :data:`MANIFEST_FILE`. ``prepare``: or a place the
    command prepares one in (written beside and renamed, so its parent must take new entries)."""
    return _Dataset(prepare)


def write_dir(atomic: bool = False) -> PathKind:
    """A directory written into, created (with its parents) if missing. ``atomic``: the command
    writes it beside under a temporary name and renames it into place, so its parent is written."""
    return _WriteDir(atomic)


def database() -> PathKind:
    """The coordinator's SQLite file: created or rewritten in an existing directory that takes new
    entries (its journal, the default ``<db>.key``); ``:memory:`` keeps no file."""
    return _Database()


def key_file(pem: str = "", lock: bool = False, parent_exists: bool = True) -> PathKind:
    """A key read if present, created if missing: ``pem`` the PEM block it must hold when present;
    ``lock``: a lock file is made beside it even when it exists; ``parent_exists``: its directory is
    not created for it (else it may be created, e.g. a work directory made first)."""
    return _KeyFile(pem, lock, parent_exists)


# -- what is at a path ----------------------------------------------------------------------------


_ODD = ("other", "link")
"""The states of a path that is neither a file nor a directory, nor missing."""


def _state(path: Path) -> str:
    """``file``, ``dir``, ``other`` (a device, a pipe, a socket), ``link`` (a symbolic link to
    nothing), ``missing``, ``under`` (a component above it is not a directory) or ``unreachable``
    (a directory above it refuses to be searched)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "link" if path.is_symlink() else "missing"
    except NotADirectoryError:
        return "under"
    except OSError:
        return "unreachable"
    if stat.S_ISREG(mode):
        return "file"
    return "dir" if stat.S_ISDIR(mode) else "other"


def _nearest(path: Path) -> tuple[Path, str]:
    """The nearest existing path at or above ``path``, and its state."""
    for above in (path, *Path(os.path.abspath(path)).parents):
        state = _state(above)
        if state not in ("missing", "under"):
            return above, state
    return Path("/"), "dir"


def _parent(path: Path) -> Path:
    return Path(os.path.abspath(path)).parent


def _wrong_type(state: str, expected: str) -> str:
    found = {"file": "a regular file", "dir": "a directory", "link": "a symbolic link to nothing"}.get(
        state, "a device, pipe or socket")
    return f"is {found}, expected {expected}"


def _not_there(path: Path, state: str) -> str:
    if state == "under":
        blocker, _ = _nearest(path)
        return f"does not exist ({blocker} is a regular file, not a directory)"
    if state == "unreachable":
        return "cannot be reached (a directory above it refuses access)"
    return "does not exist"


def _cannot_create(path: Path) -> Optional[str]:
    """Why ``path`` (missing) cannot be created with its missing parents, or None."""
    if _state(path) == "unreachable":
        return _not_there(path, "unreachable")
    above, state = _nearest(path.parent)
    if state == "unreachable":
        return f"cannot be created: {above} cannot be reached (permission denied)"
    if state != "dir":
        return f"cannot be created: {above} is {'a regular file' if state == 'file' else 'not a directory'}"
    why = _refuses_entries(above)
    return f"cannot be created: {why}" if why else None


def _parent_problem(path: Path) -> Optional[str]:
    """Why the existing directory that must hold ``path`` cannot, or None."""
    parent = _parent(path)
    state = _state(parent)
    if state == "dir":
        return _refuses_entries(parent)
    if state in ("missing", "under"):
        return f"its directory {parent} does not exist (create it first)"
    if state == "unreachable":
        return f"its directory {parent} cannot be reached (a directory above it refuses access)"
    return f"its directory {parent} is {'a regular file' if state == 'file' else 'not a directory'}"


def _refuses_entries(directory: Path) -> Optional[str]:
    """Why no file can be created in the existing ``directory``, or None. ``os.access`` answers for
    anyone but root; root passes every permission bit, so a probe directory is made and removed at
    once: /proc, /sys and read-only mounts refuse it."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable (permission denied)"
    import tempfile

    try:
        probe = tempfile.mkdtemp(prefix=".hivepath-probe-", dir=directory)
    except OSError as e:
        return f"{directory} takes no new files ({e.strerror or type(e).__name__})"
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    return None


def _unreadable(path: Path, directory: bool, write: bool = False) -> Optional[str]:
    """Why the existing ``path`` cannot be read (or ``write``: opened for writing too), or None; it
    is opened for real, as root passes ``os.access``, and nothing is written."""
    try:
        if directory:
            with os.scandir(path):
                pass
        else:
            os.close(os.open(path, os.O_RDWR if write else os.O_RDONLY))
    except OSError as e:
        return f"cannot be {'opened for writing' if write else 'read'} ({e.strerror or type(e).__name__})"
    return None


def _content_problem(path: Path, text: bool, pem: str) -> Optional[str]:
    """Why the existing regular file ``path`` is not readable (as UTF-8 text, holding a ``pem`` block)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"cannot be read ({e.strerror or type(e).__name__})"
    if not text:
        return None
    try:
        content = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
    if "\0" in content:
        return f"is binary, not text (a NUL byte at offset {content.index(chr(0))})"
    return _pem_problem(content, pem) if pem else None


_PEM_BLOCK = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----(.*?)-----END ([A-Z0-9 ]+)-----", re.S)


def _pem_label(wanted: str) -> str:
    return "CERTIFICATE" if wanted == "certificate" else "PRIVATE KEY"


def _pem_problem(content: str, wanted: str) -> Optional[str]:
    """Why ``content`` holds no well-formed PEM block of kind ``wanted`` (``certificate`` or
    ``private key``), or None: a structural check (labels, base64), not a parse of the DER inside."""
    blocks = _PEM_BLOCK.findall(content)
    if not blocks and "-----BEGIN " in content:
        return "has a PEM block with no -----END line (truncated?)"
    if not blocks:
        return f"is not PEM (no -----BEGIN {_pem_label(wanted)}----- block)"
    found = []
    for begin, body, end in blocks:
        if begin != end:
            return f"has a malformed PEM block (BEGIN {begin} ends with END {end})"
        headers = [line for line in body.strip().splitlines() if ":" in line]  # RFC 1421 (Proc-Type, DEK-Info)
        payload = "".join(line.strip() for line in body.strip().splitlines() if ":" not in line)
        try:
            decoded = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            return f"has a malformed PEM block ({begin} is not base64)"
        if not decoded:
            return f"has an empty PEM block ({begin})"
        label = "certificate" if begin == "CERTIFICATE" else (
            "private key" if begin.endswith("PRIVATE KEY") else begin.lower())
        if label == wanted == "private key" and (begin.startswith("ENCRYPTED") or any("ENCRYPTED" in h for h in headers)):
            return "holds an encrypted private key (gRPC takes no passphrase: decrypt it)"
        found.append(label)
    if wanted in found:
        return None
    return f"holds a PEM {found[0]}, not a {wanted}"
