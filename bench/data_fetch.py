"""Benchmark ``bench.data_fetch``: volunteers fetch their path's shards from seeders.

Real processes in network namespaces (``peer.localnet.netns``, prefix ``hpd``, subnet ``10.83.0``): seeder A
in namespace 0, seeder B in 1, fetchers in 2-4; every namespace's egress is shaped to ``--rate``
(default 50 Mbit/s). The dataset is a 1x1 lattice (one path) prepared from a generated corpus big
enough that the path's training shard is at least ``--shard-mb`` (default 100) MB; it is prepared
once and kept in ``--cache`` between runs. Seeders are ``hivepath data serve``, fetchers
``hivepath data fetch --progress json`` (their JSON lines carry the fetcher's clock).

1. One seeder (A), three fetchers at once, each fetching the path (router and train and validation
   shards). ``fetch_link_efficiency``: payload bytes verified per second, summed over the fetchers
   from the first byte to the last, over the seeder's uplink rate (target >= 0.8).
2. Fetcher 2 with a downlink of twice ``--rate`` (tbf on the bridge side of its link), seeders with
   ``--rate`` uplinks: the path fetched from A alone, then from A and B into a fresh directory.
   ``two_seeder_speedup``: payload rate with two seeders over the rate with one (target >= 1.7).
3. A run on a corpus the peer does not have: the coordinator in namespace 0, seeders A and B up, one
   ``hivepath peer join`` with an empty work directory in namespace 3. ``time_to_first_step_s``: from
   starting the command to its first progress line with an inner step done (report).
4. ``verified_share``: bytes of every fetched file (all fetchers, and the peer's) whose sha256
   matches the manifest, over all bytes fetched (1.0).

Namespaces and processes are removed at the end, also on Ctrl-C, SIGTERM or SIGHUP
(:func:`bench.common.run_main`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from models import strict_json
from bench.common import emit, run_main, work_directory

MEASURES = (
    "bench/data_fetch.py",
    "models",
    "peer",
    "coordinator",
    "hivepath",
    "protos",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

log = logging.getLogger("bench.data_fetch")

PREFIX, SUBNET = "hpd", "10.83.0"
"""Namespace names and addresses of this benchmark (distinct from every other benchmark's and test's)."""
TOKEN = "bench-data-fetch-token"
_WORDS = ("the of and to in is that for it as with was on be by at this from or which an are not have but had "
          "all were when we there can been one has more if their will would so no out up into them some could "
          "time these two may then do first any my now such like our over man me even most made after also did "
          "many before must through back years where much your way well down should because each just those "
          "people how too little state good very make world still own see men work long get here between both "
          "life being under never day same another know while last might us great old year off come since "
          "against go came right used take three").split()


def _corpus(path: Path, text_bytes: int, seed: int = 0) -> Path:
    """A JSON-lines corpus of about ``text_bytes`` bytes of generated documents (deterministic)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(path, "w") as f:
        n = 0
        while written < text_bytes:
            words = rng.choices(_WORDS, k=rng.randint(200, 600))
            text = f"document {n}: " + " ".join(words) + "."
            line = strict_json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
            n += 1
    return path


def dataset(cache: Path, shard_mb: int):
    """The 1x1 dataset whose training shard holds at least ``shard_mb`` MB (prepared once, cached)."""
    from models.corpus import corpus_from_paths
    from models.data import prepare, prepared

    def make(out: Path) -> None:
        # bytes tokenizer: 2 bytes of shard per byte of text; 90% of documents train
        src = _corpus(cache / f"corpus-{shard_mb}mb" / "docs.jsonl", int(shard_mb * 1e6 / 2 / 0.88))
        started = time.monotonic()
        prepare(corpus_from_paths([str(src.parent)]), out, levels=1, modules=1, tokenizer="bytes")
        log.info("prepared %s in %.0fs", out, time.monotonic() - started)

    return prepared(cache / f"ds-{shard_mb}mb", make=make)


def _maddr(procs: Any, name: str, timeout: float = 120.0) -> str:
    from peer.localnet import wait_for

    line = wait_for(lambda: next((l for l in procs.log(name).splitlines() if l.startswith("/ip4/10.")), None),
                    timeout, f"{name} to print its multiaddr")
    return line.strip()


def _rate(events: list[dict]) -> tuple[float, float, float, int]:
    """``(first byte time, last byte time, payload bytes between, total fetched)`` of one fetch's JSON lines."""
    prog = [e for e in events if e.get("event") == "progress" and e.get("fetched_bytes", 0) > 0]
    if len(prog) < 2:
        raise RuntimeError("a fetch printed fewer than two progress lines with bytes")
    first, last = prog[0], prog[-1]
    return first["time"], last["time"], last["fetched_bytes"] - first["fetched_bytes"], last["fetched_bytes"]


