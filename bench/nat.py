"""Benchmark ``bench.nat``: volunteers behind real NAT average through relays.

Real processes in network namespaces (``peer.localnet.netns``): the coordinator in namespace 0, one public
peer in 1, and three peers each behind a home router of its own that masquerades (iptables) in 2-4;
every outside link is shaped to ``--rate`` (default 50 Mbit/s). The run config is the demo preset
(2x2 byte-level lattice) with ``--inner-steps`` (default 10) so that rounds come often. The public
peer and two NATed peers start together; once every held module has averaged ``--warmup`` rounds,
the third NATed peer joins (the newcomer); the run goes on until the newcomer has finished
``--rounds`` rounds. Then everything is stopped with SIGTERM and checked. The same run with every
participant public (no routers) is the control for the round time.

Keys:
- ``natted_round_share``: over the NATed peers' outer rounds of modules held by two peers or more (at
  the end), the share of (module, round) results that were averaged with at least one other holder
  (target >= 0.95). Rounds a peer applied alone because it was the module's only live holder then (its
  round line says ``(the only holder)``: before the newcomer comes, three peers on four paths leave two
  modules to one peer each) are not rounds with anybody to average with, and are left out; they are
  counted in ``natted_only_holder_rounds``, and ``natted_round_share_counting_only_holder_rounds`` is
  the share with them counted as misses (the definition of the runs before 2026-11-26);
- ``replica_max_abs_diff``: over every pair of checkpoints of one module at one round, from the
  newcomer's first group round on (target 0.0); ``startup_mismatched_rounds`` lists earlier ones (a
  joiner's start-up fork, which the next rounds repair);
- ``relay_bytes_share``: bytes the relay forwarded (its daemon's own count of relayed bytes) over all
  bytes sent on the participants' outside links (report);
- ``nat_vs_public_round_s``: the median time between a peer's outer rounds, NAT run over control run
  (target <= 1.5), with both medians;
- ``newcomer_first_round_s``: from the newcomer's start to its first round averaged with another
  holder (target <= 60);
- ``nat_vs_public_tokens_per_s``: the tokens all peers trained a second from the newcomer's start to
  the stop (their progress lines), NAT run over control run, with both rates (report): a round that
  ends early for a waiting holder is shorter but carries fewer tokens, so rounds alone do not say
  what NAT costs the training.
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit, run_main, tokens_between

MEASURES = (
    "bench/nat.py",
    "models",
    "peer",
    "coordinator",
    "hivepath",
    "protos",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

log = logging.getLogger("bench.nat")

PREFIX, SUBNET = "hpn", "10.81.0"
"""Namespace names and addresses of this benchmark (distinct from the chaos tests' and bench.comm's)."""
NAMES = ["public", "nat2", "nat3", "nat4"]
NEWCOMER = "nat4"
_RELAYED = re.compile(r"relay/relay\.go:\d+\] relayed (\d+) bytes from")


def one_run(natted: bool, work: Path, rate: str, inner_steps: int, warmup: int, rounds: int) -> dict[str, Any]:
    from models.data import prepared
    from peer.localnet import NetnsBridge, ProcessGroup, preset_network, wait_for
    from peer.localnet.checks import acknowledged_rounds, module_results, replica_check, round_gaps, stop_all
    from peer.localnet.faults import rounds_done

    data = prepared(work / "data", 2, 2, "bytes")
    procs = ProcessGroup(work / "logs")
    bridge = NetnsBridge(5, rate=rate, subnet=SUBNET, prefix=PREFIX, nat=[2, 3, 4] if natted else [])
    out: dict[str, Any] = {}
    try:
        bridge.open()
        net = preset_network(procs, work / "net", data.dir, data.manifest_hash, preset="demo", run_id="nat",
                             inner_steps=inner_steps, round_timeout=30.0, bridge=bridge)
        net.start_coordinator()
        # the relay's count of relayed bytes comes from its daemon's debug log (the public peer's only)
        net.env.update({"GOLOG_LOG_LEVEL": "warn,relay=debug", "HIVEMIND_LOGLEVEL": "DEBUG"})
        net.start_peer_in("public", 1)
        wait_for(lambda: (net.status() or {}).get("peers"), 180, "the public peer to join")
        for name in ("GOLOG_LOG_LEVEL", "HIVEMIND_LOGLEVEL"):
            net.env.pop(name)
        works = {"public": work / "net" / "public"}
        for i, name in ((2, "nat2"), (3, "nat3")):
            works[name] = net.start_peer_in(name, i)
        wait_for(lambda: all(rounds_done(net, n) >= warmup for n in works), 600, f"{warmup} rounds on every peer")
        sent0 = _sent(bridge)
        started, started_unix = time.monotonic(), time.time()
        works[NEWCOMER] = net.start_peer_in(NEWCOMER, 4)
        first = wait_for(lambda: _first_group_round(net.procs.log(NEWCOMER)), 300, "the newcomer's first group round")
        out["newcomer_first_round_s"] = round(first - started, 1) if first else None
        # a joiner may fork from the others at start-up until the majority's state wins (peer.localnet.checks.settled):
        # replicas are compared from the newcomer's first group round on; the earlier rounds are reported apart
        floor = acknowledged_rounds([w / "checkpoints" for w in works.values()])
        wait_for(lambda: rounds_done(net, NEWCOMER) >= rounds, 1200, f"{rounds} rounds of the newcomer")
        sent = _sent(bridge) - sent0
        stopped_unix = time.time()
        out["tokens_per_s"] = round(sum(tokens_between(net.progress_lines(n), started_unix, stopped_unix) for n in works)
                                    / (stopped_unix - started_unix), 1)
        held = {m["module_id"]: len(m["holders"]) for m in (net.status() or {}).get("modules", [])}
        codes = stop_all(net, [*works])
        out["exit_codes"] = codes
        logs = {n: net.procs.log(n) for n in works}
        natted_names = [n for n in works if n != "public"]
        shared = {m for m, k in held.items() if k >= 2}
        results = [(m, k) for n in natted_names for m, k in module_results(logs[n], only_holder=False) if m in shared]
        out["natted_module_rounds"] = len(results)
        out["natted_round_share"] = round(sum(1 for _, k in results if k >= 2) / len(results), 4) if results else None
        # the definition of the runs before 2026-11-26: rounds a peer applied alone as the module's only live
        # holder (before the newcomer came, three peers leave two modules to one holder each) counted as misses
        every = [(m, k) for n in natted_names for m, k in module_results(logs[n]) if m in shared]
        out["natted_only_holder_rounds"] = len(every) - len(results)
        out["natted_round_share_counting_only_holder_rounds"] = (
            round(sum(1 for _, k in every if k >= 2) / len(every), 4) if every else None)
        gaps = [g for n in works for g in round_gaps(logs[n])[2:]]
        out["median_round_s"] = statistics.median(gaps) if gaps else None
        check = replica_check([w / "checkpoints" for w in works.values()], min_round=floor)
        out["replica_pairs"] = check.pairs
        out["replica_max_abs_diff"] = check.max_abs_diff
        out["replica_mismatches"] = check.mismatches[:5]
        startup = replica_check([w / "checkpoints" for w in works.values()])
        out["startup_mismatched_rounds"] = sorted({" ".join(m.split()[:3]).rstrip(":") for m in startup.mismatches})
        relayed = sum(int(m[1]) for m in _RELAYED.finditer(logs["public"]))
        out["bytes_sent_outside"] = sent
        out["relayed_bytes"] = relayed
        out["relay_bytes_share"] = round(relayed / sent, 4) if sent > 0 else None
        if natted:
            rows = {p["peer_id"]: p for p in (net.status() or {}).get("peers", [])}
            out["reachability"] = sorted(p.get("reachability", "") for p in rows.values())
        return out
    finally:
        procs.close()
        bridge.close()


def _sent(bridge) -> int:
    """Bytes sent so far on every participant's outside link (a NATed one's router's)."""
    return sum(bridge.tx_bytes(i) for i in range(1, bridge.n))


