"""Group commit: one writer thread turns many pending write batches into one SQLite transaction.

Joins, leaves and assignment changes wait for their commit (:meth:`GroupCommitter.commit`) before the
coordinator replies; heartbeat renewals are submitted without waiting (:meth:`GroupCommitter.submit`).
Under load, everything queued while one transaction runs goes into the next, so a burst of joins
pays for one fsync, not one each.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from coordinator.store import Store, WriteBatch

__all__ = ["GroupCommitter"]

log = logging.getLogger(__name__)


class _Waiter:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


class GroupCommitter:
    """Applies batches to ``store`` from one background thread, merging whatever queued up."""

    def __init__(self, store: Store):
        self.store = store
        self._cond = threading.Condition()
        self._pending: list[tuple[WriteBatch, Optional[_Waiter]]] = []
        self._closed = False
        self.transactions = 0
        self._thread = threading.Thread(target=self._run, name="group-commit", daemon=True)
        self._thread.start()

    def submit(self, batch: WriteBatch) -> None:
        """Queue ``batch``; it is committed soon, nobody waits for it."""
        if batch:
            self._put(batch, None)

    def commit(self, batch: WriteBatch, commit_timeout: float = 60.0) -> None:
        """Queue ``batch`` and block until it is durable (raises what the store raised)."""
        if not batch:
            return
        waiter = _Waiter()
        self._put(batch, waiter)
        if not waiter.done.wait(commit_timeout):
            raise TimeoutError(f"the state database did not commit within {commit_timeout:.0f}s")
        if waiter.error is not None:
            raise waiter.error

    def close(self) -> None:
        """Commit everything queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _put(self, batch: WriteBatch, waiter: Optional[_Waiter]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the coordinator is shutting down")
            self._pending.append((batch, waiter))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending and self._closed:
                    return
                pending, self._pending = self._pending, []
            merged = WriteBatch()
            for batch, _ in pending:
                merged.merge(batch)
            error: Optional[BaseException] = None
            try:
                self.store.apply(merged)
                self.transactions += 1
            except BaseException as e:  # reported to every waiter; the thread keeps serving
                log.exception("commit of %d batches failed", len(pending))
                error = e
            for _, waiter in pending:
                if waiter is not None:
                    waiter.error = error
                    waiter.done.set()
