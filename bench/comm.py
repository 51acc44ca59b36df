"""bench.comm: average one 64 MB module among 4 peers on rate-limited links.

Four peers, each in its own network namespace behind one bridge (:mod:`peer.localnet.netns`), each with
egress shaped to 100 Mbit/s by ``tbf``, run real DHTs and p2p daemons and average one module of
16 Mi fp32 values (64 MB) with :class:`peer.averaging.net_averager.NetAverager`, once per codec.

Keys (``bench/results/comm.json``):

- ``link_efficiency``: int8's bandwidth-optimal time ``2 (n - 1) / n * compressed_size / rate`` over
  the measured all-reduce time (from the group forming to the average decoded; target >= 0.9).
  ``compressed_size`` is what the peers actually sent: with the default entropy stage (``--entropy
  zstd``, the peers' ``OuterConfig.entropy``) it is below the codec's own size (``codec_bytes``).
- ``tcp_ceiling`` (:mod:`bench.tcp_ceiling`): for int8 and int4, the link efficiency bare TCP reaches
  moving that codec's bytes in the all-reduce's pattern (same peers, rate, segments; zeros, no TLS, no
  CPU work) in fresh namespaces, per schedule and the best of them; ``link_efficiency_vs_tcp_ceiling``:
  each codec's link efficiency over it (1.0: the exchange is as fast as the link and TCP allow;
  ``--ceiling-rounds``).
- ``speedup_vs_fp32_optimal``: bandwidth-optimal fp32 time over the measured int8 time.
- ``bytes_ratio_vs_ddp``: bytes a synchronous DDP ring all-reduce sends per peer for H = 100 steps
  (``H * 2 (n - 1) / n * 4 P``) over the payload bytes a peer sent in one int8 outer step
  (target >= 400); ``bytes_ratio_vs_ddp_wire`` uses the bytes the peer's interface really sent
  (TCP, TLS, DHT traffic included).
- ``replica_max_abs_diff``: largest difference between the peers' averages (target 0.0).
- ``cpu_s_per_mb``: per codec, CPU seconds of a peer's process and its children (the p2p
  daemon, the DHT process) from the group forming to the average decoded, plus the encoding done
  before it (the vector is encoded while the group forms: ``encoded_ahead`` in the breakdown), per MB
  of module averaged (mean over peers); ``hivemind_8bit`` the same for hivemind's averager (:mod:`bench.comm_hivemind`,
  its averager process included) on the same set-up in the same run, trigger to result.
  ``cpu_ratio_vs_hivemind``: int8's and int4's over hivemind's (target <= 0.5).
- ``cpu_breakdown_seconds``: per codec, that CPU by phase (mean over peers): ``encode``, ``entropy``,
  ``decode``, ``reduce``, ``copy`` (:mod:`peer.compression.phases`), ``io_loop`` (the averager's
  event-loop thread: streams to the p2p daemon, framing, asyncio), ``other_python`` (the rest of the
  process), ``daemon`` (``p2pd``), ``dht_process``, with ``python_system`` (the kernel's share) and
  ``minor_page_faults``.
- ``group_formed_spread_s``: per codec, how far apart the members learned that their group formed
  (the first member's all-reduce starts that much before the last one's can; in its link efficiency).
- ``link_idle_seconds`` (per codec): where the peers' links idled in the round, from a sampler of each
  peer's link counter beside it (:func:`peer.localnet.netns.sample_tx`, every 10 ms; its CPU is not the
  peer's): from the first member's group forming to the last member's average (``span_s``), the time
  a link carried nothing (``idle_s``, the mean over the peers), split into ``start_s`` (before the
  link first ran at half its rate or more in a 20 ms slice), ``tail_s`` (after it last did) and
  ``middle_s`` (waits in between); ``link_idle_seconds_mean`` the mean over the rounds.
- ``link_efficiency_by_rate``: the link efficiency at the headline rate and at ``--report-rates``
  (default 50 and 25 Mbit/s, codecs ``--report-codecs``: int8, int4), each a fresh set of namespaces;
  their full per-codec results are under ``codecs_RATEmbit``.
- ``codecs``: per codec, compressed size, measured times and bytes, and where each peer's CPU went
  during the round: ``python_cpu_seconds_by_peer`` (user + system), ``python_system_cpu_seconds_by_peer``
  (the kernel's share: sockets, TCP) and ``child_cpu_seconds_by_peer`` (its child processes by name:
  ``p2pd``, the DHT process).

Each codec's timed rounds follow a full-size untimed round in that codec (``--no-warmup`` skips
it), its vectors handed back as a training peer does once it applied a round, so the timings are
those of a running network's rounds, where one codec serves every round: the p2p connections are
open and the codec's module-sized vectors and buffers are reused (the first round of a fresh swarm
also pays the connection handshakes and faults in its vectors; a warm-up in another codec would
leave the timed codec's first round paying its own first touches). ``bench.comm_hivemind`` likewise times hivemind's full-size rounds after
a first one in the same codec and averager.
Each codec runs ``--rounds`` (default 3) timed rounds: its entry is the round of median link
efficiency, with ``cpu_s_per_mb`` and ``cpu_breakdown_seconds`` the medians over the rounds and
``link_efficiency_by_round``, ``cpu_s_per_mb_by_round`` every round's (a single round on these two
shared cores varies as much as the changes it is meant to show).

Run as root: ``python -m bench.comm`` (``--mb``, ``--rate-mbit``, ``--peers``, ``--codecs``,
``--report-rates``, ``--report-codecs``, ``--no-hivemind``; a reduced run for iteration:
``--mb 16 --codecs int8 --report-rates '' --no-hivemind``). Without
root (or iproute2) it prints a ``{"skipped": ...}`` line and exits 0. A rate other than the reference
100 Mbit/s (:data:`bench.common.ISSUE_RATE_MBIT`) writes ``bench/results/comm_RATEmbit.json`` instead (``--rate-mbit 25``: each peer then has
the CPU per byte of link that a peer with two cores of its own has at 100 Mbit/s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from bench import tcp_ceiling
from bench.common import ISSUE_RATE_MBIT, emit, rate_result_name, run_main
from peer.localnet.netns import link_idle, read_samples, tx_bytes
from models import strict_json
from models.codec_spec import ENTROPY_STAGES, codec_spec, wire_name
from models.config import OuterConfig
from models.durable import atomic_write_text

MEASURES = (
    "bench/comm.py",
    "peer/localnet",
    "bench/tcp_ceiling.py",
    "models",
    "peer/averaging",
    "peer/compression",
    "peer/network",
    "protos",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

log = logging.getLogger("bench.comm")

RUN_ID = "bench"
CONFIG_HASH = "c0ffee00c0ffee00"
MODULE = "L0M0"
H = 100


_CHILDREN: list = []
"""This process's descendants as the last rescan found them (:func:`_cpu_seconds`)."""


