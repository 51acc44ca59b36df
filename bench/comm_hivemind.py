"""bench.comm_hivemind: the set-up of :mod:`bench.comm`, averaged by hivemind's own averager (the baseline).

hivemind 1.1.12's ``DecentralizedAverager`` on the same set-up (4 peers, 100 Mbit/s tbf egress, one
64 MB module) is the baseline hivepath's exchange is held against. Figures quoted for it come from
other machines; this benchmark measures them on this one, in the same namespaces, so ``bench.comm``'s ``link_efficiency`` can be read against hivemind's on equal hardware
(four peers sharing two cores here).

Each peer runs a real hivemind DHT and one ``DecentralizedAverager`` per codec (``NoCompression``,
``Float16Compression``, ``Uniform8BitQuantization``). Matchmaking is excluded from the timing, as in
``bench.comm``: a peer asks for a step with ``require_trigger``, waits until its group is formed
(``AWAITING_TRIGGER``), then starts the clock and triggers the all-reduce; ``allreduce_seconds`` is
the slowest peer's trigger-to-result time. A 1 MB uncompressed round runs first so the p2p
connections are open, and each codec's averager runs a full-size round before the timed ones (as
``bench.comm`` times hivepath's rounds after a full-size warm-up: a running network's rounds, not a
fresh process's first, whose buffers are all first touches). ``--rounds`` (default 3) timed rounds
per codec: the round of median link efficiency is reported, ``cpu_s_per_mb`` is the median over the
rounds, and ``*_by_round`` lists every round's (one round on these shared cores varies).

hivemind's 8-bit decoder fails under numpy 2.x (``int()`` of a one-element array), and its averager
swallows the error and returns with nothing averaged; this benchmark fixes that one line (as any
measurement of it must) and checks each average against the exact weighted
mean, so a round that averaged nothing cannot pass for a fast one.

Keys (``bench/results/comm_hivemind.json``): per codec ``link_efficiency`` (``2 (n - 1) / n *
size / rate`` over ``allreduce_seconds``, ``size`` the bytes hivemind's codec makes of the module),
``allreduce_seconds_by_peer``, ``python_cpu_seconds_by_peer`` (the peer's main process, user +
system), ``averager_cpu_seconds_by_peer`` (hivemind's averager process, which compresses and reduces,
from the end of its warm-up round to the result: matchmaking included), ``child_cpu_seconds_by_peer`` (the p2p daemon and
the DHT process by name),
``max_abs_error_vs_exact_mean`` and ``replica_max_abs_diff`` (largest difference between two
peers' averages; hivemind's lossy codecs leave replicas apart). Run as root:
``python -m bench.comm_hivemind``; without root it prints a ``{"skipped": ...}`` line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings
from pathlib import Path
from typing import Optional

from bench.comm import _cpu_seconds, median_index, namespaced_peers
from bench.common import ISSUE_RATE_MBIT, emit, rate_result_name, run_main
from models import strict_json
from models.durable import atomic_write_text

MEASURES = (
    "bench/comm_hivemind.py",
    "bench/comm.py",
    "peer/localnet",
    "models",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

log = logging.getLogger("bench.comm_hivemind")

CODECS = ("8bit", "fp16", "none")


def _compression(name: str):
    from hivemind.compression import (
        Float16Compression,
        NoCompression,
        Uniform8BitQuantization,
    )

    return {"none": NoCompression(), "fp16": Float16Compression(), "8bit": Uniform8BitQuantization()}[name]


def _patch_8bit_decoder() -> None:
    """hivemind 1.1.12's quantized decoder calls ``int()`` on a one-element array, a TypeError under
    numpy 2.x that its averager swallows; read the codebook length as a scalar instead."""
    import numpy as np
    import torch
    from hivemind.compression.quantization import Quantization

    def extract(self, serialized):
        buf = serialized.buffer
        size = int(np.frombuffer(buf, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buf, offset=8, count=size, dtype=self.codebook_dtype)
        codes = np.frombuffer(buf, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        codes = torch.as_tensor(codes, dtype=torch.int64).reshape(tuple(serialized.size))
        return torch.as_tensor(codebook).to(dtype=getattr(torch, serialized.dtype))[codes]

    Quantization.extract = extract


def _encoded_bytes(name: str, numel: int, part_values: int) -> int:
    """Bytes hivemind's codec makes of ``numel`` fp32 values sent in parts of ``part_values``."""
    import torch
    from hivemind.compression import CompressionInfo

    codec, total, left = _compression(name), 0, numel
    while left > 0:
        n = min(part_values, left)
        part = torch.zeros(n)
        total += len(codec.compress(part, CompressionInfo.from_tensor(part)).buffer)
        left -= n
    return total


