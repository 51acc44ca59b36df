"""Stage mode (SWARM parallelism, Ryabinin et al. 2023): how much of a pipeline's capacity one trainer
uses, with and without servers dying, and what compressing activations costs.

Setup: path (0, 0) of the tiny 2x2 lattice. Four stage servers, each its own process with its own
DHT and p2p daemon on loopback: L0M0 on a fast (1000 tokens/s) and a throttled (333 tokens/s)
server, L1M0 on two fast ones. Server speeds are emulated (``StageServerOptions.emulated_throughput``:
a request lasts at least its share of that rate) so that the capacity is known exactly and the
shared CPU of the machine does not set it. The bottleneck is level 0: 1333 tokens/s.

- ``throughput_fraction``: the trainer's tokens/s (its step rate times its batch) over the
  bottleneck's capacity, int8 activations, after a warm-up (target >= 0.8).
- ``throughput_fraction_with_kills``: the same while a server is SIGKILLed every 30 s and a fresh
  one of the same module and speed is started in its place (target >= 0.6).
- ``activation_bytes_ratio``: bytes of activations and gradients on the wire over their fp32 size.
- ``loss_by_codec``: validation loss of the same path trained in one process with every stage
  boundary's activations and gradients passed through each codec (the numerical effect alone).

Run: ``python -m bench.swarm`` (about 4 minutes; ``--quick`` for a short smoke run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import emit, run_main
from models import strict_json

ROOT = Path(__file__).resolve().parents[1]
SPEEDS = {"a0": ("L0M0", 1000.0), "a1": ("L0M0", 333.0), "b0": ("L1M0", 1000.0), "b1": ("L1M0", 1000.0)}
PATH = (0, 0)
BATCH, MICRO_BATCHES = int(os.environ.get("SWARM_BATCH", 64)), int(os.environ.get("SWARM_MICRO", 16))
"""Sequences per trainer step, and micro-batches of it in flight at once (128 tokens each)."""


def _config():
    from models.presets import tiny_cpu

    return tiny_cpu().replace(inner={"batch_size": BATCH}, outer={"inner_steps": 50})


def _bottleneck() -> float:
    levels: dict[str, float] = {}
    for mid, tps in SPEEDS.values():
        levels[mid] = levels.get(mid, 0.0) + tps
    return min(levels.values())


# -- a stage server process ------------------------------------------------------------------------


def serve(opts: dict) -> None:
    from peer.network import DHTOptions, start_dht
    from peer.node import run_stage_server
    from peer.stage import StageServerOptions

    torch.set_num_threads(1)
    stop = {"reason": None}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(reason="terminated"))
    dht = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=opts["initial_peers"]))
    try:
        run_stage_server(_config(), opts["module"], None, torch.device("cpu"), dht, None, None,
                         lambda: stop["reason"], options=StageServerOptions(
                             emulated_throughput=opts["tps"], record_ttl=opts["record_ttl"]))
    finally:
        dht.shutdown()


# -- the trainer and the measurements --------------------------------------------------------------


class Servers:
    """The stage server processes, each in its own session (a kill takes its p2p daemon too), stopped
    with this benchmark however it ends (:class:`peer.node.lifetime.ChildProcesses`)."""

    def __init__(self, maddrs: list[str], record_ttl: float, log_dir: Path):
        from peer.node.lifetime import ChildProcesses

        self.maddrs, self.record_ttl = maddrs, record_ttl
        self.children = ChildProcesses(log_dir)
        self.started = 0
        self.current: dict[str, str] = {}
        """Server name -> its running process's name in ``children`` (and log file)."""

    def start(self, name: str) -> None:
        module, tps = SPEEDS[name]
        opts = {"module": module, "tps": tps, "initial_peers": self.maddrs, "record_ttl": self.record_ttl}
        self.started += 1
        self.current[name] = f"{name}-{self.started}"
        self.children.start(self.current[name], [sys.executable, "-m", "bench.swarm", "--serve", strict_json.dumps(opts)],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def kill(self, name: str) -> None:
        self.children.kill(self.current.pop(name))

    def close(self) -> None:
        self.children.stop(timeout=10.0)


def _wait_servers(client, count_by_module: dict[str, int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(len(client.servers(m)) >= n for m, n in count_by_module.items()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"stage servers did not all announce themselves within {timeout:.0f}s")
        time.sleep(0.2)


def _measure(trainer, seconds: float, gen: torch.Generator, on_tick=None) -> tuple[float, int, list[float]]:
    """Train for ``seconds``; return tokens/s, steps and losses."""
    cfg = trainer.cfg
    start, tokens, steps, losses = time.monotonic(), 0, 0, []
    while time.monotonic() - start < seconds:
        x = torch.randint(0, 64, (cfg.inner.batch_size, cfg.lattice.seq_len + 1), generator=gen)  # (B, T+1)
        loss, _ = trainer.train_step(x[:, :-1], x[:, 1:])
        tokens += x[:, 1:].numel()
        steps += 1
        losses.append(loss)
        if on_tick is not None:
            on_tick(time.monotonic() - start)
    return tokens / (time.monotonic() - start), steps, losses


def _throttled_share(client, served: dict[str, int]) -> float:
    """Share of level 0's steady-phase requests that went to its slowest server."""
    level0 = {p: e.record.throughput for p, e in client.servers("L0M0").items() if p in served}
    if len(level0) < 2:
        return float("nan")
    slowest = min(level0, key=level0.get)
    return round(served[slowest] / sum(served[p] for p in level0), 3)


def pipeline(seconds: float, kill_seconds: float, kill_every: float, micro_batches: int, log_dir: Path) -> dict:
    from peer.network import DHTOptions, start_dht
    from peer.node import StageTrainer
    from peer.stage import StageClient

    cfg = _config()
    dht = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    servers = Servers(dht.maddrs(), record_ttl=4.0, log_dir=log_dir)
    client = StageClient(dht, cfg.run_id, cfg.content_hash(), codec="int8", request_timeout=10.0, seed=0)
    trainer = None
    try:
        for name in SPEEDS:
            servers.start(name)
        _wait_servers(client, {"L0M0": 2, "L1M0": 2}, timeout=120.0)
        trainer = StageTrainer(cfg, PATH, client, torch.device("cpu"), micro_batches=micro_batches)
        gen = torch.Generator().manual_seed(0)
        _measure(trainer, 5.0, gen)  # warm-up: connections, measured throughputs
        steady_tps, steady_steps, losses = _measure(trainer, seconds, gen)
        served_steady = dict(client.stats.served_by)
        throttled_share = _throttled_share(client, served_steady)
        measured_capacity = min(sum(e.record.throughput for e in client.servers(m).values()) for m in ("L0M0", "L1M0"))
        stats_before = (client.stats.bytes_sent + client.stats.bytes_received, client.stats.fp32_bytes)

        victims, kills = ["a0", "b0", "b1", "a1"], []

        def tick(elapsed: float) -> None:
            if elapsed >= kill_every * (len(kills) + 1):
                victim = victims[len(kills) % len(victims)]
                servers.kill(victim)
                servers.start(victim)  # a volunteer of the same speed takes its place (and must announce itself)
                kills.append(round(elapsed, 1))

        failovers0, failures0 = client.stats.failovers, client.stats.failures
        kill_tps, kill_steps, _ = _measure(trainer, kill_seconds, gen, on_tick=tick)
        wire, fp32 = client.stats.bytes_sent + client.stats.bytes_received, client.stats.fp32_bytes
        capacity = _bottleneck()
        return {
            "bottleneck_tokens_per_s": capacity,
            "bottleneck_tokens_per_s_as_servers_measured": round(measured_capacity, 1),
            "throughput_fraction_of_measured_bottleneck": round(steady_tps / measured_capacity, 3),
            "trainer_tokens_per_s": round(steady_tps, 1),
            "throughput_fraction": round(steady_tps / capacity, 3),
            "trainer_tokens_per_s_with_kills": round(kill_tps, 1),
            "throughput_fraction_with_kills": round(kill_tps / capacity, 3),
            "kills_at_seconds": kills,
            "failovers_during_kills": client.stats.failovers - failovers0,
            "failed_requests_during_kills": client.stats.failures - failures0,
            "steps": steady_steps,
            "steps_with_kills": kill_steps,
            "activation_bytes_ratio": round(wire / fp32, 4),
            "activation_bytes_ratio_steady": round(stats_before[0] / stats_before[1], 4),
            "requests_by_server_steady": sorted(served_steady.values()),
            "throttled_server_share_of_level0": throttled_share,
            "servers_used_with_kills": len(client.stats.served_by),
            "loss_first_last": [round(losses[0], 3), round(sum(losses[-10:]) / 10, 3)],
        }
    finally:
        if trainer is not None:
            trainer.close()
        client.close()
        servers.close()
        dht.shutdown()


class _Wire(torch.autograd.Function):
    """A stage boundary: the activations and (in backward) the gradients pass through a codec."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, codec: str) -> torch.Tensor:
        from peer.averaging import get_codec

        ctx.codec = codec
        return get_codec(codec).roundtrip(x.detach().reshape(-1)).view_as(x)  # (B, T, C)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        from peer.averaging import get_codec

        return get_codec(ctx.codec).roundtrip(g.reshape(-1)).view_as(g), None  # (B, T, C)


def loss_by_codec(steps: int, data_dir: Path) -> dict:
    from models.corpus import default_corpus
    from models.data import MANIFEST_FILE, Dataset, prepare
    from models.lattice import ModularLM
    from models.training import make_adamw

    cfg = _config()
    if not (data_dir / MANIFEST_FILE).exists():
        prepare(default_corpus(), data_dir, cfg.lattice.levels, cfg.lattice.modules_per_level, "bytes")
    ds = Dataset(data_dir)
    out = {}
    for codec in ("none", "fp16", "int8"):
        model = ModularLM(cfg.lattice, seed=0).path_model(PATH)
        opt = make_adamw(model.parameters(), cfg.inner)
        batches = ds.path_batches(PATH, "train", 16, cfg.lattice.seq_len, seed=1)

        def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = _Wire.apply(model.embed(x), codec)  # (B, T, C)
            for block in model.stack:
                h = _Wire.apply(block(h), codec)  # (B, T, C)
            logits = model.head(h, model.embed.tok.weight)  # (B, T, V)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = cfg.inner.lr * min(1.0, (step + 1) / cfg.inner.warmup_steps)
            x, y = next(batches)
            loss = run(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
            opt.step()
        val = ds.path_batches(PATH, "validation", 16, cfg.lattice.seq_len, seed=2)
        with torch.no_grad():
            out[codec] = round(sum(float(run(*next(val))) for _ in range(20)) / 20, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--keep-logs", action="store_true", help="keep the stage servers' logs (a temp dir)")
    args = parser.parse_args()
    if args.serve:
        serve(json.loads(args.serve))
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    log_dir = Path(tempfile.mkdtemp(prefix="hivepath-swarm-"))  # the servers' logs
    seconds, kill_seconds, steps = (20.0, 0.0, 60) if args.quick else (60.0, 95.0, 400)
    try:
        result = pipeline(seconds, kill_seconds, kill_every=30.0, micro_batches=MICRO_BATCHES, log_dir=log_dir)
    finally:
        if args.keep_logs:
            print(f"stage server logs in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    result["loss_by_codec"] = loss_by_codec(steps, ROOT / "data" / "swarm-default-bytes")
    result["loss_by_codec_steps"] = steps
    result["targets"] = {"throughput_fraction": 0.8, "throughput_fraction_with_kills": 0.6}
    assert all(math.isfinite(v) for v in result["loss_by_codec"].values())
    emit("swarm", result)


if __name__ == "__main__":
    run_main(main)
