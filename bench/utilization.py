"""bench.utilization: share of wall time in inner compute on slow, far-apart links.

Four peers, each in its own network namespace behind one bridge (:mod:`peer.localnet.netns`, namespaces
``hpu<pid>-p0..3`` on 10.85.0.0/24), egress shaped to 50 Mbit/s by ``tbf``, about 40 ms round trip added by
:mod:`bench.delay_relay` (each peer's p2p daemon listens on 127.0.0.1 inside its namespace; a relay in
the same namespace is the announced, and only, way in, holding every byte 20 ms in each direction).
Every variant starts four fresh peer processes (a real DHT and p2p daemon each, bootstrapped from the
first) that train the same path of the ``demo`` lattice (``--preset``) from the same initialisation,
each on its own random windows of the built-in corpus, for ``--steps`` inner steps of ``--batch``
sequences (DiLoCo variants: ``--steps // H`` rounds on every peer; the fastest member paces each round,
so a slower one ends it early with fewer tokens, as in a real run, and ``inner_steps_per_peer`` says how
many steps each took on average; after each round a peer does what ``peer join`` does, re-syncs a module
whose round it missed and announces each module's round and state digest,
:func:`peer.diloco.resync_after_round`):

- ``ddp``: every-step gradient averaging, synchronous data-parallel over the same transport
  (:class:`peer.averaging.net_averager.NetAverager`, codec ``none``, one bucket holding every gradient; after a
  round with fewer than every peer, a peer waits for the others' holder records to reach its step,
  so the group stays in lock-step as DDP does instead of racing ahead alone);
- ``h10``, ``h15``, ``h18``, ``h20``, ``h100``: hivepath, :class:`peer.diloco.DiLoCoOptimizer` with
  H = 10 / 15 / 18 / 20 / 100, codec ``--codec`` (int8);
- ``h10_overlap``, ...: the same with ``OuterConfig.overlap`` (Streaming DiLoCo). As in a real peer
  (``DiLoCoOptimizer(train_through_waits=True)``), a peer whose last exchange is still in flight at the
  end of a round's steps goes on stepping until it returns (at most H more steps) instead of waiting
  idle, so these variants take more inner steps in the same rounds (``inner_steps_per_peer``).

By default only the headline pair :data:`HEADLINE` runs (``--variants`` picks others): H = 18 on the
demo preset is the longest horizon where one exchange without overlap still costs a large share of a
round (``comm_share_without_overlap``; ``--variants`` runs the shorter horizons to compare).

Keys (``bench/results/utilization.json``), per variant under ``variants``: ``utilization`` (wall time
not spent blocked on the network, over wall time: ``1 - wait / wall``, wait from
``RoundReport.wait_seconds`` plus the time in :func:`peer.diloco.resync_after_round`, or the gradient
all-reduce time for ``ddp``; mean over peers, the final
overlap flush excluded and reported as ``utilization_with_drain``), ``val_loss`` (mean cross-entropy of
the final global model on fixed validation windows), ``val_bpb`` (its bits per byte on the first 32
validation documents of the path), ``bytes_sent_per_peer`` (payload) and ``wire_tx_bytes_per_peer``
(eth0), ``dht_requests_per_round`` (per peer and round, the requests its DHT sent for coalesced
batches by kind, :func:`peer.network.coalescing.request_counts`: ``find_requests`` for latest reads,
``store_requests`` for stores, ``hivemind_*_batches`` for batches that went through hivemind's search;
None with hivemind's DHT as it is). Headline keys from :data:`HEADLINE`: ``comm_share_without_overlap`` (``1 - utilization`` without
overlap), ``utilization_no_overlap``, ``utilization_overlap`` (target >= 0.95) and
``utilization_overlap_bpb_delta`` (``val_bpb`` with overlap minus without, after the same rounds:
the cost of the steps taken on the old global copy while each exchange was in flight, net of the
extra steps trained through waits). All measured; nothing projected.

Run as root: ``python -m bench.utilization`` (``--steps``, ``--preset``, ``--codec``, ``--variants``).
Without root it prints a ``{"skipped": ...}`` line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench.common import emit, run_main
from peer.localnet.netns import tx_bytes
from peer.network.coalescing import request_counts
from models import strict_json
from models.durable import atomic_write_text

MEASURES = (
    "bench/utilization.py",
    "bench/delay_relay.py",
    "models",
    "peer",
    "protos",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

log = logging.getLogger("bench.utilization")

P2P_PORT = 40000
RELAY_PORT = 40001
VARIANTS = {"ddp": (1, False), "h10": (10, False), "h10_overlap": (10, True), "h15": (15, False),
            "h15_overlap": (15, True), "h18": (18, False), "h18_overlap": (18, True), "h20": (20, False),
            "h20_overlap": (20, True), "h100": (100, False), "h100_overlap": (100, True), "sparse": (16, False),
            "sparse_plain_dht": (16, False)}
"""name -> (H, overlap); ddp averages gradients every step instead of DiLoCo pseudo-gradients."""
VARIANT_CODECS = {"ddp": "none", "sparse": "topk16b2", "sparse_plain_dht": "topk16b2"}
"""A variant's own codec where it is not ``--codec``: ``sparse`` is the point of ``bench.quality`` that
met its bytes goal (H = 16, top-k of a sixteenth with 2-bit values, error feedback), which
:mod:`bench.wire` measures on the wire."""

PLAIN_DHT = frozenset({"sparse_plain_dht"})
"""Variants whose peers run hivemind's DHT as it is, one search per key (``DHTOptions.coalesce``
off): ``bench.wire``'s control run for the DHT's coalesced requests."""
HEADLINE = ("h18", "h18_overlap")
"""The pair the headline keys come from: without / with overlap, at an H where an exchange costs
a large share of a round on the demo preset (``comm_share_without_overlap`` measures it)."""
SUBNET, PREFIX = "10.85.0", "hpu"
"""This bench's namespaces (chaos uses hpc/10.78.0, bench.nat hpn/10.81.0, bench.data_fetch hpd/10.83.0)."""
PATH = (0, 0)
EVAL_BATCHES = 16
BPB_DOCUMENTS = 32


