"""Benchmark ``bench.swarm``: stage mode in a real run of ``hivepath peer join`` processes.

Setup: the demo lattice (2x2, byte tokenizer, the built-in corpus), a coordinator, 2 path peers and 6
small peers, each small one started with nothing but a ``--max-memory`` that fits a stage module and
a pipeline trainer but not a path (computed from the lattice, as the coordinator judges it). Every
process is the installed ``hivepath`` command, in 4 network namespaces behind one bridge with
50 Mbit/s links (``peer.localnet.netns``; on loopback, said in the result, where namespaces cannot be made).
One torch thread per process. The path peers run on one half of this machine's CPUs, the coordinator
and the small peers on the other (``--shared-cpus``: all on all): as on machines of their own, the
small peers do not take the path peers' CPU, so what changes the path peers' rounds between the
windows is the protocol, not the machine's sharing (the small peers' own throughput is what their
half allows, and ``throughput_fraction`` compares it with their servers' capacity on that half).

Phases, each measured over its own window:

1. **control**: the 2 path peers alone. Their module rounds: exchange seconds and failures.
2. **stage**: the 6 small peers join; the coordinator makes them stage servers and trainers. Once a
   pipeline runs, the window measures every peer's tokens, the path peers' rounds again, and the
   servers' capacity (the tokens each trained over its seconds spent serving, both counted over the
   window from its progress lines).
3. **kills**: a stage server (chosen with the seeded generator) is killed with SIGKILL every 30 s
   and started again on its work directory.

Keys:

- ``small_peers_idle``: small peers that processed no token in the last half of the stage window (target 0).
- ``small_peer_token_share``: tokens trained through pipelines (the trainers') / all tokens trained.
- ``throughput_fraction``: the trainers' tokens/s over the pipelines' bottleneck, the least over
  levels of the summed capacity of that level's servers (every pipeline token crosses one server a
  level; a server's capacity: the tokens it trained over the seconds it spent serving, in the window),
  in the stage window (target >= 0.8); ``throughput_fraction_with_kills`` in the kill
  window, against the same bottleneck (target >= 0.6).
- ``path_round_ratio_with_small_peers``: the path peers' median seconds from one round of a module to
  its next, with small peers over without (target <= 1.2); with ``--shared-cpus`` it counts the CPU
  the small peers take from the path peers too. ``path_exchange_wait_seconds_median`` (what the path
  peers waited on one module's exchange: most modules' is none) and ``path_round_wait_seconds_mean``
  (what a path peer's training loop waited on a round's exchanges, all its modules', the mean over
  its rounds) and ``path_round_failures`` (failed rounds a window) isolate the
  averaging; ``path_round_failures_on_small_peers`` counts the failed ones that waited for a small
  peer's declaration past the gather deadline (target 0), ``path_round_failures_naming_small_peers``
  those whose reason names a small peer at all (also a small peer behind, waited for until it re-syncs
  as any holder behind is).
- ``path_tokens_per_s_ratio_with_small_peers``: the path peers' trained tokens/s with small peers over
  without. The exchange planner is off here (:data:`COORDINATOR`), so rounds of equal H are compared;
  ``path_planned_h`` (each window's largest H an exchange plan gave a path peer's module; None: no
  plan) shows that none changed it.
- ``kill_retention``: the trainers' tokens/s in the kill window over the stage window's (report).
  ``--servers-per-level 2`` (``python -m bench.swarm_standby``, result ``swarm_standby``) runs the same
  with a standby server on each driven level: fewer trainers, and kills cost a retry, not a pause.
- ``activation_bytes_ratio``: bytes of activations and gradients the trainers sent and received over
  their fp32 size (4 tensors per level per token), in this run's codec; the codec's effect on bits
  per byte at equal tokens (``stage_bpb_gap_vs_fp32``) is ``bench.stage_codec``'s, measured in one
  process where only the codec differs.
- ``replica_max_abs_diff``: over every pair of snapshots of one module at one round, across all the
  peers' checkpoints (stage servers against path peers included): target 0.

Run: ``python -m bench.swarm`` (``--quick`` for a short smoke run).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import signal
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import emit, run_main, tokens_between, work_directory

MEASURES = (
    "bench/swarm.py",
    "models",
    "peer",
    "coordinator",
    "hivepath",
    "protos",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

log = logging.getLogger("bench.swarm")

SUBNET, PREFIX = "10.79.0", "hps"
"""Namespaces ``hps<pid>-p0``..., apart from the other benchmarks' and the chaos tests'."""
RATE = "50mbit"
NAMESPACES = 4
KILL_EVERY = 30.0

COORDINATOR = {"min_move_interval": 20.0, "planner": False}
"""The ``[coordinator]`` settings beyond a short local network's (lease 8 s): the run is the demo preset's,
its round deadline 20 s. The exchange planner is off, so both windows run the preset's H: with it on, a
module shared with a small peer gets a longer H from that peer's measured link (the planner's own claim,
``bench.planner``'s), and the round ratio would measure that choice instead of a stall."""


