"""``hivepath`` run in the test's own process: the real entry point (:func:`hivepath.cli.main`, what the
console script calls), without a second of interpreter start-up per call. For sweeps of hundreds of
refused flags; the process boundary itself (exit status, stderr, no traceback) is checked by the
tests that run the installed command (``helpers.hivepath_cmd``)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path
from typing import Mapping, NamedTuple, Optional

__all__ = ["CliResult", "run_cli"]


class CliResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str, env: Optional[Mapping[str, str]] = None, cwd: Optional[Path] = None) -> CliResult:
    """``hivepath ARGS`` with ``env`` as the whole environment (default: this one) in ``cwd``: its exit
    status and what it printed. An exception that escapes :func:`hivepath.cli.main` (which the
    installed command would print as a traceback) propagates and fails the test."""
    from hivepath.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's exit: the installed command exits with it
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        root.handlers[:] = saved_handlers  # main() configures logging on the redirected stderr
        root.setLevel(saved_level)
    return CliResult(int(code), out.getvalue(), err.getvalue())