def _fetch_cmd(manifest_hash: str, out: Path, host: str, peers: list[str]) -> list[str]:
    from peer.localnet import hivepath_cmd

    return hivepath_cmd("data", "fetch", "--manifest-hash", manifest_hash, "--path", "0", "--out", str(out),
                        "--progress", "json", "--timeout", "120", "--host-maddrs", f"/ip4/{host}/tcp/0",
                        "--initial-peers", *peers)


def _run_fetches(bridge: Any, procs: Any, names: dict[str, int], manifest_hash: str, work: Path,
                 peers: list[str], timeout: float) -> dict[str, dict]:
    """Start one fetch per ``name -> participant`` at once; wait for all; their rates."""
    from peer.localnet import wait_for

    started = {}
    for name, i in names.items():
        cmd = _fetch_cmd(manifest_hash, work / name, bridge.address(i), peers)
        started[name] = procs.start(name, ["ip", "netns", "exec", bridge.where(i), *cmd])
    wait_for(lambda: all(p.poll() is not None for p in started.values()), timeout, "the fetches to finish", 0.2)
    out = {}
    for name, p in started.items():
        if p.returncode != 0:
            raise RuntimeError(f"{name} exited {p.returncode}: {procs.log(name)[-2000:]}")
        t0, t1, payload, total = _rate(procs.json_lines(name))
        out[name] = {"t0": t0, "t1": t1, "payload": payload, "fetched": total, "dir": work / name}
    return out


def _verified(directory: Path, manifest: dict) -> tuple[int, int]:
    """``(bytes matching the manifest's sha256, bytes)`` of the data files in ``directory``."""
    good = total = 0
    for name, digest in manifest["files"].items():
        p = directory / name
        if not p.is_file():
            continue
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        size = p.stat().st_size
        total += size
        good += size if h.hexdigest() == digest else 0
    return good, total


def _shape_downlink(bridge: Any, i: int, rate: str) -> None:
    """Shape what participant ``i`` receives: tbf on the bridge side of its link."""
    subprocess.run(["ip", "netns", "exec", bridge.switch, "tc", "qdisc", "replace", "dev", f"{PREFIX}s{i}", "root",
                    "tbf", "rate", rate, "burst", bridge.burst, "limit", bridge.limit], check=True, capture_output=True)