def _cpu_seconds(rescan: bool = True) -> tuple[float, float, dict[str, float]]:
    """This process's CPU seconds (user + system, system) and its descendants' by command name (p2pd, the DHT).
    ``rescan=False`` reuses the descendants the last call found: finding them reads every process's
    ``/proc`` entry, too slow for the event loop's
    snapshot at the round's start, which would hold the round's first sends back."""
    import psutil

    me = psutil.Process()
    own = me.cpu_times()
    if rescan or not _CHILDREN:
        _CHILDREN[:] = me.children(recursive=True)
    children: dict[str, float] = {}
    for child in _CHILDREN:
        try:
            with child.oneshot():
                t = child.cpu_times()
                children[child.name()] = children.get(child.name(), 0.0) + t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return own.user + own.system, own.system, children


def _thread_cpu_seconds(native_id: Optional[int]) -> float:
    """CPU seconds (user + system) of one thread of this process, by its native id."""
    import psutil

    for t in psutil.Process().threads():
        if t.id == native_id:
            return t.user_time + t.system_time
    return 0.0


def _snapshot(loop_thread: Optional[int], rescan: bool = True) -> dict:
    """Everything a round's CPU breakdown is computed from: this process (and its loop thread), its
    children by name, the averager's phase counters (:mod:`peer.compression.phases`), page faults.
    ``rescan``: as :func:`_cpu_seconds`'s (False in the event loop)."""
    import resource

    from peer.compression.phases import snapshot

    cpu, system, children = _cpu_seconds(rescan)
    return dict(cpu=cpu, system=system, children=children, phases=snapshot(), loop=_thread_cpu_seconds(loop_thread),
                minflt=resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


AHEAD_PHASES = ("encode", "entropy")
"""The codec phases a round may run before its group forms (the vector is encoded while matchmaking
runs, ``Codec.prepare``): counted in the round's CPU, as they would be if done after."""


def _breakdown(before: dict, after: dict, ahead: Optional[dict] = None) -> dict:
    """Per-phase CPU seconds between two :func:`_snapshot`: the codec phases, the event loop's own
    (``io_loop``: streams to the daemon, framing, asyncio), the rest of the process (``other_python``:
    threads handing work over, the caller), the p2p daemon and the DHT process. ``ahead``: a
    :func:`_snapshot` from the round's start, whose :data:`AHEAD_PHASES` seconds up to ``before`` (the
    group forming) are counted too, in their phase and the process's total (``encoded_ahead``)."""
    early = {k: before["phases"][k] - ahead["phases"][k] for k in AHEAD_PHASES} if ahead is not None else {}
    phases = {k: after["phases"][k] - before["phases"][k] + early.get(k, 0.0) for k in after["phases"]}
    children = {k: v - before["children"].get(k, 0.0) for k, v in after["children"].items()}
    python = after["cpu"] - before["cpu"] + sum(early.values())
    loop = after["loop"] - before["loop"]
    out = {k: round(v, 4) for k, v in phases.items()}
    out.update(io_loop=round(loop, 4), other_python=round(python - loop - sum(phases.values()), 4),
               python_total=round(python, 4), python_system=round(after["system"] - before["system"], 4),
               daemon=round(children.get("p2pd", 0.0), 4),
               dht_process=round(sum(v for k, v in children.items() if k != "p2pd"), 4),
               minor_page_faults=after["minflt"] - before["minflt"], encoded_ahead=round(sum(early.values()), 4))
    out["peer_and_daemon"] = round(python + sum(children.values()), 4)
    return out


def run_peer(args: argparse.Namespace) -> None:
    """One peer inside its namespace: join, average once per codec, write timings and the averages."""
    import torch

    from peer.averaging import NetAverager
    from peer.compression import get_codec
    from peer.network import (
        DHTOptions,
        HolderRecord,
        holders_key,
        read_records,
        start_dht,
    )

    torch.set_num_threads(1)
    out = Path(args.out)
    dht = start_dht(DHTOptions(host_maddrs=[f"/ip4/{args.host}/tcp/0"], initial_peers=args.initial or []))
    if args.peer == 0:
        atomic_write_text(out / "maddrs", strict_json.dumps(dht.maddrs()), temp_name="maddrs.tmp")
    marks: dict[str, float] = {}
    formed: dict[str, dict] = {}

    def on_event(point: str) -> None:
        if point not in marks:
            marks[point] = time.monotonic()
            if point == "group_formed":  # the all-reduce's CPU is counted from here
                formed["snapshot"] = _snapshot(avg.loop_thread_id, rescan=False)  # in the loop: no /proc scan

    rate = args.rate_mbit * 1e6 / 8
    avg = NetAverager(dht, RUN_ID, CONFIG_HASH, bandwidth=rate, event_hook=on_event, direct_lanes=args.lanes)
    try:
        avg.hold(MODULE, 0)
        deadline = time.monotonic() + 120
        while len(read_records(dht.dht, holders_key(RUN_ID, MODULE), HolderRecord)) < args.peers:
            if time.monotonic() > deadline:
                raise TimeoutError("not every peer appeared")
            time.sleep(0.2)
        numel = args.mb * 2**20 // 4
        delta = torch.randn(numel, generator=torch.Generator().manual_seed(args.peer)) * 0.01  # (numel,)
        results: dict[str, list[dict]] = {}
        round_no = -1  # the run's first round is 0: the round every peer announced holding at start
        for codec in args.codecs.split(","):
            results[codec] = []
            if args.warmup:
                # a full-size exchange in this codec first, so the peers' p2p connections are open and
                # the codec's vectors and buffers in use, as in a running network (every round after
                # the first, one codec for the whole run; hivemind's baseline warms each codec up too):
                # the timings then measure the exchange, not the handshakes and first touches
                round_no += 1
                warm = avg.average(MODULE, round_no, [delta], 1.0, get_codec(wire_name(codec, args.entropy)),
                                   args.timeout)
                if warm.averaged is None:
                    raise RuntimeError(f"{codec} warm-up round failed: {warm.reason}")
                avg.give_back(warm)
            for _ in range(args.rounds):
                round_no += 1
                marks.clear()
                formed.clear()
                start = _snapshot(avg.loop_thread_id)  # used only if no group forms (a lone round)
                tx0, t0, (cpu0, sys0, children0) = tx_bytes(), time.monotonic(), _cpu_seconds()
                lanes0 = avg.lane_streams
                wire = get_codec(wire_name(codec, args.entropy))
                res = avg.average(MODULE, round_no, [delta], float(1 + args.peer), wire, args.timeout)
                t1, (cpu1, sys1, children1) = time.monotonic(), _cpu_seconds()
                end = _snapshot(avg.loop_thread_id)
                if res.averaged is None:
                    raise RuntimeError(f"{codec} round failed: {res.reason}")
                flat = res.averaged[0]
                results[codec].append(dict(
                    seconds_total=t1 - t0, seconds_allreduce=t1 - marks.get("group_formed", t0),
                    formed_at=marks.get("group_formed", t0),  # time.monotonic(): one clock for every namespace
                    cpu_seconds=cpu1 - cpu0, system_cpu_seconds=sys1 - sys0,
                    child_cpu_seconds={name: round(v - children0.get(name, 0.0), 3) for name, v in children1.items()},
                    bytes_sent=res.bytes_sent, bytes_received=res.bytes_received, wire_tx_bytes=tx_bytes() - tx0,
                    group_size=res.group_size, sha256=hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
                    allreduce_cpu=_breakdown(formed["snapshot"], end, ahead=start) if "snapshot" in formed
                    else _breakdown(start, end),
                    lane_streams=avg.lane_streams - lanes0,
                ))
                if codec == "int8":
                    torch.save(flat, out / f"avg{args.peer}.pt")  # the last round's: compared across peers
                log.info("%s: %.2fs (all-reduce %.2fs), sent %d bytes", codec, results[codec][-1]["seconds_total"],
                         results[codec][-1]["seconds_allreduce"], res.bytes_sent)
                del flat
                avg.give_back(res)  # as a training peer does once it applied the round (its vectors are reused)
        atomic_write_text(out / f"peer{args.peer}.json", strict_json.dumps(results), temp_name=f"peer{args.peer}.tmp")
    finally:
        avg.shutdown()
        dht.shutdown()


def _wait(path: Path, procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"a peer exited before writing {path.name}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} after {timeout:.0f}s")
        time.sleep(0.1)


@contextmanager
def namespaced_peers(module: str, n: int, rate_mbit: int, args: list[str], wait_s: float,
                     prefix: str = "hpb", sample_links: bool = False) -> Iterator[Path]:
    """Run ``python -m MODULE ARGS --out DIR --peer i --host ADDR`` in each of ``n`` rate-limited
    namespaces (:class:`peer.localnet.netns.NetnsBridge`), peer 0 first: it writes its DHT multiaddrs to
    ``DIR/maddrs`` (JSON), which the others get as ``--initial``. Yields ``DIR`` once every peer exited
    0 within ``wait_s`` (else raises with the failed peer's log tail); everything is torn down after.
    ``sample_links``: beside each peer, a sampler of its link's counter (:func:`peer.localnet.netns.sample_tx`)
    writes ``DIR/tx{i}.txt`` once the peers exited."""
    from peer.localnet.netns import NetnsBridge

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix=f"hivepath-{prefix}-") as tmp, \
            NetnsBridge(n, rate=f"{rate_mbit}mbit", prefix=prefix) as net:
        out = Path(tmp)
        procs, logs = [], [open(out / f"peer{i}.log", "wb") for i in range(n)]
        samplers = [net.popen(i, [sys.executable, "-m", "peer.localnet.netns", "--sample-tx", str(out / f"tx{i}.txt")],
                              env=env, stdout=subprocess.PIPE, stderr=logs[i], text=True)
                    for i in range(n)] if sample_links else []
        try:
            for i, p in enumerate(samplers):  # each reads its link before any peer starts
                if p.stdout.readline().strip() != "sampling":
                    raise RuntimeError(f"the link sampler of peer {i} did not start:\n"
                                       f"{(out / f'peer{i}.log').read_text()[-3000:]}")
            base = [sys.executable, "-m", module, "--out", tmp, *args]
            procs.append(net.popen(0, [*base, "--peer", "0", "--host", net.address(0)], env=env,
                                   stdout=logs[0], stderr=subprocess.STDOUT))
            _wait(out / "maddrs", procs, 120)
            maddrs = json.loads((out / "maddrs").read_text())
            for i in range(1, n):
                procs.append(net.popen(i, [*base, "--peer", str(i), "--host", net.address(i), "--initial", *maddrs],
                                       env=env, stdout=logs[i], stderr=subprocess.STDOUT))
            for i, p in enumerate(procs):
                p.wait(timeout=wait_s)
                if p.returncode != 0:
                    raise RuntimeError(f"peer {i} exited {p.returncode}:\n{(out / f'peer{i}.log').read_text()[-3000:]}")
            for p in samplers:
                p.terminate()
            for i, p in enumerate(samplers):
                p.stdout.close()
                if p.wait(timeout=30) != 0 or not (out / f"tx{i}.txt").exists():
                    raise RuntimeError(f"the link sampler of peer {i} exited {p.returncode}")
            yield out
        finally:
            for p in [*procs, *samplers]:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
            for f in logs:
                f.close()


