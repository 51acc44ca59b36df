"""Shared helpers for multi-process tests: waiting on conditions with deadlines, ports, and
child processes that are always reaped (see ``tests/conftest.py``'s ``procs`` fixture)."""

from helpers.corpus import write_corpus
from helpers.procs import ProcessGroup, free_port, hivepath_cmd, wait_for

__all__ = ["ProcessGroup", "free_port", "hivepath_cmd", "wait_for", "write_corpus"]
