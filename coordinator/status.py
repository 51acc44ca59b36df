"""One consistent picture of the run for people and tools: the JSON status endpoint, the HTML
page, the Status RPC and the Prometheus metrics are all rendered from :func:`snapshot`."""

from __future__ import annotations

import heapq
import math
from typing import Any, Optional

from coordinator.core import Coordinator
from coordinator.pipelines import busy_share, pipelines
from coordinator.reachability import RELAYED, relay_of
from coordinator.results import StatusView
from coordinator.records import MODE_ARCHIVE, MODE_PATH, MODE_STAGE, MODE_TRAINER, PeerRecord
from coordinator.view import ClusterView
from models.config import format_path
from protos import versions

__all__ = ["snapshot", "contributions", "stages", "health", "ROLES"]

ROLES = (MODE_PATH, MODE_STAGE, MODE_TRAINER, MODE_ARCHIVE)
"""A peer row's ``role``: its assignment's mode (:mod:`coordinator.records`)."""


def _mean(values: list[float]) -> float:
    vals = [v for v in values if math.isfinite(v)]
    return sum(vals) / len(vals) if vals else float("nan")


def stages(view: ClusterView) -> list[dict[str, Any]]:
    """Every module that has stage servers, by id: how many, the tokens/s they served, what they can
    serve (0 while any is unmeasured) and their busy share (None until every server is measured)."""
    out = []
    for m in sorted(view.stage_peers):
        servers = view.stage_peers[m]
        caps = [view.capacity.get(p, 0.0) for p in servers]
        out.append({"module_id": m, "servers": len(servers), "tokens_per_s": sum(servers.values()),
                    "capacity_tokens_per_s": sum(caps) if all(c > 0 for c in caps) else 0.0,
                    "busy": busy_share(view, m)})
    return out


def health(v: StatusView) -> dict[str, Any]:
    """The long-run health signals (:mod:`coordinator.health`): ``paths`` whose validation bits per
    byte rise over several archive scorings, ``peers`` (active ones) whose training loss diverges;
    each with the module and round where it began, its best and latest value and the relative rise."""
    return {
        "paths": [{"path": r.path, "module": r.module, "since_round": r.since_round, "since_time": r.since_time,
                   "best_bpb": r.best, "latest_bpb": r.latest, "rise": r.rise, "scorings_rising": r.rises}
                  for r in v.bpb_rises],
        "peers": [{"peer_id": d.peer_id, "module": d.module, "since_round": d.since_round,
                   "since_time": d.since_time, "best_loss": d.best, "latest_loss": d.latest, "rise": d.rise,
                   "reports_above": d.reports} for d in v.loss_divergences],
    }


