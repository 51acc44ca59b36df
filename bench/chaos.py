"""Benchmark ``bench.chaos``: the long fault run and the hostile-peer measurement.

**Fault run.** A coordinator, an archive and ``--peers`` peers (default 4, a 2x2 lattice) as real
``hivepath`` processes, each in its own network namespace behind one bridge (``peer.localnet.netns``; on
loopback without the partition when namespaces cannot be made). For ``--minutes`` (default 10):
every ``--kill-every`` seconds one peer (round robin) is killed with ``kill -9`` and restarted with
the same work dir and identity once the others finished a round without it; once, the coordinator is
killed and restarted on the same ``--db`` after every peer finished two rounds without it;
``--partitions`` times (default 3, over the run's second half, each time another peer), one peer's
namespace link goes down for ``--partition-seconds`` (default 30), and until the others finished two
rounds and it finished one on its own; ``partition_remerge_rounds`` lists the rounds each took to
re-merge after the heal, ``partition_remerge_rounds_max`` the worst (target <= 2). The fault injector and the
invariants are the chaos test suite's (``tests/chaos``): faults fire on conditions (rounds ended,
log lines), and at the end everything is stopped with SIGTERM and checked.

**Hostile peer.** ``byzantine_bpb_gap`` comes from the in-process K-worker DiLoCo simulator
(``peer.simulator``, the same ``peer.averaging.aggregate`` the network runs): 5 workers on the dense
tiny model with ``outer.aggregator = trimmed_mean``, one of which sends ``-10x`` its honest
pseudo-gradient every round, against the same run with 5 honest workers; validation bits per byte
of each, gap relative to the clean run.

Keys: ``rounds_completed``, ``rounds_lost`` (target 0), ``max_stall_s`` (target <= the round
deadline), ``replica_max_abs_diff`` (target 0.0), ``partition_remerge_rounds_max`` (target <= 2),
``byzantine_bpb_gap`` (target <= 0.05; every attack with a control: ``bench.byzantine``).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import emit, run_main, work_directory

MEASURES = (
    "bench/chaos.py",
    "bench/chaos_drain.py",
    "models",
    "peer",
    "coordinator",
    "hivepath",
    "protos",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

log = logging.getLogger("bench.chaos")

ROUND_TIMEOUT = 12.0
"""The run's round deadline (the chaos tests' too)."""
PREFIX, SUBNET = "hpk", "10.80.0"
"""Namespaces of this benchmark: apart from the chaos tests' and the other benchmarks', so they can run at once."""
# -- the fault run ------------------------------------------------------------------------------


def fault_run(minutes: float, peers: int, kill_every: float, work: Path, inner_steps: int,
              partition_s: float = 30.0, partitions: int = 3) -> dict:
    from models.data import prepared
    from peer.localnet import NetnsBridge, ProcessGroup, netns_available, preset_network
    from peer.localnet.checks import (acknowledged_rounds, first_identical_round, first_merged_rounds, held_rounds,
                                      loss_thirds, replica_check, round_gaps, round_waits, rounds_lost, settled,
                                      stop_all)
    from peer.localnet.faults import FaultInjector, rounds_done

    data = prepared(work / "data", 2, 2, "bytes")
    procs = ProcessGroup(work / "logs")
    why = netns_available()
    bridge = NetnsBridge(peers + 2, rate="100mbit", subnet=SUBNET, prefix=PREFIX) if not why else None
    names = [f"peer{i}" for i in range(peers)]
    out: dict = {"netns": not why, "netns_unavailable": why}
    try:
        if bridge is not None:
            bridge.open()
            net = preset_network(procs, work / "net", data.dir, data.manifest_hash, run_id="chaos",
                                 inner_steps=inner_steps, round_timeout=ROUND_TIMEOUT, lease_timeout=8.0, bridge=bridge)
            net.start_coordinator()
            archive = net.start_archive_in(1)
            works = [net.start_peer_in(n, i + 2) for i, n in enumerate(names)]
        else:
            log.warning("no network namespaces (%s): loopback, no partition", why)
            net = preset_network(procs, work / "net", data.dir, data.manifest_hash, run_id="chaos",
                                 inner_steps=inner_steps, round_timeout=ROUND_TIMEOUT, lease_timeout=8.0)
            net.start_coordinator()
            archive = net.start_archive()
            works = [net.start_peer(n) for n in names]
        roots = [archive, *[w / "checkpoints" for w in works]]
        inj = FaultInjector(net, bridge)
        inj.when(lambda: settled(net, names), 240, "the network to form")
        baseline = acknowledged_rounds(roots)
        start = time.monotonic()
        end = start + minutes * 60
        coordinator_at = start + 0.4 * (end - start)
        # partitions spread over the last half of the run, each on another peer (at most one per peer)
        partition_due = [start + (0.5 + 0.45 * i / max(1, partitions)) * (end - start)
                         for i in range(min(partitions, peers))]
        next_kill, victim = start + kill_every if kill_every > 0 else float("inf"), 0
        exclude: dict[Path, Any] = {}
        cuts: list[tuple[Path, dict[str, int]]] = []
        merge_rounds: list[int] = []

        def others_round(skip: set[str], n: int = 1, timeout: float = 120.0) -> None:
            rest = [x for x in names if x not in skip]
            done = {x: rounds_done(net, x) for x in rest}
            inj.when(lambda: all(rounds_done(net, x) >= done[x] + n for x in rest), timeout,
                     f"{', '.join(rest)} to finish {n} round(s)")

        while time.monotonic() < end:
            now = time.monotonic()
            if coordinator_at and now >= coordinator_at:
                coordinator_at = 0.0
                others_round(set(), 1)  # every peer trains (a restarting one needs the coordinator to join)
                inj.kill_coordinator()
                others_round(set(), 2)
                inj.restart_coordinator()
            elif partition_due and bridge is not None and now >= partition_due[0]:
                partition_due.pop(0)
                others_round(set(), 1)
                was_cut = {r for r, _ in cuts}
                order = [names[(victim + 1 + i) % peers] for i in range(peers)]
                cut = next(n for n in order if works[names.index(n)] / "checkpoints" not in was_cut)
                cut_root = works[names.index(cut)] / "checkpoints"
                ref_root = works[names.index(next(n for n in order if n != cut))] / "checkpoints"
                forked_from = max(held_rounds([cut_root]).values(), default=0)
                cuts.append((cut_root, held_rounds([cut_root])))
                alone = rounds_done(net, cut)
                inj.partition(net.where[cut])
                cut_at = time.monotonic()
                others_round({cut}, 2)
                inj.when(lambda: rounds_done(net, cut) > alone and time.monotonic() - cut_at >= partition_s,
                         partition_s + 120, f"the cut-off {cut} to finish a round alone, {partition_s:.0f}s cut off")
                inj.heal(net.where[cut])
                healed_at = max(held_rounds([r for r in roots if r != cut_root]).values())
                merged = inj.when(lambda: first_identical_round(ref_root, cut_root, healed_at, ("embed", "head")),
                                  180, f"{cut} to re-merge with the others")
                merge_rounds.append(merged - healed_at)
                log.info("partition %d: %s re-merged %d rounds after the heal", len(cuts), cut, merged - healed_at)
                exclude[cut_root] = (forked_from + 1, merged - 1)
            elif now >= next_kill:
                name = names[victim % peers]
                victim += 1
                inj.kill(name)
                others_round({name}, 3)
                back = rounds_done(net, name)
                inj.restart(name)
                inj.when(lambda: rounds_done(net, name) > back, 120, f"the restarted {name} to finish a round")
                next_kill = time.monotonic() + kill_every
            else:  # the next fault is due later: wait for a round to end meanwhile (not a sleep)
                due = min([next_kill, end, *partition_due])
                others_round(set(), 1, timeout=max(1.0, due - now) + 60)
        run_s = time.monotonic() - start
        seconds: dict[str, float] = {}
        codes = stop_all(net, names, 90.0, seconds)
        for name in ("archive", "coordinator"):
            codes.update(stop_all(net, [name], 90.0, seconds))
        for cut_root, forked in cuts:  # per module: the cut-off peer's own rounds from the cut until it re-merged
            merged_by_module = first_merged_rounds(cut_root, [r for r in roots if r != cut_root], forked)
            exclude[cut_root] = {m: (forked[m] + 1, merged_by_module[m] - 1) for m in merged_by_module}
            out.setdefault("partition_merged_round_by_module", []).append(merged_by_module)
        check = replica_check(roots, baseline, exclude)
        acked, held = acknowledged_rounds(roots), held_rounds(roots)
        lost = rounds_lost(acked, held)
        per_peer = {n: round_gaps(procs.log(n)) for n in names}
        gaps = [g for v in per_peer.values() for g in v]
        # what the training loop waited on each round, as the trainer logs it
        stalls = [w for n in names for w in round_waits(procs.log(n))]
        losses = {n: loss_thirds(net.progress_lines(n)) for n in names}
        out.update({
            "run_s": round(run_s, 1),
            "rounds_completed": sum(held.values()) - sum(baseline.values()),
            "rounds_per_module": held,
            "rounds_lost": sum(lost.values()),
            "max_stall_s": max(stalls, default=0.0),
            "max_round_gap_s": max(gaps, default=0.0),
            "median_round_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
            "round_deadline_s": ROUND_TIMEOUT,
            "replica_max_abs_diff": check.max_abs_diff,
            "replica_pairs": check.pairs,
            "replica_mismatches": check.mismatches[:10],
            "faults": {k: inj.fired(k) for k in ("kill", "restart", "coordinator_kill", "partition")},
            "timeline": inj.timeline(),
            "exit_codes": codes,
            "exit_seconds": seconds,
            "hung": [n for n, c in codes.items() if c is None],
            "loss_first_last_third": {n: [round(a, 3), round(b, 3)] for n, (a, b, _) in losses.items()},
            "loss_falling": all(b < a for a, b, k in losses.values() if k >= 3),
            "partition_remerge_rounds": merge_rounds,
            "partition_remerge_rounds_max": max(merge_rounds, default=None),
            "partition_excluded_rounds": {str(k): v for k, v in exclude.items()},
        })
        net.close()
    finally:
        procs.close()
        if bridge is not None:
            bridge.close()
    return out


# -- the hostile peer ---------------------------------------------------------------------------


def byzantine(steps: int, work: Path, aggregator: str = "trimmed_mean") -> dict:
    """Validation bits per byte of 5 simulated workers, clean vs one sending -10x its pseudo-gradient."""
    import torch

    from models.data import prepared
    from models.presets import tiny_cpu
    from models.evaluate import bits_per_byte
    from peer.simulator import DiLoCoSimulator

    torch.set_num_threads(1)
    ds = prepared(work / "data-dense", 1, 1, "bytes")
    cfg = tiny_cpu().replace(lattice={"levels": 1, "modules_per_level": 1, "vocab_size": ds.manifest["vocab_size"]},
                             outer={"aggregator": aggregator},
                             data={"manifest_hash": ds.manifest_hash, "tokenizer": ds.manifest["tokenizer"]})
    B, T = cfg.inner.batch_size, cfg.lattice.seq_len

    class HostileSimulator(DiLoCoSimulator):
        """Worker ``hostile`` replaces its pseudo-gradient by ``-10x`` itself before every outer step."""

        hostile: Optional[int] = None

        @torch.no_grad()
        def outer_step(self, weights):
            if self.hostile is not None:
                w = self.workers[self.hostile]
                for mid in self.module_ids:
                    opt = self.outer[mid]
                    for p, g in zip(w.module_params(mid), opt.global_params):
                        p.copy_(g + 10.0 * (p - g))  # delta = g - p  ->  -10 x delta
            super().outer_step(weights)

    def run(hostile: Optional[int]) -> float:
        torch.manual_seed(cfg.seed)
        sim = HostileSimulator(cfg, [(0,)], 5, lambda k, path: ds.dense_batches("train", B, T, cfg.seed * 1_000_003 + k))
        sim.hostile = hostile
        sim.train(steps)
        model = sim.global_model()
        return bits_per_byte(model.path_model((0,)), ds.validation_documents(), T, "cpu", max_documents=32).bpb

    clean, attacked = run(None), run(4)
    return {"byzantine_aggregator": aggregator, "byzantine_steps": steps, "byzantine_bpb_clean": round(clean, 4),
            "byzantine_bpb_hostile": round(attacked, 4), "byzantine_bpb_gap": round((attacked - clean) / clean, 4)}


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the fault run (default 10)")
    ap.add_argument("--peers", type=int, default=4, help="trainers (default 4; plus an archive)")
    ap.add_argument("--kill-every", type=float, default=60.0, help="seconds between peer kills (default 60; 0: none)")
    ap.add_argument("--inner-steps", type=int, default=20, help="inner steps per round (default 20)")
    ap.add_argument("--partition-seconds", type=float, default=30.0,
                    help="the cut-off peer's link stays down at least this long (default 30)")
    ap.add_argument("--partitions", type=int, default=3,
                    help="partitions in the run, each of another peer, over its second half (default 3)")
    ap.add_argument("--byzantine-steps", type=int, default=300, help="inner steps per simulated worker (default 300; 0: no hostile-peer run)")
    ap.add_argument("--aggregator", default="trimmed_mean", choices=["trimmed_mean", "centered_clip", "mean"])
    ap.add_argument("--skip-faults", action="store_true", help="only the hostile-peer measurement")
    ap.add_argument("--skip-drain", action="store_true", help="leave out the drain measurement (bench.chaos_drain)")
    ap.add_argument("--work", type=Path, help="keep logs and checkpoints here (default: a temp dir, removed at the "
                    "end unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the temp work directory and say where")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # every peer's run config and the hostile-peer simulator keep the preset's seed (0); kills follow a fixed order
    result: dict = {"minutes": args.minutes, "peers": args.peers, "kill_every_s": args.kill_every,
                    "inner_steps": args.inner_steps, "seeds": [0]}
    with work_directory("hivepath-chaos-", args.work, args.keep) as work:
        if args.work or args.keep:
            result["work"] = str(work)
        if args.byzantine_steps > 0:
            result.update(byzantine(args.byzantine_steps, work, args.aggregator))
        if not args.skip_drain:
            from bench.chaos_drain import drain_run  # survivor_round_ratio_after_drain: survivors' rounds after a peer drains

            result.update(drain_run(work))
        if not args.skip_faults:
            result.update(fault_run(args.minutes, args.peers, args.kill_every, work, args.inner_steps,
                                    args.partition_seconds, args.partitions))
    return emit("chaos", result)


if __name__ == "__main__":
    run_main(main)
