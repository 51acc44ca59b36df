"""Prometheus metrics of the coordinator, rendered from :func:`coordinator.status.snapshot` at
scrape time (no state of their own, so they can never disagree with the status page)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.reachability import STATES
from coordinator.status import ROLES

__all__ = ["SnapshotCollector", "render_metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS = {
    "joins": "Peers admitted for the first time",
    "rejoins": "Known peers admitted again",
    "leaves": "Peers that gave their lease back",
    "expirations": "Leases that expired without a heartbeat",
    "drains": "Peers told to drain (preemption or operator)",
    "moves": "Rebalancing moves",
    "plan_changes": "Exchange plans changed by the planner (one per module and change)",
    "heartbeats": "Heartbeats accepted",
    "heartbeats_unknown_lease": "Heartbeats refused for an unknown or expired lease",
    "heartbeat_streams": "HeartbeatStream calls opened by peers",
    "bandwidth_probes": "Bandwidth probes completed (either direction)",
    "rejected_no_fit": "Joins refused because no work fits the peer's memory",
    "rejected_key": "Joins refused because the peer id belongs to another key",
    "rejected_incompatible": "Joins refused because the peer's data differs",
    "rejected_banned": "Joins refused because the peer is banned",
    "rejected_version": "Joins refused for another major protocol version or a release below min_peer_version",
    "drained_version": "Peers told to drain because the run now requires a newer release",
    "reports": "Reports of misbehaving peers received",
    "seeder_reports": "Reports of seeders that sent bad bytes of the run's dataset",
    "bans": "Peers banned (by reports or by the operator)",
    "malformed_requests": "Requests refused because their bytes are not a valid message (coordinator.wire)",
    "evaluations": "Validation results (one path each) reported by archive peers",
}


class SnapshotCollector(Collector):
    """Turns one status snapshot into metric families per scrape."""

    def __init__(self, get_snapshot: Callable[[], dict[str, Any]]):
        self._get = get_snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._get()
        peers = GaugeMetricFamily("hivepath_coordinator_peers", "Known peers by state", labels=["state"])
        for state in ("active", "draining", "left", "expired", "banned"):
            peers.add_metric([state], s["peer_states"].get(state, 0))
        yield peers
        reach = GaugeMetricFamily("hivepath_coordinator_peers_reachability",
                                  "Live peers by the coordinator's dial-back verdict at their join", labels=["reachability"])
        for verdict in STATES:
            reach.add_metric([verdict], s["peer_reachability"].get(verdict, 0))
        yield reach
        roles = GaugeMetricFamily("hivepath_coordinator_peers_role", "Active peers by role", labels=["role"])
        for role in ROLES:
            roles.add_metric([role], s["peer_roles"].get(role, 0))
        yield roles
        info = GaugeMetricFamily("hivepath_coordinator_info", "The coordinator's release, commit and protocols",
                                 labels=["version", "commit", "protocols", "min_peer_version"])
        v = s["versions"]
        info.add_metric([v["release"], v["commit"], v["protocols"], v["min_peer_version"]], 1)
        yield info
        by_version = GaugeMetricFamily("hivepath_coordinator_peers_version", "Live peers by release",
                                       labels=["version"])
        for release, n in sorted(v["peers"].items()):
            by_version.add_metric([release or "unknown"], n)
        yield by_version
        yield GaugeMetricFamily("hivepath_coordinator_unknown_fields",
                                "Fields of peers' messages ignored because this coordinator does not know them",
                                value=sum(v["unknown_fields"].values()))
        yield GaugeMetricFamily("hivepath_coordinator_leases", "Live leases", value=s["live_leases"])
        yield GaugeMetricFamily("hivepath_coordinator_tokens_per_second",
                                "Tokens trained per second: path peers' and pipeline trainers' (what they served)",
                                value=s["total_tokens_per_s"])
        yield CounterMetricFamily("hivepath_coordinator_tokens", "Tokens processed by all peers", value=s["tokens"])
        yield CounterMetricFamily("hivepath_coordinator_exchanged_bytes", "Bytes peers sent and received averaging",
                                  value=s["bytes_exchanged"])
        holders = GaugeMetricFamily("hivepath_coordinator_module_holders", "Peers training each module",
                                    labels=["module"])
        rounds = GaugeMetricFamily("hivepath_coordinator_module_round", "Highest outer round reported per module",
                                   labels=["module"])
        for m in s["modules"]:
            holders.add_metric([m["module_id"]], len(m["holders"]))
            rounds.add_metric([m["module_id"]], m["round"])
        yield holders
        yield rounds
        path_tps = GaugeMetricFamily("hivepath_coordinator_path_tokens_per_second", "Path-mode tokens/s per path",
                                     labels=["path"])
        path_loss = GaugeMetricFamily("hivepath_coordinator_path_loss", "Mean latest loss per path", labels=["path"])
        path_seeders = GaugeMetricFamily("hivepath_coordinator_path_seeders",
                                         "Live peers seeding each path's shards (as their heartbeats say)",
                                         labels=["path"])
        path_bpb = GaugeMetricFamily("hivepath_coordinator_path_validation_bpb",
                                     "Latest validation bits per byte per path (archive peers' reports)", labels=["path"])
        for p in s["paths"]:
            path_tps.add_metric([p["name"]], p["tokens_per_s"])
            if p["val_bpb"] is not None:
                path_bpb.add_metric([p["name"]], p["val_bpb"])
            path_seeders.add_metric([p["name"]], p["seeders"])
            if p["loss"] is not None:
                path_loss.add_metric([p["name"]], p["loss"])
        yield path_tps
        yield path_loss
        yield path_seeders
        yield path_bpb
        pipe_tps = GaugeMetricFamily("hivepath_coordinator_pipeline_tokens_per_second",
                                     "Tokens/s a pipeline's trainers drove through its stage servers", labels=["path"])
        pipe_running = GaugeMetricFamily("hivepath_coordinator_pipeline_running",
                                         "1 while a pipeline has a trainer and a server on every level",
                                         labels=["path"])
        for p in s["pipelines"]:
            pipe_tps.add_metric([p["name"]], p["tokens_per_s"])
            pipe_running.add_metric([p["name"]], 1.0 if p["state"] == "running" else 0.0)
        yield pipe_tps
        yield pipe_running
        stage_servers = GaugeMetricFamily("hivepath_coordinator_stage_servers", "Stage servers of each module",
                                          labels=["module"])
        stage_tps = GaugeMetricFamily("hivepath_coordinator_stage_tokens_per_second",
                                      "Tokens/s a module's stage servers served (their heartbeats' measurements)",
                                      labels=["module"])
        stage_busy = GaugeMetricFamily("hivepath_coordinator_stage_busy_ratio",
                                       "Served over what a module's stage servers can serve (once all are measured)",
                                       labels=["module"])
        for m in s["stages"]:
            stage_servers.add_metric([m["module_id"]], m["servers"])
            stage_tps.add_metric([m["module_id"]], m["tokens_per_s"])
            if m["busy"] is not None:
                stage_busy.add_metric([m["module_id"]], m["busy"])
        yield stage_servers
        yield stage_tps
        yield stage_busy
        rising = GaugeMetricFamily("hivepath_coordinator_path_bpb_rise",
                                   "Relative rise of a path's validation bits per byte over its last archive "
                                   "scorings, while they rise (coordinator.health); module and round: where it began",
                                   labels=["path", "module", "since_round"])
        for r in s["health"]["paths"]:
            rising.add_metric([r["path"], r["module"], str(r["since_round"])], r["rise"])
        yield rising
        diverging = GaugeMetricFamily("hivepath_coordinator_peer_loss_divergence",
                                      "Relative rise of an active peer's training loss over its best, while it "
                                      "diverges (coordinator.health); module and round: where it began",
                                      labels=["peer", "module", "since_round"])
        for d in s["health"]["peers"]:
            diverging.add_metric([d["peer_id"], d["module"], str(d["since_round"])], d["rise"])
        yield diverging
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"hivepath_coordinator_{name}", doc, value=s["counters"].get(name, 0))


def render_metrics(get_snapshot: Callable[[], dict[str, Any]]) -> bytes:
    """The Prometheus text exposition of one snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(get_snapshot))
    return generate_latest(registry)
