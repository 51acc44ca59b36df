"""bench.wire_split: a split round at the largest size this machine runs, counted on the wire and
set against the simulator's figure for the same size.

The harness is :mod:`bench.utilization`'s (as :mod:`bench.wire`'s): ``--peers`` peers (default 17)
in network namespaces, egress shaped to ``--rate-mbit``, ``--rtt-ms`` added by delay relays, the
``demo`` preset's path (0, 0) (embed, L0M0, L1M0, head) held by every peer, the ``sparse`` point
(H = 16, ``topk16b2``) with ``[outer] max_group_size = --max-group-size`` (default 4). With 17 holders
of each module and a cap of 4, every round splits in three levels (:func:`peer.network.records.split_levels`:
8 buckets, groups of delegates, a top group). One sequence a step (``--batch 1``): 17 trainers at 8
sequences a step kept this machine's 2 cores at a load average of about 20, and most of their rounds
failed on timeouts. Before it trains, each peer counts for
``--idle-seconds`` what its link sends while it holds the modules and no round runs.

Real keys (per member, means over the peers; "a round" is one outer round of the path, its 4
modules averaged):

- ``replica_max_abs_diff``: the largest difference of any value of the final states from peer 0's
  (target 0); ``rounds``, ``failed_rounds`` (rounds lost, target 0), ``mean_group_size``;
- ``payload_bytes_per_round``: what the averager sent (its all-reduces at every level) plus the
  round's average passed down the distribution tree, which the averager does not count: every holder
  but a bucket's delegate receives it once, so a member's mean is the module's encoded average
  (:func:`models.codec_spec.encoded_size`) times the share of holders that are not delegates (an
  estimate from the codec's exact size, not a count);
- ``wire_bytes_per_round``: ``eth0``'s sent bytes over the rounds;
- ``control_bytes_per_peer_round``: wire minus payload (framing, matchmaking, holder records, the
  DHT and its upkeep) (measured, with the tree's share estimated as above);
- ``upkeep_bytes_per_round``: the idle rate times the mean round's seconds.

Simulated: :func:`bench.scale_sim.simulate` with the same number of peers, all on the one path of a
2x1 lattice (the same 4 modules), the same cap, links and round seconds (the real run's mean
compute seconds a round), the peers' code as it is (``census`` off): ``sim_control_bytes_per_peer_round``
(its DHT bytes a peer and round, the only control traffic it models) and
``sim_vs_real_control_bytes_error`` = |sim - real| / real.

Run as root: ``python -m bench.wire_split`` (about 10 minutes on a quiet 2-core machine). Without
root it prints a ``{"skipped": ...}`` line and exits 0.
"""

from __future__ import annotations

import logging
from typing import Optional

from bench import utilization
from bench.common import emit, run_main
from bench.utilization import PATH, VARIANT_CODECS, VARIANTS, parser, run_bench

MEASURES = ("bench/wire_split.py", "bench/scale_calibrate.py", "bench/scale_sim", *utilization.MEASURES, "coordinator")
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

__all__ = ["main", "real_keys", "simulated"]

VARIANT = "sparse"


def real_keys(v: dict, *, peers: int, cap: int, module_sizes: list[int]) -> dict:
    """The real figures from the variant's summary (:func:`bench.utilization.run_bench`); ``module_sizes``:
    the encoded size of each module's average."""
    from peer.network.records import split_levels

    rounds = v["rounds"]
    buckets = split_levels(peers, cap)[0]
    tree = sum(module_sizes) * max(0, peers - buckets) / peers  # a member's mean share of the tree's bytes
    payload = v["bytes_sent_per_peer"] / rounds + tree
    wire = v["wire_tx_bytes_per_peer"] / rounds
    round_s = v["wall_seconds"] / rounds
    idle = v.get("idle_tx_bytes_per_peer_s")
    return dict(
        rounds=rounds, failed_rounds=v["failed_rounds"], replica_max_abs_diff=v["replica_max_abs_diff"],
        replicas_identical=v["replicas_identical"], mean_group_size=v["mean_group_size"],
        split_levels=len(split_levels(peers, cap)) + 1,
        averager_bytes_per_round=round(v["bytes_sent_per_peer"] / rounds),
        tree_bytes_per_round_estimated=round(tree),
        payload_bytes_per_round=round(payload),
        wire_bytes_per_round=round(wire),
        control_bytes_per_peer_round=round(wire - payload),
        round_seconds_mean=round(round_s, 3),
        compute_seconds_per_round=round((v["wall_seconds"] - v["wait_seconds_mean"]) / rounds, 3),
        idle_bytes_per_s=idle,
        upkeep_bytes_per_round=round(idle * round_s) if idle is not None else None,
        failures=v["failures"],
        dht_requests_per_peer_round=v.get("dht_requests_per_round"),
    )