def _wait_holders(dht, run_id: str, module_id: str, count: int, barrier_timeout: float, min_round: int = 0) -> bool:
    """Wait until ``count`` holders of ``module_id`` announce a round >= ``min_round``; False on timeout."""
    from peer.network import HolderRecord, holders_key, read_records

    deadline = time.monotonic() + barrier_timeout
    while True:
        holders = read_records(dht.dht, holders_key(run_id, module_id), HolderRecord)
        if sum(1 for h in holders.values() if h.round_no >= min_round) >= count:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def run_variant(name: str, args: argparse.Namespace, dht, dataset, cfg) -> dict:
    """Train one variant on this peer; returns its timings, bytes and (peer 0) validation loss."""
    import torch

    from models.config import OuterConfig
    from models.lattice import ModularLM
    from peer.averaging import NetAverager
    from peer.compression import get_codec
    from peer.diloco import DiLoCoOptimizer, install_resync, resync_after_round

    h, overlap = VARIANTS[name]
    codec = VARIANT_CODECS.get(name, args.codec)
    run_id = f"util-{name.replace('_', '-')}"
    mids = cfg.lattice.path_modules(PATH)
    model = ModularLM(cfg.lattice, seed=0, module_ids=mids).path_model(PATH)
    trained: dict = {}  # "opt": the DiLoCo optimizer, once made (the state our averager serves)
    avg = NetAverager(dht, run_id, cfg.content_hash(), bandwidth=args.rate_mbit * 1e6 / 8,
                      state_provider=lambda mid: trained["opt"].module_state(mid) if "opt" in trained else None)

    def fetch(mid: str, like: list, accept=None, min_round: int = -1):
        """A module's state from a live holder, for a re-sync after a missed round (as ``peer join``)."""
        try:
            return avg.fetch_state(mid, timeout=args.round_timeout, like=like, accept=accept, min_round=min_round)
        except Exception as e:
            log.info("no live holder sent %s (%s)", mid, e)
            return None
    batches = dataset.path_batches(PATH, "train", args.batch, cfg.lattice.seq_len, seed=1000 + args.peer)
    wait = drain = sent = received = 0.0
    failed = rounds = 0
    steps_done = 0
    reasons: list[str] = []
    groups: list[int] = []  # members of every exchange we took part in
    try:
        keys = ["embed"] if name == "ddp" else mids
        for mid in keys:
            avg.hold(mid, 0)
        if not _wait_holders(dht, run_id, keys[0], args.peers, 180.0):
            raise TimeoutError(f"not every peer of {run_id} appeared within 180s")
        idle_tx = idle_s = 0.0
        if args.idle_seconds > 0:  # a measurement window: what holding the modules costs with no round running
            i0, s0 = tx_bytes(), time.perf_counter()
            time.sleep(args.idle_seconds)
            idle_tx, idle_s = tx_bytes() - i0, time.perf_counter() - s0
        tx0, t0, dht0 = tx_bytes(), time.perf_counter(), request_counts(dht.dht)
        if name == "ddp":
            params = [p for p in model.parameters()]
            exact = get_codec("none")  # DDP's fp32 gradients
            for p in params:
                p.grad = torch.zeros_like(p)  # every gradient is in the bucket, even one a step left untouched
            inner = torch.optim.AdamW(params, lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2),
                                      weight_decay=cfg.inner.weight_decay)
            for step in range(args.steps):
                x, y = next(batches)  # (B, T), (B, T)
                model(x, y)[1].backward()
                w0 = time.perf_counter()
                if groups and groups[-1] < args.peers:  # lock-step again after a short round, as DDP is
                    _wait_holders(dht, run_id, "embed", args.peers, args.round_timeout, min_round=step)
                res = avg.average("embed", step, [p.grad for p in params], float(y.numel()), exact, args.round_timeout)
                wait += time.perf_counter() - w0
                sent, received, rounds = sent + res.bytes_sent, received + res.bytes_received, rounds + 1
                groups.append(res.group_size)
                if res.ok:
                    for p, g in zip(params, res.averaged):
                        p.grad.copy_(g)
                else:
                    failed += 1
                    reasons.append(f"step {step}: {res.reason}")
                if cfg.inner.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
                for group in inner.param_groups:
                    group["lr"] = cfg.inner.lr * min(1.0, (step + 1) / max(1, cfg.inner.warmup_steps))
                inner.step()
                inner.zero_grad(set_to_none=False)
            wall = time.perf_counter() - t0
            steps_done = args.steps
            state = [p.detach().clone() for p in params]
        else:
            outer = OuterConfig(inner_steps=h, codec=codec, overlap=overlap, round_timeout=args.round_timeout,
                                max_group_size=args.max_group_size)
            opt = trained["opt"] = DiLoCoOptimizer(model.modules_by_id(), inner=cfg.inner, outer=outer,
                                                   lattice=cfg.lattice, averager=avg)
            install_resync(opt, fetch)  # what a real peer does after a missed round (peer.node.trainer)
            reports = []
            after_rounds = 0.0  # seconds in resync_after_round
            # the same rounds on every peer: the fastest member paces a round (a slower one ends it
            # early, with fewer tokens), so a fixed step count would leave slower peers extra rounds
            # without the others, and their replicas would differ at the end
            while opt.round < args.steps // h:
                x, y = next(batches)  # (B, T), (B, T)
                model(x, y)[1].backward()
                report = opt.step(tokens=float(y.numel()))
                opt.zero_grad()
                steps_done += 1
                if report is not None:
                    reports.append(report)
                    a0 = time.perf_counter()
                    resync_after_round(opt, report, avg, fetch)
                    after_rounds += time.perf_counter() - a0
            wall = time.perf_counter() - t0
            d0 = time.perf_counter()
            last = opt.flush()
            drain = time.perf_counter() - d0
            opt.close()
            # blocked on the network: each round's wait for its exchange, and the after-round work
            # (re-syncs, announcements) that does not compute either
            wait = sum(r.wait_seconds for r in reports) + after_rounds
            log.info("%s: waits per round %s; after rounds %.2fs in all", name,
                     " ".join(f"{r.wait_seconds:.2f}" for r in reports), after_rounds)
            reports += [last] if last is not None else []
            mods = [m for r in reports for m in r.modules.values()]
            sent, received = sum(m.bytes_sent for m in mods), sum(m.bytes_received for m in mods)
            rounds, failed = len(reports), sum(1 for r in reports if not r.applied)
            reasons = [f"{m.module_id} round {m.round_no}: {m.reason}" for m in mods if not m.applied]
            groups = [m.group_size for m in mods]
            state = [t for mid in mids for t in opt.module_state(mid).global_params]
            with torch.no_grad():  # evaluate the group's global model, identical on every member
                for p, g in zip([p for mid in mids for p in model.modules_by_id()[mid].parameters()], state):
                    p.copy_(g)
        wire = tx_bytes() - tx0
        dht1 = request_counts(dht.dht)
        dht_requests = {k: v - dht0.get(k, 0) for k, v in dht1.items()} if dht1 else None
        if args.out:  # the final state, for the replicas' largest difference (_replica_max_abs_diff)
            torch.save([t.detach().cpu() for t in state], Path(args.out) / f"state{args.peer}.pt")
    finally:
        avg.shutdown()
    out = dict(wall_seconds=wall, wait_seconds=wait, drain_seconds=drain, bytes_sent=sent, bytes_received=received,
               wire_tx_bytes=wire, idle_tx_bytes=idle_tx, idle_seconds=idle_s, inner_steps_done=steps_done, rounds=rounds, failed_rounds=failed, failures=reasons[:5],
               mean_group_size=sum(groups) / max(1, len(groups)), dht_requests=dht_requests)
    if args.peer == 0:
        out["val_loss"] = evaluate(model, dataset, args.batch, cfg.lattice.seq_len)
        out["val_bpb"] = validation_bpb(model, dataset, cfg.lattice.seq_len)
    log.info("%s: wall %.1fs, waited %.1fs, %d rounds (%d failed)", name, wall, wait, rounds, failed)
    return out


