"""Training one path assignment: build the path's modules, adopt the freshest state, run inner steps
with DiLoCo outer rounds (DiPaCo path mode, Douillard et al. 2024), checkpoint after every round.

The loop body is plain PyTorch: forward, backward, ``opt.step()``; the outer rounds hide inside
:class:`peer.diloco.DiLoCoOptimizer`. The trainer only decides where state comes from (its own
checkpoint when current, else the module's live holders, else the shared seed) and where it goes
(a checkpoint snapshot after each outer round).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from models.checkpoint.summary import SnapshotSummary
from models.config import OuterConfig, RunConfig, format_path
from models.lattice import ModularLM
from models.training import autocast
from peer.averaging.contract import LONE_HOLDER
from peer.node.fresh_start import start_fresh_module
from peer.node.checkpoint import CheckpointDir, CheckpointError, save_snapshot, saved_state, state_groups
from peer.diloco import JOIN_RAMP_ROUNDS, DiLoCoOptimizer, RoundReport
from peer.node.progress import PeerStatus
from peer.diloco import install_resync, resync_after_round

__all__ = ["CpuLimit", "PathTrainer", "StateSource"]

log = logging.getLogger(__name__)


@dataclass
class StateSource:
    """Where a module's starting state came from."""

    module_id: str
    origin: str
    """``checkpoint``, ``peer``, ``init`` or ``sibling:<module>@<round>`` (:mod:`peer.node.fresh_start`)."""
    round_no: int


class CpuLimit:
    """Rests between inner steps so that computing takes at most ``share`` of the wall time: a
    volunteer's ``--cpu-limit`` on a machine its owner also uses (BOINC's "use at most N% of CPU
    time"). After an inner step of ``t`` seconds it waits ``t * (1 - share) / share`` on ``wake``,
    which a drain sets, so a rest never delays one. A step that ran an outer round is not followed
    by a rest: its exchange already left the compute idle."""

    def __init__(self, share: float = 1.0, wake: Optional[threading.Event] = None):
        if not (isinstance(share, (int, float)) and 0.0 < share <= 1.0):
            raise ValueError(f"cpu limit must be > 0 and <= 1, got {share!r}")
        self.share = float(share)
        self._wake = wake if wake is not None else threading.Event()
        self.rested_s = 0.0
        """Seconds spent resting so far."""

    def after_step(self, seconds: float) -> None:
        if self.share >= 1.0 or not seconds > 0.0:
            return
        pause = seconds * (1.0 - self.share) / self.share
        started = time.monotonic()
        self._wake.wait(pause)
        self.rested_s += time.monotonic() - started


