"""The volunteer peer's life cycle: ``hivepath peer join``.

1. Ask the coordinator for the run spec and the DHT's bootstrap peers (``GetRunSpec``).
2. Find or prepare the dataset and check it against the run's manifest hash.
3. Start the DHT with a persistent identity, measure tokens/s on the run's own model.
4. Join with those capabilities; get a lease and an assignment (a path).
5. Train it (:class:`peer.node.trainer.PathTrainer`): state from our checkpoint or from live holders,
   outer rounds over :class:`peer.averaging.net_averager.NetAverager`, a checkpoint after each round,
   heartbeats in the background. A new assignment in a heartbeat reply ends the current path
   cleanly (flush, checkpoint, release its modules) and starts the new one.
6. On SIGTERM/SIGINT, a drain order or a preemption notice: finish or abandon the round within
   ``drain_timeout``, checkpoint, leave, exit 0.

The coordinator is never on the data path: while it is unreachable the peer keeps training and
averaging, and its client retries in the background.
"""

from __future__ import annotations

import fcntl
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from models.config import RunConfig
from models.errors import HivepathError
from peer.node.checkpoint import CheckpointDir
from peer.network import load_or_create_identity
from peer.coordinator_client import CoordinatorClient, HeartbeatReply, PeerInfo, Progress, WorkAssignment
from peer.node.local_status import start_optional
from peer.node.progress import PeerStatus, ProgressView, make_view
from peer.node.resources import describe_device, measure_tokens_per_s, resolve_device, usable_memory_bytes

__all__ = ["PeerOptions", "PeerNode", "ensure_dataset", "UnsupportedAssignment"]

log = logging.getLogger(__name__)

THROUGHPUT_SETTLE_SECONDS = 30.0
"""Seconds of work on an assignment before its measured tokens/s goes into heartbeats."""


class UnsupportedAssignment(HivepathError):
    """The coordinator gave this peer work it cannot do (e.g. a stage while stage mode is off)."""

    exit_code = 5


