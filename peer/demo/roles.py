"""Which role each demo peer plays: the memory that makes a peer small, and what each peer says it does.

A **small peer** is started with a ``--max-memory`` that fits a stage server of any block module and a
pipeline trainer, but not a whole path, so the coordinator hands it a stage or trainer role
(coordinator/pipelines.py). The bytes come from the run's lattice
(:meth:`models.config.LatticeConfig.training_memory_bytes`) the way the coordinator judges fit:
``fits_path`` and ``trainer_memory`` on the run's batch, with ``memory_headroom`` of the memory usable.

:class:`PeerLines` follows each peer's ``--progress json`` lines in its log: its role (``mode``), its
work (``assignment``), its state and its tokens, trained by a path peer or a trainer, served by a stage
server, and the ``failover`` events of a trainer; it hands every event a peer prints to ``on_event``
(the demo prints them off a terminal).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from models.config import RunConfig
from models.errors import HivepathError
from peer.node.progress import EVENTS

__all__ = ["MEMORY_HEADROOM", "SmallPeerMemory", "small_peer_memory", "PeerLines", "PeerRole"]

MEMORY_HEADROOM = 0.8
"""Share of a peer's memory the coordinator plans to use (``[coordinator] memory_headroom``); the demo
writes it into its run config, so that both sides judge fit alike."""


@dataclass(frozen=True)
class SmallPeerMemory:
    """The ``--max-memory`` of a small peer and the bytes it sits between."""

    max_memory_gb: float
    """What the demo passes to ``peer join --max-memory`` (GiB, as the peer reads it)."""
    path_bytes: int
    """Training memory of a whole path: a small peer's usable memory stays below it."""
    stage_bytes: int
    """Training memory of the largest block module (a stage server)."""
    trainer_bytes: int
    """Training memory of a path's embedding and head (a pipeline trainer)."""


def small_peer_memory(cfg: RunConfig, headroom: float = MEMORY_HEADROOM) -> SmallPeerMemory:
    """A ``--max-memory`` whose usable share (``headroom``) fits a stage server of every block module and
    a trainer but not a path of ``cfg``'s lattice: half way between the two."""
    lattice, batch = cfg.lattice, cfg.inner.batch_size
    path = lattice.paths()[0]
    path_bytes = lattice.training_memory_bytes(lattice.path_modules(path), batch)
    blocks = [m for m in lattice.module_ids() if lattice.module_kind(m) == "block"]
    stage_bytes = max(lattice.training_memory_bytes([m], batch) for m in blocks)
    trainer_bytes = lattice.training_memory_bytes([lattice.embed_id(path), lattice.head_id(path)], batch)
    low = max(stage_bytes, trainer_bytes)
    gb = float(f"{(low + path_bytes) / 2 / headroom / 2**30:.4g}")
    usable = int(gb * 2**30) * headroom
    if not low <= usable < path_bytes:
        raise HivepathError(f"--small-peers: no memory fits a stage server ({stage_bytes} bytes) and a trainer "
                            f"({trainer_bytes}) but not a path ({path_bytes}) on run {cfg.run_id}'s lattice")
    return SmallPeerMemory(gb, path_bytes, stage_bytes, trainer_bytes)


@dataclass
class PeerRole:
    """What one demo peer last said it does, and the tokens of each role it had."""

    peer_id: str = ""
    role: str = ""
    """``path``, ``stage`` or ``trainer`` ('' until it has work)."""
    work: str = ""
    """The path (``0,1``) trained or driven, or the module served (``L0M1``)."""
    state: str = ""
    tokens: int = 0
    """Tokens of the current work: trained (path, trainer) or served (stage)."""
    failovers: int = 0
    """Requests of this trainer that left a failed stage server."""
    done: dict[str, int] = field(default_factory=dict)
    """Tokens of earlier work, by role (a peer the coordinator moved)."""

    def tokens_by_role(self) -> dict[str, int]:
        out = dict(self.done)
        if self.role:
            out[self.role] = out.get(self.role, 0) + self.tokens
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "role": self.role, "work": self.work, "state": self.state,
                "tokens": sum(self.tokens_by_role().values()), "tokens_by_role": self.tokens_by_role(),
                "failovers": self.failovers}


class PeerLines:
    """Follows the JSON lines each demo peer writes to its log (``--progress json``); other lines (log
    records) are skipped. :meth:`watch` a log before its process starts, :meth:`read` to catch up."""

    def __init__(self, on_event: Optional[Callable[[str, dict], None]] = None) -> None:
        self.peers: dict[str, PeerRole] = {}
        self._logs: dict[str, tuple[Path, int]] = {}
        self.on_event = on_event
        """Called with the peer's name and the line for each of its events (:data:`peer.node.progress.EVENTS`)."""

    def watch(self, name: str, log: Path) -> None:
        """Follow ``log`` from its current end (a reused run directory keeps the logs of earlier runs)."""
        self._logs[name] = (Path(log), Path(log).stat().st_size if Path(log).exists() else 0)
        self.peers[name] = PeerRole()

    def read(self) -> None:
        for name, (log, offset) in self._logs.items():
            try:
                with open(log, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                continue
            whole = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written is read next time
            self._logs[name] = (log, offset + len(whole))
            for line in whole.splitlines():
                if line.startswith(b"{"):
                    try:
                        record = json.loads(line)
                        self._take(self.peers[name], record)
                    except (ValueError, TypeError, AttributeError):
                        continue
                    if self.on_event is not None and record.get("event") in EVENTS:
                        self.on_event(name, record)

    def names(self) -> dict[str, str]:
        """Peer id -> demo name (``peer0``, ``small1``) of every peer that printed its id."""
        return {p.peer_id: name for name, p in self.peers.items() if p.peer_id}

    @staticmethod
    def _take(peer: PeerRole, line: dict) -> None:
        if line.get("peer_id"):
            peer.peer_id = str(line["peer_id"])
        if line.get("event") == "failover":
            peer.failovers += 1
        if line.get("event") != "progress":
            return
        role, work, tokens = str(line.get("mode", "")), str(line.get("assignment", "")), int(line.get("tokens", 0))
        peer.state = str(line.get("state", ""))
        if not work:  # starting, joining: no role yet
            return
        if peer.role and ((role, work) != (peer.role, peer.work) or tokens < peer.tokens):
            if peer.tokens:  # new work counts from 0
                peer.done[peer.role] = peer.done.get(peer.role, 0) + peer.tokens
            peer.tokens = 0
        peer.role, peer.work = role, work
        peer.tokens = max(peer.tokens, tokens)
