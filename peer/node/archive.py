"""``hivepath archive``: a peer that trains nothing and keeps every module's latest state on disk.

It follows each module's rounds through the holders' DHT records; when a holder is ahead of the
archive, the archive fetches that module's global state and outer momentum from it (the same
transfer a newcomer uses) and writes a snapshot (keeping the last ``keep``). It serves what it
holds to newcomers and announces itself under an archive record, so a run survives the loss of
every trainer of a module: the next trainer of that module resumes from the archive.

Each snapshot is a run directory (``run.json`` + ``modules/``), readable by ``hivepath eval``,
``generate`` and ``export``.

Given the run's dataset (``--data``, checked against the run's manifest hash), the archive seeds all
of it (:class:`peer.node.run_data.RunData`), so that volunteers need no data: they fetch their path's
shards from it and from each other; and it scores each new snapshot on the validation documents
(:mod:`peer.node.archive_eval`) and reports the bits per byte of every complete path to the
coordinator, whose status page plots them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from models.checkpoint.summary import SnapshotSummary
from models.config import RunConfig, format_path
from models.errors import HivepathError
from peer.node.archive_eval import SnapshotEvaluator
from peer.node.checkpoint import CheckpointDir, save_snapshot, saved_state, state_groups
from peer.outer import ModuleState
from peer.node.progress import PeerStatus
from peer.node.run_data import DataOptions, RunData
from peer.node.startup import NetworkOptions, PeerStartup
from peer.settings import default

__all__ = ["ArchiveOptions", "ArchivePeer"]

log = logging.getLogger(__name__)


def _majority_check(holders: dict, cfg: RunConfig):
    """``accept`` for the archive's fetches: a state is kept only when a strict majority of the module's
    live holders (``holders``: their records, read just before the fetch) announce its digest. A peer
    that averaged alone while cut off can carry a round number the group also reaches with other
    weights; archiving its copy would record a fork. Pure: it runs on the averager's event loop."""
    mine = [h for h in holders.values() if h.config_hash == cfg.content_hash()]
    need = len(mine) // 2 + 1

    def accept(state: ModuleState) -> str:
        agree = sum(1 for h in mine if h.digest == state.digest)
        if agree >= need:
            return ""
        return (f"round {state.round_no} state {state.digest} is announced by {agree} of {len(mine)} holders "
                f"(needs {need}); waiting for the group")

    return accept


@dataclass
class ArchiveOptions:
    """Everything ``hivepath archive`` is told (flags or ``HIVEPATH_*`` variables)."""

    network: NetworkOptions
    """The coordinator, the DHT and the status page (shared with ``peer join``: :mod:`peer.node.startup`)."""
    directory: Path
    """Where snapshots go; the identity file too unless ``network.identity`` names one."""
    data_dir: Optional[Path] = None
    """The run's prepared dataset: recorded in snapshots for eval, and seeded to peers."""
    seed: bool = True
    """Seed ``data_dir`` (``--no-seed``: do not)."""
    keep: int = default("HIVEPATH_ARCHIVE_KEEP")
    """Snapshots kept on disk (the last K)."""
    poll_interval: float = 1.0
    """Seconds between looks at the holders' rounds."""
    eval_documents: int = default("HIVEPATH_ARCHIVE_EVAL_DOCS")
    """Validation documents per path scored on a new snapshot, whose bits per byte go to the
    coordinator's status page (0: no scoring; without ``data_dir`` there is nothing to score on). The
    same documents each time, so the history shows the trend; ``hivepath eval`` scores them all.
    Scoring costs CPU seconds per path, more beside training peers on the same cores (``--eval-docs``
    bounds it)."""
    eval_interval: float = default("HIVEPATH_ARCHIVE_EVAL_INTERVAL")
    """Seconds between two scorings at least (the archive often shares a machine with trainers;
    ``--eval-interval``)."""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory).expanduser()
        if self.keep < 1:
            raise HivepathError(f"--keep must be >= 1, got {self.keep}")
        if self.eval_documents < 0:
            raise HivepathError(f"eval_documents must be >= 0, got {self.eval_documents}")
        if not self.eval_interval >= 0:
            raise HivepathError(f"eval_interval must be >= 0, got {self.eval_interval}")