def _first_group_round(log_text: str) -> float:
    """Monotonic time at which ``log_text`` first shows a round averaged by 2 or more, else 0."""
    if re.search(r"peer\.node\.trainer: round \d+: .*averaged by [2-9]", log_text):
        return time.monotonic()
    return 0.0


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.nat", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="50mbit", help="every outside link's rate (tc tbf), default 50mbit")
    p.add_argument("--inner-steps", type=int, default=10, help="inner steps per round (default 10)")
    p.add_argument("--warmup", type=int, default=5, help="rounds before the newcomer joins (default 5)")
    p.add_argument("--rounds", type=int, default=20, help="rounds of the newcomer before the stop (default 20)")
    p.add_argument("--work", type=Path, default=None,
                   help="keep every process's logs and checkpoints in this directory (default: a temporary one, removed)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from peer.localnet.netns import nat_available

    why = nat_available()
    if why:
        emit("nat", {"skipped": why})
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-nat-") as tmp:
        work = args.work or Path(tmp)
        nat = one_run(True, work / "nat", args.rate, args.inner_steps, args.warmup, args.rounds)
        public = one_run(False, work / "public", args.rate, args.inner_steps, args.warmup, args.rounds)
    result = {
        "seeds": [0],  # every peer's run config keeps the preset's seed
        "natted_round_share": nat["natted_round_share"],
        "replica_max_abs_diff": max(nat["replica_max_abs_diff"], public["replica_max_abs_diff"]),
        "relay_bytes_share": nat["relay_bytes_share"],
        "nat_vs_public_round_s": (round(nat["median_round_s"] / public["median_round_s"], 3)
                                  if nat["median_round_s"] and public["median_round_s"] else None),
        "newcomer_first_round_s": nat["newcomer_first_round_s"],
        "nat_vs_public_tokens_per_s": (round(nat["tokens_per_s"] / public["tokens_per_s"], 3)
                                       if nat["tokens_per_s"] and public["tokens_per_s"] else None),
        "nat_run": nat,
        "public_run": public,
        "setup": {"rate": args.rate, "preset": "demo", "inner_steps": args.inner_steps, "peers": "1 public + 3 NATed",
                  "rounds": args.rounds, "warmup": args.warmup},
    }
    emit("nat", result)
    return 0


if __name__ == "__main__":
    run_main(main)
