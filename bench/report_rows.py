"""The rows of ``docs/BENCHMARKS.md``'s summary table: which key of which result file, and its target.

Each row names a benchmark module (whose ``MEASURES`` decide whether its result is stale), the result
file it reads (``bench/results/FILE.json``), a key (dots reach into nested objects: ``cpu_ratio_vs_
hivemind.int8``), what the key is, in a few words, and the target the project set for it, if any.
The measured figure, whether the target is met, and the result's commit all come from the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

__all__ = ["Row", "ROWS", "NOT_RUN_YET"]

Target = tuple[str, Union[float, bool]]


@dataclass(frozen=True)
class Row:
    """One figure of the summary table."""

    bench: str
    """The benchmark module under ``bench/`` that writes the file (``comm`` for ``bench.comm``)."""
    result: str
    """The result file's name without ``.json``."""
    key: str
    """The key in the result; dots reach into nested objects."""
    what: str
    """What the figure is, as a short phrase (the setting it was measured in lives in the prose)."""
    target: Optional[Target] = None
    """``(op, value)`` with op one of ``<=``, ``>=``, ``==``, ``<``; None: reported, no target."""


def _rows(bench: str, result: str, *specs: tuple) -> list[Row]:
    return [Row(bench, result, *spec) for spec in specs]