def _first_step(procs: Any, name: str) -> Optional[float]:
    for e in procs.json_lines(name):
        if e.get("event") == "progress" and (e.get("step") or 0) >= 1:
            return e["time"]
    return None


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from models.presets import tiny_cpu
    from peer.localnet import LocalNetwork, NetnsBridge, ProcessGroup, hivepath_cmd, wait_for

    ds = dataset(Path(args.cache), args.shard_mb)
    manifest = ds.manifest
    shard = manifest["chunks"]["shards/0.train.tokens"]["size"]
    path_bytes = sum(manifest["chunks"][f]["size"] for f in manifest["chunks"])
    rate_bps = args.rate_mbit * 1e6 / 8
    out: dict[str, Any] = {"rate_mbit": args.rate_mbit, "train_shard_bytes": shard, "path_bytes": path_bytes,
                           "manifest_hash": ds.manifest_hash, "chunk_size": manifest["chunk_size"],
                           "targets": {"fetch_link_efficiency": 0.8, "two_seeder_speedup": 1.7, "verified_share": 1.0}}
    procs = ProcessGroup(work / "logs")
    bridge = NetnsBridge(5, rate=f"{args.rate_mbit}mbit", subnet=SUBNET, prefix=PREFIX)
    verified_dirs: list[Path] = []
    try:
        bridge.open()
        serve = lambda i, *extra: ["ip", "netns", "exec", bridge.where(i), *hivepath_cmd(
            "data", "serve", str(ds.dir), "--host-maddrs", f"/ip4/{bridge.address(i)}/tcp/0", *extra)]
        procs.start("seeder_a", serve(0))
        a = _maddr(procs, "seeder_a")

        # 1. one seeder, three fetchers at once
        fetches = _run_fetches(bridge, procs, {"fetch2": 2, "fetch3": 3, "fetch4": 4}, ds.manifest_hash,
                               work / "eff", [a], args.timeout)
        t0 = min(f["t0"] for f in fetches.values())
        t1 = max(f["t1"] for f in fetches.values())
        payload = sum(f["payload"] for f in fetches.values())
        out["three_fetchers_seconds"] = round(t1 - t0, 2)
        out["three_fetchers_payload_bytes"] = payload
        out["fetch_link_efficiency"] = round(payload / (t1 - t0) / rate_bps, 4)
        out["per_fetcher_rate_mbit"] = {n: round(f["payload"] / (f["t1"] - f["t0"]) * 8e-6, 2)
                                        for n, f in fetches.items()}
        verified_dirs += [f["dir"] for f in fetches.values()]

        # 2. a fetcher with twice the downlink: one seeder, then two
        _shape_downlink(bridge, 2, f"{2 * args.rate_mbit}mbit")
        one = _run_fetches(bridge, procs, {"one_seeder": 2}, ds.manifest_hash, work / "one", [a], args.timeout)
        procs.start("seeder_b", serve(1, "--initial-peers", a))
        b = _maddr(procs, "seeder_b")
        wait_for(lambda: _seeders_seen(bridge, ds.manifest_hash, a) >= 2, 120, "both seeders on the DHT", 1.0)
        two = _run_fetches(bridge, procs, {"two_seeders": 2}, ds.manifest_hash, work / "two", [a, b], args.timeout)
        r1 = one["one_seeder"]["payload"] / (one["one_seeder"]["t1"] - one["one_seeder"]["t0"])
        r2 = two["two_seeders"]["payload"] / (two["two_seeders"]["t1"] - two["two_seeders"]["t0"])
        out["one_seeder_rate_mbit"] = round(r1 * 8e-6, 2)
        out["two_seeder_rate_mbit"] = round(r2 * 8e-6, 2)
        out["two_seeder_speedup"] = round(r2 / r1, 3)
        verified_dirs += [work / "one", work / "two"]

        # 3. join to first step: a peer with no data on a run whose corpus it does not have
        cfg = tiny_cpu().replace(run_id="datafetch", lattice={"levels": 1, "modules_per_level": 1},
                                 data={"manifest_hash": ds.manifest_hash, "corpus": str(work / "not-here")})
        net = LocalNetwork(procs, work / "net", ds.dir, cfg, env={"HIVEPATH_PROGRESS_INTERVAL": "0.5"},
                           peer_flags=["--measure-seconds", "0.5", "--upload-mbps", str(args.rate_mbit)], bridge=bridge)
        net.start_coordinator()
        started = time.time()
        net.start_peer("peer", "--initial-peers", a, b, data=False, index=3)
        first = wait_for(lambda: _first_step(procs, "peer"), args.timeout, "the peer's first step", 0.2)
        out["time_to_first_step_s"] = round(first - started, 1)
        fetch_lines = [e for e in procs.json_lines("peer") if e.get("event") == "fetch"]
        if fetch_lines:
            out["peer_fetch_seconds"] = round(fetch_lines[-1]["time"] - started, 1)
        peer_dir = work / "net" / "peer" / f"data-{ds.manifest_hash}"
        wait_for(lambda: (peer_dir / "shards" / "0.validation.tokens").is_file(), 120, "the peer's validation shard")
        verified_dirs.append(peer_dir)

        good = total = 0
        for d in verified_dirs:
            g, t = _verified(d, manifest)
            good, total = good + g, total + t
        out["verified_bytes"] = good
        out["fetched_file_bytes"] = total
        out["verified_share"] = round(good / total, 6) if total else None
        return out
    finally:
        procs.close()
        bridge.close()


def _seeders_seen(bridge: Any, manifest_hash: str, via: str) -> int:
    """How many seeders ``hivepath data info`` finds, asked from participant 4."""
    from peer.localnet import hivepath_cmd

    r = subprocess.run(["ip", "netns", "exec", bridge.where(4), *hivepath_cmd(
        "data", "info", "--manifest-hash", manifest_hash, "--json", "--initial-peers", via, "--host-maddrs",
        f"/ip4/{bridge.address(4)}/tcp/0")], capture_output=True, text=True, timeout=120)
    try:
        return len(json.loads(r.stdout)["seeders"])
    except (ValueError, KeyError):
        return 0


def main() -> int:
    from peer.localnet.netns import netns_available

    p = argparse.ArgumentParser(prog="python -m bench.data_fetch", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate-mbit", type=int, default=50, help="every link's rate in Mbit/s (default 50)")
    p.add_argument("--shard-mb", type=int, default=100, help="size of the path's training shard in MB (default 100)")
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "hivepath-bench-data-fetch"),
                   help="where the generated dataset is kept between runs")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each phase may take")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, fetched files) and say where")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    why = netns_available()
    if why:
        emit("data_fetch", {"skipped": why})
        return 0
    with work_directory("hpd-bench-", keep=args.keep) as work:
        result = run(args, work)
    result["meets_target"] = {
        "fetch_link_efficiency": result["fetch_link_efficiency"] >= 0.8,
        "two_seeder_speedup": result["two_seeder_speedup"] >= 1.7,
        "verified_share": result["verified_share"] == 1.0,
    }
    result["seeds"] = [0]  # the generated corpus and the run config
    emit("data_fetch", result)
    return 0


if __name__ == "__main__":
    run_main(main)
