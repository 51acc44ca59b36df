"""Scale past one machine: 10 to 10,000 simulated volunteers against the real coordinator.

Runs :mod:`bench.scale_sim` (the real :class:`coordinator.Coordinator` on SQLite, the real DHT
records, a simulated clock and network) over a sweep of swarm sizes on a 2x2 lattice, and of
lattice shapes at 1,000 peers, and reports round time, DHT operations and bytes per peer per round,
the coordinator's measured CPU (thread CPU time inside its calls per simulated second), heartbeats
per second and the share of compute lost to churn (10% of peers leaving per hour).

Keys: ``peers_simulated`` (>= 10,000; every join, of which ``peers_admitted`` trained and
``peers_refused`` were refused, in the largest run), ``round_time_ratio_1000_vs_10`` (<= 1.5),
``round_time_ratio_10000_vs_10`` (<= 1.5; the same pair at 10,000 peers, whose cap splits rounds into
several levels), ``dht_ops_per_peer_round_at_1000`` (flat in peers), ``coordinator_cpu_share_at_10000`` (<= 0.5),
``churn_compute_loss_10pct_per_hour`` (<= 0.05); ``sweep`` holds every run's figures.
``coordinator_cpu_share_at_10000`` is the in-process coordinator's thread CPU inside the simulator;
``coordinator_cpu_share_at_10000_grpc`` (<= 0.5) the real server process's, through gRPC at the
simulated heartbeat rate with a storm of 1,000 joins (:mod:`bench.scale_grpc`; ``--quick``: 1,000
peers and 100 joins, ``coordinator_cpu_share_at_1000_grpc``). ``noncompute_round_ratio_1000_vs_10``
compares the part of a round after its compute (``exchange_s_median``: from a peer's declaration to its
round's end), which the whole round's ratio dilutes.
``--quick`` runs 10 and 100 peers only (seconds; writes ``scale_quick.json``, no plot). Each size runs
twice: ``before`` (one averaging group per module and round) and ``after`` (``[outer] max_group_size``
= 64: a widely held module's holders average in groups drawn by
:func:`peer.network.records.group_bucket`, whose means a top group of one delegate each averages and
passes down each group's tree, as :mod:`peer.averaging.hierarchy` does). The 10,000-peer runs measure 240 simulated seconds after
their ramp (wall time on 2 cores), the others 900 (lattice shapes 300). A third run at each size,
``census``, models the design of :mod:`bench.scale_sim.census` (control reads bounded by the cap, not
by the holders; the peers' code does not do it yet): ``control_bytes_per_peer_round_{n}`` and
``control_bytes_growth_10_to_10000`` (target <= 3) are its DHT bytes per peer and round, and
``max_group_members_at_{n}`` / ``upper_group_members_max_at_{n}`` the largest group of the ``after``
run (hashed buckets, groups of delegates and top groups) and of its groups of delegates and top groups.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Optional

from bench.common import emit, run_main
from bench.scale_grpc import coordinator_cpu_share
from bench.scale_sim import SimConfig, simulate

MEASURES = (
    "bench/scale.py",
    "bench/scale_sim",
    "bench/scale_grpc.py",
    "bench/coordinator_load.py",
    "coordinator",
    "models",
    "protos",
    "peer/averaging",
    "peer/compression",
    "peer/network/records.py",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

__all__ = ["main", "sweep"]

log = logging.getLogger("bench.scale")

DOCS_PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "scale.png"


MAX_GROUP = 64
"""``max_group_size`` of the ``after`` runs (groups of about 64: a network of a few peers keeps one group)."""
RATIO_GROUP = 8
"""``max_group_size`` of the runs behind ``round_time_ratio_1000_vs_10`` and ``round_time_ratio_10000_vs_10``
(groups of 5-8 at every size)."""
SIZES = (10, 100, 1000, 10_000)


def _window(peers: int, seconds: float) -> float:
    """Simulated seconds a run of ``peers`` measures: ``seconds``, but 240 at 10,000 peers (wall time)."""
    return seconds if peers < 10_000 else 240.0


def runs(quick: bool, seed: int) -> list[tuple[str, SimConfig]]:
    """(label, config) of every run: ``before`` (one group a module) and ``after`` (groups bounded by
    ``MAX_GROUP``) at each size on 2x2, the ratio pair, and lattice shapes at 1,000 peers."""
    if quick:
        return [(tag, SimConfig(peers=n, duration=600.0, ramp=60.0, seed=seed, max_group_size=g))
                for tag, g in (("before", 0), ("after", MAX_GROUP)) for n in (10, 100)]
    out = []
    for tag, g in (("before", 0), ("after", MAX_GROUP), ("census", MAX_GROUP)):
        for n in SIZES:
            out.append((tag, SimConfig(peers=n, duration=_window(n, 900.0), seed=seed, max_group_size=g,
                                       census=tag == "census")))
    out += [("ratio", SimConfig(peers=n, duration=_window(n, 600.0), seed=seed, max_group_size=RATIO_GROUP))
            for n in (10, 1000, 10_000)]
    out += [("lattice", SimConfig(peers=1000, levels=l, modules_per_level=m, duration=300.0, seed=seed,
                                  max_group_size=MAX_GROUP)) for l, m in ((4, 4), (2, 16))]
    return out


def sweep(quick: bool, seed: int) -> list[dict]:
    """Every run's figures, each with its ``run`` label."""
    out = []
    for tag, cfg in runs(quick, seed):
        r = simulate(cfg)
        log.info("%s %s", tag, r.figures)
        out.append({"run": tag, **r.figures, "refusal_example": r.refusals[0] if r.refusals else "",
                    "unserved": len(r.unserved)})
    return out