def _round_at(args: argparse.Namespace, rate_mbit: int, codecs: list[str]) -> tuple[dict, list]:
    """Run the peers at ``rate_mbit`` for ``codecs``: per codec its summary, and int8's averages."""
    import torch

    n, numel = args.peers, args.mb * 2**20 // 4
    rate = rate_mbit * 1e6 / 8
    peer_args = ["--peers", str(n), "--mb", str(args.mb), "--rate-mbit", str(rate_mbit), "--codecs", ",".join(codecs),
                 "--rounds", str(args.rounds),
                 "--entropy", args.entropy, "--timeout", str(args.timeout), *([] if args.warmup else ["--no-warmup"]),
                 *([] if args.lanes else ["--no-lanes"])]
    with namespaced_peers("bench.comm", n, rate_mbit, peer_args, args.timeout * len(codecs) * args.rounds + 180,
                          sample_links=True) as out:
        peers = [json.loads((out / f"peer{i}.json").read_text()) for i in range(n)]
        links = [read_samples(str(out / f"tx{i}.txt")) for i in range(n)]
        avgs = [torch.load(out / f"avg{i}.pt") for i in range(n)] if "int8" in codecs else []
    per_codec = {}
    for codec in codecs:
        rounds = [_round_summary(args, codec, [p[codec][r] for p in peers], rate, numel, links)
                  for r in range(len(peers[0][codec]))]
        per_codec[codec] = _median_round(rounds)
    return per_codec, avgs