def small_memory_gb() -> float:
    """GB for ``--max-memory`` that fits a stage module and a trainer but not a path of the demo lattice
    (the demo's ``--small-peers`` rule)."""
    from models.presets import demo
    from peer.demo.roles import small_peer_memory

    return small_peer_memory(demo()).max_memory_gb


def _lines(net: Any, name: str, since: float, until: float, event: Optional[str] = None) -> list[dict]:
    return [p for p in net.progress_lines(name) if since <= p.get("time", 0) <= until
            and (event is None or p.get("event") == event)]


def _tokens(net: Any, name: str, since: float, until: float, mode: Optional[str] = None) -> int:
    """Tokens ``name`` reported processing between ``since`` and ``until`` (:func:`bench.common.tokens_between`)."""
    return tokens_between(net.progress_lines(name), since, until, mode)


PLAN = re.compile(r"exchange plan: module (\w+): H=(\d+)")


def _planned_h(net: Any, names: list[str], since: float, until: float) -> Optional[int]:
    """The largest H an exchange plan gave a module of ``names`` that applied in the window (the plans
    logged up to ``until``, the last one of each module before ``since`` included); None: no plan."""
    largest: Optional[int] = None
    for n in names:
        for module_plans in _plans(net, n, until).values():
            in_force = [h for t, h in module_plans if since <= t] + [h for t, h in module_plans if t < since][-1:]
            largest = max([largest or 0, *in_force]) if in_force else largest
    return largest


def _plans(net: Any, name: str, until: float) -> dict[str, list[tuple[float, int]]]:
    """Each module's exchange plans ``name`` logged before ``until``: (unix time, H), in order."""
    out: dict[str, list[tuple[float, int]]] = {}
    day = time.strftime("%Y-%m-%d", time.localtime(until))
    for line in net.procs.log(name).splitlines():
        m = PLAN.search(line)
        if not m:
            continue
        try:
            at = time.mktime(time.strptime(f"{day} {line[:8]}", "%Y-%m-%d %H:%M:%S"))
        except ValueError:
            continue
        if at < until:
            out.setdefault(m.group(1), []).append((at, int(m.group(2))))
    return out


def _rounds(net: Any, names: list[str], since: float, until: float
            ) -> tuple[list[float], int, int, list[float], list[str], list[float]]:
    """The path peers' module rounds in the window: the seconds between one round of a module and the
    next on the same peer, rounds done, rounds failed, the seconds each waited on its exchange, why
    each failed round failed, and each peer's rounds' waits (the sum over a round's modules: what its
    training loop was blocked)."""
    seconds, done, failed, waits, reasons = [], 0, 0, [], []
    per_round: dict[tuple[str, int], float] = {}
    for n in names:
        last: dict[str, float] = {}
        for e in _lines(net, n, since, until, "round"):
            if e.get("status") == "done":
                done += 1
                waits.append(float(e.get("seconds") or 0.0))
                key = (n, int(e.get("round", -1)))
                per_round[key] = per_round.get(key, 0.0) + waits[-1]
            else:
                failed += 1
                reasons.append(str(e.get("reason", "")))
            module = e.get("module", "")
            if module in last:
                seconds.append(e["time"] - last[module])
            last[module] = e["time"]
    return seconds, done, failed, waits, reasons, list(per_round.values())


def _blaming(reasons: list[str], peer_ids: list[str], only: str = "") -> int:
    """How many of ``reasons`` name one of ``peer_ids`` (whole, or its last 8 characters as the averager
    writes a peer that did not catch up); ``only``: of those holding this text."""
    return sum(1 for r in reasons if only in r and any(p and (p in r or p[-8:] in r) for p in peer_ids))


