"""The volunteer peer's life cycle: ``hivepath peer join``.

1. Ask the coordinator for the run spec and the DHT's bootstrap peers (``GetRunSpec``).
2. Find or prepare the dataset and check it against the run's manifest hash; a run on a corpus this
   machine lacks is fetched instead (:mod:`peer.node.run_data`).
3. Measure tokens/s on the run's own model, start the DHT with a persistent identity; fetch the
   dataset's manifest, router and tokenizer when it is not here.
4. Join with those capabilities; get a lease and an assignment (a path, a stage or a pipeline to
   drive); seed the files held
   (unless ``--no-seed``), fetch the path's training shard (training starts once it is verified;
   the validation shard follows in the background).
5. Train it (:class:`peer.node.trainer.PathTrainer`), or, on a peer too small for a path, serve a
   stage or drive a pipeline through stage servers (:mod:`peer.node.stage_runner`; the coordinator
   decides which, ``--role`` may ask): state from our checkpoint or from live holders,
   outer rounds over :class:`peer.averaging.net_averager.NetAverager`, a checkpoint after each round,
   heartbeats in the background. A new assignment in a heartbeat reply ends the current path
   cleanly (flush, checkpoint, release its modules) and starts the new one.
6. On SIGTERM/SIGINT, a drain order or a preemption notice: finish the round in flight, or abandon it
   once ``drain_timeout`` seconds have passed since the drain began (the round is not applied: the
   last global state is kept), checkpoint, withdraw our DHT records, leave, exit 0; exit 7 when the
   drain order said the run now requires a newer release (``[coordinator] min_peer_version``).

Start-up and teardown (identity, status page, coordinator, DHT, averager, join, leave) are those of
every long-running peer process: :class:`peer.node.startup.PeerStartup`.

The coordinator is never on the data path: while it is unreachable the peer keeps training and
averaging, and its client retries in the background.
"""

from __future__ import annotations

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
from peer.coordinator_client import HeartbeatReply, PeerInfo, Progress, VersionMismatch, WorkAssignment
from peer.diloco import PlanBook, RoundReport
from peer.node.progress import PeerStatus, ProgressView, make_view
from peer.node.machine_share import MachineShare
from peer.node.resources import describe_device, measured_tokens_per_s, resolve_device, usable_memory_bytes
from peer.node.run_data import DataOptions, RunData, Stopped, ensure_dataset
from peer.node.startup import NetworkOptions, PeerStartup
from peer.settings import default

__all__ = ["PeerOptions", "PeerNode", "ensure_dataset", "UnsupportedAssignment"]

log = logging.getLogger(__name__)

THROUGHPUT_SETTLE_SECONDS = 30.0
"""Seconds of work on an assignment before its measured tokens/s goes into heartbeats."""


TRAINER_MICRO_BATCHES = 4
"""Chunks of a pipeline trainer's batch in flight at once (SWARM keeps its servers busy so)."""
TRAINER_WAIT_SECONDS = 20.0
"""Seconds a pipeline trainer waits for a server of a level before it drops the step, says why and
looks at its stop and reassignment orders again."""
TRAINER_VACANT_SECONDS = 3.0
"""Seconds a pipeline trainer waits while a level has no usable server at all (its only one died)
before it drives another complete pipeline, a detour (:func:`peer.node.stage_runner.run_stage_trainer`),
rather than pausing until the coordinator refills the level (a lease's timeout and more)."""


class UnsupportedAssignment(HivepathError):
    """The coordinator gave this peer work it cannot do (e.g. a stage while stage mode is off)."""

    exit_code = 5