def _round_summary(args: argparse.Namespace, codec: str, peers: list[dict], rate: float, numel: int,
                   links: Optional[list] = None) -> dict:
    """One round of ``codec``: its times, bytes and CPU from every peer's record of it; with ``links``
    (each peer's :func:`peer.localnet.netns.read_samples`), where their links idled in it."""
    n = len(peers)
    sent = sum(p["bytes_sent"] for p in peers) / n
    size = sent / (2 * (n - 1) / n)  # what the codec (and entropy stage) actually sends per copy of the module
    optimal = sent / rate  # = 2 (n - 1) / n * size / rate
    t_ar = max(p["seconds_allreduce"] for p in peers)
    cpu = [p["allreduce_cpu"] for p in peers]
    return dict(
        wire_codec=wire_name(codec, args.entropy), codec_bytes=codec_spec(codec).encoded_size(numel),
        compressed_bytes=round(size), optimal_seconds=round(optimal, 3), allreduce_seconds=round(t_ar, 3),
        total_seconds=round(max(p["seconds_total"] for p in peers), 3),
        link_efficiency=round(optimal / t_ar, 3),
        group_formed_spread_s=round(max(p["formed_at"] for p in peers) - min(p["formed_at"] for p in peers), 3),
        cpu_s_per_mb=round(sum(c["peer_and_daemon"] for c in cpu) / n / args.mb, 5),
        cpu_breakdown_seconds={k: round(sum(c[k] for c in cpu) / n, 4) for k in cpu[0]},
        bytes_sent_per_peer=round(sent),
        wire_tx_bytes_per_peer=round(sum(p["wire_tx_bytes"] for p in peers) / n),
        wire_tx_bytes_by_peer=[p["wire_tx_bytes"] for p in peers],
        allreduce_seconds_by_peer=[round(p["seconds_allreduce"], 3) for p in peers],
        python_cpu_seconds_by_peer=[round(p["cpu_seconds"], 3) for p in peers],
        python_system_cpu_seconds_by_peer=[round(p["system_cpu_seconds"], 3) for p in peers],
        child_cpu_seconds_by_peer=[p["child_cpu_seconds"] for p in peers],
        lane_streams_by_peer=[p["lane_streams"] for p in peers],
        identical_on_all_peers=len({p["sha256"] for p in peers}) == 1,
        group_size=min(p["group_size"] for p in peers),
    ) | (dict(link_idle_seconds=_link_idle(peers, links, rate)) if links else {})