@dataclass
class PeerOptions:
    """Everything ``hivepath peer join`` is told (flags or ``HIVEPATH_*`` variables)."""

    coordinator: str
    """``host:port`` of the coordinator."""
    token: str
    """The run token (a shared secret)."""
    initial_peers: tuple[str, ...] = ()
    """Extra DHT bootstrap multiaddrs besides those the coordinator hands out."""
    device: str = "auto"
    max_memory_gb: Optional[float] = None
    work_dir: Path = field(default_factory=lambda: Path("~/.hivepath").expanduser())
    """Checkpoints, identity and (by default) data live here."""
    identity: Optional[Path] = None
    """Identity file (default: WORK_DIR/identity.key)."""
    data_dir: Optional[Path] = None
    """Prepared dataset (default: WORK_DIR/data-<corpus>-<tokenizer>-<L>x<M>, prepared if missing)."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    client_mode: bool = False
    progress: str = "auto"
    tls_ca: Optional[str] = None
    upload_mbps: Optional[float] = None
    """Measured upload bandwidth in Mbit/s (sizes our share of each reduction); None: 100."""
    drain_timeout: float = 60.0
    measure_seconds: float = 2.0
    max_steps: int = 0
    """Stop after this many inner steps (0: run until stopped)."""
    threads: Optional[int] = None
    coordinator_timeout: float = 60.0
    """Seconds to keep retrying the coordinator at start-up before giving up (exit 3)."""
    rebootstrap_interval: float = 20.0
    """Seconds between checks that the peers the coordinator lists are in our DHT routing table
    (re-merges the swarm after a partition; see ``PeerDHT.keep_connected``)."""
    keep_checkpoints: int = 2
    """Snapshots kept under WORK_DIR/checkpoints."""
    status_port: int = 0
    """Serve the local status (``/status``, ``/healthz``) on 127.0.0.1 at this port (0: do not)."""
    stall_timeout: float = 300.0
    """Seconds without progress after which the local status reports the peer unhealthy."""

    def __post_init__(self) -> None:
        self.work_dir = Path(self.work_dir).expanduser()
        if self.identity is None:
            self.identity = self.work_dir / "identity.key"


def ensure_dataset(cfg: RunConfig, data_dir: Optional[Path], work_dir: Path, manifest_hash: str):
    """The run's dataset: ``data_dir`` if given, else prepared under ``work_dir`` (once, under a lock)."""
    from models.corpus import corpus_from_paths, default_corpus
    from models.data import MANIFEST_FILE, Dataset, prepare

    lat = cfg.lattice
    if data_dir is None:
        name = Path(cfg.data.corpus).name or "corpus"
        data_dir = work_dir / f"data-{name}-{cfg.data.tokenizer.replace(':', '')}-{lat.levels}x{lat.modules_per_level}"
    data_dir = Path(data_dir)
    if not (data_dir / MANIFEST_FILE).exists():
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(data_dir.parent / f".{data_dir.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (data_dir / MANIFEST_FILE).exists():
                log.info("preparing the run's dataset (%s, %s) in %s", cfg.data.corpus, cfg.data.tokenizer, data_dir)
                corpus = default_corpus() if cfg.data.corpus == "default" else corpus_from_paths([cfg.data.corpus])
                prepare(corpus, data_dir, lat.levels, lat.modules_per_level, cfg.data.tokenizer)
    ds = Dataset(data_dir)
    if manifest_hash:
        ds.check(manifest_hash)
    return ds


class PeerNode:
    """One volunteer peer; :meth:`run` blocks until it is stopped and returns the exit code."""

    def __init__(self, opts: PeerOptions):
        self.opts = opts
        self.status = PeerStatus()
        self._stop = threading.Event()
        self._stop_reason = ""
        self._reassign: Optional[WorkAssignment] = None
        self._lock = threading.Lock()
        self._work_started = time.monotonic()
        self._preempting = False
        self.view: Optional[ProgressView] = None

    # -- control from other threads (signals, heartbeats, spot notices) --------------------------

    def request_stop(self, reason: str, preempting: bool = False) -> None:
        """Drain: finish or abandon the current round, checkpoint, leave."""
        with self._lock:
            if not self._stop.is_set():
                self._stop_reason = reason
                self._preempting = preempting
                self._stop.set()
                log.info("stopping: %s", reason)

    def _on_heartbeat(self, reply: HeartbeatReply) -> None:
        self.status.coordinator = "connected"
        self.status.mark_heartbeat()
        if reply.drain:
            self.request_stop(f"drained by the coordinator: {reply.drain_reason or 'no reason given'}")
        elif reply.assignment is not None:
            with self._lock:
                self._reassign = reply.assignment
            log.info("reassigned to %s (%s)", reply.assignment.label(), reply.assignment.reason)

    def _should_stop(self) -> Optional[str]:
        self.status.mark_loop()
        if self._stop.is_set():
            return "stop"
        if self._reassign is not None:
            return "reassigned"
        if self.opts.max_steps and self.status.step >= self.opts.max_steps:
            return "max-steps"
        if self.view is not None:
            self.view.update(self.status)
        return None

    def _progress(self) -> dict:
        trainer = getattr(self, "_trainer", None)
        progress = []
        if trainer is not None:
            for mid in trainer.module_ids:
                progress.append(Progress(mid, trainer.opt.module_round(mid), trainer.tokens, self.status.loss or 0.0))
        elif self.status.mode == "stage" and self.status.assignment:
            progress.append(Progress(self.status.assignment, self.status.round_no, self.status.tokens, 0.0))
        # a throughput measured over the first seconds of new work (state loading, first rounds) is
        # noise the coordinator would rebalance on: report 0 ("unchanged", it keeps the join figure)
        settled = time.monotonic() - self._work_started >= THROUGHPUT_SETTLE_SECONDS
        return {
            "progress": progress,
            "tokens_per_s": self.status.tokens_per_s if settled else 0.0,
            "bytes_sent": self.status.bytes_sent,
            "bytes_received": self.status.bytes_received,
            "preempting": self._preempting,
        }

    # -- the life cycle -----------------------------------------------------------------------

    def run(self) -> int:
        from peer.network import CredentialVerifier
        from peer.network import DHTOptions, start_dht
        from peer.averaging import NetAverager

        opts = self.opts
        if opts.threads:
            torch.set_num_threads(opts.threads)
        opts.work_dir.mkdir(parents=True, exist_ok=True)
        load_or_create_identity(opts.identity).release()  # fail fast (exit 6) if a live peer holds it
        client = CoordinatorClient(opts.coordinator, opts.token, tls_ca=opts.tls_ca,
                                   retry_timeout=opts.coordinator_timeout)
        dht = averager = None
        status_server = start_optional(self.status, "peer", opts.status_port, opts.stall_timeout)
        try:
            spec = client.run_spec()
            cfg = spec.run_config
            dataset = ensure_dataset(cfg, opts.data_dir, opts.work_dir, spec.manifest_hash)
            device = resolve_device(opts.device)
            memory = usable_memory_bytes(device, opts.max_memory_gb)
            tokens_per_s = measure_tokens_per_s(cfg.lattice, cfg.inner, device, seconds=opts.measure_seconds)
            dht = start_dht(DHTOptions(
                initial_peers=tuple(opts.initial_peers) + tuple(spec.initial_peers),
                host_maddrs=opts.host_maddrs, announce_maddrs=opts.announce_maddrs,
                client_mode=opts.client_mode, identity_path=str(opts.identity),
            ))
            bandwidth, download = (None, 0.0) if opts.upload_mbps is None else (opts.upload_mbps * 1e6 / 8, 0.0)
            if bandwidth is None and not opts.client_mode:
                measured = client.measure_bandwidth()  # bytes/s both ways, timed against the coordinator
                if measured is not None and measured[0] > 0:
                    bandwidth, download = measured
                    log.info("measured bandwidth: %.1f Mbit/s up, %.1f Mbit/s down", bandwidth * 8e-6, download * 8e-6)
            verifier = None
            if spec.coordinator_public_key:
                verifier = CredentialVerifier(cfg.run_id, spec.coordinator_public_key)
                dht.admit_only(cfg.run_id, spec.coordinator_public_key, cfg.lattice.module_ids())
            averager = NetAverager(dht, cfg.run_id, cfg.content_hash(), dataset.manifest_hash,
                                   bandwidth=bandwidth, throughput=tokens_per_s,
                                   credential=lambda: client.credential, verifier=verifier,
                                   on_suspect=client.report_peer_later)
            self.status.peer_id = dht.peer_id
            client.peer = PeerInfo(
                peer_id=dht.peer_id, device=describe_device(device), memory_bytes=memory, tokens_per_s=tokens_per_s,
                upload_bps=bandwidth or 0.0, download_bps=download, multiaddrs=tuple(dht.maddrs()), manifest_hash=dataset.manifest_hash,
            )
            self.status.state = "joining"
            joined = client.join()
            dht.connect(joined.initial_peers)
            dht.keep_connected(lambda: client.run_spec().initial_peers, interval=opts.rebootstrap_interval)
            averager.on_isolated = dht.poke
            log.info("joined run %s as %s: %s (%s)", cfg.run_id, dht.peer_id, joined.assignment.label(),
                     joined.assignment.reason)
            client.start_heartbeats(self._progress, self._on_heartbeat)
            self.view = make_view(opts.progress)
            self._train(joined.run_config, joined.assignment, dataset, device, averager, dht)
            return 0
        finally:
            self.status.state = "stopped"
            if self.view is not None:
                self.view.close(self.status)
            if client.joined is not None:
                client.retry_timeout = min(client.retry_timeout or 10.0, 10.0)  # never hang a drain on it
                try:
                    client.leave(self._stop_reason or "finished")
                except HivepathError as e:
                    log.warning("could not tell the coordinator we left: %s", e)
            client.close()
            if averager is not None:
                averager.shutdown()
            if dht is not None:
                dht.shutdown()
            if status_server is not None:
                status_server.stop()

    def _train(self, cfg: RunConfig, assignment: WorkAssignment, dataset, device, averager, dht) -> None:
        from peer.node.stage_runner import run_stage_server
        from peer.node.trainer import PathTrainer

        peer_id = dht.peer_id
        checkpoints = CheckpointDir(self.opts.work_dir / "checkpoints", keep=self.opts.keep_checkpoints)

        def fetch(mid, like, accept=None, min_round=-1):
            from peer.averaging import StateTransferError

            try:
                return averager.fetch_state(mid, timeout=cfg.outer.round_timeout, like=like, accept=accept,
                                            min_round=min_round)
            except StateTransferError as e:
                log.info("no live holder sent %s (%s)", mid, e)
                return None

        while True:
            if assignment.mode not in ("path", "stage"):
                raise UnsupportedAssignment(f"the coordinator assigned {assignment.label()}, which a training peer "
                                            "cannot do; run 'hivepath archive' for an archive peer")
            outer = assignment.outer_config(cfg.outer)  # H and codec as the coordinator decided them
            self.status.mode = assignment.mode
            self._work_started = time.monotonic()
            deadline = time.monotonic() + self.opts.drain_timeout
            if assignment.mode == "stage":
                # SWARM stage mode: serve one module's forward/backward to trainers (peer.node.stage_runner)
                self.status.assignment = assignment.module_id
                self._trainer = None
                reason = run_stage_server(cfg, assignment.module_id, dataset, device, dht, averager, checkpoints,
                                          self._should_stop, status=self.status, outer=outer)
            else:
                self.status.assignment = ",".join(map(str, assignment.path))
                self.status.state = "loading"
                self._trainer = PathTrainer(cfg, assignment.path, dataset, device, averager, checkpoints,
                                            peer_id, self.status, fetch_state=fetch, outer=outer)
                reason = self._trainer.run(self._should_stop, lambda report: None)
                self.status.state = "draining"
                self._trainer.finish()
            if time.monotonic() > deadline:
                log.warning("draining took longer than --drain-timeout %.0fs", self.opts.drain_timeout)
            if reason != "reassigned":
                return
            with self._lock:
                assignment, self._reassign = self._reassign, None
