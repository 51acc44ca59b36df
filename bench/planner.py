"""Benchmark ``bench.planner``: the coordinator's exchange planner against the fixed policy, on uneven links.

Setup: the demo lattice (2x2, byte tokenizer, the built-in corpus; the run's codec is the preset's,
int8), ``--inner-steps`` (default 10) so that rounds come every few seconds, a coordinator and 6 path
peers (``--role path``), every process the installed ``hivepath`` command in its own network namespace
behind one bridge (``peer.localnet.netns``). The peers' egress is shaped to 10, 10, 25, 25, 100 and 100 Mbit/s
(a peer's download is limited by what its senders' egress lets out); halfway through the measured
window the first 100 Mbit/s peer's link drops to 10 Mbit/s. Each peer's p2p daemon and direct lane
listen on 127.0.0.1 of its namespace only, behind a user-space delay relay (``bench.delay_relay``,
20 ms each way: 40 ms round trip) on the namespace's address, which is what the peer announces: every
byte between two peers crosses a relay (checked every 5 s: ``unrelayed_connections``, the peers'
established TCP connections between namespaces that neither cross a relay port nor go to the
coordinator, must stay empty; ``relay_share_of_peer_link_bytes`` compares the relays' application
bytes with what the links sent, TCP/IP headers, acknowledgements and the coordinator's traffic
included). The coordinator
in namespace 0 is dialled directly. Two variants, each on fresh namespaces and processes, measured
over the same wall time (``--minutes``, from the moment every peer finished 2 rounds):

- **planner**: ``[coordinator] planner = true``, ``planner_codecs = "int4"``: each module's H and codec
  follow its holders' measured links (``coordinator/planner.py``). With ``--overlap-budget X`` (> 0) the
  planner may also have a module's path peers exchange it behind their next round (``overlap_budget``;
  off by default), and the result is ``planner_overlap.json``.
- **fixed**: ``planner = false``: the run's codec, and H doubled per peer at assignment for a slow link.

Keys:

- ``utilization_planner``, ``utilization_fixed``: per peer, 1 - (seconds its training loop was blocked
  on exchanges) / (the window's seconds), the mean over the 6 peers. The blocked seconds are the sum of
  the ``seconds`` of the peer's ``round`` progress lines written in the window: all modules' exchanges
  of a round start together and the loop waits for them one after the other, so each line's
  ``seconds`` is the wait that module added. Time outside rounds (a re-sync download after a fork,
  waiting for holders at start-up) is not counted. Target: planner >= 0.9; fixed: report.
- ``bpb_planner_vs_fixed``: validation bits per byte of each variant's model at the end of its window,
  planner minus fixed (target < 0). Each of the 4 paths is taken from the latest snapshot written by
  the window's end of a peer that held the whole path (its modules as that peer trained them
  together) and scored on the first 32 validation documents of its own shard
  (``models.evaluate.bits_per_byte``); the key compares the means over paths (``bpb`` per variant has
  each path's figure and its modules' rounds).
- ``rounds_slowed_by_slowest``: per variant, module rounds of a group of 2 or more members (done
  rounds, one per module and round number, members named by the rounds' ``peers``) whose slowest
  member's link was under half the group's median: ``count``, of ``rounds``, and ``share``. The link
  is the member's shaped egress at the round's end (the set-up's truth: the planner cannot change it,
  only how often such a round comes and how long it lasts); ``measured`` counts the same with the
  upload rate the coordinator had for each member then (``/status.json``, measured from rounds: a lower
  bound that includes waiting for the group's slowest). Report.
- ``replica_max_abs_diff``: over every pair of snapshots of one module at one round, both variants'
  peers (``peer.localnet.checks.replica_diff``, start-up forks left out as ``bench.swarm`` does): target 0.
- ``tokens_planner_over_fixed``: tokens every peer trained in the window, the planner run's over the
  fixed run's, the mean over the seeds (``_by_seed`` each seed's). Report: time not blocked is worth
  what it trains.
- ``plan_changes``: the planner run's plans, from ``/status.json`` polled every 5 s: ``count``
  (``_plan_changes_total`` at the end, summed over the seeds) and each distinct plan seen (module,
  inner_steps, codec, overlap, from_round, reason, the seed's run). Report.

Seeds (``--seeds``, default 0, 1 and 2): the pair of runs is repeated with the run's ``seed`` set to
each (both variants of a seed start from the same model). One pair's difference mixes the policies'
with what timing alone changes between two runs (which rounds form with whom, where the window ends
in a round), so each seed gives one paired difference and the keys are over the seeds: utilizations are the means of the
runs', ``bpb_planner_vs_fixed`` the mean of each seed's difference (``bpb_planner_vs_fixed_by_seed``
and ``bpb_planner_vs_fixed_stdev`` beside it), ``rounds_slowed_by_slowest`` counts the rounds of
every run of a variant, ``replica_max_abs_diff`` is the largest of any run.

Also per run (``runs``, by seed and variant): each peer's link rates as the coordinator had them (Mbit/s, ``upload``/``download``)
just before the drop and at the end, rounds done and tokens trained per peer in the window, and the
exit codes.

Run: ``python -m bench.planner`` (root; without it prints a ``skipped`` line and exits 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from bench.common import emit, run_main, tokens_between, work_directory

MEASURES = (
    "bench/planner.py",
    "bench/delay_relay.py",
    "models",
    "peer",
    "coordinator",
    "hivepath",
    "protos",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

log = logging.getLogger("bench.planner")

PREFIX, SUBNET = "hpq", "10.87.0"
"""Namespace names and addresses of this benchmark (apart from the others' and the chaos tests')."""
RATES = ("10mbit", "10mbit", "25mbit", "25mbit", "100mbit", "100mbit")
"""Each peer's egress, peer ``p{i + 1}`` in namespace ``i + 1``."""
COORDINATOR_RATE = "1gbit"
DROPPED, DROP_RATE = 4, "10mbit"
"""The peer (index into :data:`RATES`) whose 100 Mbit/s link drops halfway, and its rate after."""
P2P_PORT, RELAY_PORT, LANE_PORT = 40000, 40001, 40002
"""In every peer namespace: its p2p daemon and direct lane on 127.0.0.1, the relay on the namespace
address at RELAY_PORT (in front of the daemon) and at LANE_PORT (in front of the lane)."""
BPB_DOCUMENTS = 32
POLL_INTERVAL = 5.0
WARMUP_ROUNDS = 2
VARIANTS = {"planner": {"planner": True, "planner_codecs": "int4"}, "fixed": {"planner": False}}
"""The ``[coordinator]`` settings of each variant (the run is the demo preset's, lease 8 s)."""