def _link_idle(peers: list[dict], links: list, rate: float) -> dict:
    """Where the peers' links idled in one round (:func:`peer.localnet.netns.link_idle`, the mean over the
    peers): from the first peer's group forming to the last one's average, its length ``span_s``,
    the time no bytes went ``idle_s``, and that split into ``start_s``, ``middle_s`` and ``tail_s``."""
    start = min(p["formed_at"] for p in peers)
    end = max(p["formed_at"] + p["seconds_allreduce"] for p in peers)
    each = [link_idle(samples, start, end, rate) for samples in links]
    return {k: round(statistics.mean(e[k] for e in each), 3) for k in each[0]}


def median_index(values: list[float]) -> int:
    """The index of the median of ``values`` (the lower one of an even count): the round a benchmark
    reports of several (``bench.comm``, ``bench.comm_hivemind``)."""
    return sorted(range(len(values)), key=lambda i: values[i])[(len(values) - 1) // 2]


def _median_round(rounds: list[dict]) -> dict:
    """A codec's result over its rounds: the round of median link efficiency in full, with the median
    over the rounds of ``cpu_s_per_mb`` and of each phase of ``cpu_breakdown_seconds`` (one round on
    shared cores varies), each round's ``link_efficiency`` and ``cpu_s_per_mb``
    (``*_by_round``), and ``identical_on_all_peers`` only if it held in every round."""
    out = dict(rounds[median_index([r["link_efficiency"] for r in rounds])])
    out.update(
        rounds=len(rounds),
        cpu_s_per_mb=round(statistics.median([r["cpu_s_per_mb"] for r in rounds]), 5),
        cpu_breakdown_seconds={k: round(statistics.median([r["cpu_breakdown_seconds"][k] for r in rounds]), 4)
                               for k in rounds[0]["cpu_breakdown_seconds"]},
        link_efficiency_by_round=[r["link_efficiency"] for r in rounds],
        group_formed_spread_s_by_round=[r["group_formed_spread_s"] for r in rounds],
        cpu_s_per_mb_by_round=[r["cpu_s_per_mb"] for r in rounds],
        identical_on_all_peers=all(r["identical_on_all_peers"] for r in rounds),
    )
    if all("link_idle_seconds" in r for r in rounds):
        out["link_idle_seconds_mean"] = {k: round(statistics.mean(r["link_idle_seconds"][k] for r in rounds), 3)
                                         for k in rounds[0]["link_idle_seconds"]}
    return out


HIVEMIND_ATTEMPTS = 2
"""Runs of hivemind's baseline before ``bench.comm`` gives up: its averager at times fails a round
(``MatchmakingException: Unable to run All-Reduce``), which
would otherwise throw away the whole run's measurements of ours. A retry runs in fresh namespaces;
``hivemind_8bit.attempts`` says how many it took."""


def _hivemind(args: argparse.Namespace) -> dict:
    """hivemind's averager on the same set-up and rate (:mod:`bench.comm_hivemind`), its 8-bit codec."""
    from bench import comm_hivemind

    hm = argparse.Namespace(peers=args.peers, mb=args.mb, rate_mbit=args.rate_mbit, codecs="8bit", timeout=args.timeout,
                            rounds=args.rounds)
    for attempt in range(1, HIVEMIND_ATTEMPTS):
        try:
            return comm_hivemind.run_bench(hm)["codecs"]["8bit"] | {"attempts": attempt}
        except RuntimeError as e:  # a peer exited non-zero (namespaced_peers), its log's tail in the message
            log.warning("hivemind's baseline failed (%s); running it again in fresh namespaces", str(e)[-300:])
    return comm_hivemind.run_bench(hm)["codecs"]["8bit"] | {"attempts": HIVEMIND_ATTEMPTS}


def run_bench(args: argparse.Namespace) -> dict:
    from peer.localnet.netns import netns_available

    why = netns_available()
    if why:
        return {"skipped": f"bench.comm {why}"}
    n, numel = args.peers, args.mb * 2**20 // 4
    rate = args.rate_mbit * 1e6 / 8
    codecs = args.codecs.split(",")
    per_codec, avgs = _round_at(args, args.rate_mbit, codecs)
    result: dict = {"peers": n, "module_mb": args.mb, "rate_mbit": args.rate_mbit, "warmup": args.warmup, "rounds": args.rounds,
                    "entropy": args.entropy, "codecs": per_codec}
    by_rate = {str(args.rate_mbit): {c: per_codec[c]["link_efficiency"] for c in codecs}}
    report_codecs = [c for c in args.report_codecs.split(",") if c]
    for other in (int(r) for r in args.report_rates.split(",") if r):
        if other != args.rate_mbit and report_codecs:
            at, _ = _round_at(args, other, report_codecs)
            by_rate[str(other)] = {c: at[c]["link_efficiency"] for c in report_codecs}
            result[f"codecs_{other}mbit"] = at
    result["link_efficiency_by_rate"] = by_rate
    result["cpu_s_per_mb"] = {c: per_codec[c]["cpu_s_per_mb"] for c in codecs}
    result["cpu_breakdown_seconds"] = {c: per_codec[c]["cpu_breakdown_seconds"] for c in codecs}
    if args.hivemind:
        hm = _hivemind(args)
        result["hivemind_8bit"] = hm
        result["cpu_s_per_mb"]["hivemind_8bit"] = hm["cpu_s_per_mb"]
        result["cpu_ratio_vs_hivemind"] = {c: round(per_codec[c]["cpu_s_per_mb"] / hm["cpu_s_per_mb"], 3)
                                           for c in codecs if c in ("int8", "int4")}
        result["link_efficiency_hivemind_8bit"] = hm["link_efficiency"]
    ceiling_codecs = [c for c in ("int8", "int4") if c in per_codec] if args.ceiling_rounds > 0 else []
    if ceiling_codecs:
        from peer.averaging.partition import segment_bounds

        # what bare TCP reaches on the same link with each codec's bytes in the same pattern, no CPU work at all
        result["tcp_ceiling"] = {c: tcp_ceiling.measure(n, args.rate_mbit, per_codec[c]["compressed_bytes"],
                                                        len(segment_bounds(numel)), rounds=args.ceiling_rounds)
                                 for c in ceiling_codecs}
        result["link_efficiency_vs_tcp_ceiling"] = {
            c: round(per_codec[c]["link_efficiency"] / result["tcp_ceiling"][c]["link_efficiency"], 3)
            for c in ceiling_codecs}
    if "int8" in per_codec:
        c = per_codec["int8"]
        fp32_optimal = 2 * (n - 1) / n * 4 * numel / rate
        ddp = H * 2 * (n - 1) / n * 4 * numel
        result.update(
            link_efficiency=c["link_efficiency"],
            speedup_vs_fp32_optimal=round(fp32_optimal / c["allreduce_seconds"], 3),
            bytes_ratio_vs_ddp=round(ddp / c["bytes_sent_per_peer"], 1),
            bytes_ratio_vs_ddp_wire=round(ddp / c["wire_tx_bytes_per_peer"], 1),
            replica_max_abs_diff=max(float((a - avgs[0]).abs().max()) for a in avgs),
        )
    return result


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.comm", description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mb", type=int, default=64, help="module size in MB of fp32 values")
    parser.add_argument("--rate-mbit", type=int, default=ISSUE_RATE_MBIT,
                        help=f"egress limit of every peer (default {ISSUE_RATE_MBIT}; others write comm_RATEmbit.json)")
    parser.add_argument("--codecs", default="int8,fp16,none,int4")
    parser.add_argument("--report-rates", default="50,25",
                        help="other rates (Mbit/s) whose link efficiency is reported too ('' for none)")
    parser.add_argument("--report-codecs", default="int8,int4", help="the codecs run at --report-rates")
    parser.add_argument("--no-hivemind", dest="hivemind", action="store_false",
                        help="skip hivemind's averager with its 8-bit codec on the same set-up (bench.comm_hivemind)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds per codec (default 3): the round of median link efficiency is reported, "
                             "with the median CPU over the rounds")
    parser.add_argument("--timeout", type=float, default=120.0, help="round_timeout of each average")
    parser.add_argument("--entropy", choices=ENTROPY_STAGES, default=OuterConfig().entropy,
                        help="lossless stage on the codec's bytes (default: the peers' default)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="time the first exchange too (its p2p connections are opened during it)")
    parser.add_argument("--no-lanes", dest="lanes", action="store_false",
                        help="carry every byte through the p2p daemons (no direct lanes, peer.network.lanes): "
                             "the control run of what the lanes save")
    parser.add_argument("--ceiling-rounds", type=int, default=5,
                        help="rounds of bare TCP moving int8's and int4's bytes in the all-reduce's pattern on the same link "
                             "(bench.tcp_ceiling: the link's own ceiling, key tcp_ceiling; 0 skips it)")
    parser.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--host", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--initial", nargs="*", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.peer is not None:
        run_peer(args)
        return
    # peer k's delta is drawn from seed k
    emit(rate_result_name("comm", args.rate_mbit), {**run_bench(args), "seeds": list(range(args.peers))})


if __name__ == "__main__":
    run_main(main)