def _ratio(ratio: dict[int, dict], n: int, key: str) -> Optional[float]:
    """``key`` of the ratio run at ``n`` peers over the one at 10 (None unless both ran)."""
    return ratio[n][key] / ratio[10][key] if {10, n} <= set(ratio) else None


def _across(ratio: dict[int, dict], n: int, key: str) -> Optional[list]:
    """``key`` of every ratio run, by peers (None unless the runs at 10 and ``n`` peers both ran)."""
    return [ratio[m][key] for m in sorted(ratio)] if {10, n} <= set(ratio) else None


def headline(rows: list[dict]) -> dict:
    """The headline keys, read from the ``after`` runs (bounded groups), the ratio pair and the ``before`` runs."""
    after = {r["peers"]: r for r in rows if r["run"] == "after"}
    before = {r["peers"]: r for r in rows if r["run"] == "before"}
    ratio = {r["peers"]: r for r in rows if r["run"] == "ratio"}
    census = {r["peers"]: r for r in rows if r["run"] == "census"}
    top = max(after)
    mid = after.get(1000, after[top])
    biggest = max(rows, key=lambda r: r["peers_ever"])
    out = {
        "peers_simulated": max(r["peers_ever"] for r in rows),
        # of the largest run, the joins the coordinator admitted and those it refused (reported apart:
        # a refused join is a peer that never trained)
        "peers_admitted": biggest["peers_ever"] - biggest["refused"],
        "peers_refused": biggest["refused"],
        "round_time_ratio_1000_vs_10": _ratio(ratio, 1000, "round_s_median"),
        "round_time_ratio_group_sizes": _across(ratio, 1000, "group_size_mean"),
        # the same ratio on the part of a round beyond its fixed compute, which the whole round's ratio
        # dilutes: a peer's median seconds from its declaration (compute done) to its round's end, i.e.
        # matchmaking, the exchange and waiting for the group as the link model and the groups make
        # them (not the median round less round_seconds: a round that pacing ends early is shorter)
        "noncompute_round_ratio_1000_vs_10": _ratio(ratio, 1000, "exchange_s_median"),
        # the same pair at 10,000 peers: the cap of 8 splits their rounds into several levels (the
        # exchange is the link model's, not capped), ``round_time_ratio_split_levels`` the levels of each
        "round_time_ratio_10000_vs_10": _ratio(ratio, 10_000, "round_s_median"),
        "noncompute_round_ratio_10000_vs_10": _ratio(ratio, 10_000, "exchange_s_median"),
        "round_time_ratio_split_levels": _across(ratio, 10_000, "split_levels_max"),
        "dht_ops_per_peer_round_at_1000": mid["dht_ops_per_peer_round"],
        "dht_bytes_per_peer_round_at_1000": mid["dht_bytes_per_peer_round"],
        "coordinator_cpu_share_at_10000": after[top]["coordinator_cpu_share"] if top >= 10_000 else None,
        "churn_compute_loss_10pct_per_hour": mid["churn_compute_loss"],
        "max_group_size": MAX_GROUP,
        # every group of a split round (hashed buckets, groups of delegates, top groups) at the largest
        # size, and the groups of delegates and top groups alone (split_levels bounds those by the cap)
        f"max_group_members_at_{top}": after[top].get("max_group_members"),
        f"upper_group_members_max_at_{top}": after[top].get("upper_group_size_max"),
        f"split_levels_at_{top}": after[top].get("split_levels_max"),
    }
    for n in sorted(census):
        out[f"control_bytes_per_peer_round_{n}"] = census[n]["dht_bytes_per_peer_round"]
    if 10 in census and 10_000 in census:
        out["control_bytes_growth_10_to_10000"] = (census[10_000]["dht_bytes_per_peer_round"]
                                                   / census[10]["dht_bytes_per_peer_round"])
    for n in sorted(after):
        for tag, by in (("before", before), ("after", after)):
            if n in by:
                out[f"group_size_mean_{tag}_{n}"] = by[n]["group_size_mean"]
                out[f"dht_bytes_per_peer_round_{tag}_{n}"] = by[n]["dht_bytes_per_peer_round"]
    return out


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(20, 3.6))
    panels = (("group_size_mean", "mean group size"), ("dht_bytes_per_peer_round", "DHT bytes / peer / round"),
              ("dht_ops_per_peer_round", "DHT ops / peer / round"), ("round_s_median", "median round (s)"),
              ("coordinator_cpu_share", "coordinator CPU (cores)"))
    for tag, style in (("before", "o--"), ("after", "s-")):
        sel = sorted((r for r in rows if r["run"] == tag), key=lambda r: r["peers"])
        n = [r["peers"] for r in sel]
        for ax, (key, label) in zip(axes, panels):
            label_run = "one group a module" if tag == "before" else f"max_group_size {MAX_GROUP}"
            ax.plot(n, [r[key] for r in sel], style, label=label_run)
            ax.set_xscale("log")
            if key in ("group_size_mean", "dht_bytes_per_peer_round"):
                ax.set_yscale("log")
            ax.set_xlabel("peers (2x2 lattice)")
            ax.set_title(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 and 100 peers only (seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grpc-seconds", type=float, default=30.0,
                    help="window of the coordinator's CPU share through gRPC (bench.scale_grpc; default 30)")
    ap.add_argument("--plot", default=str(DOCS_PLOT), help="write the curves to this PNG ('' for none)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("coordinator").setLevel(logging.WARNING)
    logging.getLogger("peer").setLevel(logging.ERROR)
    rows = sweep(args.quick, args.seed)
    if args.plot and not args.quick:
        plot(rows, args.plot)
    grpc = coordinator_cpu_share(*((1000, 100) if args.quick else (10_000, 1000)), seconds=args.grpc_seconds)
    emit("scale_quick" if args.quick else "scale", {**headline(rows), **grpc, "quick": args.quick, "seed": args.seed,
                                                     "seeds": [args.seed], "sweep": rows})
    return 0


if __name__ == "__main__":
    run_main(main)
