"""Shared helpers for tests: a generated corpus, the tests' local network (``helpers.network``) and
the repository's root (``helpers.procs``). Processes are started and reaped with :mod:`peer.localnet`
(see ``tests/conftest.py``'s ``procs`` fixture)."""

from helpers.corpus import write_corpus

__all__ = ["write_corpus"]
