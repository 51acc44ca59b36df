"""Benchmark ``bench.joiners``: what a newcomer does to the modules it shares, in one process.

The demo lattice (2x2, byte tokenizer, the built-in corpus prepared for it), 3 peers on paths 0,0,
0,1 and 0,0 (L0M1 held by nobody), trained until the network's validation bits per byte flatten
(the mean over held paths improved by less than 1% over the last 3 rounds, or ``--warm-rounds``);
then, one at a time, each followed by ``--window`` rounds:

1. **join_fresh**: a peer joins on 1,0, whose L0M1 nobody holds (the fresh module starts by the
   release's rule, :mod:`peer.node.fresh_start`, or ``--fresh``), sharing L1M0, embed and head;
2. **join_held**: a peer joins on 0,1, a fully held path (every module loaded from a holder);
3. **move**: the third peer leaves 0,0 and trains 1,1 with a new optimizer (as a rebalanced peer
   does: its modules loaded from their holders).

Every peer is a real :class:`peer.diloco.DiLoCoOptimizer` over the real modules (``models.lattice``),
with the demo preset's inner and outer settings, codec and error feedback, and the newcomer ramp
(:func:`peer.diloco.ramp_factor`, ``--ramp``); modules are averaged by the in-process
:class:`peer.averaging.LocalAverager` (the same reduction and codec bytes as the network's
all-reduce, members as threads), so the figures isolate the training dynamics from the network and
are deterministic for a seed. After every round each held path is scored as the archive scores its
snapshots: the routed validation documents of that path (at most ``--eval-docs``), with the modules'
global copies.

Keys (each the worst over seeds):

- ``sharer_bpb_rise_max``: the largest rise of the validation bits per byte of any other path a peer
  trains, within the window after a newcomer arrives (a join, or a moved peer taking up its new
  path), relative to its value just before (target <= 0.01; negative: every other path kept
  improving). The path a moved peer left is not a sharer of what the newcomer does: it lost a
  trainer, and its figure is reported apart.
- ``left_path_bpb_rise_max``: the same for the path a moved peer left, which keeps its other
  trainers but now weighs less in the modules it shares (averages are weighted by tokens).
- ``network_bpb_change``: per event, the relative change of the mean bits per byte over the paths
  held both before the event and at the window's end (whether the network as a whole gained).
- ``joiner_rounds_to_network_bpb``: per event, rounds until the newcomer's path is within 5% of the
  mean of the other paths peers train (None: not within the window).
- ``replica_max_abs_diff``: over every round and module, the largest difference between two holders'
  global copies (target 0).

``--compare`` runs the same seeds again with the fresh module at the seed's init and no ramp (the
behaviour before either guard) and reports its keys beside.

Run: ``python -m bench.joiners`` (3 seeds); ``--quick`` for one seed and short windows.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from bench.common import emit, run_main
from models.config import RunConfig, format_path
from models.corpus import default_corpus
from models.data import Dataset, prepare
from models.evaluate import bits_per_byte
from models.lattice import ModularLM
from models.presets import demo
from peer.averaging import LocalAverager
from peer.diloco import JOIN_RAMP_ROUNDS, DiLoCoOptimizer
from peer.node.fresh_start import FRESH_START, FRESH_STARTS, start_fresh_module

MEASURES = (
    "bench/joiners.py",
    "models",
    "peer/diloco",
    "peer/averaging",
    "peer/compression",
    "peer/outer",
    "peer/node/fresh_start.py",
)
"""The code this benchmark's figures depend on (``python -m bench.report`` marks results stale after it changed)."""

START = {"A": (0, 0), "B": (0, 1), "C": (0, 0)}
EVENTS = (("join_fresh", "J1", (1, 0), None), ("join_held", "J2", (0, 1), None), ("move", "C2", (1, 1), "C"))
"""(event, the newcomer, its path, the peer it replaces)."""


