"""DiLoCo/DiPaCo with K simulated workers in one process: the numerical reference.

DiLoCo (Douillard et al. 2023) alternates H inner AdamW steps on every worker with one outer step:
each worker's pseudo-gradient ``delta = global - local`` is averaged across workers and applied to
the global copy with Nesterov SGD. DiPaCo (Douillard et al. 2024) does this per module of a lattice:
a module is averaged among the workers whose paths contain it.

This simulator runs exactly the arithmetic the networked peers run (the codec a peer resolves,
:func:`peer.compression.resolve_codec`, entropy stage included; ``peer.outer``; ``peer.averaging.aggregate``),
so distributed runs can be checked against it.
For each module ``m`` and each worker ``k`` holding it, in worker order::

    x_k = delta_k + beta residual_k                  (error feedback; beta 1, or 0.95 for sparse codecs)
    sent_k = codec.roundtrip(flatten(x_k)); residual_k = x_k - sent_k
    avg = codec.roundtrip(sum_k w_k sent_k / sum_k w_k)      (w_k: tokens this round; or the run's
                                                     robust rule on the whole module, outer.aggregator)
    avg *= sqrt(len(paths_through(m)))               (only with outer.sqrt_sharing)
    OuterOptimizer.step(avg); sync_to every worker's copy of m
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from models.config import Path_, RunConfig, format_path
from models.lattice import ModularLM
from models.training import InnerLoop
from peer.averaging import Aggregation, aggregate, encode_aggregate
from peer.averaging import flatten, unflatten
from peer.compression import resolve_codec
from peer.outer import OuterOptimizer

__all__ = ["SimWorker", "RoundStats", "DiLoCoSimulator"]

log = logging.getLogger(__name__)

BatchFn = Callable[[int, Path_], Iterator[tuple[torch.Tensor, torch.Tensor]]]
StepCallback = Callable[[int, float, int], None]


@dataclass
class SimWorker:
    """One simulated worker: its path, its own copy of the path's modules and inner optimizer."""

    index: int
    path: Path_
    model: ModularLM
    loop: InnerLoop
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    residual: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0

    def module_params(self, module_id: str) -> list[torch.nn.Parameter]:
        return list(self.model.mods[module_id].parameters())


@dataclass
class RoundStats:
    """One round: mean loss per worker over its inner steps and the tokens each processed."""

    round_no: int
    losses: list[float]
    tokens: list[int]