def snapshot(coord: Coordinator, max_peers: Optional[int] = None) -> dict[str, Any]:
    """The run now: live peers (the first ``max_peers`` by id; None: all) with their role and why, the
    lattice grid with each module's holders, paths with their throughput, loss and number of seeders
    of their shards (live peers of the run whose heartbeats say they seed it: the coordinator never
    looks at the data or the DHT; ``hivepath data info --manifest-hash`` lists every seeder on the
    DHT), the pipelines (:func:`coordinator.pipelines.pipelines`) and stage modules (:func:`stages`),
    totals and counters (tokens, module rounds and event counters survive restarts), each path's
    latest validation bits per byte, the long-run health signals (:func:`health`), and every peer's contribution (``contributions``: the first
    ``max_peers`` by tokens).

    Throughput is what the scheduler counts (:meth:`PeerRecord.counted_tokens_per_s`): a stage server
    or trainer shows what it served (0 until measured), never its join figure. The run's total is
    the tokens trained per second: path peers' and trainers' (a stage server serves a trainer's
    tokens, counted once at the trainer)."""
    lattice = coord.run.lattice
    v = coord.status_view()
    now, peers, leases, progress, counters, reason = (
        v.now, v.peers, v.lease_expiry, v.progress, v.counters, v.rebalance_reason
    )
    states: dict[str, int] = {}
    reach: dict[str, int] = {}
    roles: dict[str, int] = {r: 0 for r in ROLES}
    live = []
    for p in peers:
        states[p.state] = states.get(p.state, 0) + 1
        if p.state in ("active", "draining"):
            live.append(p)
            reach[p.reachability] = reach.get(p.reachability, 0) + 1
        if p.state == "active" and p.assignment is not None:
            roles[p.assignment.mode] = roles.get(p.assignment.mode, 0) + 1
    # the coordinator's view holds active peers only; rebuilt from these copies, it agrees with them
    view = ClusterView.from_peers(p for p in peers if p.state == "active")
    live.sort(key=lambda p: p.peer_id)
    holders: dict[str, list[str]] = {m: [] for m in lattice.module_ids()}
    module_tps: dict[str, float] = {m: 0.0 for m in holders}
    module_round: dict[str, int] = {m: v.module_rounds.get(m, 0) for m in holders}
    paths: dict[tuple[int, ...], dict[str, Any]] = {}
    peer_rows = []
    for p in live:
        a = p.assignment
        mine = progress.get(p.peer_id, {})
        if p.state == "active" and a is not None:
            for m in a.module_ids:
                holders[m].append(p.peer_id)
                module_tps[m] += p.counted_tokens_per_s()
            if a.mode == MODE_PATH:
                row = paths.setdefault(a.path, {"peers": [], "tokens_per_s": 0.0, "losses": []})
                row["peers"].append(p.peer_id)
                row["tokens_per_s"] += p.counted_tokens_per_s()
                row["losses"].append(_mean([r.loss for r in mine.values()]))
        for m, r in mine.items():
            if m in module_round:
                module_round[m] = max(module_round[m], r.round)
        expiry = leases.get(p.peer_id)
        if max_peers is None or len(peer_rows) < max_peers:
            peer_rows.append({
                "peer_id": p.peer_id,
                "device": p.capabilities.device,
                "state": p.state,
                "role": a.mode if a else "",
                "role_reason": a.reason if a else "",
                "tokens_per_s": p.counted_tokens_per_s(),
                "capacity_tokens_per_s": p.capacity_tokens_per_s if a and a.mode == MODE_STAGE else None,
                "memory_bytes": p.capabilities.memory_bytes,
                "upload_bps": p.capabilities.upload_bps,
                "download_bps": p.capabilities.download_bps,
                "link_measured": p.link_measured_at > 0,
                "exchange_overhead_s": p.exchange_overhead_s,
                "assignment": a.to_dict() if a else None,
                "work": a.label() if a else "",
                "last_seen_age_s": max(0.0, now - p.last_seen),
                "lease_remaining_s": max(0.0, expiry - now) if expiry is not None else 0.0,
                "tokens": p.tokens,
                "bytes_exchanged": p.bytes_exchanged,
                "joins": p.joins,
                "reachability": p.reachability,
                "reachable_addr": p.reachable_addr,
                "relay": (relay_of(p.reachable_addr) or ("", ""))[1] if p.reachability == RELAYED else "",
                "observed_addr": p.observed_addr,
                "version": coord.peer_versions.get(p.peer_id),
            })
    seeders: dict[str, int] = {}
    live_ids = {p.peer_id for p in live}
    for peer_id, held in v.seeding.items():
        if peer_id in live_ids:
            for name in held:
                seeders[name] = seeders.get(name, 0) + 1
    path_rows = []
    for path in sorted(set(paths) | set(lattice.paths()[:4096])):
        row = paths.get(path, {"peers": [], "tokens_per_s": 0.0, "losses": []})
        loss = _mean(row["losses"])
        name = format_path(path)
        bpb = v.latest_bpb.get(name)
        path_rows.append({
            "path": list(path), "name": name, "peers": row["peers"],
            "tokens_per_s": row["tokens_per_s"], "loss": loss if math.isfinite(loss) else None,
            "seeders": seeders.get("-".join(map(str, path)), 0),
            "val_bpb": bpb[1] if bpb else None, "val_bpb_age_s": max(0.0, now - bpb[0]) if bpb else None,
        })
    modules = [
        {"module_id": m, "holders": holders[m], "round": module_round[m], "tokens_per_s": module_tps[m],
         "plan": _plan_row(v.plans.get(m, []), module_round[m], coord), "plan_reason": v.plan_reasons.get(m, "")}
        for m in lattice.module_ids()
    ]
    grid = [
        [{"module_id": lattice.block_id(l, i), "holders": len(holders[lattice.block_id(l, i)]),
          "round": module_round[lattice.block_id(l, i)]} for i in range(lattice.modules_per_level)]
        for l in range(lattice.levels)
    ]
    total_tokens = sum(p.tokens for p in peers)
    return {
        "run_id": coord.run.run_id,
        "run_config_hash": coord.run_hash,
        "lattice_hash": coord.lattice_hash,
        "manifest_hash": coord.run.data.manifest_hash,
        "lattice": {"levels": lattice.levels, "modules_per_level": lattice.modules_per_level, "grid": grid},
        "uptime_s": max(0.0, now - coord.started_at),
        "live_leases": len(leases),
        "peer_states": states,
        "peer_reachability": reach,
        "peer_roles": roles,
        "total_tokens_per_s": sum(p.counted_tokens_per_s() for p in live if p.state == "active"
                                  and p.assignment is not None and p.assignment.mode in (MODE_PATH, MODE_TRAINER)),
        "tokens": total_tokens,
        "bytes_exchanged": sum(p.bytes_exchanged for p in peers),
        "peers": peer_rows,
        "peers_truncated": len(live) > len(peer_rows),
        "modules": modules,
        "paths": path_rows,
        "pipelines": pipelines(coord.run, view),
        "stages": stages(view),
        "rebalance": reason,
        "slow_links": v.link_reason,
        "health": health(v),
        "counters": counters,
        "data": {
            "manifest_hash": coord.run.data.manifest_hash,
            "seeding_peers": sum(1 for p in v.seeding if p in live_ids),
            "paths_without_seeder": [r["name"] for r in path_rows if not r["seeders"]],
        },
        "banned": v.banned[:1000],
        "totals": {"tokens": total_tokens, "module_rounds": {m: module_round[m] for m in holders},
                   "peers_ever": len(peers)},
        "contributions": contributions(peers, total_tokens, now, max_peers),
        "versions": {
            "release": versions.RELEASE, "commit": versions.commit(),
            "protocols": ", ".join(f"{k} {v}" for k, v in versions.stated_all().items()),
            "min_peer_version": coord.settings.min_peer_version,
            "peers": coord.peer_versions.counts([p.peer_id for p in live]),
            "unknown_fields": versions.UNKNOWN_FIELDS.snapshot(),
        },
    }