class Peer:
    """One simulated peer: its path's modules, a DiLoCo optimizer on the shared hub, its batches."""

    def __init__(self, name: str, path: tuple[int, ...], cfg: RunConfig, hub: LocalAverager, dataset: Dataset,
                 seed: int, ramp: int):
        self.name, self.path = name, path
        ids = cfg.lattice.path_modules(path)
        self.lm = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=ids)
        self.model = self.lm.path_model(path)
        self.opt = DiLoCoOptimizer(self.model.modules_by_id(), inner=cfg.inner, outer=cfg.outer, lattice=cfg.lattice,
                                   averager=hub.member(name, ids), join_ramp_rounds=ramp)
        self.batches = dataset.path_batches(path, "train", cfg.inner.batch_size, cfg.lattice.seq_len,
                                            seed * 1000 + sum(map(ord, name)))
        self.failed = ""

    def round(self, steps: int) -> None:
        """Inner steps until the optimizer ends a round (at most ``steps``)."""
        for _ in range(steps):
            x, y = next(self.batches)
            _, loss = self.model(x, y)
            loss.backward()
            report = self.opt.step(tokens=x.numel())
            self.opt.zero_grad(set_to_none=True)
            if report is not None:
                bad = [f"{m}: {r.reason}" for m, r in report.modules.items() if not r.applied]
                self.failed = "; ".join(bad)
                return