def simulated(*, peers: int, cap: int, rate_mbit: float, round_seconds: float, round_timeout: float,
              rounds: int, preset: str, seed: int = 0) -> dict:
    """The simulator's figures for ``peers`` CPU peers on one 2x1 path, joined a second apart, over
    ``rounds`` rounds of ``round_seconds`` after they all joined."""
    from bench.scale_calibrate import peer_specs
    from bench.scale_sim import SimConfig, simulate
    from models.presets import PRESETS

    run = PRESETS[preset]()
    bps = rate_mbit * 1e6 / 8
    tokens = run.inner.batch_size * run.lattice.seq_len * 10.0  # ten steps a second: rounds end on time
    specs = peer_specs([{"arrival": float(i), "tokens_per_s": tokens, "memory_bytes": 8 << 30, "upload_bps": bps,
                          "download_bps": bps} for i in range(peers)])
    ramp = float(peers) + 5.0
    cfg = SimConfig(peers=peers, levels=2, modules_per_level=1, duration=rounds * (round_seconds + 1.0), ramp=ramp,
                    leave_per_hour=0.0, seed=seed, inner_steps=100_000, round_seconds=round_seconds,
                    round_timeout=round_timeout, max_group_size=cap, replace_departures=False, base_run=run,
                    peer_specs=specs)
    f = simulate(cfg).figures
    return dict(sim_control_bytes_per_peer_round=round(f["dht_bytes_per_peer_round"]),
                sim_peer_rounds=f["peer_rounds"], sim_split_levels=f["split_levels_max"],
                sim_group_size_mean=f["group_size_mean"], sim_round_s_median=f["round_s_median"])


def main(argv: Optional[list[str]] = None) -> None:
    ap = parser("python -m bench.wire_split", __doc__.split("\n")[0])
    ap.set_defaults(variants=VARIANT, peers=17, max_group_size=4, steps=128, batch=1, idle_seconds=20.0,
                    round_timeout=60.0)
    args = ap.parse_args(argv)
    if args.variants != VARIANT:
        ap.error(f"--variants: bench.wire_split runs {VARIANT} (python -m bench.utilization runs the others)")
    if args.max_group_size < 2 or args.peers <= args.max_group_size:
        ap.error(f"--peers {args.peers} --max-group-size {args.max_group_size}: a split round needs a cap of at "
                 "least 2 and more peers than the cap")
    if args.steps % VARIANTS[VARIANT][0]:
        ap.error(f"--steps {args.steps}: a multiple of H = {VARIANTS[VARIANT][0]}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from models.codec_spec import encoded_size
    from models.presets import PRESETS

    result = run_bench(args)
    if "skipped" not in result:
        lattice = PRESETS[args.preset]().lattice
        codec = VARIANT_CODECS[VARIANT]
        sizes = [encoded_size(codec, lattice.module_param_count(m)) for m in lattice.path_modules(PATH)]
        real = real_keys(result["variants"][VARIANT], peers=args.peers, cap=args.max_group_size, module_sizes=sizes)
        sim = simulated(peers=args.peers, cap=args.max_group_size, rate_mbit=args.rate_mbit,
                        round_seconds=real["compute_seconds_per_round"], round_timeout=args.round_timeout,
                        rounds=real["rounds"], preset=args.preset)
        error = abs(sim["sim_control_bytes_per_peer_round"] - real["control_bytes_per_peer_round"]) / max(
            1, real["control_bytes_per_peer_round"])
        result.update(codec=codec, inner_steps=VARIANTS[VARIANT][0], max_group_size=args.max_group_size, **real, **sim,
                      sim_vs_real_control_bytes_error=round(error, 3))
    # the model from seed 0, peer k's batches from 1000 + k and its torch state from k, validation from 4242
    emit("wire_split", {**result, "seeds": sorted({0, 4242, *range(args.peers), *(1000 + k for k in range(args.peers))})})


if __name__ == "__main__":
    run_main(main)