def evaluate(model, dataset, batch: int, seq_len: int) -> float:
    """Mean cross-entropy over fixed validation windows (the same on every variant)."""
    import torch

    batches = dataset.path_batches(PATH, "validation", batch, seq_len, seed=4242)
    with torch.no_grad():
        return sum(float(model(*next(batches))[1]) for _ in range(EVAL_BATCHES)) / EVAL_BATCHES


def validation_bpb(model, dataset, seq_len: int) -> float:
    """Bits per byte of ``model`` on the first :data:`BPB_DOCUMENTS` validation documents of the path."""
    from models.evaluate import bits_per_byte

    return bits_per_byte(model, dataset.validation_documents(PATH), seq_len, "cpu", max_documents=BPB_DOCUMENTS).bpb


def run_peer(args: argparse.Namespace) -> None:
    """One peer inside its namespace: every variant in turn, each under its own run id."""
    import torch

    from models.data import Dataset
    from models.presets import PRESETS
    from peer.network import DHTOptions, start_dht

    torch.set_num_threads(1)
    torch.manual_seed(args.peer)
    out = Path(args.out)
    cfg = PRESETS[args.preset]()
    dataset = Dataset(args.data)
    announce = f"/ip4/{args.host}/tcp/{RELAY_PORT}"
    dht = start_dht(DHTOptions(host_maddrs=[f"/ip4/127.0.0.1/tcp/{P2P_PORT}"], announce_maddrs=[announce],
                               initial_peers=args.initial or [],
                               coalesce=not any(v in PLAIN_DHT for v in args.variants.split(","))))
    if args.peer == 0:
        atomic_write_text(out / "maddr", f"{announce}/p2p/{dht.peer_id}", temp_name="maddr.tmp")
    results: dict = {}
    try:
        for name in args.variants.split(","):
            results[name] = run_variant(name, args, dht, dataset, cfg)
            atomic_write_text(out / f"peer{args.peer}.json", strict_json.dumps(results), temp_name=f"peer{args.peer}.tmp")
    finally:
        dht.shutdown()