class PathTrainer:
    """Trains ``path`` of the run on ``dataset`` with ``averager`` (a :class:`peer.averaging.ModuleAverager`).

    ``fetch_state(module_id, like) -> ModuleState | None`` asks live holders for a module's state;
    ``outer`` overrides the run's outer config for this assignment (a larger H or a stronger codec
    for a slow link); the checkpoint still belongs to the run's config hash. ``cpu_limit`` rests
    between inner steps (:class:`CpuLimit`; default: no rest).
    """

    def __init__(
        self,
        cfg: RunConfig,
        path: tuple[int, ...],
        dataset: Any,
        device: torch.device,
        averager: Any,
        checkpoints: CheckpointDir,
        peer_id: str,
        status: PeerStatus,
        fetch_state: Optional[Callable[[str, list[torch.Tensor]], Any]] = None,
        outer: Optional[OuterConfig] = None,
        cpu_limit: Optional[CpuLimit] = None,
    ):
        self.cfg = cfg
        self.cpu_limit = cpu_limit or CpuLimit()
        self.path = cfg.lattice.check_path(path)
        self.dataset = dataset
        self.device = device
        self.averager = averager
        self.checkpoints = checkpoints
        self.peer_id = peer_id
        self.status = status
        self.module_ids = cfg.lattice.path_modules(self.path)
        self.lm = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=self.module_ids).to(device)
        self.model = self.lm.path_model(self.path)
        self.opt = DiLoCoOptimizer(
            modules=self.model.modules_by_id(),
            # the config, not a ready AdamW: the optimizer then warms the learning rate up and clips the
            # gradients as the simulator and the stage runner do (a peer joining onto trained modules with
            # a fresh AdamW took full-size steps on every weight from its first one)
            inner=cfg.inner,
            outer=outer or cfg.outer,
            lattice=cfg.lattice,
            averager=averager,
            join_ramp_rounds=JOIN_RAMP_ROUNDS,
            # beside a pipeline trainer or stage server, whose group forms only once it noticed us
            # waiting, exchanges run behind the next round instead of holding each round up
            overlap_beside_sparse=True,
        )
        self.opt.on_round_end = self._averaging
        self._fetch_state = fetch_state
        install_resync(self.opt, fetch_state)
        self.sources = self._adopt_state(fetch_state)
        seed = int.from_bytes(hashlib.sha256(f"{peer_id}/{format_path(self.path)}".encode()).digest()[:4], "little")
        self.batches = dataset.path_batches(self.path, "train", cfg.inner.batch_size, cfg.lattice.seq_len, seed)
        self.loss_ema: Optional[float] = None
        self.tokens = 0
        self.round_tokens: dict[str, int] = {m: 0 for m in self.module_ids}

    # -- state --------------------------------------------------------------------------------

    def _adopt_state(self, fetch_state: Optional[Callable]) -> list[StateSource]:
        """Per module, the newest of: our checkpoint (same run), a live holder, the seed's init."""
        snap = None
        try:
            snap = self.checkpoints.load_latest()
        except CheckpointError as e:
            log.warning("%s; loading state from peers instead", e)
        if snap is not None and snap.meta.get("config_hash") != self.cfg.content_hash():
            log.warning("checkpoint %s belongs to another run config; ignoring it", snap.path)
            snap = None
        sources = []
        for mid in self.module_ids:
            mod = self.model.modules_by_id()[mid]
            local = saved_state(snap, mid, [n for n, _ in mod.named_parameters()]) if snap is not None else None
            local_round = local.round_no if local is not None else -1
            remote = None
            if fetch_state is not None:
                like = [p.detach().cpu() for p in mod.parameters()]
                remote = fetch_state(mid, like)
            if remote is not None and remote.round_no > local_round:
                self.opt.load_module_state(mid, remote.global_params, remote.momentum, remote.round_no)
                sources.append(StateSource(mid, "peer", remote.round_no))
            elif local is not None:
                self.opt.load_module_state(mid, local.global_params, local.momentum, local_round)
                sources.append(StateSource(mid, "checkpoint", local_round))
            else:  # nobody holds it: the seed's init, or a held sibling's state (peer.node.fresh_start)
                like = [p.detach().cpu() for p in mod.parameters()]
                sources.append(StateSource(mid, start_fresh_module(self.opt, self.cfg.lattice, mid, like, fetch_state), 0))
        for s in sources:
            log.info("module %s: starting from %s (round %d)", s.module_id, s.origin, s.round_no)
        return sources

    def provide_state(self, module_id: str):
        """A module's replicated state for a newcomer (None for modules this path does not hold)."""
        return self.opt.module_state(module_id) if module_id in self.module_ids else None

    def snapshot_groups(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, str]], dict[str, int]]:
        """Tensors of a checkpoint (each module's global weights and outer momentum), their metadata,
        and the round of each module."""
        modules = self.model.modules_by_id()
        states = {mid: self.opt.module_state(mid) for mid in modules}
        names = {mid: [n for n, _ in mod.named_parameters()] for mid, mod in modules.items()}
        groups, metadata = state_groups(states, names, self.cfg.lattice.content_hash())
        return groups, metadata, {mid: st.round_no for mid, st in states.items()}

    def checkpoint(self) -> None:
        """Write the current global state; a failure is logged and training goes on."""
        groups, metadata, rounds = self.snapshot_groups()
        meta = SnapshotSummary.of(
            self.cfg, self.module_ids, paths=[format_path(self.path)], data_dir=str(self.dataset.dir.resolve()),
            manifest_hash=self.dataset.manifest_hash, rounds=rounds, peer_id=self.peer_id, tokens=self.tokens,
            unix_time=round(time.time(), 3),
        ).to_dict()
        save_snapshot(self.checkpoints, max(rounds.values()), groups, meta, metadata, self.status)

    # -- training -----------------------------------------------------------------------------

    def train_step(self) -> Optional[RoundReport]:
        """One inner step (and the outer round when one is due)."""
        x, y = next(self.batches)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with autocast(self.device):
            _, loss = self.model(x, y)
        loss.backward()
        value = float(loss.detach())
        if math.isfinite(value):
            self.loss_ema = value if self.loss_ema is None else 0.95 * self.loss_ema + 0.05 * value
        tokens = x.numel()
        self.tokens += tokens
        report = self.opt.step(tokens=tokens)  # its outer round sets the state "averaging" (_averaging)
        self.status.state = "training"
        self.opt.zero_grad(set_to_none=True)
        return report

    def _averaging(self) -> None:
        """The outer round began (at the round's budget, or early because another holder waits for
        us): the local status page shows it until the step returns."""
        self.status.state = "averaging"

    def run(self, should_stop: Callable[[], Optional[str]], on_round: Callable[[RoundReport], None]) -> str:
        """Train until ``should_stop()`` returns a reason; return it. Checkpoints after every round."""
        self.averager.serve_states(self.provide_state)
        for mid in self.module_ids:
            self.averager.hold(mid, self.opt.module_round(mid))
        started = time.monotonic()
        tokens_at_start = self.tokens
        self.status.state = "training"
        while True:
            reason = should_stop()
            if reason:
                return reason
            step_started = time.monotonic()
            report = self.train_step()
            if report is None:
                self.cpu_limit.after_step(time.monotonic() - step_started)
            elapsed = max(1e-6, time.monotonic() - started)
            self.status.step += 1
            self.status.loss = self.loss_ema
            self.status.tokens = self.tokens
            self.status.tokens_per_s = (self.tokens - tokens_at_start) / elapsed
            if report is not None:
                self._after_round(report)
                on_round(report)

    def _after_round(self, report: RoundReport) -> None:
        log.info("round %d: %s; waited %.2fs", report.round, "; ".join(
            f"{mid} r{m.round_no} {_outcome(m)}" for mid, m in report.modules.items()), report.wait_seconds)
        for mid, m in report.modules.items():
            self.status.bytes_sent += m.bytes_sent
            self.status.bytes_received += m.bytes_received
            self.status.group_sizes[mid] = m.group_size
        self.status.link.observe_round(report)
        resync_after_round(self.opt, report, self.averager, self._fetch_state)
        self.status.round_no = max(self.opt.module_round(m) for m in self.module_ids)
        self.checkpoint()

    def finish(self) -> None:
        """Apply exchanges in flight, checkpoint, and stop announcing our modules."""
        try:
            report = self.opt.flush()
            if report is not None:
                self._after_round(report)
            else:
                self.checkpoint()
        finally:
            self.opt.close()
            for mid in self.module_ids:
                self.averager.release(mid)


def _outcome(m: Any) -> str:
    """A module's round in the trainer's round line (``averaged by N``, ``(the only holder)`` when it
    had nobody to average with, or ``not applied (why)``); the chaos tests and benchmarks parse it."""
    if not m.applied:
        return f"not applied ({m.reason})"
    return f"averaged by {m.group_size}" + (" (the only holder)" if m.reason == LONE_HOLDER else "")
