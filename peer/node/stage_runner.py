"""Stage mode inside a peer: ``run_stage_server`` and ``run_stage_trainer``, the entry points
:class:`peer.node.PeerNode` calls for a stage assignment (SWARM parallelism, Ryabinin et al. 2023).

- A **stage server** serves one block module (:class:`peer.stage.server.StageServer`). Before
  serving it loads the module's state: from live holders of the module when they are ahead of its
  own checkpoint, else from the checkpoint, else the shared initialisation. It checkpoints after
  every outer round and serves its state to newcomers.
- A **stage trainer** (:class:`StageTrainer`) holds a path's embedding and head and pushes the
  path's data through the servers of its levels with a :class:`peer.stage.client.StageClient`;
  its embedding and head average with their other holders like any path-mode module.

Both run until ``should_stop()`` returns a reason, then flush, checkpoint, stop announcing, and
return that reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from models.checkpoint.summary import SnapshotSummary
from models.config import OuterConfig, RunConfig, format_path
from models.lattice import ModularLM
from models.training import autocast
from peer.node.checkpoint import CheckpointDir, CheckpointError, saved_state, state_groups
from peer.node.fresh_start import start_fresh_module
from peer.diloco import JOIN_RAMP_ROUNDS, DiLoCoOptimizer, RoundReport
from peer.node.progress import PeerStatus, ProgressView
from peer.diloco import FetchState, PlanBook, install_resync, resync_after_round
from peer.stage import DEFAULT_ACTIVATION_CODEC, StageClient, StageUnavailable
from peer.stage import StageServer, StageServerOptions
from peer.stage.activity import IdleHolds, ServedRate

__all__ = ["StageTrainer", "run_stage_server", "run_stage_trainer", "adopt_states", "save_states", "failover_events",
           "detour", "whole_pipeline", "DETOUR_CHECK"]

log = logging.getLogger(__name__)

_POLL = 0.2  # seconds between should_stop() checks of an idle stage server (a control-loop poll)


def adopt_states(cfg: RunConfig, opt: DiLoCoOptimizer, modules: dict[str, nn.Module],
                 checkpoints: Optional[CheckpointDir], fetch_state: Optional[FetchState]) -> dict[str, str]:
    """Per module, load the newest of: a live holder's state, our checkpoint (same run), the seed's
    init. Returns ``module_id -> "peer@R" | "checkpoint@R" | "init" | "sibling:ID@R"``."""
    snap = None
    if checkpoints is not None:
        try:
            snap = checkpoints.load_latest()
        except CheckpointError as e:
            log.warning("%s; loading state from peers instead", e)
    if snap is not None and snap.meta.get("config_hash") != cfg.content_hash():
        log.warning("checkpoint %s belongs to another run config; ignoring it", snap.path)
        snap = None
    origins = {}
    for mid, mod in modules.items():
        local = saved_state(snap, mid, [n for n, _ in mod.named_parameters()]) if snap is not None else None
        local_round = local.round_no if local is not None else -1
        like = [p.detach().cpu() for p in mod.parameters()]
        # not joining: a stage server or trainer holds its modules idle until it is driven
        # (:class:`peer.stage.activity.IdleHolds`), so the holders we fetch from must not wait for our
        # declarations meanwhile; once driven, it joins the rounds and re-syncs if it fell behind
        remote = fetch_state(mid, like, joining=False) if fetch_state is not None else None
        if remote is not None and remote.round_no > local_round:
            opt.load_module_state(mid, remote.global_params, remote.momentum, remote.round_no)
            origins[mid] = f"peer@{remote.round_no}"
        elif local is not None:
            opt.load_module_state(mid, local.global_params, local.momentum, local.round_no)
            origins[mid] = f"checkpoint@{local_round}"
        else:  # nobody holds it: the seed's init, or a held sibling's state (peer.node.fresh_start)
            origins[mid] = start_fresh_module(opt, cfg.lattice, mid, like, fetch_state)
        log.info("module %s: starting from %s", mid, origins[mid])
    return origins


def save_states(cfg: RunConfig, opt: DiLoCoOptimizer, modules: dict[str, nn.Module], checkpoints: CheckpointDir,
                extra: dict[str, Any]) -> None:
    """Checkpoint the global copies and outer momentum of ``modules``; a failure is logged, not raised."""
    states = {mid: opt.module_state(mid) for mid in modules}
    names = {mid: [n for n, _ in mod.named_parameters()] for mid, mod in modules.items()}
    groups, metadata = state_groups(states, names, cfg.lattice.content_hash())
    rounds = {mid: state.round_no for mid, state in states.items()}
    extra = dict(extra)
    meta = SnapshotSummary.of(cfg, list(modules), paths=extra.pop("paths", ()), rounds=rounds,
                              unix_time=round(time.time(), 3), **extra).to_dict()
    try:
        checkpoints.save(max(rounds.values()), groups, meta, metadata)
    except CheckpointError as e:
        log.error("%s", e)


class StageTrainer:
    """Trains a path whose blocks live on stage servers: embed and head here, levels remote.

    One :meth:`train_step` takes a batch of ``cfg.inner.batch_size`` sequences, splits it into
    ``micro_batches`` chunks that travel the pipeline concurrently, backpropagates each through the
    servers of every level in reverse, and steps the embed/head inner optimizer on the mean
    gradient (outer rounds inside :class:`peer.diloco.DiLoCoOptimizer`). Each level's forward and
    backward name the codec the client's scheme gives that level (:class:`peer.stage.wire.CodecScheme`:
    e.g. a richer codec for the embedding's output into level 0); its server answers in it.

    Drawing from the path's shard, a step launches the next step's micro-batches before it waits on
    its own, so two steps' micro-batches are in flight and the servers never wait on this trainer's
    optimizer step (as in SWARM, where trainers keep micro-batches flowing): the next step's may read
    the embedding before this step updates it, one step stale, as the servers' modules are. Each
    micro-batch returns its own gradients, summed per step, so no step's gradient mixes with
    another's. ``overlap``: the embedding's and head's exchanges run behind the next round (a
    trainer's steps are seconds apart, and a synchronous exchange would stop its micro-batches for
    the whole exchange every round), as a stage server's do.
    """

    def __init__(self, cfg: RunConfig, path: tuple[int, ...], client: StageClient, device: torch.device,
                 averager: Any = None, dataset: Any = None, micro_batches: int = 1, seed: int = 0,
                 outer: Optional[OuterConfig] = None, overlap: bool = True):
        self.cfg = cfg
        self.path = cfg.lattice.check_path(path)
        ids = cfg.lattice.path_modules(self.path)
        self.embed_id, self.head_id, self.levels = ids[0], ids[-1], ids[1:-1]
        self.device = torch.device(device)
        lm = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=[self.embed_id, self.head_id]).to(self.device)
        self.embed, self.head = lm.mods[self.embed_id], lm.mods[self.head_id]
        self.modules = {self.embed_id: self.embed, self.head_id: self.head}
        self.opt = DiLoCoOptimizer(self.modules, inner=cfg.inner,
                                   outer=dataclasses.replace(outer or cfg.outer, overlap=overlap),
                                   lattice=cfg.lattice, averager=averager, join_ramp_rounds=JOIN_RAMP_ROUNDS,
                                   paced_min_share=0.0)  # steps far apart: a waiting holder is answered at once
        self._params = [p for m in self.modules.values() for p in m.parameters()]
        self._embed_params = list(self.embed.parameters())
        self._values = threading.Lock()
        """Held while a micro-batch's graph reads the embedding's or head's values (the head's forward
        and backward) and while the optimizer rewrites them: an inner step never lands inside one."""
        self._ahead: Optional[_Launched] = None
        """The next step's micro-batches, launched beside this step's."""
        self.client = client
        self.scheme = client.scheme
        """Which codec each level's requests name (``run_stage_trainer``'s ``codec``, resolved by the client)."""
        self.micro_batches = max(1, min(micro_batches, cfg.inner.batch_size))
        self._pool = ThreadPoolExecutor(max_workers=2 * self.micro_batches,  # this step's and the next's
                                        thread_name_prefix="stage-micro")
        self._dataset, self._seed = dataset, seed
        self.driving = self.path
        """The path whose servers the next launched micro-batches cross: the assigned one, or a detour
        (:meth:`drive`) while one of its levels has no server."""
        self._shards: dict[tuple[int, ...], Any] = {}
        """Each driven path's batch iterator but the current one's, so a path resumes where it left off."""
        self.batches = None
        if dataset is not None:
            self.batches = self._path_batches(self.path)
        self.tokens = 0
        self.before_step: Optional[Callable[[], None]] = None
        """Called once a batch went through the whole pipeline, before the optimizer steps on it."""
        self.pace_interval = 0.25
        """Seconds between checks, while a step's micro-batches are in flight, for a holder waiting on
        our round."""
        self.on_round: Optional[Callable[[RoundReport], None]] = None
        """Called with each outer round's report as the round ends (in a step, or during one)."""
        self.holding: Callable[[], bool] = lambda: True
        """Whether the embedding and head are held in rounds now: a round ends during a step only then.
        While they are announced idle the other holders neither wait for them nor count them, so a
        round this trainer ended then could meet another idle holder's alone: a second average of
        that round (the first step after a pause holds them again, before the optimizer steps)."""

    def _path_batches(self, path: tuple[int, ...]) -> Any:
        cfg = self.cfg
        return self._dataset.path_batches(path, "train", cfg.inner.batch_size, cfg.lattice.seq_len, self._seed)

    def drive(self, path: tuple[int, ...]) -> None:
        """Send the micro-batches launched from now on through ``path``'s servers, on its shard's data
        (those in flight finish on the path they were launched on). Only with a shared embedding and
        head (``lattice.shared_embed``): they are every path's, so any path can be driven with them."""
        path = self.cfg.lattice.check_path(path)
        if path == self.driving:
            return
        if not self.cfg.lattice.shared_embed:
            raise ValueError(f"path {format_path(path)} has its own embedding and head, which this trainer does not hold")
        self._shards[self.driving] = self.batches
        self.batches = self._shards.pop(path, None)
        if self.batches is None and self._dataset is not None:
            self.batches = self._path_batches(path)
        self.driving, self.levels = path, self.cfg.lattice.path_modules(path)[1:-1]

    def _micro(self, x: torch.Tensor, y: torch.Tensor, scale: float,
               levels: list[str]) -> tuple[float, list[Optional[torch.Tensor]]]:
        """Forward and backward of one micro-batch x, y (b, T) through the servers of ``levels`` (one
        module per level); returns its loss and its gradients (scaled by ``scale``), one per parameter
        of ``self._params`` (None: unused)."""
        with self._values, autocast(self.device):
            h0 = self.embed(x)  # (b, T, C); its backward reads the token ids, not the weights
        h, hops = h0.detach(), []
        for level, mid in enumerate(levels):
            h, hop = self.client.forward(mid, h, codec=self.scheme.forward(level))  # (b, T, C) CPU fp32
            hops.append(hop)
        top = h.to(self.device).requires_grad_(True)  # (b, T, C)
        with self._values:
            with autocast(self.device):
                logits = self.head(top, self.embed.tok.weight)  # (b, T, V)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
            grad, *grads = torch.autograd.grad(loss * scale, [top, *self._params], allow_unused=True)  # grad: (b, T, C)
        for level in reversed(range(len(hops))):
            grad = self.client.backward(hops[level], grad, codec=self.scheme.backward(level))  # (b, T, C)
        embed_grads = torch.autograd.grad(h0, self._embed_params, grad.to(device=h0.device, dtype=h0.dtype),
                                          allow_unused=True)
        for i, g in enumerate(embed_grads):  # the embedding's parameters come first in self._params
            if g is not None:
                grads[i] = g if grads[i] is None else grads[i] + g
        return float(loss.detach()), grads

    def _launch(self, x: torch.Tensor, y: torch.Tensor) -> "_Launched":
        """Send the micro-batches of x, y (B, T) into the pipeline of the driven path (at each server they
        queue after the requests already there)."""
        x, y = x.to(self.device), y.to(self.device)
        chunks = list(zip(x.chunk(self.micro_batches), y.chunk(self.micro_batches)))
        levels = list(self.levels)  # a later drive() does not reroute these
        futures = [self._pool.submit(self._micro, cx, cy, cx.shape[0] / x.shape[0], levels) for cx, cy in chunks]
        return _Launched(x.numel(), [cx.shape[0] / x.shape[0] for cx, _ in chunks], futures)

    def _drop_ahead(self) -> None:
        """Forget the next step's micro-batches (a failed step's pipeline is not to be trusted)."""
        if self._ahead is not None:
            for f in self._ahead.futures:
                f.cancel()
            wait(self._ahead.futures)
            self._ahead = None

    def train_step(self, x: Optional[torch.Tensor] = None, y: Optional[torch.Tensor] = None) -> tuple[float, list[RoundReport]]:
        """One inner step on ``x, y`` (B, T) (default: the next batch of the path's shard): mean loss
        and the reports of the outer rounds that ended during it (none, usually).

        A step waits for its micro-batches to cross every level twice, seconds on a busy pipeline. When
        another holder of the embedding or head already waits to average the current round meanwhile,
        the round ends while the micro-batches are in flight
        (:meth:`peer.diloco.DiLoCoOptimizer.end_round_if_others_wait`) instead of holding that holder
        past its gather deadline, where its round would fail. The outer step lands between micro-batches'
        reads of the values, so those still in flight finish on a mix of the two, and this step's
        gradient lands on the new values: one slightly stale inner step, as in overlapped DiLoCo.

        Without ``x``, the next batch's micro-batches are launched beside this one's before it waits,
        and the next call steps on them."""
        if x is None:
            step = self._ahead if self._ahead is not None else self._launch(*next(self.batches))
            self._ahead = self._launch(*next(self.batches))
        else:
            step = self._launch(x, y)
        futures = step.futures
        reports: list[RoundReport] = []
        try:
            in_flight = set(futures)
            while in_flight:
                _, in_flight = wait(in_flight, timeout=self.pace_interval)
                if in_flight and self.holding() and not any(f.done() and f.exception() is not None
                                                            for f in futures):
                    with self._values:
                        ended = self.opt.end_round_if_others_wait(sparse=True)
                    self._ended(ended, reports)
            results = [f.result() for f in futures]
        except StageUnavailable:
            wait(futures)
            self._drop_ahead()
            raise
        loss = sum(l * share for (l, _), share in zip(results, step.shares))
        if self.before_step is not None:
            self.before_step()
        self.tokens += step.tokens
        with self._values:
            for p, gs in zip(self._params, zip(*(g for _, g in results))):
                gs = [g for g in gs if g is not None]
                p.grad = torch.stack(gs).sum(0) if gs else None
            report = self.opt.step(tokens=step.tokens)
            self.opt.zero_grad(set_to_none=True)
        self._ended(report, reports)
        return loss, reports

    def _ended(self, report: Optional[RoundReport], reports: list[RoundReport]) -> None:
        if report is not None:
            reports.append(report)
            if self.on_round is not None:
                self.on_round(report)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead = None
        self.opt.close()


