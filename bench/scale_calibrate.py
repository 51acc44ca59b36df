"""Calibrate the scale simulator against real processes: the same figures from a real
network on this machine and from :mod:`bench.scale_sim` describing the same run.

Real: a ``hivepath coordinator serve`` and N ``hivepath peer join`` processes on loopback (one torch
thread each, their own DHT node and p2p daemon each), the ``tiny`` preset on a 2x2 lattice over the
built-in corpus, rounds bounded in time (``[outer] round_seconds``, with an ``inner_steps`` no peer
reaches). The network grows in stages (default 4, 8, 12 peers): at each stage the new peers join,
the benchmark waits until every peer's last rounds averaged ``embed`` (held by every path) with all
of them, then measures ``window`` seconds. Round times come from the peers' ``--progress json``
``round`` events (the time between two rounds of ``embed`` of one peer); group sizes from the same
events (one per module, round and member set).

Each peer trains a share of the time (``peer join --cpu-limit``) such that all of them together at
the largest size take ``compute_cores`` (default 1) of this machine's 2 cores: volunteers each have a
machine of their own, and N peers training flat out on 2 cores starve every exchange of CPU, which
the simulator (one machine per peer) does not model.

Simulated: :func:`bench.scale_sim.simulate` with the same peers (each joining at the second the real
one did, with the tokens/s and link bandwidths it measured and reported to the coordinator), the
same lattice, ``round_seconds``, ``round_timeout``, ``inner_steps``, the tiny run config, no churn,
and the same window; the exchange's fixed ``latency`` and a member's processing of each other member's
part (``part_cpu``) as :mod:`bench.exchange_probe` measured them on this machine before the network
started (real averaging processes and nothing else; ``sim_fixed`` beside: the constants
``LOOPBACK_LATENCY`` and ``scale_sim.swarm.PART_CPU`` fitted once on another machine), and the peers'
exchanges sharing the cores the training leaves (``Plan.exchange_cores``): on one machine each
member's processing of the others' parts slows with the peers sharing it, which made the real
exchange's wait grow with the group and the network at once.

Keys: ``sim_vs_real_round_time_error``, |simulated median round - real median round| / real median
round at the largest real size (target <= 0.25), and ``sim_vs_real_noncompute_error``, the same on the
overheads alone (median round minus ``round_seconds``: matchmaking, exchange and waits, the part the
simulator models beyond compute; target <= 0.25), where fixed compute cannot hide a gap
(``..._fixed_constants``: the same with the constants instead of the probe's figures); the same at
every size, both medians, both overheads and
mean group sizes; the machine's load average over each window, and its CPU use over it (``cpu``,
:mod:`bench.cpu_use`): the cores the machine was busy (``host_busy_cores_by_peers``), those the
network's processes used by role (trainers, DHT processes, p2p daemons, coordinator, watchdogs), and
those used outside it (``outside_cores_by_peers``: other work on the machine). A size at which the
peers did not all average together within a deadline is reported under ``sizes_not_measured`` and
ends the run (this machine's limit). ``--quick`` runs 4 peers with short rounds and window
(``scale_calibrate_quick.json``); ``--resimulate RESULT.json`` runs only the simulator again on an
earlier result's measured inputs (after a change to the model; the earlier figures are kept).
``--max-group-size N`` runs it with split rounds (``[outer] max_group_size``, ``embed`` and ``head``
averaged in two levels once more than N peers hold them) and writes ``scale_calibrate_split.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from bench.common import emit, run_main
from bench.cpu_use import CpuWindow
from peer.localnet import LocalNetwork, ProcessGroup, wait_for

MEASURES = (
    "bench/scale_calibrate.py",
    "bench/exchange_probe.py",
    "bench/scale_sim",
    "models",
    "peer",
    "coordinator",
    "hivepath",
    "protos",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

__all__ = ["Plan", "calibrate", "main", "peer_specs", "real_figures"]

log = logging.getLogger("bench.scale_calibrate")

COORDINATOR = {"lease_timeout": 60.0}
"""The real run's ``[coordinator]`` table: the tiny preset with time-bounded rounds (:func:`calibrate`), the
coordinator's other settings its defaults (as the simulator's :class:`coordinator.CoordinatorSettings`),
a lease long enough for a loaded machine."""

INNER_STEPS = 100_000
"""H: more steps than a tiny peer takes in a round, so every round ends at ``round_seconds``."""
MODULE = "embed"
"""The module whose rounds are timed: every path holds it, so every peer averages it every round."""
LOOPBACK_LATENCY = 0.05
"""The simulator's ``latency`` on loopback where no probe measured it (``--no-probe``, and results
from before the probe): seconds an exchange and a hop of a split round's tree take beside bytes and
per-part processing, chosen with ``scale_sim.swarm.PART_CPU`` on the stored run of commit 1e51584."""


@dataclass(frozen=True)
class Plan:
    """One calibration run."""

    sizes: tuple[int, ...] = (4, 8, 12)
    """Peers at each stage (the network grows from one to the next)."""
    round_seconds: float = 10.0
    round_timeout: float = 20.0
    window: float = 60.0
    """Seconds measured at each stage, once every peer averages with all the others."""
    settle_rounds: int = 2
    """Rounds of ``embed`` in a group of everyone each peer must have done before a stage is measured."""
    seed: int = 0
    max_group_size: int = 0
    """``[outer] max_group_size`` of the run (0: one group a module): with it, ``embed`` and ``head``
    split into groups averaged in two levels (:mod:`peer.averaging.hierarchy`) once more peers hold
    them, in the real peers and in the simulator alike."""
    probe: bool = True
    """Measure the simulator's ``latency`` and ``part_cpu`` on this machine first
    (:mod:`bench.exchange_probe`); False: the fixed constants."""
    compute_cores: float = 1.0
    """Cores the peers' training takes together at the largest size: each peer trains with
    ``--cpu-limit compute_cores / max(sizes)`` (0: no limit). Volunteers each have a machine of
    their own; here N peers share 2 cores, and training them flat out starves every exchange of CPU
    (load averages of 10-27 on 2 cores in the first runs), an overhead no volunteer has. The rest of
    the machine is left to the exchanges, daemons and DHTs (the simulator's ``exchange_cores``)."""

    def exchange_cores(self, host_cores: Optional[int] = None) -> float:
        """Cores this machine leaves to the peers' exchanges: all but the training's ``compute_cores``
        (at least one)."""
        host = host_cores or len(os.sched_getaffinity(0))
        return max(1.0, host - self.compute_cores)

    def cpu_limit(self) -> Optional[float]:
        if self.compute_cores <= 0:
            return None
        return min(1.0, self.compute_cores / max(self.sizes))


QUICK = Plan(sizes=(4,), round_seconds=5.0, round_timeout=10.0, window=25.0)


def _round_events(net: LocalNetwork, name: str) -> list[dict]:
    return sorted((e for e in net.progress_lines(name, "round") if e.get("module") == MODULE), key=lambda e: e["time"])


def _settled(net: LocalNetwork, n: int, rounds: int, since: float, split: bool = False) -> bool:
    """Every peer's last ``rounds`` rounds of ``embed``, all after ``since``, averaged in a group of all
    ``n`` (``split``: averaged, in a split round: a peer's group then counts its bucket and the delegates)."""
    for name in net.peers:
        last = [e for e in _round_events(net, name) if e["time"] > since][-rounds:]
        if len(last) < rounds or not all(e["status"] == "done" and (split or e["group_size"] == n) for e in last):
            return False
    return True


def real_figures(net: LocalNetwork, start: float, stop: float) -> dict:
    """Round times, group sizes and failed rounds of the rounds that ended in ``(start, stop]``."""
    durations: list[float] = []
    groups: dict[tuple, int] = {}
    waits: list[float] = []
    rounds = failed = 0
    for name in net.peers:
        ends = [e["time"] for e in _round_events(net, name)]
        durations += [b - a for a, b in zip(ends, ends[1:]) if start < b <= stop]
        for e in net.progress_lines(name, "round"):
            if start < e["time"] <= stop:
                if e["status"] == "done":  # a failed round names no group
                    groups[(e["module"], e["round"], tuple(sorted(e.get("peers") or ())))] = e["group_size"]
                if e["module"] == MODULE:
                    waits.append(e["seconds"])
                    rounds += 1
                    failed += e["status"] != "done"
    return {
        "round_s_median": statistics.median(durations) if durations else None,
        "round_s_p90": sorted(durations)[int(0.9 * len(durations))] if durations else None,
        "peer_rounds": rounds,
        "failed_round_share": failed / rounds if rounds else None,
        "group_size_mean": statistics.fmean(groups.values()) if groups else None,
        "exchange_wait_s_median": statistics.median(waits) if waits else None,
    }


def _measured_peers(net: LocalNetwork, t0: float) -> list[dict]:
    """What the simulator needs of each real peer: when it joined (seconds after the coordinator
    started) and the tokens/s, memory and links it reported to the coordinator (tokens/s as its
    heartbeats last reported it: measured while training)."""
    reported = {p["peer_id"]: p for p in (net.status_json() or {}).get("peers", [])}
    out = []
    for name in net.peers:
        join = net.progress_lines(name, "join")[0]
        p = reported[join["peer_id"]]
        up = p["upload_bps"] or 100e6 / 8
        out.append({"arrival": round(max(0.0, join["time"] - t0), 3), "tokens_per_s": p["tokens_per_s"],
                    "memory_bytes": p["memory_bytes"], "upload_bps": up, "download_bps": p["download_bps"] or up})
    return out


def peer_specs(peers: list[dict]) -> tuple:
    """Measured peers as the simulator's :class:`~bench.scale_sim.PeerSpec` (no NAT, no departure)."""
    import math

    from bench.scale_sim import PeerSpec
    from bench.scale_sim.population import peer_id

    return tuple(PeerSpec(index=i, peer_id=peer_id(i), device="cpu", tokens_per_s=p["tokens_per_s"],
                          memory_bytes=p["memory_bytes"], upload_bps=p["upload_bps"], download_bps=p["download_bps"],
                          natted=False, arrival=p["arrival"], lifetime=math.inf, leave_kind="leave")
                 for i, p in enumerate(peers))


def fixed_model() -> dict:
    """The simulator's exchange constants where nothing was measured on the machine."""
    from bench.scale_sim import swarm

    return {"latency": LOOPBACK_LATENCY, "part_cpu": swarm.PART_CPU, "source": "constants"}


def simulated(plan: Plan, base_run, measured: dict, model: dict) -> dict:
    """The simulator's figures for the measured peers and window (``measured``: ``peers``, and ``start``
    and ``stop`` in seconds after the coordinator started), with ``model``'s ``latency`` and
    ``part_cpu`` (:func:`fixed_model`, or a probe's)."""
    from bench.scale_sim import SimConfig, simulate

    specs, start, stop = peer_specs(measured["peers"]), measured["start"], measured["stop"]
    cfg = SimConfig(peers=len(specs), duration=stop - start, ramp=start, leave_per_hour=0.0, seed=plan.seed,
                    inner_steps=INNER_STEPS, round_seconds=plan.round_seconds, round_timeout=plan.round_timeout,
                    replace_departures=False, base_run=base_run, peer_specs=specs, max_group_size=plan.max_group_size,
                    latency=model["latency"], part_cpu=model["part_cpu"],
                    exchange_cores=plan.exchange_cores(measured.get("host_cores")))
    f = simulate(cfg).figures
    return {k: f[k] for k in ("round_s_median", "round_s_p90", "peer_rounds", "group_size_mean", "refused")}


def _dataset():
    """The built-in corpus prepared for the 2x2 lattice (kept in the temp dir), and the run config the
    simulator is given: the tiny preset on it."""
    from models.data import prepared
    from models.presets import tiny_cpu

    data = prepared(Path(tempfile.gettempdir()) / "hivepath-calib-data-2x2", 2, 2, "bytes")
    return data, tiny_cpu().replace(lattice={"vocab_size": data.manifest["vocab_size"]},
                                    data={"manifest_hash": data.manifest_hash})


def calibrate(plan: Plan, work: Path) -> dict:
    """Grow a real network through ``plan.sizes``, measure each stage, simulate it; the rows."""
    data, base_run = _dataset()
    from models.presets import tiny_cpu

    run = tiny_cpu().replace(run_id="calib", outer={"inner_steps": INNER_STEPS, "round_seconds": plan.round_seconds,
                                                    "round_timeout": plan.round_timeout,
                                                    "max_group_size": plan.max_group_size},
                             data={"manifest_hash": data.manifest_hash, "corpus": "default"})
    net = LocalNetwork(ProcessGroup(work / "logs"), work, data.dir, run, COORDINATOR,
                       env={"HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor"}, peer_flags=["--measure-seconds", "0.3"])
    model = fixed_model()
    if plan.probe:  # before the network: the probe's processes have the machine to themselves
        from bench import exchange_probe

        # every size, whatever this calibration's largest network: the constants are the machine's, and
        # only the sizes past its cores tell the fixed latency from the per-part cost (a fit over the
        # smaller sizes alone takes part of the latency for per-part cost)
        model = {**exchange_probe.measure(run, MODULE, exchange_probe.SIZES, work=work / "probe"), "source": "probe"}
        log.info("probe: latency %.4f s, part_cpu %.4f s", model["latency"], model["part_cpu"])
    rows = []
    cpu = CpuWindow(os.getpid())
    try:
        t0 = time.time()
        net.start_coordinator(timeout=120.0)
        limit = plan.cpu_limit()
        peer_flags = ["--cpu-limit", f"{limit:.4f}"] if limit is not None else []
        for n in plan.sizes:
            new = [f"peer{i}" for i in range(len(net.peers), n)]
            for name in new:
                net.start_peer(name, *peer_flags)
            log.info("%d peers: started %d; waiting until all average together", n, len(new))
            try:
                wait_for(lambda: net.procs.none_exited() and all(net.progress_lines(m, "join") for m in new), 120 + 10 * len(new),
                           f"{len(new)} new peers to join", interval=0.5, retry_on=())
                joined = max(net.progress_lines(m, "join")[0]["time"] for m in new)
                wait_for(lambda: net.procs.none_exited() and _settled(net, n, plan.settle_rounds, joined, plan.max_group_size > 0),
                           120 + 4 * plan.settle_rounds * (plan.round_seconds + plan.round_timeout),
                           f"all {n} peers to average together", interval=0.5, retry_on=())
            except (TimeoutError, RuntimeError) as e:  # this machine's limit: report the sizes that ran
                log.warning("%d peers: not measured: %s", n, e)
                rows.append({"peers": n, "not_measured": str(e)[:500], "load_average": os.getloadavg()[0]})
                break
            start, load = time.time(), os.getloadavg()[0]
            cpu.start()
            wait_for(lambda: net.procs.none_exited() and time.time() >= start + plan.window, plan.window + 30,
                       "the measured window", interval=1.0, retry_on=())
            stop = time.time()
            used = cpu.stop()
            measured = {"start": round(start - t0, 3), "stop": round(stop - t0, 3), "peers": _measured_peers(net, t0),
                        "host_cores": len(os.sched_getaffinity(0))}
            row = compare(plan, base_run, {"peers": n, "window_s": round(stop - start, 1),
                                           "load_average": [load, os.getloadavg()[0]], "cpu": used,
                                           "real": real_figures(net, start, stop), "measured": measured},
                          model)
            log.info("%d peers: %s", n, {k: v for k, v in row.items() if k != "measured"})
            rows.append(row)
    finally:
        net.shutdown()
    return {"rows": rows, "work": str(work), "model": model}


def compare(plan: Plan, base_run, row: dict, model: dict) -> dict:
    """``row`` (a stage's ``real`` figures and ``measured`` inputs) with the simulator's figures and the
    error, with ``model``'s exchange constants (``sim``) and, where those were measured, with the fixed
    ones (``sim_fixed``: what the probe changed)."""
    real, sim = row["real"], simulated(plan, base_run, row["measured"], model)
    sides = [real, sim]
    fixed = None
    if model.get("source") == "probe":
        fixed = simulated(plan, base_run, row["measured"], fixed_model())
        sides.append(fixed)
    for side in sides:
        side["overhead_s_median"] = (side["round_s_median"] - plan.round_seconds
                                     if side["round_s_median"] is not None else None)
    out = {**row, "sim": sim, "round_time_error": _error(sim["round_s_median"], real["round_s_median"]),
           "noncompute_error": _error(sim["overhead_s_median"], real["overhead_s_median"])}
    if fixed is not None:
        out.update(sim_fixed=fixed,
                   noncompute_error_fixed=_error(fixed["overhead_s_median"], real["overhead_s_median"]))
    return out


def _error(sim: Optional[float], real: Optional[float]) -> Optional[float]:
    if sim is None or not real:
        return None
    return abs(sim - real) / real


def _noncompute_error(row: dict) -> Optional[float]:
    """The error on the part of a round beyond ``round_seconds`` (matchmaking, exchange, waits): the
    round-time error divides by a round that is mostly fixed compute, which hides a model of the rest
    that is several times off. Computed from the overheads, so older results get it too."""
    if "noncompute_error" in row:
        return row["noncompute_error"]
    return _error(row["sim"].get("overhead_s_median"), row["real"].get("overhead_s_median"))


def headline(plan: Plan, rows: list[dict], model: dict) -> dict:
    """The key at the largest real size, and the figures of every size; ``model``: the exchange
    constants the simulator ran with (a probe's result, or :func:`fixed_model`)."""
    from bench.scale_sim import swarm

    measured = [r for r in rows if "real" in r]
    if not measured:
        raise RuntimeError(f"no size was measured: {rows}")
    top = max(measured, key=lambda r: r["peers"])
    by = {str(r["peers"]): r for r in measured}
    return {
        "sizes_not_measured": {str(r["peers"]): r["not_measured"] for r in rows if "real" not in r},
        "sim_vs_real_round_time_error": top["round_time_error"],
        "sim_vs_real_noncompute_error": _noncompute_error(top),
        "largest_real_peers": top["peers"],
        "sim_vs_real_round_time_error_by_peers": {k: r["round_time_error"] for k, r in by.items()},
        "sim_vs_real_noncompute_error_by_peers": {k: _noncompute_error(r) for k, r in by.items()},
        "real_round_s_median_by_peers": {k: r["real"]["round_s_median"] for k, r in by.items()},
        "sim_round_s_median_by_peers": {k: r["sim"]["round_s_median"] for k, r in by.items()},
        "real_group_size_mean_by_peers": {k: r["real"]["group_size_mean"] for k, r in by.items()},
        "sim_group_size_mean_by_peers": {k: r["sim"]["group_size_mean"] for k, r in by.items()},
        "real_overhead_s_median_by_peers": {k: r["real"]["overhead_s_median"] for k, r in by.items()},
        "sim_overhead_s_median_by_peers": {k: r["sim"]["overhead_s_median"] for k, r in by.items()},
        "host_busy_cores_by_peers": {k: r["cpu"]["host_busy_cores"] for k, r in by.items() if "cpu" in r},
        "outside_cores_by_peers": {k: r["cpu"]["outside_cores"] for k, r in by.items() if "cpu" in r},
        "sizes": list(plan.sizes), "round_seconds": plan.round_seconds, "round_timeout": plan.round_timeout,
        "window_s": plan.window, "compute_cores": plan.compute_cores, "peer_cpu_limit": plan.cpu_limit(),
        "max_group_size": plan.max_group_size,
        "inner_steps": INNER_STEPS, "lattice": "2x2", "preset": "tiny", "seed": plan.seed, "seeds": [plan.seed],
        "sim_model": {"LATENCY": model["latency"], "PART_CPU": model["part_cpu"], "source": model["source"],
                      "GATHER": swarm.GATHER, "POLL": swarm.POLL, "WAITING_POLL": swarm.WAITING_POLL,
                      "DEADLINE": swarm.DEADLINE, "exchange_cores": plan.exchange_cores()},
        **({"probe": {k: v for k, v in model.items() if k != "source"},
            "sim_vs_real_noncompute_error_fixed_constants": top.get("noncompute_error_fixed"),
            "sim_vs_real_noncompute_error_fixed_constants_by_peers": {k: r.get("noncompute_error_fixed")
                                                                       for k, r in by.items()}}
           if model["source"] == "probe" else {}),
        "rows": rows,
    }


def resimulate(previous: dict) -> tuple[Plan, list[dict], dict]:
    """The rows of an earlier result with the simulator run again on its measured inputs (after a change
    to the model): the real figures are kept, the earlier simulated ones move to ``sim_previous``; the
    exchange constants are its probe's where it ran one, else :func:`fixed_model`'s."""
    plan = Plan(sizes=tuple(previous["sizes"]), round_seconds=previous["round_seconds"],
                round_timeout=previous["round_timeout"], window=previous["window_s"], seed=previous["seed"],
                compute_cores=previous.get("compute_cores", 0.0),  # the first runs trained flat out
                max_group_size=previous.get("max_group_size", 0))
    _, base_run = _dataset()
    model = {**previous["probe"], "source": "probe"} if "probe" in previous else fixed_model()
    rows = []
    for r in previous["rows"]:
        if "real" not in r:
            rows.append(r)
            continue
        row = compare(plan, base_run, {k: r[k] for k in ("peers", "window_s", "load_average", "cpu", "real", "measured")
                                       if k in r}, model)
        rows.append({**row, "sim_previous": r["sim"], "round_time_error_previous": r["round_time_error"],
                     "sim_model_previous": previous["sim_model"]})
    return plan, rows, model


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 peers, 5 s rounds, a 25 s window")
    ap.add_argument("--sizes", help="peers at each stage, comma-separated (default 4,8,12)")
    ap.add_argument("--window", type=float, help="seconds measured at each stage (default 60)")
    ap.add_argument("--compute-cores", type=float,
                    help="cores the peers' training takes together at the largest size (each peer's --cpu-limit is "
                         "this over the largest size; 0: no limit; default 1)")
    ap.add_argument("--max-group-size", type=int, default=0,
                    help="the run's [outer] max_group_size: split rounds of more holders (default 0: one group a "
                         "module); writes scale_calibrate_split.json")
    ap.add_argument("--no-probe", action="store_true",
                    help="simulate with the fixed exchange constants instead of measuring them on this machine "
                         "first (bench.exchange_probe)")
    ap.add_argument("--work", type=Path, help="keep the processes' logs and work dirs here (default: a temp dir)")
    ap.add_argument("--resimulate", type=Path, metavar="RESULT.json",
                    help="no real run: simulate again the measured inputs of an earlier result (after a model change)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("coordinator").setLevel(logging.WARNING)
    logging.getLogger("peer").setLevel(logging.ERROR)
    if args.resimulate is not None:
        previous = json.loads(args.resimulate.read_text())
        plan, rows, model = resimulate(previous)
        emit(previous["bench"], {**headline(plan, rows, model), "quick": previous["quick"],
                                 "real_measured_unix_time": previous.get("real_measured_unix_time",
                                                                         previous["unix_time"]),
                                 "real_measured_commit": previous.get("real_measured_commit", previous["commit"]),
                                 "real_measured_command": previous.get("real_measured_command", previous["command"])})
        return 0
    plan = QUICK if args.quick else Plan()
    if args.sizes:
        plan = Plan(**{**plan.__dict__, "sizes": tuple(int(s) for s in args.sizes.split(","))})
    if args.window:
        plan = Plan(**{**plan.__dict__, "window": args.window})
    if args.compute_cores is not None:
        if not args.compute_cores >= 0:
            ap.error(f"--compute-cores must be >= 0, got {args.compute_cores}")
        plan = Plan(**{**plan.__dict__, "compute_cores": args.compute_cores})
    if args.max_group_size:
        if args.max_group_size < 2:
            ap.error(f"--max-group-size must be 0 or at least 2, got {args.max_group_size}")
        plan = Plan(**{**plan.__dict__, "max_group_size": args.max_group_size})
    if args.no_probe:
        plan = Plan(**{**plan.__dict__, "probe": False})
    if args.work is not None:
        out = calibrate(plan, args.work)
    else:
        with tempfile.TemporaryDirectory(prefix="hivepath-calib-") as d:
            out = calibrate(plan, Path(d))
    name = "scale_calibrate_quick" if args.quick else "scale_calibrate"
    emit(name + ("_split" if plan.max_group_size else ""),
         {**headline(plan, out["rows"], out["model"]), "quick": args.quick})
    return 0


if __name__ == "__main__":
    run_main(main)
