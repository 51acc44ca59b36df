"""bench.byzantine: hostile peers against a model near its plateau, each attack with and without the defence.

A dense (1x1) ``demo``-sized model (d_model 96, byte tokenizer, seq_len 96, ``--batch`` 8) is first trained
by one worker for ``--pretrain-steps`` inner steps (cached under ``--cache``: the same settings reuse
it), and, to say how close that is to the plateau, for twice as many. Every run then starts from the
pretrained weights and does ``--rounds`` outer rounds of H inner steps with the in-process simulator
(:class:`peer.simulator.DiLoCoSimulator`). Its outer step is replaced by the network's: each module's
flat vector is split into one part per member (:func:`peer.averaging.partition.part_bounds`, equal
bandwidths), the member owning a part reduces it with the run's rule
(:func:`peer.averaging.aggregate`), and every honest reducer files what it caught as a report against
the sender to a coordinator (:class:`coordinator.core.Coordinator` in process, memory store, default
``CoordinatorSettings``: its ``report`` and :func:`coordinator.bans.ban_decision` decide the ban, as
over gRPC), and a banned peer is left out of every later group (its credential is not renewed).

Attacks (1 hostile of 5; ``collude``: 2 of 7), applied to the hostile worker's pseudo-gradient every
round before the codec: ``scaled`` (x100), ``sign_flip`` (-1x), ``noise`` (Gaussian, the same norm),
``nan`` (all NaN), ``alie`` ("a little is enough", Baruch et al. 2019: the honest mean minus one
standard deviation per coordinate, inside the honest spread), ``replay`` (the update it sent in the
first attacked round, replayed every round), ``collude`` (both hostiles send the same vector: -10x the
honest mean). Each runs with the defence (``--aggregator`` and ``--norm-bound``, plus bans) and
without it (the control: the plain weighted mean, no bans); the clean runs (no hostile, 5 and 7
workers) use the plain mean.

Keys per attack under ``attacks``, and overall as the worst attack: ``byzantine_bpb_gap`` (defended,
relative to the clean run; target <= 0.05), ``byzantine_bpb_gap_undefended`` (the control; an attack
whose control gap is below 0.05 is ``not harmful at this scale``), ``rounds_to_ban`` (rounds until
the ban, null where never banned). Run as ``python -m bench.byzantine``; writes
``bench/results/byzantine.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench.common import emit, run_main
from models.durable import atomic_write

MEASURES = (
    "bench/byzantine.py",
    "models",
    "peer/averaging",
    "peer/compression",
    "peer/simulator",
    "peer/outer",
    "peer/diloco",
    "coordinator",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

log = logging.getLogger("bench.byzantine")

ATTACKS = ("scaled", "sign_flip", "noise", "nan", "alie", "replay", "collude")
HARMFUL = 0.05
"""A control gap below this is "not harmful at this scale" (the benchmark's threshold)."""
EVAL_DOCUMENTS = 48
ROUND_SECONDS = 10.0
"""Coordinator clock advanced per round (inside the default 30 s lease and 600 s ban window)."""


def _config(ds, aggregator: str, norm_bound: float, inner_steps: int, batch: int):
    from models.presets import demo

    return demo().replace(lattice={"levels": 1, "modules_per_level": 1, "vocab_size": ds.manifest["vocab_size"]},
                          inner={"batch_size": batch},
                          outer={"aggregator": aggregator, "norm_bound": norm_bound, "inner_steps": inner_steps},
                          data={"manifest_hash": ds.manifest_hash, "tokenizer": ds.manifest["tokenizer"]})


def _bpb(model, ds, cfg) -> float:
    from models.evaluate import bits_per_byte

    return bits_per_byte(model.path_model((0,)), ds.validation_documents(), cfg.lattice.seq_len, "cpu",
                         max_documents=EVAL_DOCUMENTS).bpb


def pretrain(ds, cfg, steps: int, cache: Path) -> tuple[dict, dict]:
    """Train one worker ``steps`` and ``2 * steps`` inner steps; the state after ``steps`` and both bpbs (cached)."""
    import torch

    from peer.simulator import DiLoCoSimulator

    key = hashlib.sha256(f"{cfg.content_hash()}:{steps}:v1".encode()).hexdigest()[:16]
    path = cache / f"pretrained-{key}.pt"
    if path.exists():
        saved = torch.load(path)
        log.info("pretrained model from %s", path)
        return saved["state"], saved["info"]
    B, T = cfg.inner.batch_size, cfg.lattice.seq_len
    torch.manual_seed(cfg.seed)
    sim = DiLoCoSimulator(cfg, [(0,)], 1, lambda k, p: ds.dense_batches("train", B, T, cfg.seed * 7919 + 17),
                          outer_steps=False)
    t0 = time.perf_counter()
    sim.train(steps)
    state = {mid: sim.global_state(mid) for mid in sim.module_ids}
    bpb = _bpb(sim.global_model(), ds, cfg)
    log.info("pretrained %d steps in %.0fs: %.4f bpb; training as long again for the plateau", steps,
             time.perf_counter() - t0, bpb)
    sim.train(steps)
    longer = _bpb(sim.global_model(), ds, cfg)
    info = {"pretrain_steps": steps, "bpb_pretrained": bpb, "bpb_twice_as_long": longer,
            "pretrain_seconds": round(time.perf_counter() - t0, 1)}
    cache.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: torch.save({"state": state, "info": info}, tmp), temp_name=path.with_suffix(".tmp").name)
    return state, info