def run_peer(args: argparse.Namespace) -> None:
    """One peer inside its namespace: a hivemind DHT and one averager per codec, timed from the trigger."""
    import hashlib

    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage
    from hivemind.dht import DHT

    _patch_8bit_decoder()
    torch.set_num_threads(1)
    out, n = Path(args.out), args.peers
    dht = DHT(host_maddrs=[f"/ip4/{args.host}/tcp/0"], initial_peers=args.initial or [], start=True)
    if args.peer == 0:
        atomic_write_text(out / "maddrs", strict_json.dumps([str(m) for m in dht.get_visible_maddrs()]),
                          temp_name="maddrs.tmp")
    rate = args.rate_mbit * 1e6 / 8
    numel = args.mb * 2**20 // 4

    def average(prefix: str, tensor: torch.Tensor, codec: str, weight: float,
                rounds: int = 1) -> list[tuple[float, torch.Tensor, float, float]]:
        """Per timed round: (all-reduce seconds, the average, CPU seconds of the averager's own process,
        CPU seconds of this process and all its descendants from the trigger to the result)."""
        import psutil

        averager = DecentralizedAverager([tensor.clone()], dht, prefix=prefix, start=True, target_group_size=n,
                                         min_group_size=n, min_matchmaking_time=3.0, request_timeout=3.0,
                                         compression=_compression(codec), bandwidth=rate,
                                         allreduce_timeout=args.timeout)
        try:
            # a first full-size round, untimed: the second one is timed, as bench.comm times hivepath's
            # rounds after a full-size warm-up (a running network's rounds, not a fresh process's first)
            if averager.step(weight=weight, timeout=120) is None:
                raise RuntimeError(f"{codec}: the warm-up round failed")
            timed = []
            for _ in range(rounds):
                with averager.get_tensors() as tensors:
                    tensors[0].copy_(tensor)  # every timed round averages the same input
                warm = psutil.Process(averager.pid).cpu_times()
                control = averager.step(weight=weight, timeout=120, require_trigger=True, wait=False)
                deadline = time.monotonic() + 120
                while control.stage != AveragingStage.AWAITING_TRIGGER:
                    if control.done() or time.monotonic() > deadline:
                        raise RuntimeError(f"{codec}: no group of {n} formed ({control.stage})")
                    time.sleep(0.01)
                cpu0, _, children0 = _cpu_seconds()  # the averager process, the DHT and p2pd are descendants
                t0 = time.monotonic()
                control.allow_allreduce()
                if control.result() is None:
                    raise RuntimeError(f"{codec}: the all-reduce failed")
                seconds = time.monotonic() - t0
                cpu1, _, children1 = _cpu_seconds()
                t = psutil.Process(averager.pid).cpu_times()  # read before shutdown ends the process
                allreduce_cpu = cpu1 - cpu0 + sum(children1.values()) - sum(children0.values())
                with averager.get_tensors() as tensors:
                    timed.append((seconds, tensors[0].clone(), t.user + t.system - warm.user - warm.system,
                                  allreduce_cpu))
            return timed
        finally:
            averager.shutdown()

    try:
        average("bench_warmup", torch.zeros(2**18), "none", 1.0)
        results = {}
        for codec in args.codecs.split(","):
            delta = torch.randn(numel, generator=torch.Generator().manual_seed(args.peer)) * 0.01  # (numel,)
            cpu0, _, children0 = _cpu_seconds()
            timed = average(f"bench_{codec}", delta.clone(), codec, float(1 + args.peer), args.rounds)
            cpu1, _, children1 = _cpu_seconds()
            torch.save(timed[-1][1], out / f"avg_{codec}_{args.peer}.pt")
            results[codec] = dict(seconds_allreduce=[r[0] for r in timed], cpu_seconds=cpu1 - cpu0,
                                  averager_cpu_seconds=[r[2] for r in timed],
                                  allreduce_cpu_seconds=[r[3] for r in timed],
                                  child_cpu_seconds={k: round(v - children0.get(k, 0.0), 3) for k, v in children1.items()},
                                  sha256=[hashlib.sha256(r[1].numpy().tobytes()).hexdigest() for r in timed])
            log.info("%s: all-reduce %s s", codec, ", ".join(f"{r[0]:.2f}" for r in timed))
        atomic_write_text(out / f"peer{args.peer}.json", strict_json.dumps(results), temp_name=f"peer{args.peer}.tmp")
    finally:
        dht.shutdown()