class DiLoCoSimulator:
    """K workers over the given paths (worker ``k`` trains ``paths[k % len(paths)]``).

    ``batches(k, path)`` returns worker ``k``'s endless batch iterator. With ``outer_steps=False``
    there is one worker per path and no outer step: plain local training (the single-path baseline).
    """

    def __init__(self, cfg: RunConfig, paths: Sequence[Path_], workers: int, batches: BatchFn,
                 device: Union[str, torch.device] = "cpu", outer_steps: bool = True):
        if not paths:
            raise ValueError("train at least one path")
        if workers < len(paths):
            raise ValueError(f"{workers} workers cannot cover {len(paths)} paths; use --workers >= {len(paths)}")
        if not outer_steps and workers != 1:
            raise ValueError("training without outer steps needs exactly one worker")
        self.cfg = cfg
        self.paths = [cfg.lattice.check_path(p) for p in paths]
        self.device = torch.device(device)
        self.outer_steps = outer_steps
        self.codec = resolve_codec(cfg.outer)
        """The run's wire codec, entropy stage included, resolved as a peer resolves it."""
        self.aggregation = Aggregation.from_config(cfg.outer)
        self.workers: list[SimWorker] = []
        for k in range(workers):
            path = self.paths[k % len(self.paths)]
            model = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=cfg.lattice.path_modules(path)).to(self.device)
            pm = model.path_model(path)
            self.workers.append(SimWorker(k, path, model, InnerLoop(pm, cfg.inner, self.device), batches(k, path)))
        self.module_ids = [m for m in cfg.lattice.module_ids() if any(m in w.model.mods for w in self.workers)]
        self.outer: dict[str, OuterOptimizer] = {}
        for mid in self.module_ids:
            first = next(w for w in self.workers if mid in w.model.mods)
            self.outer[mid] = OuterOptimizer(first.module_params(mid), lr=cfg.outer.lr,
                                             momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov)
        self.round_no = 0
        self.steps_done = 0
        self.last_exchange: dict[str, tuple[dict, object]] = {}
        """Per module, the last round's decoded contributions by worker and their aggregate
        (:class:`peer.averaging.Reduced`): what a benchmark counts wire bytes from."""

    def holders(self, module_id: str) -> list[SimWorker]:
        """Workers whose path contains ``module_id``, in worker order (the reduction order)."""
        return [w for w in self.workers if module_id in w.model.mods]

    def inner_steps(self, steps: int, on_step: Optional[StepCallback] = None) -> RoundStats:
        """``steps`` inner steps on every worker (worker after worker, as independent machines would)."""
        B, T = self.cfg.inner.batch_size, self.cfg.lattice.seq_len
        losses, tokens = [], []
        for w in self.workers:
            total = torch.zeros((), device=self.device)
            for _ in range(steps):
                x, y = next(w.batches)
                total += w.loop.step(x.to(self.device), y.to(self.device))
            losses.append(float(total) / max(1, steps))
            tokens.append(steps * B * T)
            w.tokens += steps * B * T
        self.steps_done += steps
        if on_step is not None:
            on_step(self.steps_done, sum(losses) / len(losses), sum(tokens))
        return RoundStats(self.round_no, losses, tokens)

    @torch.no_grad()
    def outer_step(self, weights: Sequence[float]) -> None:
        """Average every module's pseudo-gradients among its holders and apply the outer step."""
        for mid in self.module_ids:
            holders = self.holders(mid)
            opt = self.outer[mid]
            sent = []
            for w in holders:
                x = flatten(opt.pseudo_gradient(w.module_params(mid)))  # (numel,)
                if self.cfg.outer.error_feedback:
                    r = w.residual.get(mid, torch.zeros_like(x))
                    x = x + (r if self.codec.feedback_decay == 1.0 else r * self.codec.feedback_decay)
                s = self.codec.roundtrip(x)  # (numel,)
                if self.cfg.outer.error_feedback:
                    w.residual[mid] = x - s
                sent.append(s)
            contributions = {f"{w.index:06d}": (s, float(weights[w.index])) for w, s in zip(holders, sent)}
            reduced = aggregate(contributions, self.aggregation)
            reply = encode_aggregate(self.codec, reduced, contributions, self.aggregation)
            self.last_exchange[mid] = (contributions, reduced)
            avg = self.codec.decode_average(reply, reduced.value.numel())
            if self.cfg.outer.sqrt_sharing:
                avg = avg * math.sqrt(len(self.cfg.lattice.paths_through(mid)))
            opt.step(unflatten(avg, opt.global_params))
            for w in holders:
                opt.sync_to(w.module_params(mid))
        self.round_no += 1

    def train(self, total_steps: int, on_step: Optional[StepCallback] = None) -> list[RoundStats]:
        """Run ``total_steps`` inner steps per worker in rounds of ``outer.inner_steps`` (the last may be
        shorter), with an outer step after each round; without outer steps, one long round."""
        if total_steps < 1:
            raise ValueError(f"steps must be >= 1, got {total_steps}")
        H = self.cfg.outer.inner_steps if self.outer_steps else total_steps
        rounds = []
        done = 0
        while done < total_steps:
            n = min(H, total_steps - done)
            # Step one inner step at a time across workers so the progress callback ticks per step.
            stats = RoundStats(self.round_no, [0.0] * len(self.workers), [0] * len(self.workers))
            for _ in range(n):
                s = self.inner_steps(1, on_step)
                stats.losses = [a + b / n for a, b in zip(stats.losses, s.losses)]
                stats.tokens = [a + b for a, b in zip(stats.tokens, s.tokens)]
            if self.outer_steps:
                self.outer_step(stats.tokens)
                log.debug("round %d: losses %s", stats.round_no, [f"{l:.3f}" for l in stats.losses])
            rounds.append(stats)
            done += n
        return rounds

    def global_state(self, module_id: str) -> dict[str, torch.Tensor]:
        """The module's global (outer) weights by name; without outer steps, worker 0's weights."""
        first = self.holders(module_id)[0]
        names = [n for n, _ in first.model.mods[module_id].named_parameters()]
        if not self.outer_steps:
            return {n: p.detach().cpu().clone() for n, p in first.model.mods[module_id].named_parameters()}
        return {n: g.clone() for n, g in zip(names, self.outer[module_id].global_params)}

    def global_model(self) -> ModularLM:
        """A CPU ``ModularLM`` of the trained modules holding their global weights."""
        model = ModularLM(self.cfg.lattice, seed=self.cfg.seed, module_ids=self.module_ids)
        for mid in self.module_ids:
            model.load_module_state(mid, self.global_state(mid))
        return model

    def describe(self) -> str:
        return ", ".join(f"worker {w.index}: path {format_path(w.path)}" for w in self.workers)