def _capacities(net: Any, names: list[str], since: float, until: float) -> dict[tuple[str, str], float]:
    """Each stage server's capacity over the window, by (name, module served): the tokens it trained
    over the seconds it spent serving, both summed over its consecutive progress lines serving that
    module (a restarted or moved server counts from 0 again); a server that served nothing is left out."""
    out: dict[tuple[str, str], float] = {}
    for n in names:
        seen = [p for p in _lines(net, n, since, until, "progress") if p.get("mode") == "stage" and "busy_seconds" in p]
        sums: dict[str, list[float]] = {}
        for a, b in zip(seen, seen[1:]):
            if a.get("assignment") == b.get("assignment") and b["busy_seconds"] >= a["busy_seconds"] \
                    and b["tokens"] >= a["tokens"]:
                acc = sums.setdefault(str(b["assignment"]), [0.0, 0.0])
                acc[0] += b["tokens"] - a["tokens"]
                acc[1] += b["busy_seconds"] - a["busy_seconds"]
        out.update({(n, m): tokens / busy for m, (tokens, busy) in sums.items() if tokens > 0 and busy > 0})
    return out


def _bottleneck(net: Any, names: list[str], since: float, until: float) -> float:
    """The least over levels of the summed window capacity of that level's stage servers (0 when
    fewer than two levels were measured)."""
    levels: dict[str, float] = {}
    for (_, module), capacity in _capacities(net, names, since, until).items():
        levels[module[:2]] = levels.get(module[:2], 0.0) + capacity
    return min(levels.values()) if len(levels) >= 2 else 0.0