def _plan_row(plans: list, module_round: int, coord: Any) -> dict[str, Any]:
    """A module's exchange plan as the status shows it: what applies at its current round, and the
    plan decided for a later round (None until one is)."""
    run = coord.run.outer
    now = {"inner_steps": run.inner_steps, "codec": run.codec, "overlap": False, "from_round": 0,
           "reason": "the run's H and codec"}
    upcoming = None
    for p in plans:
        row = {"inner_steps": p.inner_steps, "codec": p.codec, "overlap": p.overlap, "from_round": p.from_round,
               "reason": p.reason}
        if p.from_round <= module_round:
            now = row
        else:
            upcoming = row
    return {**now, "next": upcoming}


def contributions(peers: list[PeerRecord], total_tokens: int, now: float,
                  max_peers: Optional[int] = None) -> list[dict[str, Any]]:
    """Every peer that ever joined, those that left included, with what it contributed: the most
    tokens first (the first ``max_peers``; None: all)."""
    key = lambda p: (-p.tokens, p.peer_id)  # noqa: E731
    chosen = sorted(peers, key=key) if max_peers is None else heapq.nsmallest(max_peers, peers, key=key)
    return [{
        "peer_id": p.peer_id,
        "state": p.state,
        "device": p.capabilities.device,
        "work": p.assignment.label() if p.assignment else "",
        "tokens": p.tokens,
        "rounds": p.rounds,
        "share": p.tokens / total_tokens if total_tokens else 0.0,
        "reachability": p.reachability,
        "first_seen": p.first_joined,
        "last_seen": p.last_seen,
        "last_seen_age_s": max(0.0, now - p.last_seen),
    } for p in chosen]