@dataclasses.dataclass
class _Launched:
    """One step's micro-batches in the pipeline: its tokens, each chunk's share of the batch, and
    their futures (each a loss and gradients, :meth:`StageTrainer._micro`)."""

    tokens: int
    shares: list[float]
    futures: list[Future]


def _fetcher(averager: Any, timeout: float) -> Optional[FetchState]:
    if not hasattr(averager, "fetch_state"):
        return None

    def fetch(mid: str, like: list[torch.Tensor], accept: Any = None, min_round: int = -1, joining: bool = True) -> Any:
        try:
            return averager.fetch_state(mid, timeout=timeout, like=like, accept=accept, min_round=min_round,
                                        joining=joining)
        except Exception as e:  # no live holder yet: start from the checkpoint or the init
            log.info("no live holder sent %s (%s)", mid, e)
            return None

    return fetch


def run_stage_server(cfg: RunConfig, module_id: str, dataset: Any, device: torch.device, dht: Any, averager: Any,
                     checkpoints: Optional[CheckpointDir], should_stop: Callable[[], Optional[str]],
                     status: Optional[PeerStatus] = None, outer: Optional[OuterConfig] = None,
                     options: StageServerOptions = StageServerOptions(), event_hook: Any = None,
                     after_round: Optional[Callable[[RoundReport], None]] = None,
                     plans: Optional[PlanBook] = None) -> str:
    """Serve ``module_id`` as a pipeline stage until ``should_stop()`` returns a reason; return it.

    ``dataset``: the run's dataset (its manifest hash goes into checkpoints; None is fine);
    ``averager``: the process's NetAverager (or any ModuleAverager); ``outer``: the assignment's
    outer config (H, codec) if it overrides the run's; ``after_round``: called with each round's
    report once it is applied and checkpointed (the peer's round events); ``plans``: the
    coordinator's exchange plans (:class:`peer.diloco.PlanBook`) the module's rounds follow.
    """
    status = status if status is not None else PeerStatus()
    extra = {"peer_id": getattr(averager, "peer_id", ""), "stage": module_id}
    if dataset is not None:
        extra["data"] = {"dir": str(dataset.dir.resolve()), "manifest_hash": dataset.manifest_hash}
    server: Optional[StageServer] = None

    fetch = _fetcher(averager, (outer or cfg.outer).round_timeout)

    def on_round(report: RoundReport) -> None:
        resync_after_round(server.opt, report, averager, fetch, join_late=False)  # no exchange inside a request
        status.round_no = server.opt.module_round(module_id)
        for mid, m in report.modules.items():
            status.group_sizes[mid] = m.group_size
            status.bytes_sent += m.bytes_sent
            status.bytes_received += m.bytes_received
        status.link.observe_round(report)
        if checkpoints is not None:
            save_states(cfg, server.opt, {module_id: server.module}, checkpoints, extra)
        if after_round is not None:
            after_round(report)

    server = StageServer(cfg, module_id, dht, averager, device, options, outer, event_hook, on_round)
    server.opt.plans = plans
    adopt_states(cfg, server.opt, {module_id: server.module}, checkpoints, fetch)
    install_resync(server.opt, fetch, wait=0.0)  # never a poll in the request that completed a step
    if hasattr(averager, "serve_states"):
        averager.serve_states(server.opt.module_state)
    status.mode, status.assignment, status.state = "stage", module_id, "waiting"
    server.start()
    log.info("serving %s; waiting for a trainer to drive it (it holds back no round meanwhile)", module_id)
    served, wake = ServedRate(), threading.Event()
    try:
        while True:
            reason = should_stop()
            if reason:
                return reason
            status.step = server.counts["step"]
            status.tokens = server.tokens_trained
            status.tokens_per_s = served.rate(server.tokens_trained)
            status.capacity_tokens_per_s = server.throughput if server.tokens_trained else 0.0
            status.busy_seconds = round(server.busy_seconds, 3)
            status.state = "waiting" if server.holds is not None and server.holds.paused else "training"
            wake.wait(_POLL)
    finally:
        status.state = "draining"
        server.close()
        status.step, status.tokens = server.counts["step"], server.tokens_trained  # the last poll's may lag
        status.busy_seconds = round(server.busy_seconds, 3)
        if checkpoints is not None:
            save_states(cfg, server.opt, {module_id: server.module}, checkpoints, extra)
        if hasattr(averager, "release"):
            averager.release(module_id)