def cpu_halves(isolate: bool) -> Optional[tuple[set[int], set[int]]]:
    """The CPUs of the path peers and those of everything else (the coordinator and the small peers):
    this process's usable CPUs cut in two halves, or None (one set for all) without ``isolate`` or
    with fewer than 2 CPUs."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not isolate or len(cpus) < 2:
        return None
    return set(cpus[: len(cpus) // 2]), set(cpus[len(cpus) // 2:])


def _pinned(cpus: Optional[set[int]]) -> None:
    """Start the processes that follow on ``cpus`` (a child inherits its parent's CPU affinity)."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def run(work: Path, control_s: float, stage_s: float, kill_s: float, seed: int,
        isolate: bool = True, servers_per_level: Optional[int] = None) -> dict[str, Any]:
    from models.data import prepared
    from models.presets import demo
    from peer.localnet import NetnsBridge, ProcessGroup, netns_available, preset_network, wait_for
    from peer.localnet.checks import forked_rounds, replica_diff

    rng = random.Random(seed)
    data = prepared(work / "data", 2, 2, "bytes")
    procs = ProcessGroup(work / "logs")
    why = netns_available()
    bridge = NetnsBridge(NAMESPACES, rate=RATE, subnet=SUBNET, prefix=PREFIX) if not why else None
    out: dict[str, Any] = {"netns": not why, "netns_unavailable": why, "link": RATE if not why else "loopback",
                           "seed": seed, "seeds": [seed], "small_max_memory_gb": small_memory_gb(),
                           "windows_s": {"control": control_s, "stage": stage_s, "kills": kill_s}}
    small = [f"small{i}" for i in range(6)]
    path_names = ["path0", "path1"]
    net = None
    own_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    halves = cpu_halves(isolate)
    out["cpu_sets"] = ({"path_peers": sorted(halves[0]), "coordinator_and_small_peers": sorted(halves[1])}
                       if halves else "shared")
    where = {"path0": 1, "path1": 2, **{n: 1 + i % (NAMESPACES - 1) for i, n in enumerate(small)}}
    try:
        if bridge is not None:
            bridge.open()
        else:
            log.warning("no network namespaces (%s): loopback, no link limit", why)
        coordinator = {**COORDINATOR, **({"servers_per_level": servers_per_level} if servers_per_level is not None else {})}
        net = preset_network(procs, work / "net", data.dir, data.manifest_hash, preset="demo", run_id="swarm",
                             round_timeout=20.0, coordinator=coordinator, bridge=bridge)
        start = lambda name, *extra: net.start_peer(name, *extra, index=where[name] if bridge else None)  # noqa: E731
        out["servers_per_level"] = servers_per_level
        _pinned(halves[1] if halves else None)
        net.start_coordinator()
        _pinned(halves[0] if halves else None)
        works = {n: start(n) for n in path_names}
        _pinned(halves[1] if halves else None)  # the small peers, and the restarts of the killed ones

        def path_rounds(k: int) -> bool:
            return all(len([e for e in net.progress_lines(n) if e.get("event") == "round"]) >= k for n in path_names)

        wait_for(lambda: path_rounds(8), 600, "the path peers averaging")
        t0 = time.time()
        wait_for(lambda: time.time() >= t0 + control_s, control_s + 60, "the control window")
        control = _rounds(net, path_names, t0, time.time())
        memory = str(small_memory_gb())
        for n in small:
            works[n] = start(n, "--max-memory", memory)
        wait_for(lambda: all(_tokens(net, n, 0, time.time()) > 0 for n in small if _is_trainer(net, n)) and
                 any(_is_trainer(net, n) for n in small), 600, "a pipeline running")
        t1 = time.time()
        wait_for(lambda: time.time() >= t1 + stage_s, stage_s + 120, "the stage window", interval=5.0)
        t2 = time.time()
        with_small = _rounds(net, path_names, t1, t2)
        trainers = [n for n in small if _is_trainer(net, n)]
        tokens = {n: _tokens(net, n, t1, t2) for n in [*path_names, *small]}
        late = {n: _tokens(net, n, (t1 + t2) / 2, t2) for n in small}
        bottleneck = _bottleneck(net, small, t1, t2)
        path_tps = (sum(_tokens(net, n, t0, t1) for n in path_names) / max(1e-9, t1 - t0),
                    sum(tokens[n] for n in path_names) / max(1e-9, t2 - t1))
        trained = {n: _tokens(net, n, t1, t2, "trainer") for n in small}  # through pipelines, whatever the roles did
        trainer_tps = sum(trained.values()) / (t2 - t1)
        out.update({
            "roles": {n: _mode(net, n) for n in small},
            "small_peers_idle": sum(1 for n in small if late[n] == 0),
            "small_peer_tokens_last_half": late,
            "small_peer_token_share": sum(trained.values()) / max(1, sum(trained.values())
                                                                   + sum(tokens[n] for n in path_names)),
            "pipeline_tokens_per_s": round(trainer_tps, 1),
            "bottleneck_capacity_tokens_per_s": round(bottleneck, 1),
            "throughput_fraction": trainer_tps / bottleneck if bottleneck > 0 else None,
            "path_round_seconds_median": {"control": _median(control[0]), "with_small_peers": _median(with_small[0])},
            "path_exchange_wait_seconds_median": {"control": _median(control[3]),
                                                  "with_small_peers": _median(with_small[3])},
            "path_round_wait_seconds_mean": {"control": _mean(control[5]), "with_small_peers": _mean(with_small[5])},
            "path_round_ratio_with_small_peers": (_median(with_small[0]) / _median(control[0])
                                                  if control[0] and with_small[0] and _median(control[0]) > 0 else None),
            "path_tokens_per_s": {"control": round(path_tps[0], 1), "with_small_peers": round(path_tps[1], 1)},
            "path_tokens_per_s_ratio_with_small_peers": path_tps[1] / path_tps[0] if path_tps[0] > 0 else None,
            "path_planned_h": {"control": _planned_h(net, path_names, t0, t1),
                               "with_small_peers": _planned_h(net, path_names, t1, t2)},
            "path_round_failures": {"control": {"done": control[1], "failed": control[2]},
                                    "with_small_peers": {"done": with_small[1], "failed": with_small[2]}},
            "path_round_failures_on_small_peers": _blaming(with_small[4], [_peer_id(net, n) for n in small],
                                                           "did not declare in time"),
            "path_round_failures_naming_small_peers": _blaming(with_small[4], [_peer_id(net, n) for n in small]),
            "path_round_failure_reasons": sorted(set(with_small[4]))[:20],
        })
        # activation bytes on the wire: 4 tensors (forward out and back, gradient out and back) a level a token
        lat = demo().lattice
        sent = sum(_last(net, n, "bytes_sent") + _last(net, n, "bytes_received") for n in trainers)
        fp32 = sum(_last(net, n, "tokens") for n in trainers) * lat.levels * 4 * lat.d_model * 4
        out["activation_bytes_ratio"] = sent / fp32 if fp32 else None
        # kills: a stage server every KILL_EVERY seconds, started again on its work directory
        servers = [n for n in small if _mode(net, n) == "stage"]
        t3, kills = time.time(), 0
        while time.time() < t3 + kill_s and servers:
            victim = rng.choice(servers)
            procs.signal(victim, signal.SIGKILL)
            procs.procs[victim].wait(timeout=30)
            start(victim, "--max-memory", memory)
            kills += 1
            due = time.time() + KILL_EVERY
            wait_for(lambda: time.time() >= min(due, t3 + kill_s), KILL_EVERY + 60, "the next kill", interval=1.0)
        t4 = time.time()
        killed_tps = sum(_tokens(net, n, t3, t4, "trainer") for n in small) / max(1e-9, t4 - t3)
        out.update({"kills": kills, "pipeline_tokens_per_s_with_kills": round(killed_tps, 1),
                    "throughput_fraction_with_kills": killed_tps / bottleneck if bottleneck > 0 else None,
                    "kill_retention": killed_tps / trainer_tps if trainer_tps > 0 else None})
        codes = {}
        for n in list(works):
            procs.signal(n, signal.SIGTERM)
        for n in list(works):
            try:
                codes[n] = procs.procs[n].wait(timeout=120)
            except Exception:
                codes[n] = None
        out["exit_codes"] = codes
        logs = [procs.log(n) for n in works]
        pairs, diff, first = replica_diff([w / "checkpoints" for w in works.values()], forked_rounds(logs))
        out.update({"replica_pairs": pairs, "replica_max_abs_diff": diff, "replica_first_difference": first})
    finally:  # each step whatever the one before did: no process and no namespace outlives the run
        if own_cpus:
            os.sched_setaffinity(0, own_cpus)
        try:
            if net is not None:
                net.close()
        finally:
            try:
                procs.close()
            finally:
                if bridge is not None:
                    bridge.close()
    return out


