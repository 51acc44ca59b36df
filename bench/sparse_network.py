"""The sparse codec through the real peer path: replicas stay bit-identical.

Run: ``python -m bench.sparse_network [--peers 3] [--rounds 6] [--codec topk16b2]``.

Starts a coordinator, an archive peer and ``--peers`` path-mode peers (``hivepath`` processes on
loopback, the tiny preset) whose run config names the sparse codec:
the coordinator hands it to every peer in its assignment, peers matchmake, all-reduce their sparse
pseudo-gradients (token-weighted) and apply the outer step. When every held module has done
``--rounds`` rounds the peers are drained, and every pair of checkpoints of the same module at the
same round (weights and outer momentum, past any start-up fork) is compared: ``replica_max_abs_diff``
is the largest absolute difference found (0.0: bit-identical). ``bytes_sent_per_peer`` is what each
peer counted on the wire; ``assigned_codecs`` is the codec each peer's assignment carried.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from bench.common import emit, run_main

MEASURES = (
    "bench/sparse_network.py",
    "models",
    "peer",
    "coordinator",
    "hivepath",
    "protos",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

__all__ = ["sparse_network", "main"]

log = logging.getLogger("bench.sparse_network")


def _held_rounds(net, ids: list[str]) -> Optional[int]:
    """The lowest round of a held module once every peer holds one, else None."""
    modules = (net.status() or {}).get("modules", [])
    held = [m for m in modules if m.get("holders")]
    if not held or any(not any(pid in m["holders"] for m in held) for pid in ids):
        return None
    return min(m["round"] for m in held)


def sparse_network(work: Path, peers: int = 3, rounds: int = 6, codec: str = "topk16b2", inner_steps: int = 10,
                   timeout: float = 600.0) -> dict:
    """Run the network in ``work`` and compare its replicas; returns the figures."""
    import torch
    from models.data import prepared
    from peer.localnet import ProcessGroup, preset_network, wait_for

    data = work / "data"
    ds = prepared(data, 2, 2, "bytes")
    procs = ProcessGroup(work / "logs")
    net = preset_network(procs, work / "net", ds.dir, ds.manifest_hash, run_id="sparse", inner_steps=inner_steps,
                         round_timeout=12.0, outer={"codec": codec, "lr": 1.0, "momentum": 0.0})
    names = [f"peer{i}" for i in range(peers)]
    t0 = time.monotonic()
    try:
        net.start_coordinator()
        net.start_archive()
        works = [net.start_peer(n) for n in names]

        def trained() -> bool:
            try:
                ids = [net.peer_id(n) for n in names]
            except AssertionError:
                return False
            done = _held_rounds(net, ids)
            return done is not None and done >= rounds

        wait_for(trained, timeout, f"{peers} peers training, {rounds} rounds on every held module", interval=0.5)
        rows = {p["peer_id"]: p for p in (net.status_json() or {}).get("peers", [])}
        assigned = [((rows.get(net.peer_id(n)) or {}).get("assignment") or {}).get("codec") for n in names]
        codes = [net.stop(n) for n in names]
        sent = [max((p.get("bytes_sent", 0) for p in net.progress_lines(n)), default=0) for n in names]
        logs = [procs.log(n) for n in names]
    finally:
        net.close()
        procs.close()
    from peer.localnet.checks import forked_rounds, replica_diff

    forked = forked_rounds(logs)
    pairs, diff, _ = replica_diff([w / "checkpoints" for w in works], forked)
    return {"replica_max_abs_diff": diff, "pairs_compared": pairs, "exit_codes": codes,
            "bytes_sent_per_peer": sent, "codec": codec, "assigned_codecs": assigned, "peers": peers,
            "rounds": rounds, "inner_steps": inner_steps, "forked_rounds": forked,
            "seconds": round(time.monotonic() - t0, 1), "torch": torch.__version__}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sparse_network", description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--codec", default="topk16b2")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="sparse-net-") as tmp:
        result = sparse_network(Path(tmp), args.peers, args.rounds, args.codec, args.inner_steps)
    emit("sparse_network", {**result, "seeds": [0]})  # every peer's run config keeps the preset's seed
    ok = result["replica_max_abs_diff"] == 0.0 and result["pairs_compared"] > 0
    return 0 if ok and result["assigned_codecs"] == [args.codec] * args.peers else 1


if __name__ == "__main__":
    run_main(main)