DETOUR_CHECK = 5.0
"""Seconds between a detoured trainer's looks at whether its own pipeline has a server on every level
again (each look reads the DHT records of that path's modules)."""

_DETOUR_CANDIDATES = 64
"""Paths looked at per detour (bounds the cost on a large lattice)."""


def whole_pipeline(client: StageClient, cfg: RunConfig, path: tuple[int, ...]) -> bool:
    """Whether every level of ``path`` has a server ``client`` may send to now."""
    return all(client.usable(m) for m in cfg.lattice.path_modules(path)[1:-1])


def detour(client: StageClient, cfg: RunConfig, driving: tuple[int, ...], home: tuple[int, ...],
           has_data: Callable[[tuple[int, ...]], bool]) -> Optional[tuple[int, ...]]:
    """A path other than ``driving`` whose every level has a usable server and whose shard this peer
    holds: ``home`` when it qualifies, else the one whose least-served level has the most servers
    (ties: path order); None when there is none."""
    lattice = cfg.lattice
    served: list[list[tuple[int, int]]] = []  # per level, (module index, usable servers) of served modules
    for level in range(lattice.levels):
        row = [(i, len(client.usable(lattice.block_id(level, i)))) for i in range(lattice.modules_per_level)]
        served.append([(i, n) for i, n in row if n > 0])
    best: Optional[tuple[bool, int, tuple[int, ...]]] = None
    for combo in itertools.islice(itertools.product(*served), _DETOUR_CANDIDATES):
        path = tuple(i for i, _ in combo)
        if path == tuple(driving) or not has_data(path):
            continue
        key = (path != tuple(home), -min(n for _, n in combo), path)
        best = key if best is None or key < best else best
    return None if best is None else best[2]