ROWS: tuple[Row, ...] = tuple(
    _rows("inner_loop", "inner_loop",
          ("overhead", "throughput lost to hivepath's loop vs a bare PyTorch loop", ("<=", 0.03)))
    + _rows("routing", "routing",
            ("purity", "routing purity of 4 shards", (">=", 0.9)))
    + _rows("codecs", "codecs",
            ("codecs.int8.ratio_vs_fp32", "int8 size over fp32"),
            ("codecs.int8.rel_l2_error_gauss", "int8 relative L2 error (Gaussian vector)"))
    + _rows("coordinator_load", "coordinator_load",
            ("heartbeats_per_s", "heartbeats per second, 10,000 leases", (">=", 3000)),
            ("p99_ms", "heartbeat p99 latency, ms", ("<=", 20)),
            ("assign_ms_100k", "assignment time at 100,000 peers, ms", ("<=", 50)),
            ("loadavg_1m", "machine load while measuring"))
    + _rows("comm", "comm",
            ("link_efficiency", "int8 link efficiency at 100 Mbit/s", (">=", 0.9)),
            ("link_efficiency_vs_tcp_ceiling.int8", "int8 link efficiency over bare TCP's in the same run"),
            ("speedup_vs_fp32_optimal", "int8 speed-up over an fp32 exchange at link rate"),
            ("bytes_ratio_vs_ddp", "payload bytes of DDP over ours (H=100, int8)", (">=", 400)),
            ("bytes_ratio_vs_ddp_wire", "the same, counting every byte the interfaces sent"),
            ("cpu_ratio_vs_hivemind.int8", "CPU per MB over hivemind 8-bit's (int8)", ("<=", 0.5)),
            ("cpu_ratio_vs_hivemind.int4", "CPU per MB over hivemind 8-bit's (int4)", ("<=", 0.5)),
            ("replica_max_abs_diff", "largest difference between replicas", ("==", 0.0)))
    + _rows("comm", "comm",
            ("link_efficiency_by_rate.50.int8", "int8 link efficiency at 50 Mbit/s"),
            ("link_efficiency_by_rate.25.int8", "int8 link efficiency at 25 Mbit/s"))
    + _rows("comm_hivemind", "comm_hivemind",
            ("link_efficiency_8bit", "hivemind 8-bit's link efficiency at 100 Mbit/s"))
    + _rows("utilization", "utilization",
            ("comm_share_without_overlap", "share of a round spent communicating, no overlap", (">=", 0.30)),
            ("utilization_no_overlap", "compute utilization without overlap"),
            ("utilization_overlap", "compute utilization with overlap", (">=", 0.95)),
            ("utilization_overlap_bpb_delta", "bits per byte of overlap minus no overlap, same rounds"))
    + _rows("wire", "wire",
            ("payload_bytes_ratio_vs_ddp", "sparse (H=16, topk16b2) against every-step DDP: payload bytes, same steps"),
            ("wire_bytes_ratio_vs_ddp", "the same counted on the peers' network interfaces"),
            ("per_round_control_bytes", "bytes on the wire per member and round beyond the payload"),
            ("upkeep_bytes_per_round", "of which the link sends with modules held and no round (DHT upkeep)"),
            ("plain_dht_per_round_control_bytes", "the same with hivemind's DHT uncoalesced (the control run)"),
            ("control_bytes_cut_vs_plain_dht", "control bytes per round, uncoalesced over coalesced DHT requests"),
            ("params_for_1000x_wire", "projected: parameters from which the wire ratio reaches 1000x"))
    + _rows("wire_split", "wire_split",
            ("replica_max_abs_diff", "split rounds, 17 holders capped at 4 (three levels): replicas' largest difference",
             ("==", 0.0)),
            ("failed_rounds", "the same run: rounds lost", ("==", 0)),
            ("control_bytes_per_peer_round", "the same run: bytes on the wire per member and round beyond the payload"),
            ("sim_control_bytes_per_peer_round", "the simulator's DHT bytes per member and round at the same size"),
            ("sim_vs_real_control_bytes_error", "|simulated - real| / real control bytes"))
    + _rows("quality", "quality",
            ("sparse_smallest_gap_at_1000x", "quick grid (1,000 steps): smallest gap of a point at >= 1000x",
             ("<=", 0.02)),
            ("sparse_bpb_gap_mean", "quick grid, 3 seeds: smallest mean gap of a point at >= 1000x, against the "
             "baseline at its best of 4 inner learning rates", ("<=", 0.02)),
            ("sparse_bpb_gap_stdev", "its spread over the seeds (sample standard deviation)"),
            ("sync_lr_best", "the synchronous baseline's inner learning rate kept (of 1.5e-3, 3e-3, 6e-3, 1.2e-2)"),
            ("diloco_smallest_gap", "quick grid: smallest gap of any DiLoCo point"),
            ("dipaco_bpb", "DiPaCo 2x2 bits per byte"),
            ("dense_p_bpb", "dense model of one path's size, bits per byte"),
            ("hetero_speedup", "speed-up with one worker 4x slower, simulated clock", (">=", 1)))
    + _rows("quality", "quality_horizon",
            ("sparse_best_bytes_ratio", "12,000 steps, 0.12M model, one seed: most payload bytes saved within 2%",
             (">=", 1000)),
            ("sparse_bpb_gap_at_best", "bits-per-byte gap at that point", ("<=", 0.02)))
    + _rows("sparse_network", "sparse_network",
            ("replica_max_abs_diff", "sparse codec over real peers: largest replica difference", ("==", 0.0)),
            ("pairs_compared", "replica pairs compared"))
    + _rows("swarm", "swarm",
            ("small_peers_idle", "small peers left idle", ("==", 0)),
            ("small_peer_token_share", "share of tokens trained through small peers"),
            ("throughput_fraction", "trainers' tokens/s over the least level capacity", (">=", 0.8)),
            ("throughput_fraction_with_kills", "the same with a server killed every 30 s", (">=", 0.6)),
            ("path_round_ratio_with_small_peers", "path peers' round time with small peers over without",
             ("<=", 1.2)),
            ("path_round_failures_on_small_peers", "path peers' rounds failed waiting for a small peer's declaration",
             ("==", 0)),
            ("path_round_failures_naming_small_peers", "path peers' failed rounds whose reason names a small peer"),
            ("activation_bytes_ratio", "activation bytes over fp32 (the default codec)", ("<=", 0.125)),
            ("kill_retention", "tokens/s with kills over without"),
            ("replica_max_abs_diff", "largest difference between replicas", ("==", 0.0)))
    + _rows("swarm_standby", "swarm_standby",
            ("throughput_fraction", "with a standby server a level: trainers' tokens/s over the least level capacity"),
            ("throughput_fraction_with_kills", "the same with a server killed every 30 s"),
            ("kill_retention", "tokens/s with kills over without (bench.swarm's: its own row)"),
            ("replica_max_abs_diff", "largest difference between replicas", ("==", 0.0)))
    + _rows("stage_codec", "stage_codec",
            ("activation_bytes_ratio", "activation bytes over fp32 (the candidate: peers' default)", ("<=", 0.125)),
            ("stage_bpb_gap_vs_fp32", "its bits-per-byte gap to fp32 activations", ("<=", 0.02)))
    + _rows("nat", "nat",
            ("natted_round_share", "share of NATed peers' rounds averaged with others", (">=", 0.95)),
            ("replica_max_abs_diff", "largest difference between replicas", ("==", 0.0)),
            ("relay_bytes_share", "share of bytes through relays"),
            ("nat_vs_public_round_s", "round time behind NAT over all-public", ("<=", 1.5)),
            ("nat_vs_public_tokens_per_s", "tokens trained a second behind NAT over all-public"),
            ("newcomer_first_round_s", "a NATed newcomer's first round, s", ("<=", 60)))
    + _rows("planner", "planner",
            ("utilization_planner", "exchange planner: peers' time not blocked on exchanges, uneven links", (">=", 0.9)),
            ("utilization_fixed", "the same with the fixed policy (planner = false)"),
            ("bpb_planner_vs_fixed", "validation bits per byte at equal wall time, planner minus fixed", ("<", 0.0)),
            ("tokens_planner_over_fixed", "tokens trained at equal wall time, planner over fixed"),
            ("rounds_slowed_by_slowest.planner.share", "share of rounds with a member under half the median link"),
            ("rounds_slowed_by_slowest.fixed.share", "the same with the fixed policy"),
            ("plan_changes.count", "plan changes in the planner run"),
            ("replica_max_abs_diff", "largest difference between replicas", ("==", 0.0)))
    + _rows("planner", "planner_overlap",
            ("utilization_planner", "the planner allowed to exchange behind the next round (overlap_budget 0.3)"),
            ("bpb_planner_vs_fixed", "bits per byte at equal wall time, planner (overlap allowed) minus fixed"),
            ("replica_max_abs_diff", "largest difference between replicas", ("==", 0.0)))
    + _rows("scale", "scale",
            ("peers_simulated", "joins simulated, admitted and refused together", (">=", 10000)),
            ("coordinator_cpu_share_at_10000", "coordinator CPU share at 10,000 peers (in-process)", ("<=", 0.5)),
            ("churn_compute_loss_10pct_per_hour", "compute lost to 10% churn per hour", ("<=", 0.05)),
            ("round_time_ratio_1000_vs_10", "round time at 1,000 peers over 10", ("<=", 1.5)),
            ("round_time_ratio_10000_vs_10", "round time at 10,000 peers over 10 (groups capped at 8, five levels)",
             ("<=", 1.5)),
            ("coordinator_cpu_share_at_10000_grpc", "coordinator CPU share through gRPC, 10,000 peers and 1,000 joins at once",
             ("<=", 0.5)),
            ("max_group_members_at_10000", "largest group of any level at 10,000 peers (cap 64)", ("<=", 64)),
            ("control_bytes_growth_10_to_10000",
             "DHT bytes per peer and round, 10,000 peers over 10 (census design, simulator only)", ("<=", 3)))
    + _rows("scale", "scale_quick",
            ("peers_admitted", "quick sweep (10 and 100 peers): joins admitted"),
            ("peers_refused", "joins refused"),
            ("coordinator_cpu_share_at_1000_grpc", "coordinator CPU share through gRPC, 1,000 peers and 100 joins at once"),
            ("heartbeat_rate_achieved", "heartbeats per second it served (the simulated rate: 200)"))
    + _rows("scale_calibrate", "scale_calibrate",
            ("sim_vs_real_round_time_error", "simulated vs real round time, largest real size", ("<=", 0.25)),
            ("sim_vs_real_noncompute_error", "the same on the part of a round beyond compute", ("<=", 0.25)),
            ("sim_vs_real_noncompute_error_fixed_constants",
             "the same with the exchange constants of another machine, not this one's probe"),
            ("largest_real_peers", "real peers at that size"))
    + _rows("scale_calibrate", "scale_calibrate_split",
            ("sim_vs_real_round_time_error", "the same with split rounds", ("<=", 0.25)),
            ("sim_vs_real_noncompute_error", "split rounds: the part of a round beyond compute", ("<=", 0.25)),
            ("largest_real_peers", "real peers at that size"))
    + _rows("scale_calibrate", "scale_calibrate_quick",
            ("sim_vs_real_round_time_error", "quick calibration (4 peers, 5 s rounds): round time", ("<=", 0.25)),
            ("sim_vs_real_noncompute_error", "the same on the part of a round beyond compute", ("<=", 0.25)),
            ("sim_vs_real_noncompute_error_fixed_constants", "the same with the other machine's exchange constants"))
    + _rows("data_fetch", "data_fetch",
            ("fetch_link_efficiency", "shard fetch link efficiency, 1 seeder 3 fetchers", (">=", 0.8)),
            ("two_seeder_speedup", "speed-up with two seeders", (">=", 1.7)),
            ("time_to_first_step_s", "join to first training step, s"),
            ("verified_share", "share of fetched bytes verified", ("==", 1.0)))
    + _rows("robust", "robust",
            ("robust_err_over_spread_max", "worst error of trimmed mean and centered clip, 1 hostile of 5, in spreads",
             ("<=", 0.6)),
            ("err_over_spread.huge.mean", "the plain mean against a huge update, in spreads"))
    + _rows("chaos", "chaos",
            ("rounds_lost", "rounds lost to kills and a partition", ("==", 0)),
            ("max_stall_s", "longest stall, s", ("<=", 12)),
            ("replica_max_abs_diff", "largest difference between replicas", ("==", 0.0)),
            ("byzantine_bpb_gap", "bits-per-byte gap with 1 hostile peer of 5", ("<=", 0.05)),
            ("partition_remerge_rounds_max", "most rounds to re-merge after each of its partitions", ("<=", 2)))
    + _rows("byzantine", "byzantine",
            ("byzantine_bpb_gap", "bits-per-byte gap under the worst attack, defended", ("<=", 0.05)),
            ("byzantine_worst_attack", "the worst attack"),
            ("rounds_to_ban", "rounds until the attacker is banned"))
    + _rows("joiners", "joiners",
            ("sharer_bpb_rise_max", "3 seeds, H=30, 10 rounds an event: largest rise of another trained path's "
             "validation bpb after a newcomer arrives (a join, or a moved peer on its new path)", ("<=", 0.01)),
            ("variants.unguarded.sharer_bpb_rise_max", "the same without the guards (seed init, no ramp)"),
            ("left_path_bpb_rise_max", "largest rise of the path a moved peer left (one trainer fewer, so less "
             "weight in its shared modules)"),
            ("network_bpb_change.move.0", "the move: change of the mean bpb over the held paths, 10 rounds on "
             "(seed 0)"),
            ("joiner_rounds_to_network_bpb.join_held.0", "rounds until a joiner on a held path is within 5% of the "
             "network's (seed 0; the same at seeds 1 and 2)"),
            ("replica_max_abs_diff", "largest difference between replicas", ("==", 0.0)))
    + _rows("joiners", "joiners_quick",
            ("sharer_bpb_rise_max", "quick run (1 seed, H=10, 4 rounds an event): largest rise of another trained "
             "path's validation bpb after a newcomer arrives", ("<=", 0.01)),
            ("variants.unguarded.sharer_bpb_rise_max", "the same without the guards (seed init, no ramp)"),
            ("left_path_bpb_rise_max", "largest rise of the path a moved peer left"),
            ("joiner_rounds_to_network_bpb.move.0", "rounds until a moved peer's path is within 5% of the "
             "network's"),
            ("replica_max_abs_diff", "largest difference between replicas", ("==", 0.0)))
)

NOT_RUN_YET: frozenset[str] = frozenset()
"""Result files of benchmarks whose rows are declared before their first measurement: the summary
says "not run yet" for them while the file is missing (any other missing file is an error)."""
