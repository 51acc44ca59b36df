"""Errors a user can cause and fix, shared by every package.

The command line catches :class:`HivepathError`, prints its message as one line and exits with its
``exit_code``; no traceback is shown for these. Anything else is a bug and keeps its traceback.

Exit codes (documented in ``docs/cli.md``):

====  ==============================================================
 2    bad input: a flag, a config file, a data directory
 3    the coordinator cannot be reached or refused the peer (token)
 4    incompatible run: config hash or dataset manifest differ
 5    no assignment fits this machine (memory)
 6    the work dir or the identity file is in use by a live process
====  ==============================================================
"""

from __future__ import annotations

__all__ = ["HivepathError", "ConfigError", "DataError"]


class HivepathError(Exception):
    """A problem the user can fix; the message names the problem and the fix."""

    exit_code: int = 2


class ConfigError(HivepathError, ValueError):
    """A config field is invalid; the message names the field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"config field '{field}': {problem}")
        self.field = field


class DataError(HivepathError):
    """Input data is missing, unreadable or does not fit the run."""