def run_bench(args: argparse.Namespace) -> dict:
    import torch

    from peer.localnet.netns import netns_available

    why = netns_available()
    if why:
        return {"skipped": f"bench.comm_hivemind {why}"}
    n, numel = args.peers, args.mb * 2**20 // 4
    rate = args.rate_mbit * 1e6 / 8
    codecs = args.codecs.split(",")
    peer_args = ["--peers", str(n), "--mb", str(args.mb), "--rate-mbit", str(args.rate_mbit), "--codecs", args.codecs,
                 "--timeout", str(args.timeout), "--rounds", str(args.rounds)]
    with namespaced_peers("bench.comm_hivemind", n, args.rate_mbit, peer_args,
                          (args.timeout + 130) * (len(codecs) * args.rounds + 1) + 60, prefix="hph") as out:
        peers = [json.loads((out / f"peer{i}.json").read_text()) for i in range(n)]
        avgs = {c: [torch.load(out / f"avg_{c}_{i}.pt") for i in range(n)] for c in codecs}
    deltas = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) * 0.01 for i in range(n)]
    weights = [float(1 + i) for i in range(n)]
    exact = sum(w * d for w, d in zip(weights, deltas)) / sum(weights)
    part_values = (2**19) // 4  # hivemind's DEFAULT_PART_SIZE_BYTES of fp32 values
    per_codec = {}
    for codec in codecs:
        size = _encoded_bytes(codec, numel, part_values)
        optimal = 2 * (n - 1) / n * size / rate
        rounds = len(peers[0][codec]["seconds_allreduce"])
        t_ar = [max(p[codec]["seconds_allreduce"][r] for p in peers) for r in range(rounds)]
        cpu = [sum(p[codec]["allreduce_cpu_seconds"][r] for p in peers) / n / args.mb for r in range(rounds)]
        mid = median_index([optimal / t for t in t_ar])  # the round of median link efficiency
        per_codec[codec] = dict(
            rounds=rounds, compressed_bytes=size, optimal_seconds=round(optimal, 3), allreduce_seconds=round(t_ar[mid], 3),
            link_efficiency=round(optimal / t_ar[mid], 3),
            link_efficiency_by_round=[round(optimal / t, 3) for t in t_ar],
            cpu_s_per_mb=round(statistics.median(cpu), 5),  # the median over the rounds, as bench.comm's
            cpu_s_per_mb_by_round=[round(c, 5) for c in cpu],
            allreduce_cpu_seconds_by_peer=[round(p[codec]["allreduce_cpu_seconds"][mid], 3) for p in peers],
            allreduce_seconds_by_peer=[round(p[codec]["seconds_allreduce"][mid], 3) for p in peers],
            python_cpu_seconds_by_peer=[round(p[codec]["cpu_seconds"], 3) for p in peers],
            averager_cpu_seconds_by_peer=[round(p[codec]["averager_cpu_seconds"][mid], 3) for p in peers],
            child_cpu_seconds_by_peer=[p[codec]["child_cpu_seconds"] for p in peers],
            max_abs_error_vs_exact_mean=max(float((a - exact).abs().max()) for a in avgs[codec]),
            replica_max_abs_diff=max(float((a - avgs[codec][0]).abs().max()) for a in avgs[codec]),
            identical_on_all_peers=all(len({p[codec]["sha256"][r] for p in peers}) == 1 for r in range(rounds)),
        )
    result: dict = {"peers": n, "module_mb": args.mb, "rate_mbit": args.rate_mbit, "rounds": args.rounds,
                    "implementation": "hivemind 1.1.12",
                    "codecs": per_codec}
    for codec in codecs:
        result[f"link_efficiency_{codec}"] = per_codec[codec]["link_efficiency"]
    return result


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.comm_hivemind", description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mb", type=int, default=64, help="module size in MB of fp32 values")
    parser.add_argument("--rate-mbit", type=int, default=ISSUE_RATE_MBIT,
                        help=f"egress limit of every peer (default {ISSUE_RATE_MBIT}; others write comm_hivemind_RATEmbit.json)")
    parser.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated, of {','.join(CODECS)}")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds per codec after the warm-up round (default 3; the median is reported)")
    parser.add_argument("--timeout", type=float, default=120.0, help="all-reduce timeout of each average")
    parser.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--host", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--initial", nargs="*", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.codecs.split(",")) - set(CODECS))
    if unknown:
        parser.error(f"unknown codec(s) {', '.join(unknown)}: pass --codecs with names of {', '.join(CODECS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # hivemind's 8-bit encoder uses torch.quantize_per_tensor, deprecated in torch 2.13: its code, not ours
    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor", category=UserWarning)
    if args.peer is not None:
        run_peer(args)
        return
    # peer k's delta is drawn from seed k
    emit(rate_result_name("comm_hivemind", args.rate_mbit), {**run_bench(args), "seeds": list(range(args.peers))})


if __name__ == "__main__":
    run_main(main)