# -- the keys, from what the peers and the coordinator wrote ------------------------------------------


def mbit(rate: str) -> float:
    """Mbit/s of a tc rate (``10mbit``, ``1gbit``, ``500kbit``)."""
    m = re.fullmatch(r"([\d.]+)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"not a tc rate in bit/s: {rate!r}")
    return float(m.group(1)) * {"k": 1e-3, "": 1e-6, "m": 1.0, "g": 1e3}[m.group(2)]


def utilization(rounds: Iterable[dict], since: float, until: float) -> float:
    """1 - (the ``seconds`` of the ``round`` lines written in [since, until]) / (until - since), in [0, 1]."""
    span = until - since
    if span <= 0:
        raise ValueError(f"empty window [{since}, {until}]")
    blocked = sum(float(e.get("seconds") or 0.0) for e in rounds
                  if e.get("event") == "round" and since <= e.get("time", 0) <= until)
    return min(1.0, max(0.0, 1.0 - blocked / span))


def peer_rounds(lines: Iterable[dict], since: float = 0.0, until: float = float("inf")) -> int:
    """Outer rounds a peer ended in [since, until]: its ``round`` lines of the module it logged most
    (every round writes one line per module of its path)."""
    per_module = Counter(e.get("module") for e in lines if e.get("event") == "round" and since <= e.get("time", 0) <= until)
    return max(per_module.values(), default=0)


def group_rounds(lines_by_peer: dict[str, list[dict]], names_by_id: dict[str, str], since: float,
                 until: float) -> list[tuple[float, list[str]]]:
    """Each done module round in [since, until] with 2 or more members we know: (the time its first
    line was written, its members' names), one per (module, round number)."""
    seen: dict[tuple[str, int], tuple[float, list[str]]] = {}
    for name, lines in lines_by_peer.items():
        for e in lines:
            if e.get("event") != "round" or e.get("status") != "done" or not since <= e.get("time", 0) <= until:
                continue
            members = sorted({names_by_id[p] for p in e.get("peers") or [] if p in names_by_id} | {name})
            key = (str(e.get("module")), int(e.get("round", -1)))
            if len(members) >= 2 and (key not in seen or e["time"] < seen[key][0]):
                seen[key] = (float(e["time"]), members)
    return sorted(seen.values())


def slowed_by_slowest(groups: Sequence[tuple[float, list[str]]],
                      rate_at: Callable[[str, float], Optional[float]]) -> dict[str, Any]:
    """Of ``groups`` (:func:`group_rounds`), those whose slowest member's rate (``rate_at(name, time)``;
    None: unknown, the round is left out) was under half the members' median rate."""
    count = total = 0
    for t, members in groups:
        rates = [rate_at(n, t) for n in members]
        if any(r is None or r <= 0 for r in rates):
            continue
        total += 1
        if min(rates) < 0.5 * statistics.median(rates):
            count += 1
    return {"count": count, "rounds": total, "share": round(count / total, 4) if total else None}


def shaped_rate(base: dict[str, float], dropped: str, drop_rate: float, drop_at: float) -> Callable[[str, float], float]:
    """The egress (Mbit/s) of a peer at a time: ``base``, and ``drop_rate`` for ``dropped`` from ``drop_at``."""
    return lambda name, t: drop_rate if name == dropped and t >= drop_at else base[name]


def sampled_rate(samples: Sequence[tuple[float, dict[str, float]]]) -> Callable[[str, float], Optional[float]]:
    """A peer's rate at a time from ``samples`` (time, name -> rate) in time order: the latest sample at
    or before it (None before the first)."""
    def at(name: str, t: float) -> Optional[float]:
        found = None
        for when, rates in samples:
            if when > t:
                break
            found = rates.get(name, found)
        return found
    return at


def unrelayed(ss_lines: Iterable[str], coordinator: str) -> list[str]:
    """Of a namespace's established TCP connections (``ss -Htn state established`` lines), those
    between two namespace addresses that neither go to the coordinator's host nor cross a relay port:
    ``local -> remote``. Loopback connections (a relay to its peer) are inside one namespace."""
    relay_ports = {str(RELAY_PORT), str(LANE_PORT)}
    out = []
    for line in ss_lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        local, remote = parts[-2], parts[-1]
        (lhost, _, lport), (rhost, _, rport) = local.rpartition(":"), remote.rpartition(":")
        lhost, rhost = (h.strip("[]").removeprefix("::ffff:") for h in (lhost, rhost))  # IPv4-mapped IPv6
        if lhost.startswith("127.") or rhost == coordinator or lport in relay_ports or rport in relay_ports:
            continue
        out.append(f"{local} -> {remote}")
    return out


def plans_seen(statuses: Iterable[dict]) -> list[dict[str, Any]]:
    """Every distinct plan ``/status.json`` showed (a module's plan now and its next), in order seen."""
    out: list[dict[str, Any]] = []
    for status in statuses:
        for m in status.get("modules", []):
            plan = m.get("plan") or {}
            for row in (plan, plan.get("next") or {}):
                if not row or not row.get("from_round"):  # from_round 0: the run's H and codec, never planned
                    continue
                item = {"module": m.get("module_id"), "inner_steps": row.get("inner_steps"), "codec": row.get("codec"),
                        "overlap": bool(row.get("overlap")), "from_round": row.get("from_round"),
                        "reason": row.get("reason", "")}
                if item not in out:
                    out.append(item)
    return out


# -- one variant ------------------------------------------------------------------------------------


def _relayed(files: Sequence[Path]) -> int:
    """Bytes the relays forwarded so far, both directions, every relay."""
    total = 0
    for f in files:
        try:
            stats = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        total += sum(int(s["bytes_to_target"]) + int(s["bytes_to_client"]) for s in stats.values())
    return total


def _metric(net: Any, name: str) -> Optional[float]:
    """A counter of the coordinator's ``/metrics`` (fetched from inside namespace 0)."""
    url = f"http://{net.bridge.address(0)}:{net.http_port}/metrics"
    out = subprocess.run(net._in(0, ["curl", "-sf", "-m", "3", url]), capture_output=True, text=True, timeout=10)
    m = re.search(rf"^\S*{name}\S*\s+([\d.eE+-]+)$", out.stdout, re.M)
    return float(m.group(1)) if m else None


def _link_rates(status: dict, names_by_id: dict[str, str]) -> dict[str, dict[str, float]]:
    return {names_by_id[p["peer_id"]]: {"upload": round(p["upload_bps"] * 8e-6, 2),
                                        "download": round(p["download_bps"] * 8e-6, 2),
                                        "measured": bool(p.get("link_measured"))}
            for p in status.get("peers", []) if p.get("peer_id") in names_by_id}


def reseed(run_toml: Path, seed: int) -> None:
    """Rewrite a run-config file (``preset_network`` writes the preset's seed) with ``seed``, its
    ``[coordinator]`` table kept."""
    from models.config import RunConfig
    from models.presets import read_toml

    tables = read_toml(run_toml)
    coordinator = tables.pop("coordinator", {})
    run_toml.write_text(RunConfig.from_dict(tables).replace(seed=seed).to_toml(coordinator=coordinator))


def summarize(runs: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The keys over the seeds from ``runs`` (seed -> variant -> :func:`one_variant`'s result)."""
    out: dict[str, Any] = {}
    variants = sorted({v for by_variant in runs.values() for v in by_variant})
    for v in variants:
        util = [r[v]["utilization"] for r in runs.values() if v in r]
        out[f"utilization_{v}"] = round(statistics.mean(util), 4)
        out[f"utilization_{v}_by_seed"] = {str(s): r[v]["utilization"] for s, r in runs.items() if v in r}
    diffs = {str(s): round(r["planner"]["bpb"]["mean"] - r["fixed"]["bpb"]["mean"], 4) for s, r in runs.items()
             if "planner" in r and "fixed" in r and r["planner"]["bpb"].get("mean") is not None
             and r["fixed"]["bpb"].get("mean") is not None}
    if diffs:
        out["bpb_planner_vs_fixed"] = round(statistics.mean(diffs.values()), 4)
        out["bpb_planner_vs_fixed_by_seed"] = diffs
        out["bpb_planner_vs_fixed_stdev"] = round(statistics.stdev(diffs.values()), 4) if len(diffs) > 1 else None
    ratios = {str(s): round(sum(r["planner"]["tokens_by_peer"].values()) / sum(r["fixed"]["tokens_by_peer"].values()), 4)
              for s, r in runs.items() if "planner" in r and "fixed" in r and sum(r["fixed"]["tokens_by_peer"].values())}
    if ratios:
        out["tokens_planner_over_fixed"] = round(statistics.mean(ratios.values()), 4)
        out["tokens_planner_over_fixed_by_seed"] = ratios
    slowed: dict[str, Any] = {}
    for v in variants:
        parts = [r[v]["rounds_slowed_by_slowest"] for r in runs.values() if v in r]
        slowed[v] = _counted(parts)
        slowed[v]["measured"] = _counted([p["measured"] for p in parts])
    out["rounds_slowed_by_slowest"] = slowed
    out["replica_max_abs_diff"] = max(r[v]["replica_max_abs_diff"] for r in runs.values() for v in r)
    planned = [(s, r["planner"]) for s, r in runs.items() if "planner" in r]
    if planned:
        out["plan_changes"] = {"count": sum(r["plan_changes_total"] or 0 for _, r in planned),
                               "plans": [{**p, "seed": s} for s, r in planned for p in r["plans"]]}
    return out


def _counted(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    count, total = sum(p["count"] for p in parts), sum(p["rounds"] for p in parts)
    return {"count": count, "rounds": total, "share": round(count / total, 4) if total else None}


def one_variant(name: str, work: Path, data: Any, minutes: float, inner_steps: int, rtt_ms: float,
                seed: int = 0, overlap_budget: float = 0.0) -> dict[str, Any]:
    from peer.localnet import NetnsBridge, ProcessGroup, preset_network, wait_for
    from peer.localnet.checks import forked_rounds, replica_diff

    names = [f"p{i + 1}" for i in range(len(RATES))]
    base = {n: mbit(r) for n, r in zip(names, RATES)}
    procs = ProcessGroup(work / "logs")
    bridge = NetnsBridge(1 + len(names), subnet=SUBNET, prefix=PREFIX, rates=[COORDINATOR_RATE, *RATES])
    net = None
    out: dict[str, Any] = {"links_mbit": base}
    try:
        bridge.open()
        relay_files = [work / f"relay-{n}.json" for n in names]
        for i, n in enumerate(names, start=1):
            ns = bridge.address(i)
            procs.start(f"relay-{n}", ["ip", "netns", "exec", bridge.where(i), sys.executable, "-m", "bench.delay_relay",
                                       "--delay-ms", str(rtt_ms / 2), "--stats", str(relay_files[i - 1]),
                                       "--map", f"{ns}:{RELAY_PORT}=127.0.0.1:{P2P_PORT}",
                                       "--map", f"{ns}:{LANE_PORT}=127.0.0.1:{LANE_PORT}"])
        wait_for(lambda: all(f.exists() for f in relay_files), 60, "the relays to listen")
        net = preset_network(procs, work / "net", data.dir, data.manifest_hash, preset="demo", run_id="planner-bench",
                             inner_steps=inner_steps, coordinator=variant_settings(name, overlap_budget), bridge=bridge)
        reseed(net.run_toml, seed)
        net.start_coordinator()
        works = {}
        for i, n in enumerate(names, start=1):
            works[n] = net.start_peer_in(n, i, "--role", "path", "--lane-port", str(LANE_PORT),
                                         listen=[f"/ip4/127.0.0.1/tcp/{P2P_PORT}"],
                                         announce=[f"/ip4/{bridge.address(i)}/tcp/{RELAY_PORT}"])

        wait_for(lambda: all(peer_rounds(net.progress_lines(n)) >= WARMUP_ROUNDS for n in names), 900,
                 f"{WARMUP_ROUNDS} rounds on every peer", interval=1.0)
        t0 = time.time()
        tx0, relayed0 = sum(bridge.tx_bytes(i) for i in range(1, bridge.n)), _relayed(relay_files)
        coordinator_tx0 = bridge.tx_bytes(0)
        t_drop, t_end = t0 + minutes * 30, t0 + minutes * 60
        statuses: list[tuple[float, dict]] = []
        dropped = False
        direct: set[str] = set()
        while time.time() < t_end:
            if not dropped and time.time() >= t_drop:
                t_drop = time.time()
                bridge.set_rate(DROPPED + 1, DROP_RATE)
                dropped = True
            for i in range(1, bridge.n):
                seen = subprocess.run(["ip", "netns", "exec", bridge.where(i), "ss", "-Htn", "state", "established"],
                                      capture_output=True, text=True).stdout.splitlines()
                direct.update(unrelayed(seen, bridge.address(0)))
            s = net.status()
            if s is not None:
                statuses.append((time.time(), s))
            time.sleep(max(0.0, min(POLL_INTERVAL, (t_end if dropped else t_drop) - time.time())))
        t1 = time.time()
        tx = sum(bridge.tx_bytes(i) for i in range(1, bridge.n)) - tx0
        relayed = _relayed(relay_files) - relayed0
        out["plan_changes_total"] = _metric(net, "plan_changes_total")
        lines = {n: net.progress_lines(n) for n in names}
        names_by_id = {e["peer_id"]: n for n, ls in lines.items() for e in ls if e.get("peer_id")}
        before = [s for t, s in statuses if t < t_drop]
        out.update({
            "window_s": round(t1 - t0, 1), "drop_at_s": round(t_drop - t0, 1), "dropped_peer": names[DROPPED],
            "utilization_by_peer": {n: round(utilization(lines[n], t0, t1), 4) for n in names},
            "rounds_by_peer": {n: peer_rounds(lines[n], t0, t1) for n in names},
            "failed_module_rounds_by_peer": {n: sum(1 for e in lines[n] if e.get("event") == "round"
                                                    and t0 <= e.get("time", 0) <= t1 and e.get("status") != "done")
                                             for n in names},
            "tokens_by_peer": {n: tokens_between(lines[n], t0, t1) for n in names},
            "link_rates_mbit": {"before_drop": _link_rates(before[-1], names_by_id) if before else {},
                                "end": _link_rates(statuses[-1][1], names_by_id) if statuses else {}},
            "plans": plans_seen(s for _, s in statuses),
            "relayed_bytes": relayed, "peer_link_bytes": tx, "coordinator_link_bytes": bridge.tx_bytes(0) - coordinator_tx0,
            "relay_share_of_peer_link_bytes": round(relayed / tx, 4) if tx > 0 else None,
            "unrelayed_connections": sorted(direct),
        })
        out["utilization"] = round(statistics.mean(out["utilization_by_peer"].values()), 4)
        groups = group_rounds(lines, names_by_id, t0, t1)
        measured = [(t, {names_by_id[p["peer_id"]]: p["upload_bps"] * 8e-6 for p in s.get("peers", [])
                         if p.get("peer_id") in names_by_id and p.get("link_measured")}) for t, s in statuses]
        out["rounds_slowed_by_slowest"] = {
            **slowed_by_slowest(groups, shaped_rate(base, names[DROPPED], mbit(DROP_RATE), t_drop)),
            "measured": slowed_by_slowest(groups, sampled_rate(measured))}
        for n in names:
            procs.signal(n, signal.SIGTERM)
        out["exit_codes"] = {n: _wait(procs, n) for n in names}
        logs = [procs.log(n) for n in names]
        pairs, diff, first = replica_diff([w / "checkpoints" for w in works.values()], forked_rounds(logs))
        out.update({"replica_pairs": pairs, "replica_max_abs_diff": diff, "replica_first_difference": first})
        out["bpb"] = final_bpb([w / "checkpoints" for w in works.values()], data, t1)
        return out
    finally:  # each step whatever the one before did: no process and no namespace outlives the variant
        try:
            if net is not None:
                net.close()
        finally:
            try:
                procs.close()
            finally:
                bridge.close()


def _wait(procs: Any, name: str) -> Optional[int]:
    try:
        return procs.procs[name].wait(timeout=120)
    except subprocess.TimeoutExpired:
        return None


def final_bpb(roots: Sequence[Path], data: Any, until: float) -> dict[str, Any]:
    """Bits per byte of each path as a peer held it at ``until``: the latest snapshot written by then
    (its ``run.json`` time) of any peer whose snapshot holds every module of the path, on the first
    :data:`BPB_DOCUMENTS` validation documents of the path's shard, and their ``mean``. A path's
    modules are taken from one snapshot, as its trainer trained them together: modules of other
    peers' snapshots at other rounds would pair blocks with an embedding they were never trained
    with (coarse rounds, a long H, would then score worse for that alone)."""
    import torch

    from models.evaluate import bits_per_byte
    from models.lattice import ModularLM
    from models.presets import demo
    from peer.node import CheckpointDir

    cfg = demo()
    latest: dict[tuple[int, ...], tuple[float, Path]] = {}
    for root in roots:
        for path in CheckpointDir(root).snapshots():
            written = (path / "run.json").stat().st_mtime
            if written > until:
                continue
            held = set(json.loads((path / "run.json").read_text()).get("rounds", {}))
            for lattice_path in cfg.lattice.paths():
                if set(cfg.lattice.path_modules(lattice_path)) <= held and written > latest.get(lattice_path, (-1.0,))[0]:
                    latest[lattice_path] = (written, path)
    out: dict[str, Any] = {}
    scores = []
    for lattice_path, (_, path) in sorted(latest.items()):
        snapshot = CheckpointDir(path.parent).load(path)
        model = ModularLM(cfg.lattice)
        for mid in cfg.lattice.path_modules(lattice_path):
            names = [n for n, _ in model.mods[mid].named_parameters()]
            params, _ = snapshot.module_state(mid, names)
            with torch.no_grad():
                for p, v in zip(model.mods[mid].parameters(), params):
                    p.copy_(v)
        bpb = bits_per_byte(model.path_model(lattice_path), data.validation_documents(lattice_path),
                            cfg.lattice.seq_len, "cpu", max_documents=BPB_DOCUMENTS).bpb
        name = "-".join(map(str, lattice_path))
        out[name] = round(bpb, 4)
        out.setdefault("module_rounds", {})[name] = {m: snapshot.module_round(m)
                                                     for m in cfg.lattice.path_modules(lattice_path)}
        scores.append(bpb)
    out["mean"] = round(statistics.mean(scores), 4) if scores else None
    return out


def variant_settings(name: str, overlap_budget: float = 0.0) -> dict[str, Any]:
    """The ``[coordinator]`` settings of variant ``name``; ``overlap_budget`` > 0 lets the planner run an
    exchange behind the next round (the fixed policy plans nothing, so it keeps none)."""
    settings = dict(VARIANTS[name])
    if overlap_budget > 0 and settings.get("planner"):
        settings["overlap_budget"] = overlap_budget
    return settings


def result_name(overlap_budget: float) -> str:
    """``planner``, or ``planner_overlap`` for a run whose planner may exchange behind the next round."""
    return "planner_overlap" if overlap_budget > 0 else "planner"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.planner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="measured minutes per variant (default 5)")
    ap.add_argument("--inner-steps", type=int, default=10, help="the run's inner steps H (default 10)")
    ap.add_argument("--rtt-ms", type=float, default=40.0, help="round trip the delay relays add (default 40)")
    ap.add_argument("--variants", default="planner,fixed", help="which to run (default planner,fixed)")
    ap.add_argument("--seeds", default="0,1,2", help="the run's seeds, a pair of runs each (default 0,1,2)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, checkpoints) and say where")
    ap.add_argument("--overlap-budget", type=float, default=0.0,
                    help="the planner run's [coordinator] overlap_budget (default 0: never behind the next round); "
                         "> 0 writes planner_overlap.json")
    args = ap.parse_args(argv)
    if not 0 <= args.overlap_budget <= 1:
        ap.error(f"--overlap-budget {args.overlap_budget}: a share of a round in [0, 1]")
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: names among {', '.join(VARIANTS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        ap.error(f"--seeds {args.seeds!r}: distinct non-negative integers separated by commas, e.g. 0,1,2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from peer.localnet.netns import netns_available

    why = netns_available()
    if why:
        emit(result_name(args.overlap_budget), {"skipped": why})
        return 0
    from models.data import prepared

    runs: dict[int, dict[str, dict[str, Any]]] = {}
    with work_directory("hivepath-planner-", keep=args.keep) as work:
        data = prepared(work / "data", 2, 2, "bytes")
        for seed in seeds:  # a seed's pair back to back, so a slow spell of the machine hits both
            for v in variants:
                log.info("seed %d: %s", seed, v)
                runs.setdefault(seed, {})[v] = one_variant(v, work / f"seed{seed}" / v, data, args.minutes,
                                                           args.inner_steps, args.rtt_ms, seed, args.overlap_budget)
    result: dict[str, Any] = {
        "seeds": seeds,
        "setup": {"preset": "demo", "inner_steps": args.inner_steps, "minutes": args.minutes, "rtt_ms": args.rtt_ms,
                  "links": list(RATES), "drop": f"p{DROPPED + 1} to {DROP_RATE} at half the window",
                  "overlap_budget": args.overlap_budget},
        **summarize(runs),
        "runs": {str(s): r for s, r in runs.items()},
    }
    emit(result_name(args.overlap_budget), result)
    return 0


if __name__ == "__main__":
    run_main(main)