def _peer_id(net: Any, name: str) -> str:
    ids = [p["peer_id"] for p in net.progress_lines(name) if p.get("peer_id")]
    return ids[-1] if ids else ""


def _is_trainer(net: Any, name: str) -> bool:
    return _mode(net, name) == "trainer"


def _mode(net: Any, name: str) -> str:
    modes = [p.get("mode") for p in net.progress_lines(name) if p.get("event") == "progress"]
    return modes[-1] if modes else ""


def _last(net: Any, name: str, key: str) -> int:
    values = [p[key] for p in net.progress_lines(name) if p.get("event") == "progress" and key in p]
    return int(values[-1]) if values else 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.swarm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--control", type=float, default=120.0, help="seconds of the path peers alone (default 120)")
    ap.add_argument("--stage", type=float, default=240.0, help="seconds measured with the small peers (default 240)")
    ap.add_argument("--kills", type=float, default=150.0, help="seconds with a server killed every 30 s (default 150)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a short smoke run (not a measurement)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, checkpoints) and say where")
    ap.add_argument("--servers-per-level", type=int, default=None, metavar="N",
                    help="the coordinator's servers_per_level (default: its default, 1); 2 puts a standby "
                         "server on each driven level")
    ap.add_argument("--shared-cpus", action="store_true",
                    help="every process on every CPU (default: the path peers on one half of the CPUs, the "
                         "coordinator and the small peers on the other, as on machines of their own)")
    args = ap.parse_args(argv)
    if args.servers_per_level is not None and args.servers_per_level < 1:
        ap.error(f"--servers-per-level must be >= 1, got {args.servers_per_level}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.quick:
        args.control, args.stage, args.kills = 20.0, 40.0, 35.0
    with work_directory("hivepath-swarm-", keep=args.keep) as work:
        result = run(work, args.control, args.stage, args.kills, args.seed, isolate=not args.shared_cpus,
                     servers_per_level=args.servers_per_level)
        result["quick"] = args.quick
    standby = (args.servers_per_level or 1) > 1  # never written over the default run's result
    return emit(("swarm_standby" if standby else "swarm") + ("_quick" if args.quick else ""), result)


if __name__ == "__main__":
    run_main(main)