class Attacked:
    """One run: ``workers`` simulated peers from ``state``, ``hostile`` of them sending ``attack``."""

    def __init__(self, ds, cfg, state: dict, workers: int, hostile: list[int], attack: Optional[str],
                 defended: bool, seed: int):
        import torch

        from coordinator.core import Coordinator
        from coordinator.records import Capabilities
        from coordinator.settings import CoordinatorSettings
        from coordinator.store import MemoryStore
        from peer.averaging import MEAN, Aggregation
        from peer.simulator import DiLoCoSimulator

        B, T = cfg.inner.batch_size, cfg.lattice.seq_len
        torch.manual_seed(seed)
        self.sim = DiLoCoSimulator(cfg, [(0,)], workers,
                                   lambda k, p: ds.dense_batches("train", B, T, seed * 1_000_003 + k))
        for mid, named in state.items():
            opt = self.sim.outer[mid]
            opt.load_state_dict({"global": list(named.values()), "momentum": [torch.zeros_like(t) for t in named.values()]})
            for w in self.sim.holders(mid):
                opt.sync_to(w.module_params(mid))
        self.sim.outer_step = self.outer_step  # the network's reduction, per part, with reports
        self.hostile, self.attack, self.defended = set(hostile), attack, defended
        self.rule = Aggregation.from_config(cfg.outer) if defended else MEAN
        self.now = 1_000_000.0
        self.coord = Coordinator(cfg, CoordinatorSettings(), MemoryStore(), clock=lambda: self.now)
        self.leases = {self.pid(k): self.coord.join(self.pid(k), b"key%d" % k, Capabilities("cpu", 8 << 30, 1000.0))
                       .lease.lease_id for k in range(workers)}
        self.banned_at: dict[str, int] = {}
        self.rng = torch.Generator().manual_seed(seed)
        self.first_sent: dict[tuple[int, str], object] = {}
        self.reports = 0

    @staticmethod
    def pid(index: int) -> str:
        """A libp2p-shaped peer id (base58: no zero) whose sort order is the worker order."""
        return "12D3KooWbyz" + str(index).replace("0", "z").rjust(8, "z")

    def _attack(self, k: int, mid: str, own, honest: list):
        import torch

        if self.attack == "scaled":
            return own * 100.0
        if self.attack == "sign_flip":
            return -own
        if self.attack == "noise":
            z = torch.randn(own.shape, generator=self.rng)
            return z * (torch.linalg.vector_norm(own) / torch.linalg.vector_norm(z))
        if self.attack == "nan":
            return torch.full_like(own, float("nan"))
        stack = torch.stack(honest)  # (k_honest, n)
        if self.attack == "alie":
            return stack.mean(0) - stack.std(0)
        if self.attack == "replay":
            return self.first_sent.setdefault((k, mid), own.clone())
        if self.attack == "collude":
            return stack.mean(0) * -10.0
        raise ValueError(f"unknown attack {self.attack!r}")

    def outer_step(self, weights) -> None:
        """The networked outer step: hostile deltas, per-part robust reduction, reports, bans."""
        import torch

        from peer.averaging import aggregate, flatten, unflatten
        from peer.averaging.partition import part_bounds

        sim, rnd = self.sim, self.sim.round_no + 1
        self.now += ROUND_SECONDS
        for pid, lease in self.leases.items():  # every live peer heartbeats during the round
            if pid not in self.banned_at:
                self.coord.heartbeat(lease, pid)
        with torch.no_grad():
            for mid in sim.module_ids:
                opt = sim.outer[mid]
                members = [w for w in sim.holders(mid) if self.pid(w.index) not in self.banned_at]
                raw = {w.index: flatten(opt.pseudo_gradient(w.module_params(mid))) for w in members}  # (n,) each
                honest = [raw[w.index] for w in members if w.index not in self.hostile]
                sent = {}
                for w in members:
                    x = raw[w.index]
                    if w.index in self.hostile and self.attack is not None:
                        x = self._attack(w.index, mid, x, honest)
                        sent[w.index] = x if self.attack == "nan" else sim.codec.roundtrip(x)  # NaN: undecodable
                        continue
                    x = x + w.residual.get(mid, torch.zeros_like(x))
                    s = sim.codec.roundtrip(x)  # (n,)
                    w.residual[mid] = x - s
                    sent[w.index] = s
                order = sorted(members, key=lambda w: self.pid(w.index))
                numel = next(iter(sent.values())).numel()
                parts = []
                for reducer, (lo, hi) in zip(order, part_bounds(numel, [1.0] * len(order))):
                    if hi <= lo:
                        continue
                    reduced = aggregate({self.pid(w.index): (sent[w.index][lo:hi], float(weights[w.index]))
                                         for w in order}, self.rule)
                    parts.append(reduced.value)
                    if reducer.index in self.hostile or not self.defended:
                        continue
                    for suspect, why in sorted(reduced.suspects.items()):
                        if suspect == self.pid(reducer.index) or suspect in self.banned_at:
                            continue
                        self.reports += 1
                        reporter = self.pid(reducer.index)
                        res = self.coord.report(self.leases[reporter], reporter, suspect, mid, rnd, why)
                        if res.banned:
                            self.banned_at[suspect] = rnd
                            log.info("round %d: banned %s (%s)", rnd, suspect, res.reason)
                avg = sim.codec.roundtrip(torch.cat(parts))  # (n,) each reducer encodes its part once
                opt.step(unflatten(avg, opt.global_params))
                for w in sim.holders(mid):
                    opt.sync_to(w.module_params(mid))
        sim.round_no += 1

    def run(self, rounds: int, ds, cfg) -> dict:
        self.sim.train(rounds * cfg.outer.inner_steps)
        bans = [self.banned_at.get(self.pid(k)) for k in sorted(self.hostile)]
        wrong = sorted(p for p in self.banned_at if p not in {self.pid(k) for k in self.hostile})
        return {"bpb": _bpb(self.sim.global_model(), ds, cfg),
                "rounds_to_ban": max(bans) if bans and all(b is not None for b in bans) else None,
                "honest_banned": wrong, "reports": self.reports}