class Network:
    """The peers of one run, their rounds in lockstep, and the archive's scoring."""

    def __init__(self, cfg: RunConfig, dataset: Dataset, seed: int, ramp: int, fresh: str, eval_docs: int):
        self.cfg, self.dataset, self.seed, self.ramp, self.fresh = cfg, dataset, seed, ramp, fresh
        self.hub = LocalAverager()
        self.peers: dict[str, Peer] = {}
        docs = list(dataset.validation_documents())
        routes = [dataset.router.route_ids(d.ids) for d in docs]
        self.docs = {p: [d for d, r in zip(docs, routes) if r == p][:eval_docs] for p in cfg.lattice.paths()}
        self.replica_diff = 0.0
        self.origins: dict[str, list[str]] = {}

    def holders(self, module_id: str) -> list[Peer]:
        return [p for p in self.peers.values() if module_id in p.opt.module_ids]

    def fetch(self, module_id: str, like: Any, joining: bool = True) -> Any:
        held = self.holders(module_id)
        return held[0].opt.module_state(module_id) if held else None

    def add(self, name: str, path: tuple[int, ...]) -> None:
        """A newcomer: every module it holds from a live holder, the others by the fresh-start rule."""
        peer = Peer(name, path, self.cfg, self.hub, self.dataset, self.seed, self.ramp)
        origins = []
        for mid, mod in peer.model.modules_by_id().items():
            state = self.fetch(mid, None)
            if state is not None:
                peer.opt.load_module_state(mid, state.global_params, state.momentum, state.round_no)
                origins.append(f"{mid}: peer@{state.round_no}")
            else:
                like = [p.detach().clone() for p in mod.parameters()]
                origins.append(f"{mid}: {start_fresh_module(peer.opt, self.cfg.lattice, mid, like, self.fetch, self.fresh)}")
        self.origins[name] = origins
        self.peers[name] = peer

    def remove(self, name: str) -> None:
        self.hub.leave(name)
        del self.peers[name]

    def round(self) -> None:
        steps = self.cfg.outer.inner_steps
        # daemons: a stop signal ends the process without waiting for a round in flight
        threads = [threading.Thread(target=p.round, args=(steps,), name=p.name, daemon=True) for p in self.peers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._check_replicas()

    def _check_replicas(self) -> None:
        for mid in self.cfg.lattice.module_ids():
            held = self.holders(mid)
            states = [p.opt.module_state(mid).global_params for p in held]
            for other in states[1:]:
                for a, b in zip(states[0], other):
                    self.replica_diff = max(self.replica_diff, float((a - b).abs().max()))

    def trained_paths(self) -> set[tuple[int, ...]]:
        """Paths some peer trains (a held path may be only a combination of others' modules)."""
        return {p.path for p in self.peers.values()}

    def held_paths(self) -> list[tuple[int, ...]]:
        return [p for p in self.cfg.lattice.paths() if all(self.holders(m) for m in self.cfg.lattice.path_modules(p))]

    @torch.no_grad()
    def score(self) -> dict[tuple[int, ...], float]:
        """Validation bits per byte of every held path, with the modules' global copies."""
        lm = ModularLM(self.cfg.lattice, seed=self.cfg.seed)
        for mid in self.cfg.lattice.module_ids():
            state = self.fetch(mid, None)
            if state is not None:
                for p, g in zip(lm.mods[mid].parameters(), state.global_params):
                    p.copy_(g)
        return {p: bits_per_byte(lm.path_model(p), self.docs[p], self.cfg.lattice.seq_len).bpb
                for p in self.held_paths() if self.docs[p]}


def event_figures(before: dict[tuple[int, ...], float], window: Sequence[dict[tuple[int, ...], float]],
                  path: tuple[int, ...], others: Sequence[tuple[int, ...]], left: Optional[tuple[int, ...]],
                  held_before: dict[str, float]) -> dict[str, Any]:
    """One event's figures from the paths' bits per byte just before it (``before``: the trained paths;
    ``held_before``: every held path, by name) and after each round of its window: the largest
    relative rise of a sharer (``others`` less the path a moved peer ``left``), that of ``left``, the
    round from which the newcomer's ``path`` is within 5% of the others' mean, and the change of the
    mean over the paths held both before and at the window's end."""
    sharers = [p for p in others if p != left]
    rises = [(s[p] - before[p]) / before[p] for s in window for p in sharers]
    left_rises = [(s[left] - before[left]) / before[left] for s in window if left in s and left in before]
    reached = next((r for r, s in enumerate(window, 1)
                    if others and s[path] <= 1.05 * statistics.fmean(s[p] for p in others)), None)
    end = {format_path(p): b for p, b in window[-1].items()} if window else {}
    common = sorted(set(held_before) & set(end))
    change = ((statistics.fmean(end[p] for p in common) - statistics.fmean(held_before[p] for p in common))
              / statistics.fmean(held_before[p] for p in common)) if common else None
    return {"sharer_bpb_rise_max": max(rises) if rises else None,
            "left_path_bpb_rise_max": max(left_rises) if left_rises else None,
            "joiner_rounds_to_network_bpb": reached, "network_bpb_change": change}


def run_seed(dataset: Dataset, cfg: RunConfig, seed: int, warm_rounds: int, window: int, ramp: int, fresh: str,
             eval_docs: int) -> dict[str, Any]:
    cfg = dataclasses.replace(cfg, seed=seed)
    torch.manual_seed(seed)
    net = Network(cfg, dataset, seed, ramp, fresh, eval_docs)
    for name, path in START.items():
        net.add(name, path)
    history: list[dict[str, float]] = []

    def step(label: str) -> dict[tuple[int, ...], float]:
        t0 = time.monotonic()
        net.round()
        scores = net.score()
        history.append({format_path(p): b for p, b in scores.items()})
        print(f"seed {seed} {label} round {len(history)}: " + ", ".join(f"{format_path(p)} {b:.4f}"
              for p, b in scores.items()) + f" ({time.monotonic() - t0:.1f}s)", file=sys.stderr, flush=True)
        return scores

    means = []
    for _ in range(warm_rounds):  # until the network's bits per byte flatten
        scores = step("warm")
        means.append(statistics.fmean(scores[p] for p in net.trained_paths()))
        if len(means) > 3 and means[-4] - means[-1] < 0.01 * means[-4]:
            break
    events = {}
    for event, name, path, replaces in EVENTS:
        trained = net.trained_paths()
        now = net.score()
        before = {p: b for p, b in now.items() if p in trained}
        held_before = {format_path(p): b for p, b in now.items()}
        left = net.peers[replaces].path if replaces is not None else None
        if replaces is not None:
            net.remove(replaces)
        net.add(name, path)
        others = sorted(p for p in before if p != path and p in net.trained_paths())
        window_scores = [step(event) for _ in range(window)]
        events[event] = {**event_figures(before, window_scores, path, others, left, held_before),
                         "origins": net.origins[name], "bpb_before": {format_path(p): b for p, b in before.items()}}
    failed = sorted({p.failed for p in net.peers.values() if p.failed})
    return {"warm_rounds": len(means), "events": events, "replica_max_abs_diff": net.replica_diff,
            "bpb_history": history, "failed_rounds": failed}


def _keys(runs: dict[int, dict]) -> dict[str, Any]:
    def worst(key: str) -> Optional[float]:
        values = [e[key] for r in runs.values() for e in r["events"].values() if e.get(key) is not None]
        return max(values) if values else None

    return {
        "sharer_bpb_rise_max": worst("sharer_bpb_rise_max"),
        "left_path_bpb_rise_max": worst("left_path_bpb_rise_max"),
        "network_bpb_change": {ev: {str(s): r["events"][ev]["network_bpb_change"] for s, r in runs.items()}
                               for ev, *_ in EVENTS},
        "joiner_rounds_to_network_bpb": {ev: {str(s): r["events"][ev]["joiner_rounds_to_network_bpb"]
                                              for s, r in runs.items()} for ev, *_ in EVENTS},
        "replica_max_abs_diff": max(r["replica_max_abs_diff"] for r in runs.values()),
        "sharer_bpb_rise_per_event": {ev: {str(s): r["events"][ev]["sharer_bpb_rise_max"] for s, r in runs.items()}
                                      for ev, *_ in EVENTS},
    }


def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (weights, batches)")
    ap.add_argument("--warm-rounds", type=int, default=40, help="most rounds before the first event")
    ap.add_argument("--window", type=int, default=10, help="rounds after each event")
    ap.add_argument("--inner-steps", type=int, default=0, help="H (0: the demo preset's)")
    ap.add_argument("--eval-docs", type=int, default=32, help="validation documents scored per path")
    ap.add_argument("--ramp", type=int, default=JOIN_RAMP_ROUNDS, help="newcomer ramp rounds (0: none)")
    ap.add_argument("--fresh", choices=FRESH_STARTS, default=FRESH_START, help="how a module nobody holds starts")
    ap.add_argument("--compare", action="store_true", help="also run with --fresh seed --ramp 0 (no guard)")
    ap.add_argument("--quick", action="store_true",
                    help="one seed, 10 warm rounds at most, windows of 4, H=10, 16 documents a path")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.warm_rounds, args.window, args.inner_steps = "0", 10, 4, args.inner_steps or 10
        args.eval_docs = min(args.eval_docs, 16)
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    cfg = demo()
    if args.inner_steps:
        cfg = dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, inner_steps=args.inner_steps))
    variants = {"guarded": (args.ramp, args.fresh)}
    if args.compare:
        variants["unguarded"] = (0, "seed")
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prepare(default_corpus(), Path(tmp) / "data", levels=cfg.lattice.levels,
                modules=cfg.lattice.modules_per_level, tokenizer="bytes")
        dataset = Dataset(Path(tmp) / "data")
        cfg = cfg.replace(lattice={"vocab_size": dataset.manifest["vocab_size"]})
        for name, (ramp, fresh) in variants.items():
            runs = {s: run_seed(dataset, cfg, s, args.warm_rounds, args.window, ramp, fresh, args.eval_docs)
                    for s in seeds}
            out[name] = {"ramp": ramp, "fresh": fresh, **_keys(runs),
                         "runs": {str(s): r for s, r in runs.items()}}
    guarded = out["guarded"]
    result = {
        "sharer_bpb_rise_max": guarded["sharer_bpb_rise_max"],
        "left_path_bpb_rise_max": guarded["left_path_bpb_rise_max"],
        "network_bpb_change": guarded["network_bpb_change"],
        "joiner_rounds_to_network_bpb": guarded["joiner_rounds_to_network_bpb"],
        "replica_max_abs_diff": guarded["replica_max_abs_diff"],
        "variants": out,
        "seeds": seeds,
        "quick": args.quick,
        "settings": {"warm_rounds_max": args.warm_rounds, "window": args.window,
                     "inner_steps": cfg.outer.inner_steps, "eval_docs": args.eval_docs},
    }
    return emit("joiners_quick" if args.quick else "joiners", result)


if __name__ == "__main__":
    run_main(main)
