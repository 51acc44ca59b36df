"""Scale past one machine (issue 25): 10 to 10,000 simulated volunteers against the real coordinator.

Runs :mod:`bench.scale_sim` (the real :class:`coordinator.Coordinator` on SQLite, the real DHT
records, a simulated clock and network) over a sweep of swarm sizes on a 2x2 lattice, and of
lattice shapes at 1,000 peers, and reports round time, DHT operations and bytes per peer per round,
the coordinator's measured CPU (thread CPU time inside its calls per simulated second), heartbeats
per second and the share of compute lost to churn (10% of peers leaving per hour).

Keys: ``peers_simulated`` (>= 10,000), ``round_time_ratio_1000_vs_10`` (<= 1.5),
``dht_ops_per_peer_round_at_1000`` (flat in peers), ``coordinator_cpu_share_at_10000`` (<= 0.5),
``churn_compute_loss_10pct_per_hour`` (<= 0.05); ``sweep`` holds every run's figures.
``--quick`` runs 10 and 100 peers only (the tests' mode).
"""

from __future__ import annotations

import argparse
import logging

from bench.common import RESULTS, emit, run_main
from bench.scale_sim import SimConfig, simulate

__all__ = ["main", "sweep"]

log = logging.getLogger("bench.scale")


def sweep(quick: bool, seed: int) -> list[dict]:
    """Every run's figures: sizes on 2x2, then lattice shapes at 1,000 peers."""
    if quick:
        runs = [SimConfig(peers=n, duration=600.0, ramp=60.0, seed=seed) for n in (10, 100)]
    else:
        runs = [SimConfig(peers=n, duration=900.0 if n < 10_000 else 600.0, seed=seed) for n in (10, 100, 1000, 10_000)]
        runs += [SimConfig(peers=1000, levels=l, modules_per_level=m, duration=600.0, seed=seed)
                 for l, m in ((4, 4), (2, 16))]
    out = []
    for cfg in runs:
        r = simulate(cfg)
        log.info("%s", r.figures)
        out.append({**r.figures, "refusal_example": r.refusals[0] if r.refusals else "",
                    "unserved": len(r.unserved)})
    return out


def headline(rows: list[dict]) -> dict:
    """The issue's keys, read from the sweep's 2x2 runs."""
    by_n = {r["peers"]: r for r in rows if r["lattice"] == "2x2"}
    top = max(by_n)
    base, mid = by_n[min(by_n)], by_n.get(1000, by_n[top])
    return {
        "peers_simulated": max(r["peers_ever"] for r in rows),
        "round_time_ratio_1000_vs_10": mid["round_s_median"] / base["round_s_median"],
        "dht_ops_per_peer_round_at_1000": mid["dht_ops_per_peer_round"],
        "dht_bytes_per_peer_round_at_1000": mid["dht_bytes_per_peer_round"],
        "coordinator_cpu_share_at_10000": by_n[top]["coordinator_cpu_share"] if top >= 10_000 else None,
        "churn_compute_loss_10pct_per_hour": mid["churn_compute_loss"],
    }


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in rows if r["lattice"] == "2x2"), key=lambda r: r["peers"])
    n = [r["peers"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, key, label in zip(axes, ("round_s_median", "dht_bytes_per_peer_round", "coordinator_cpu_share",
                                     "coordinator_join_cpu_ms_median"),
                              ("median round (s)", "DHT bytes / peer / round", "coordinator CPU (cores)",
                               "CPU per join (ms)")):
        ax.plot(n, [r[key] for r in rows], "o-")
        ax.set_xscale("log")
        ax.set_xlabel("peers")
        ax.set_title(label)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 and 100 peers only (seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="", help="write the curves to this PNG")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("coordinator").setLevel(logging.WARNING)
    logging.getLogger("peer").setLevel(logging.ERROR)
    rows = sweep(args.quick, args.seed)
    if args.plot:
        plot(rows, args.plot)
    emit("scale_quick" if args.quick else "scale", {**headline(rows), "quick": args.quick, "seed": args.seed,
                                                     "sweep": rows})
    return 0


if __name__ == "__main__":
    run_main(main)
