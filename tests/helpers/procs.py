"""Where the repository is, for tests that read its files or start commands from it (the processes
themselves are started with :mod:`peer.localnet`)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TEARDOWN_GRACE = 1.0
"""Seconds a test's processes get to exit after SIGTERM at its end before SIGKILL (the ``procs``
fixture): the test has asserted what it needed, and a drain (finish the round, checkpoint, leave) would
only cost each test seconds more on a loaded machine. Tests of the drain itself stop their processes
themselves, with the drain's own timeout."""