@dataclass
class PeerOptions:
    """Everything ``hivepath peer join`` is told (flags or ``HIVEPATH_*`` variables)."""

    network: NetworkOptions
    """The coordinator, the DHT and the status page (shared with the archive: :mod:`peer.node.startup`)."""
    device: str = default("HIVEPATH_DEVICE")
    max_memory_gb: Optional[float] = None
    work_dir: Path = field(default_factory=lambda: Path(default("HIVEPATH_WORK_DIR")).expanduser())
    """Checkpoints, identity (unless ``network.identity`` names one) and (by default) data live here."""
    data_dir: Optional[Path] = None
    """Prepared dataset (default: WORK_DIR/data-<corpus>-<tokenizer>-<L>x<M>, prepared if the corpus is on
    this machine; else the assigned path's shards are fetched from seeders into WORK_DIR/data-<hash>)."""
    seed: bool = True
    """Seed the dataset files this peer holds to other peers (``--no-seed``: do not)."""
    max_data_gb: Optional[float] = None
    """Disk budget for fetched shards of paths trained before (least recently used out first)."""
    progress: str = default("HIVEPATH_PROGRESS")
    upload_mbps: Optional[float] = None
    """Measured upload bandwidth in Mbit/s (sizes our share of each reduction); None: 100."""
    drain_timeout: float = default("HIVEPATH_DRAIN_TIMEOUT")
    measure_seconds: float = default("HIVEPATH_MEASURE_SECONDS")
    max_steps: int = default("HIVEPATH_MAX_STEPS")
    """Stop after this many inner steps (0: run until stopped)."""
    threads: Optional[int] = None
    cpu_limit: float = default("HIVEPATH_CPU_LIMIT")
    """Share of the time spent training (``--cpu-limit``): the trainer rests between inner steps for
    the rest (:class:`peer.node.trainer.CpuLimit`), and the tokens/s this peer reports are scaled by it."""
    keep_checkpoints: int = default("HIVEPATH_KEEP_CHECKPOINTS")
    """Snapshots kept under WORK_DIR/checkpoints."""
    role: str = ""
    """``--role``: ask the coordinator for ``path``, ``stage`` or ``trainer`` ('' lets it decide)."""

    def __post_init__(self) -> None:
        self.work_dir = Path(self.work_dir).expanduser()
        if self.keep_checkpoints < 1:
            raise HivepathError(f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")
        if not 0.0 < self.cpu_limit <= 1.0:
            raise HivepathError(f"--cpu-limit must be > 0 and <= 1, got {self.cpu_limit}")
        if self.role not in ("", "path", "stage", "trainer"):
            raise HivepathError(f"--role must be path, stage or trainer (or left out), got {self.role!r}")
        if self.max_data_gb is not None and not self.max_data_gb > 0:
            raise HivepathError(f"--max-data-gb must be > 0, got {self.max_data_gb}")

    def data_options(self) -> DataOptions:
        return DataOptions(data_dir=self.data_dir, seed=self.seed, progress=self.progress,
                           max_data_bytes=None if self.max_data_gb is None else int(self.max_data_gb * 1e9))


class PeerNode:
    """One volunteer peer; :meth:`run` blocks until it is stopped and returns the exit code."""

    def __init__(self, opts: PeerOptions):
        self.opts = opts
        self.status = PeerStatus()
        self._stop = threading.Event()
        self._stop_reason = ""
        self._reassign: Optional[WorkAssignment] = None
        self._working: Optional[WorkAssignment] = None  # the assignment being trained or served now
        self._lock = threading.Lock()
        self._work_started = time.monotonic()
        self._share: Optional[MachineShare] = None
        self._preempting = False
        self._drain_started: Optional[float] = None
        self._drain_timer: Optional[threading.Timer] = None
        self._averager = None
        self._checkpoint_seen = ("", "")
        self._drain_overdue_at: Optional[float] = None
        self._upgrade = ""
        """Why the run no longer takes this release (a heartbeat's ``required_version``): after the drain
        the peer exits with :class:`VersionMismatch`'s code instead of 0."""
        self.view: Optional[ProgressView] = None
        self.data: Optional[RunData] = None
        self.plans = PlanBook()
        """The coordinator's exchange plans for our modules, from heartbeat replies; every optimizer this
        peer builds follows them (:class:`peer.diloco.PlanBook`)."""

    # -- control from other threads (signals, heartbeats, spot notices) --------------------------

    def request_stop(self, reason: str, preempting: bool = False) -> None:
        """Drain: finish the current round, or abandon it once ``drain_timeout`` seconds have passed
        since now; checkpoint, leave."""
        with self._lock:
            if not self._stop.is_set():
                self._stop_reason = reason
                self._preempting = preempting
                self._drain_started = time.monotonic()
                self._stop.set()
                log.info("stopping: %s (draining: the round in flight gets %.0fs)", reason, self.opts.drain_timeout)
                self._event("drain", reason=reason, preempting=preempting, drain_timeout=self.opts.drain_timeout)
                self._drain_timer = threading.Timer(self.opts.drain_timeout, self._drain_overdue)
                self._drain_timer.daemon = True
                self._drain_timer.start()

    def _event(self, kind: str, **fields) -> None:
        """One event on the progress view (:data:`peer.node.progress.EVENTS`), once it is up."""
        if self.view is not None:
            self.view.event(kind, **fields)

    def _drain_overdue(self) -> None:
        """``drain_timeout`` passed since the drain began: abandon the rounds in flight (not applied, the
        last global state is kept and checkpointed) so the peer leaves now."""
        averager = self._averager
        self._drain_overdue_at = time.monotonic()
        log.warning("draining took longer than --drain-timeout %.0fs: abandoning the round in flight (its "
                    "progress is dropped; the last global state is checkpointed)", self.opts.drain_timeout)
        if averager is not None:
            averager.abandon_rounds(f"draining past --drain-timeout {self.opts.drain_timeout:.0f}s")

    def _on_heartbeat(self, reply: HeartbeatReply) -> None:
        self.status.coordinator = "connected"
        self.status.mark_heartbeat()
        for change in self.plans.update(reply.plans):
            log.info("exchange plan: %s", change)
        if reply.drain and (reply.required_version or reply.refused):
            self._upgrade = reply.drain_reason or f"the run now requires hivepath {reply.required_version} or newer"
            self.request_stop(f"drained by the coordinator: {self._upgrade}")
        elif reply.drain:
            self.request_stop(f"drained by the coordinator: {reply.drain_reason or 'no reason given'}")
        elif reply.assignment is not None:
            with self._lock:
                # a re-join (the coordinator lost our lease, e.g. it restarted) that kept our work:
                # restarting the trainer would drop our modules from the DHT for nothing
                kept = self._working is not None and reply.assignment.same_work(self._working)
                self._reassign = None if kept else reply.assignment
            if kept:
                log.info("the coordinator kept our work: %s (%s)", reply.assignment.label(), reply.assignment.reason)
            else:
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

    def _fetch_should_stop(self) -> bool:
        """While a path's shard is fetched: a drain stops it; a reassignment does not (the peer
        trains the fetched path until its next look at the reassignment)."""
        return self._stop.is_set()

    def _progress(self) -> dict:
        trainer = getattr(self, "_trainer", None)
        progress = []
        if trainer is not None:
            for mid in trainer.module_ids:
                progress.append(Progress(mid, trainer.opt.module_round(mid), trainer.tokens, self.status.loss or 0.0))
        elif self.status.mode == "stage" and self.status.assignment:
            progress.append(Progress(self.status.assignment, self.status.round_no, self.status.tokens, 0.0))
        elif self.status.mode == "trainer" and self._working is not None:
            for mid in self._working.module_ids:
                progress.append(Progress(mid, self.status.round_no, self.status.tokens, self.status.loss or 0.0))
        if self.status.mode in ("stage", "trainer"):
            # what it served over the last window, 0 when idle: never the join figure (a whole path's)
            return {"progress": progress, "tokens_per_s": self.status.tokens_per_s, "measured": True,
                    "capacity": self.status.capacity_tokens_per_s, "bytes_sent": self.status.bytes_sent,
                    "bytes_received": self.status.bytes_received, "preempting": self._preempting,
                    "seeded_paths": self.data.seeded_paths() if self.data is not None else None,
                    "link_bps": (self.status.link.upload_bps, self.status.link.download_bps),
                    "exchange_overhead_s": self.status.link.overhead_s}
        # a throughput measured over the first seconds of new work (state loading, first rounds) is
        # noise the coordinator would rebalance on: report 0 ("unchanged", it keeps the join figure)
        settled = time.monotonic() - self._work_started >= THROUGHPUT_SETTLE_SECONDS
        return {
            "progress": progress,
            "tokens_per_s": self.status.tokens_per_s if settled else 0.0,
            "bytes_sent": self.status.bytes_sent,
            "bytes_received": self.status.bytes_received,
            "preempting": self._preempting,
            "seeded_paths": self.data.seeded_paths() if self.data is not None else None,
            "link_bps": (self.status.link.upload_bps, self.status.link.download_bps),
            "exchange_overhead_s": self.status.link.overhead_s,
        }

    # -- the life cycle -----------------------------------------------------------------------

    def _after_round(self, report: RoundReport) -> None:
        for m in report.modules.values():
            self._event("round", module=m.module_id, round=m.round_no, status="done" if m.applied else "failed",
                        peers=list(m.peers), group_size=m.group_size, bytes_sent=m.bytes_sent,
                        bytes_received=m.bytes_received, seconds=round(m.wait_seconds, 3),
                        transfer_seconds=round(m.transfer_seconds, 3), reason=m.reason)
        self._checkpoint_event()
        if self._share is not None:
            self._share.update()  # peers that started or stopped since: take our new share of the cores

    def _checkpoint_event(self) -> None:
        """A ``checkpoint`` event when a snapshot was written (or failed) since the last one."""
        seen = (self.status.checkpoint, self.status.checkpoint_error)
        if seen != self._checkpoint_seen and any(seen):
            self._checkpoint_seen = seen
            self._event("checkpoint", path=seen[0], round=self.status.round_no, error=seen[1])

    def run(self) -> int:
        opts = self.opts
        self.view = make_view(opts.progress)
        code = 1
        try:
            code = self._run()
            if code == 0 and self._upgrade:  # drained and checkpointed; the user must upgrade to come back
                raise VersionMismatch(self._upgrade)
            return code
        except HivepathError as e:
            code = e.exit_code
            self._event("error", message=str(e), exit_code=e.exit_code)
            raise
        except Exception as e:
            self._event("error", message=f"{type(e).__name__}: {e}", exit_code=1)
            raise
        finally:
            drained = None if self._drain_started is None else round(time.monotonic() - self._drain_started, 3)
            self._event("leave", reason=self._stop_reason or ("finished" if code == 0 else "error"),
                        drain_seconds=drained)
            self.view.close(self.status)

    def _run(self) -> int:
        opts = self.opts
        if opts.threads:
            torch.set_num_threads(opts.threads)
        # the peers of this machine divide its cores (unless --threads), memory and GPUs (peer.node.machine_share)
        self._share = MachineShare(None if opts.threads else torch.set_num_threads)
        startup = PeerStartup(opts.network, opts.work_dir, self.status, "peer",
                              leave_reason=lambda: self._stop_reason or "finished")
        with startup, self._share:
            try:
                spec = startup.run_spec()
                cfg = spec.run_config
                self.data = RunData(cfg, spec.manifest_hash, opts.work_dir, opts.data_options(), self.status)
                dataset = self.data.open_local()
                device = torch.device(self._share.claim_device(lambda others: str(resolve_device(opts.device, others))))
                if device.type == "cuda":  # what torch puts on "cuda" without an index goes to this GPU too
                    torch.cuda.set_device(device)
                memory = usable_memory_bytes(device, opts.max_memory_gb, self._share.peers_on(str(device)))
                tokens_per_s = measured_tokens_per_s(opts.work_dir, cfg.lattice, cfg.inner, device,
                                                     seconds=opts.measure_seconds)
                if opts.cpu_limit < 1.0:  # the coordinator sizes work by what we will do, resting included
                    log.info("--cpu-limit %g: training %.0f%% of the time, %.0f of %.0f tokens/s", opts.cpu_limit,
                             100 * opts.cpu_limit, tokens_per_s * opts.cpu_limit, tokens_per_s)
                    tokens_per_s *= opts.cpu_limit
                dht = startup.start_dht(spec)
                if dataset is None:
                    dataset = self.data.fetch_meta(dht, self._stop.is_set)
                client = startup.client
                bandwidth, download = (None, 0.0) if opts.upload_mbps is None else (opts.upload_mbps * 1e6 / 8, 0.0)
                if bandwidth is None:  # client mode and NATed peers too: the coordinator sizes work by it
                    measured = client.measure_bandwidth()  # bytes/s both ways, timed against the coordinator
                    if measured is not None and measured[0] > 0:
                        bandwidth, download = measured
                        log.info("measured bandwidth: %.1f Mbit/s up, %.1f Mbit/s down", bandwidth * 8e-6,
                                 download * 8e-6)
                peer = PeerInfo(
                    peer_id=dht.peer_id, device=describe_device(device), memory_bytes=memory, tokens_per_s=tokens_per_s,
                    upload_bps=bandwidth or 0.0, download_bps=download, multiaddrs=tuple(dht.maddrs()),
                    manifest_hash=dataset.manifest_hash, role=opts.role,
                )
                joined = startup.join(peer, self._progress, self._on_heartbeat)
                dht = startup.dht  # a new node when the join found us behind NAT and handed us relays
                self.data.start_seeding(dht, client)
                from peer.averaging.net_averager import DEFAULT_BANDWIDTH, RELAYED_SHARE

                # a client-mode peer cannot be dialled, so it reduces no part (the averager's share 0); a relayed
                # one offers a sliver of its link, so that reachable members take the reduction when present
                # (nothing crosses its relay but its own parts) and relayed members share it when alone
                if opts.network.client_mode:
                    bandwidth = None
                elif joined.reachability == "relayed":
                    bandwidth = (bandwidth or DEFAULT_BANDWIDTH) * RELAYED_SHARE
                averager = startup.start_averager(spec, dataset.manifest_hash, bandwidth=bandwidth,
                                                  throughput=tokens_per_s, on_suspect=client.report_peer_later)
                self._averager = averager
                if self._drain_started is not None and time.monotonic() - self._drain_started > self.opts.drain_timeout:
                    averager.abandon_rounds("drained before training began")
                log.info("joined run %s as %s: %s (%s)", cfg.run_id, dht.peer_id, joined.assignment.label(),
                         joined.assignment.reason)
                self._event("join", peer_id=dht.peer_id, run_id=cfg.run_id, reachability=self.status.reachability)
                try:
                    self._train(joined.run_config, joined.assignment, dataset, device, averager, dht)
                except Stopped:
                    log.info("stopped while fetching the data: %s", self._stop_reason)
                return 0
            except Stopped:  # a drain signal while fetching the manifest: nothing to leave behind
                log.info("stopped while fetching the data: %s", self._stop_reason)
                return 0
            finally:
                if self._drain_timer is not None:
                    self._drain_timer.cancel()
                if self._drain_started is not None:
                    log.info("drained in %.1fs", time.monotonic() - self._drain_started)
                if self.data is not None:
                    self.data.close()
                self.status.state = "stopped"

    def _train(self, cfg: RunConfig, assignment: WorkAssignment, dataset, device, averager, dht) -> None:
        from peer.node.stage_runner import run_stage_server, run_stage_trainer
        from peer.node.trainer import CpuLimit, PathTrainer

        peer_id = dht.peer_id
        checkpoints = CheckpointDir(self.opts.work_dir / "checkpoints", keep=self.opts.keep_checkpoints)

        def fetch(mid, like, accept=None, min_round=-1, joining=True):
            from peer.averaging import StateTransferError

            if self._drain_overdue_at is not None:  # leaving past the drain's deadline: no re-sync
                return None
            try:
                return averager.fetch_state(mid, timeout=cfg.outer.round_timeout, like=like, accept=accept,
                                            min_round=min_round, joining=joining)
            except StateTransferError as e:
                log.info("no live holder sent %s (%s)", mid, e)
                return None

        previous = None
        while True:
            if previous is None:
                self._event("assignment", mode=assignment.mode, work=assignment.label(), reason=assignment.reason)
            else:
                self._event("reroute", mode=assignment.mode, work=assignment.label(), previous=previous.label(),
                            reason=assignment.reason)
            if assignment.mode not in ("path", "stage", "trainer"):
                raise UnsupportedAssignment(f"the coordinator assigned {assignment.label()}, which a training peer "
                                            "cannot do; run 'hivepath archive' for an archive peer")
            with self._lock:
                self._working = assignment
            outer = assignment.outer_config(cfg.outer)  # H and codec as the coordinator decided them
            self.status.mode = assignment.mode
            self._work_started = time.monotonic()
            if assignment.mode == "stage":
                # SWARM stage mode: serve one module's forward/backward to trainers (peer.node.stage_runner)
                self.status.assignment = assignment.module_id
                self._trainer = None
                reason = run_stage_server(cfg, assignment.module_id, dataset, device, dht, averager, checkpoints,
                                          self._should_stop, status=self.status, outer=outer,
                                          after_round=self._after_round, plans=self.plans)
            elif assignment.mode == "trainer":
                # SWARM's trainer: the path's embedding, head and data here, its levels on stage servers
                self.status.assignment = ",".join(map(str, assignment.path))
                self._trainer = None
                self.data.ensure_path(assignment.path, dht, self._fetch_should_stop)
                reason = run_stage_trainer(cfg, assignment.path, dataset, device, dht, averager, checkpoints,
                                           self._should_stop, status=self.status, outer=outer,
                                           view=self.view, call_timeout=TRAINER_WAIT_SECONDS,
                                           micro_batches=TRAINER_MICRO_BATCHES, after_round=self._after_round,
                                           plans=self.plans, vacant_timeout=TRAINER_VACANT_SECONDS,
                                           has_data=self.data.holds)
            else:
                self.status.assignment = ",".join(map(str, assignment.path))
                self.data.ensure_path(assignment.path, dht, self._fetch_should_stop)  # returns once train is verified
                self.status.state = "loading"
                self._trainer = PathTrainer(cfg, assignment.path, dataset, device, averager, checkpoints,
                                            peer_id, self.status, fetch_state=fetch, outer=outer,
                                            cpu_limit=CpuLimit(self.opts.cpu_limit, wake=self._stop))
                self._trainer.opt.plans = self.plans
                reason = self._trainer.run(self._should_stop, self._after_round)
                self.status.state = "draining"
                self._trainer.finish()
                self._checkpoint_event()
            if reason != "reassigned":
                return
            with self._lock:
                previous, assignment, self._reassign = assignment, self._reassign, None