class ArchivePeer:
    """Follows every module of the run; :meth:`run` blocks until :meth:`request_stop`."""

    def __init__(self, opts: ArchiveOptions):
        self.opts = opts
        self.states: dict[str, ModuleState] = {}
        self.names: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.snapshots = CheckpointDir(opts.directory, keep=opts.keep, keep_flag="--keep")
        self.version = 0
        self.status = PeerStatus(mode="archive")
        self.evaluator: Optional[SnapshotEvaluator] = None
        self._sent: list = []
        """The evaluations the last heartbeat carried (report and reply run on one thread)."""

    def request_stop(self, reason: str, preempting: bool = False) -> None:
        """Stop following and leave (``preempting`` changes nothing: the archive has no round to save)."""
        log.info("archive stopping: %s", reason)
        self._stop.set()

    def _provide(self, module_id: str) -> Optional[ModuleState]:
        with self._lock:
            return self.states.get(module_id)

    def _load_own(self, cfg: RunConfig) -> None:
        snap = self.snapshots.load_latest()
        if snap is None:
            return
        if snap.meta.get("config_hash") != cfg.content_hash():
            log.warning("snapshot %s belongs to another run config; not serving it", snap.path)
            return
        self.version = snap.round_no
        for mid in snap.meta.get("rounds", {}):
            state = saved_state(snap, mid, self.names[mid])
            if state is not None:
                self.states[mid] = state
        log.info("archive resumed from %s: %s", snap.path,
                 ", ".join(f"{m} r{s.round_no}" for m, s in self.states.items()))

    def _report(self, data: Optional[RunData]) -> dict:
        """The archive's heartbeat fields: the paths it seeds, and the validation results not yet sent."""
        self._sent = self.evaluator.pending() if self.evaluator is not None else []
        return {"seeded_paths": data.seeded_paths() if data is not None else None, "evaluations": self._sent}

    def _on_heartbeat(self, reply) -> None:
        self.status.mark_heartbeat()
        if self.evaluator is not None and not reply.rejoined:  # a re-join's reply: that heartbeat was not applied
            self.evaluator.delivered(self._sent)

    def _save(self, cfg: RunConfig, manifest_hash: str) -> None:
        lat = cfg.lattice
        with self._lock:
            states = dict(self.states)
        groups, metadata = state_groups(states, self.names, lat.content_hash())
        complete = [p for p in lat.paths() if all(m in states for m in lat.path_modules(p))]
        meta = SnapshotSummary.of(
            cfg, sorted(states), paths=[format_path(p) for p in complete],
            data_dir=str(self.opts.data_dir.resolve()) if self.opts.data_dir else "", manifest_hash=manifest_hash,
            rounds={m: s.round_no for m, s in states.items()}, unix_time=round(time.time(), 3),
        ).to_dict()
        self.version += 1
        written = save_snapshot(self.snapshots, self.version, groups, meta, metadata, self.status)
        if written is not None and self.evaluator is not None:
            self.evaluator.submit(written)

    def run(self) -> int:
        from models.lattice import ModularLM
        from peer.coordinator_client import PeerInfo
        from peer.network import HolderRecord, holders_key, read_records
        from peer.averaging import StateTransferError

        opts = self.opts
        with PeerStartup(opts.network, opts.directory, self.status, "archive",
                         leave_reason=lambda: "archive stopped", home_flag="--dir") as startup:
            spec = startup.run_spec()
            cfg = spec.run_config
            lat = cfg.lattice
            shapes = ModularLM(lat, seed=cfg.seed)
            likes = {}
            for mid in lat.module_ids():
                named = list(shapes.mods[mid].named_parameters())
                self.names[mid] = [n for n, _ in named]
                likes[mid] = [p.detach() for _, p in named]
            del shapes
            self._load_own(cfg)
            data = None
            # what the snapshots name as the run's dataset: the pinned hash, else that of --data, else the
            # one the holders announce (a run on the built-in corpus that pins none)
            manifest_hash = spec.manifest_hash
            if opts.data_dir is not None:
                data = RunData(cfg, spec.manifest_hash, opts.directory,
                               DataOptions(data_dir=opts.data_dir, seed=opts.seed), self.status)
                local = data.open_local()
                manifest_hash = manifest_hash or (local.manifest_hash if local is not None else "")
                if local is not None and opts.eval_documents:
                    self.evaluator = SnapshotEvaluator(data.dataset, opts.eval_documents, opts.eval_interval)
                    startup.on_close(self.evaluator.close)
                elif local is not None:
                    log.info("not scoring snapshots on validation documents (--eval-docs 0)")
            dht = startup.start_dht(spec)
            peer = PeerInfo(peer_id=dht.peer_id, device="cpu", memory_bytes=0, tokens_per_s=0.0,
                            multiaddrs=tuple(dht.maddrs()), manifest_hash=spec.manifest_hash, archive=True)
            startup.join(peer, lambda: self._report(data), self._on_heartbeat)
            dht = startup.dht  # a new node when the join found us behind NAT and handed us relays
            if data is not None:
                data.start_seeding(dht, startup.client)
                startup.on_close(data.close)
            elif spec.manifest_hash:
                log.info("not seeding the run's dataset: pass --data DIR (the operator's prepared copy) to seed it")
            averager = startup.start_averager(spec, spec.manifest_hash, state_provider=self._provide)
            for mid, st in self.states.items():  # announced once we hold a credential
                averager.announce_archive(mid, st.round_no)
            self.status.assignment, self.status.state = "every module", "following"
            log.info("archive %s following %d modules of run %s in %s", dht.peer_id, len(lat.module_ids()),
                     cfg.run_id, opts.directory)
            while not self._stop.is_set():
                self.status.mark_loop()
                changed = False
                for mid in lat.module_ids():
                    if self._stop.is_set():
                        break
                    holders = read_records(averager.dht, holders_key(cfg.run_id, mid), HolderRecord)
                    ahead = [h.round_no for p, h in holders.items()
                             if h.config_hash == cfg.content_hash() and p != dht.peer_id]
                    have = self.states[mid].round_no if mid in self.states else -1
                    if not ahead or max(ahead) <= have:
                        continue
                    try:
                        state = averager.fetch_state(mid, timeout=5.0, like=likes[mid],
                                                     accept=_majority_check(holders, cfg), joining=False)
                    except StateTransferError as e:
                        level = logging.DEBUG if "waiting for the group" in str(e) else logging.WARNING
                        log.log(level, "could not fetch %s at round %d: %s", mid, max(ahead), e)
                        continue
                    if not manifest_hash:
                        announced = {h.data_hash for h in holders.values()
                                     if h.config_hash == cfg.content_hash() and h.data_hash}
                        manifest_hash = announced.pop() if len(announced) == 1 else ""
                    if state.round_no > have:
                        log.info("archived %s at round %d", mid, state.round_no)
                        with self._lock:
                            self.states[mid] = state
                        averager.announce_archive(mid, state.round_no)
                        changed = True
                if changed:
                    self._save(cfg, manifest_hash)
                    self.status.round_no = max(s.round_no for s in self.states.values())
                self._stop.wait(opts.poll_interval)
            return 0