def _wait_file(path: Path, procs: list, wait_timeout: float) -> None:
    deadline = time.monotonic() + wait_timeout
    while not path.exists():
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited before {path.name} appeared")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} after {wait_timeout:.0f}s")
        time.sleep(0.1)


def _summarize(peers: list[dict], relays: list[dict], names: list[str], codec: str, diffs: dict[str, float]) -> dict:
    """The variants' figures from each peer's results (``peers[i][name]``), the relays' stats and each
    variant's :func:`_replica_max_abs_diff` (``diffs``)."""
    variants = {}
    for name in names:
        runs = [p[name] for p in peers]
        util = [1 - r["wait_seconds"] / r["wall_seconds"] for r in runs]
        with_drain = [1 - (r["wait_seconds"] + r["drain_seconds"]) / (r["wall_seconds"] + r["drain_seconds"]) for r in runs]
        variants[name] = dict(
            inner_steps=VARIANTS[name][0], overlap=VARIANTS[name][1], codec=VARIANT_CODECS.get(name, codec),
            utilization=round(sum(util) / len(util), 4), utilization_min=round(min(util), 4),
            utilization_with_drain=round(sum(with_drain) / len(with_drain), 4),
            wall_seconds=round(max(r["wall_seconds"] for r in runs), 2),
            wait_seconds_mean=round(sum(r["wait_seconds"] for r in runs) / len(runs), 2),
            inner_steps_per_peer=round(sum(r["inner_steps_done"] for r in runs) / len(runs), 1),
            val_loss=round(runs[0]["val_loss"], 4), val_bpb=round(runs[0]["val_bpb"], 4),
            bytes_sent_per_peer=round(sum(r["bytes_sent"] for r in runs) / len(runs)),
            wire_tx_bytes_per_peer=round(sum(r["wire_tx_bytes"] for r in runs) / len(runs)),
            idle_tx_bytes_per_peer_s=(round(sum(r["idle_tx_bytes"] / r["idle_seconds"] for r in runs) / len(runs), 1)
                                      if all(r.get("idle_seconds") for r in runs) else None),
            rounds=runs[0]["rounds"], failed_rounds=max(r["failed_rounds"] for r in runs),
            replicas_identical=diffs[name] == 0.0,
            replica_max_abs_diff=diffs[name],
            mean_group_size=round(sum(r["mean_group_size"] for r in runs) / len(runs), 2),
            failures=sorted({f for r in runs for f in r["failures"]})[:5],
            dht_requests_per_round=_requests_per_round(runs),
        )
    relayed = sum(s["bytes_to_target"] + s["bytes_to_client"] for r in relays for s in r.values())
    return dict(variants=variants, relay_bytes_total=relayed)