def run_bench(args: argparse.Namespace) -> dict:
    import torch

    from models.data import prepared

    torch.set_num_threads(1)
    data = Path(args.work_dir) / "data-dense"
    ds = prepared(data, 1, 1, "bytes")
    cfg = _config(ds, args.aggregator, args.norm_bound, args.inner_steps, args.batch)
    t0 = time.perf_counter()
    state, info = pretrain(ds, _config(ds, "mean", 0.0, args.inner_steps, args.batch), args.pretrain_steps, Path(args.cache))

    def one(workers: int, hostile: list[int], attack: Optional[str], defended: bool) -> dict:
        t = time.perf_counter()
        out = Attacked(ds, cfg, state, workers, hostile, attack, defended, args.seed).run(args.rounds, ds, cfg)
        log.info("%s %s (%d workers): %.4f bpb, banned after %s rounds, %.0fs", attack or "clean",
                 "defended" if defended else "undefended", workers, out["bpb"], out["rounds_to_ban"],
                 time.perf_counter() - t)
        return out

    clean = {n: one(n, [], None, False) for n in (5, 7)}
    clean_defended = {n: one(n, [], None, True) for n in (5, 7)}
    attacks = {}
    for attack in args.attacks.split(","):
        workers, hostile = (7, [5, 6]) if attack == "collude" else (5, [4])
        ref = clean[workers]["bpb"]
        d, u = one(workers, hostile, attack, True), one(workers, hostile, attack, False)
        gap, gap_u = (d["bpb"] - ref) / ref, (u["bpb"] - ref) / ref
        attacks[attack] = {
            "hostile": f"{len(hostile)} of {workers}", "bpb_defended": round(d["bpb"], 4),
            "bpb_undefended": round(u["bpb"], 4), "bpb_clean": round(ref, 4),
            "byzantine_bpb_gap": round(gap, 4), "byzantine_bpb_gap_undefended": round(gap_u, 4),
            "rounds_to_ban": d["rounds_to_ban"], "honest_banned": d["honest_banned"], "reports": d["reports"],
            "verdict": ("not harmful at this scale" if gap_u < HARMFUL
                        else "defended" if gap <= HARMFUL else "not defended"),
        }
    worst = max(attacks, key=lambda a: attacks[a]["byzantine_bpb_gap"])
    harmful = [a for a in attacks if attacks[a]["byzantine_bpb_gap_undefended"] >= HARMFUL]
    bans = [attacks[a]["rounds_to_ban"] for a in attacks if attacks[a]["rounds_to_ban"] is not None]
    plateau = info["bpb_twice_as_long"]
    return {
        "preset": "demo (1x1 dense)", "path_params": cfg.lattice.path_param_count((0,)),
        "inner_steps": cfg.outer.inner_steps, "rounds": args.rounds, "codec": cfg.outer.codec,
        "aggregator": args.aggregator, "norm_bound": args.norm_bound, "seed": args.seed, "seeds": [args.seed],
        **{f"pretrain_{k}" if not k.startswith("pretrain") else k: v for k, v in info.items()},
        "bpb_clean": round(clean[5]["bpb"], 4), "bpb_clean_7": round(clean[7]["bpb"], 4),
        "bpb_clean_defended": round(clean_defended[5]["bpb"], 4),
        "bpb_clean_defended_7": round(clean_defended[7]["bpb"], 4),
        "defence_cost_clean": round((clean_defended[5]["bpb"] - clean[5]["bpb"]) / clean[5]["bpb"], 4),
        "honest_banned_clean": clean_defended[5]["honest_banned"] + clean_defended[7]["honest_banned"],
        "clean_vs_plateau": round((clean[5]["bpb"] - plateau) / plateau, 4),
        "attacks": attacks,
        "byzantine_bpb_gap": attacks[worst]["byzantine_bpb_gap"], "byzantine_worst_attack": worst,
        "byzantine_bpb_gap_undefended": max(a["byzantine_bpb_gap_undefended"] for a in attacks.values()),
        "byzantine_bpb_gap_harmful_max": max((attacks[a]["byzantine_bpb_gap"] for a in harmful), default=None),
        "rounds_to_ban": max(bans) if bans else None,
        "never_banned": sorted(a for a in attacks if attacks[a]["rounds_to_ban"] is None),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.byzantine", description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8, help="sequences per inner step (the demo preset has 16)")
    ap.add_argument("--pretrain-steps", type=int, default=1500, help="one worker's inner steps before the attacks")
    ap.add_argument("--rounds", type=int, default=4, help="outer rounds of every attacked run")
    ap.add_argument("--inner-steps", type=int, default=10, help="H")
    ap.add_argument("--aggregator", default="trimmed_mean", choices=["trimmed_mean", "centered_clip"])
    ap.add_argument("--norm-bound", type=float, default=2.0, help="the defence's norm bound (0: none)")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "hivepath-bench-data"))
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "hivepath-bench-byzantine"),
                    help="pretrained checkpoints, reused by later runs with the same settings")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("coordinator").setLevel(logging.WARNING)  # a line per join and report: bans are logged here
    if math.isnan(args.norm_bound) or args.rounds < 1:
        ap.error("--rounds must be >= 1 and --norm-bound a number")
    return emit("byzantine", run_bench(args))


if __name__ == "__main__":
    run_main(main)