def failover_events(view: ProgressView) -> Callable[[str, str, Optional[str], str], None]:
    """A :class:`peer.stage.StageClient` ``on_failover`` that shows each failover as a ``failover``
    event on ``view`` (:data:`peer.node.progress.EVENTS`)."""

    def report(module_id: str, from_server: str, to_server: Optional[str], reason: str) -> None:
        view.event("failover", module=module_id, from_server=from_server, to_server=to_server, reason=reason)

    return report


def run_stage_trainer(cfg: RunConfig, path: tuple[int, ...], dataset: Any, device: torch.device, dht: Any,
                      averager: Any, checkpoints: Optional[CheckpointDir], should_stop: Callable[[], Optional[str]],
                      status: Optional[PeerStatus] = None, outer: Optional[OuterConfig] = None,
                      codec: str = DEFAULT_ACTIVATION_CODEC,
                      micro_batches: int = 1, request_timeout: float = 10.0,
                      on_step: Optional[Callable[["StageTrainer", float], None]] = None,
                      view: Optional[ProgressView] = None, idle_timeout: float = 10.0,
                      call_timeout: Optional[float] = None,
                      after_round: Optional[Callable[[RoundReport], None]] = None,
                      plans: Optional[PlanBook] = None, vacant_timeout: Optional[float] = None,
                      has_data: Optional[Callable[[tuple[int, ...]], bool]] = None) -> str:
    """Train ``path`` through stage servers (holding its embed and head) until ``should_stop()``
    returns a reason; return it. ``codec``: activations' and gradients' codec; ``micro_batches``:
    chunks of each batch in flight at once; ``on_step(trainer, loss)`` is called after every step;
    ``view``: the progress view that shows a ``failover`` event whenever a request leaves a failed
    server (they are logged either way). ``idle_timeout``: seconds without a step through the whole
    pipeline after which the embedding and head are announced idle (held in rounds again at the next step);
    ``call_timeout``: seconds a forward or backward may wait for a server of its level (default
    ``max(60, 3 * request_timeout)``); when none answers, the step is dropped and the trainer waits.
    ``after_round``: called with each round's report once it is applied and checkpointed.
    ``plans``: the coordinator's exchange plans the embedding's and head's rounds follow.

    **Detours.** With a shared embedding and head (``lattice.shared_embed``) they are every path's, so
    when a level of ``path`` has no usable server for ``vacant_timeout`` seconds (default: the whole
    ``call_timeout``) the trainer drives another path whose levels all have one, on that path's shard
    (``has_data(path)``: whether this peer holds it; default, every path of ``dataset``), instead of
    pausing until the coordinator refills the level. It looks again every :data:`DETOUR_CHECK` seconds
    and goes back once ``path`` has a server on every level. Each switch is logged and shown as a
    ``detour`` event on ``view``."""
    status = status if status is not None else PeerStatus()
    peer_id = getattr(averager, "peer_id", "") or "trainer"
    seed = int.from_bytes(hashlib.sha256(f"{peer_id}/{format_path(tuple(path))}".encode()).digest()[:4], "little")
    client = StageClient(dht, cfg.run_id, cfg.content_hash(), codec=codec, request_timeout=request_timeout, seed=seed,
                         call_timeout=call_timeout or max(60.0, 3 * request_timeout), vacant_timeout=vacant_timeout,
                         on_failover=failover_events(view) if view is not None else None)
    trainer = StageTrainer(cfg, path, client, device, averager, dataset, micro_batches, seed, outer)
    trainer.opt.plans = plans
    extra = {"peer_id": peer_id, "paths": [format_path(trainer.path)]}
    fetch = _fetcher(averager, (outer or cfg.outer).round_timeout)
    adopt_states(cfg, trainer.opt, trainer.modules, checkpoints, fetch)
    install_resync(trainer.opt, fetch)
    if hasattr(averager, "serve_states"):
        averager.serve_states(trainer.opt.module_state)
    # the embedding and head are held in rounds only while batches get through the whole pipeline
    holds = IdleHolds(averager, list(trainer.modules), trainer.opt.module_round, idle_timeout,
                      f"trainer of {format_path(trainer.path)}")
    trainer.before_step = holds.active

    def on_round(report: RoundReport) -> None:
        resync_after_round(trainer.opt, report, averager, fetch)
        status.round_no = max(trainer.opt.module_round(m) for m in trainer.modules)
        status.link.observe_round(report)
        if checkpoints is not None:
            save_states(cfg, trainer.opt, trainer.modules, checkpoints, extra)
        if after_round is not None:
            after_round(report)

    trainer.on_round = on_round
    trainer.holding = lambda: not holds.paused  # as a stage server's pace loop: no round ends while idle
    status.mode, status.assignment, status.state = "trainer", format_path(trainer.path), "waiting"
    served, loss_ema, waiting = ServedRate(), None, ""
    home = trainer.path
    held = {tuple(q) for q in dataset.paths} if dataset is not None else set()
    holds_data = has_data or (lambda p: tuple(p) in held)
    can_detour = cfg.lattice.shared_embed and trainer.batches is not None
    look_home_at = 0.0

    def switch(to: tuple[int, ...], reason: str) -> None:
        was = trainer.driving
        trainer.drive(to)
        log.info("driving pipeline %s instead of %s: %s", format_path(to), format_path(was), reason)
        if view is not None:
            view.event("detour", from_path=format_path(was), to_path=format_path(to), reason=reason)

    try:
        while True:
            reason = should_stop()
            if reason:
                return reason
            if trainer.driving != home and time.monotonic() >= look_home_at:
                look_home_at = time.monotonic() + DETOUR_CHECK
                if whole_pipeline(client, cfg, home):
                    switch(home, f"pipeline {format_path(home)} has a server on every level again")
            try:
                loss, _ = trainer.train_step()
            except StageUnavailable as e:  # the coordinator refills the level (or new servers join): wait
                other = detour(client, cfg, trainer.driving, home, holds_data) if can_detour else None
                if other is not None:
                    look_home_at = time.monotonic() + DETOUR_CHECK
                    switch(other, f"pipeline {format_path(trainer.driving)} paused: {e}")
                    continue
                why = f"pipeline {format_path(trainer.driving)} paused: {e}"
                if why != waiting:
                    log.warning("%s; its step is dropped, and the trainer waits for a server", why)
                waiting, status.state = why, "waiting"
                status.tokens_per_s = served.rate(trainer.tokens)
                holds.pause("its pipeline lacks a server")
                continue
            if waiting:
                log.info("pipeline %s runs again", format_path(trainer.driving))
            waiting, status.state = "", "training"
            if math.isfinite(loss):
                loss_ema = loss if loss_ema is None else 0.95 * loss_ema + 0.05 * loss
            status.step += 1
            status.loss, status.tokens = loss_ema, trainer.tokens
            status.tokens_per_s = served.rate(trainer.tokens)
            status.bytes_sent, status.bytes_received = client.stats.bytes_sent, client.stats.bytes_received
            status.failovers = client.stats.failovers
            if on_step is not None:
                on_step(trainer, loss)
    finally:
        status.state = "draining"
        holds.close()
        trainer.close()
        client.close()
        if checkpoints is not None:
            save_states(cfg, trainer.opt, trainer.modules, checkpoints, extra)
        if hasattr(averager, "release"):
            for mid in trainer.modules:
                averager.release(mid)