def _requests_per_round(runs: list[dict]) -> Optional[dict]:
    """Each kind of coalesced DHT request per peer and round, the mean over peers; None when a peer ran
    hivemind's DHT as it is (nothing counted)."""
    if any(not r.get("dht_requests") for r in runs):
        return None
    kinds = sorted({k for r in runs for k in r["dht_requests"]})
    return {k: round(sum(r["dht_requests"].get(k, 0) / max(1, r["rounds"]) for r in runs) / len(runs), 1)
            for k in kinds}


def _stop(procs: list) -> None:
    """SIGTERM each process group, SIGKILL what is left after 10 s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 15)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()


def _run_variant_swarm(net, name: str, out: Path, args: argparse.Namespace, data: Path,
                       env: dict) -> tuple[list[dict], float]:
    """Start one peer per namespace for variant ``name`` (the first one bootstraps the rest); their
    results and the largest difference between their final states (:func:`_replica_max_abs_diff`)."""
    out.mkdir(parents=True)
    n, procs = args.peers, []
    logs = [open(out / f"peer{i}.log", "wb") for i in range(n)]
    base = [sys.executable, "-m", "bench.utilization", "--out", str(out), "--data", str(data), "--peers", str(n),
            "--preset", args.preset, "--steps", str(args.steps), "--batch", str(args.batch),
            "--rate-mbit", str(args.rate_mbit), "--variants", name, "--codec", args.codec, "--round-timeout", str(args.round_timeout),
            "--idle-seconds", str(args.idle_seconds), "--max-group-size", str(args.max_group_size)]
    try:
        procs.append(net.popen(0, [*base, "--peer", "0", "--host", net.address(0)], env=env,
                               stdout=logs[0], stderr=subprocess.STDOUT))
        _wait_file(out / "maddr", procs, 120)
        maddr = (out / "maddr").read_text()
        for i in range(1, n):
            procs.append(net.popen(i, [*base, "--peer", str(i), "--host", net.address(i), "--initial", maddr],
                                   env=env, stdout=logs[i], stderr=subprocess.STDOUT))
        for i, p in enumerate(procs):
            p.wait(timeout=args.peer_timeout)
            if p.returncode != 0:
                raise RuntimeError(f"{name} peer {i} exited {p.returncode}:\n{(out / f'peer{i}.log').read_text()[-3000:]}")
        log.info("%s done", name)
        results = [json.loads((out / f"peer{i}.json").read_text())[name] for i in range(n)]
        return results, _replica_max_abs_diff([out / f"state{i}.pt" for i in range(n)])
    finally:
        _stop(procs)
        for f in logs:
            f.close()


def _replica_max_abs_diff(files: list[Path]) -> float:
    """The largest absolute difference of any value of the peers' final states from peer 0's."""
    import torch

    states = [torch.load(f) for f in files]
    return max((float((a.double() - b.double()).abs().max()) for s in states[1:] for a, b in zip(states[0], s)
                if a.numel()), default=0.0)


def run_bench(args: argparse.Namespace) -> dict:
    from peer.localnet.netns import NetnsBridge, netns_available

    why = netns_available()
    if why:
        return {"skipped": f"bench.utilization {why}"}
    from models.presets import PRESETS
    from peer.node import ensure_dataset

    cfg = PRESETS[args.preset]()
    data = ensure_dataset(cfg, None, Path(args.work_dir), "").dir
    names = args.variants.split(",")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor"}
    n = args.peers
    peers: list[dict] = [{} for _ in range(n)]
    diffs: dict[str, float] = {}  # variant -> the largest difference between its peers' final states
    with tempfile.TemporaryDirectory(prefix="hivepath-util-") as tmp, \
            NetnsBridge(n, rate=f"{args.rate_mbit}mbit", subnet=SUBNET, prefix=PREFIX) as net:
        out = Path(tmp)
        relays = []
        logs = [open(out / f"relay{i}.log", "wb") for i in range(n)]
        try:
            for i in range(n):
                cmd = [sys.executable, "-m", "bench.delay_relay", "--delay-ms", str(args.rtt_ms / 2),
                       "--map", f"{net.address(i)}:{RELAY_PORT}=127.0.0.1:{P2P_PORT}", "--stats", str(out / f"relay{i}.json")]
                relays.append(net.popen(i, cmd, env=env, stdout=logs[i], stderr=subprocess.STDOUT))
            for i in range(n):
                _wait_file(out / f"relay{i}.json", relays, 60)
            for name in names:  # fresh peers (DHT, p2p daemon) for every variant
                results, diffs[name] = _run_variant_swarm(net, name, out / name, args, data, env)
                for i, res in enumerate(results):
                    peers[i][name] = res
        finally:
            _stop(relays)
            for f in logs:
                f.close()
            if args.logs:
                for f in out.glob("**/*.log"):
                    dest = Path(args.logs) / f.relative_to(out)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(f, dest)
        relay_stats = [json.loads((out / f"relay{i}.json").read_text()) for i in range(n)]
    summary = _summarize(peers, relay_stats, names, args.codec, diffs)
    wire = sum(v["wire_tx_bytes_per_peer"] for v in summary["variants"].values()) * n
    result = dict(peers=n, preset=args.preset, codec=args.codec, steps=args.steps, batch=args.batch,
                  tokens_per_peer=args.steps * args.batch * cfg.lattice.seq_len, rate_mbit=args.rate_mbit,
                  rtt_ms=args.rtt_ms, path_params=cfg.lattice.path_param_count(PATH),
                  relay_share_of_wire_bytes=round(summary["relay_bytes_total"] / wire, 3) if wire > 0 else None,
                  **summary)
    v = summary["variants"]
    if all(name in v for name in HEADLINE):
        off, on = v[HEADLINE[0]], v[HEADLINE[1]]
        result.update(headline_inner_steps=off["inner_steps"], comm_share_without_overlap=round(1 - off["utilization"], 4),
                      utilization_no_overlap=off["utilization"], utilization_overlap=on["utilization"],
                      utilization_overlap_bpb_delta=round(on["val_bpb"] - off["val_bpb"], 4))
    for name, v in summary["variants"].items():
        result[f"utilization_{name}"] = v["utilization"]
    return result


def parser(prog: str = "python -m bench.utilization", description: str = __doc__.split("\n")[0]) -> argparse.ArgumentParser:
    """The options of a run (:mod:`bench.wire` runs the same harness with its own defaults)."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--preset", default="demo", help="model size (models.presets.PRESETS)")
    ap.add_argument("--codec", default="int8", help="pseudo-gradient codec of the DiLoCo variants")
    ap.add_argument("--steps", type=int, default=252,
                    help="inner steps per peer (DiLoCo variants: steps // H rounds, paced by the fastest peer)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per inner step")
    ap.add_argument("--rate-mbit", type=int, default=50, help="egress limit of every peer")
    ap.add_argument("--rtt-ms", type=float, default=40.0, help="round trip added by the delay relays")
    ap.add_argument("--variants", default=",".join(HEADLINE))
    ap.add_argument("--round-timeout", type=float, default=30.0)
    ap.add_argument("--max-group-size", type=int, default=0,
                    help="the DiLoCo variants' [outer] max_group_size: split rounds of more holders (0: one group)")
    ap.add_argument("--idle-seconds", type=float, default=0.0,
                    help="before training, measure for this long what the link sends with the modules held and no round")
    ap.add_argument("--peer-timeout", type=float, default=1200.0, help="seconds a peer may take for one variant")
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "hivepath-bench-data"))
    ap.add_argument("--logs", default=None, help="copy every peer's and relay's log into this folder")
    ap.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--host", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--initial", nargs="*", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: Optional[list[str]] = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.peer is not None:
        run_peer(args)
        return
    # the model from seed 0, peer k's batches from 1000 + k and its torch state from k, validation from 4242
    emit("utilization", {**run_bench(args), "seeds": sorted({0, 4242, *range(args.peers), *(1000 + k for k in range(args.peers))})})


if __name__ == "__main__":
    run_main(main)
