"""Pseudo-gradient codecs: compressed size, round-trip error and CPU speed per codec.

Run: ``python -m bench.codecs [--numel N]``. Two inputs: N(0, 1) values (64 MB of fp32 by default,
the module size of ``bench.comm``) and a real pseudo-gradient (``global - local`` after 10 AdamW
steps of the tiny preset's path). Writes ``bench/results/codecs.json``. ``entropy`` gives, per codec,
what the lossless zstd stage (``OuterConfig.entropy``, codec ``NAME+zstd``) sends instead: its bytes
relative to the codec's own, on both inputs, and its speed.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import emit, run_main
from models.codec_spec import CODECS
from models.presets import tiny_cpu
from peer.averaging import flatten
from peer.compression import ErrorFeedback, get_codec

MEASURES = (
    "bench/codecs.py",
    "models",
    "peer/averaging",
    "peer/compression",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""


def _real_pseudo_gradient(steps: int = 10) -> torch.Tensor:
    """``global - local`` of every module of one tiny path after ``steps`` AdamW steps."""
    from models.lattice import ModularLM

    cfg = tiny_cpu()
    path = (0, 0)
    pm = ModularLM(cfg.lattice, seed=0, module_ids=cfg.lattice.path_modules(path)).path_model(path)
    start = flatten(pm.parameters())
    opt = torch.optim.AdamW(pm.parameters(), lr=cfg.inner.lr)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, cfg.lattice.vocab_size, (8, cfg.lattice.seq_len + 1), generator=gen)  # (B, T+1)
        pm(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad()
    return start - flatten(pm.parameters())


def _best_seconds(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _ef_drift(name: str, numel: int = 1 << 16, rounds: int = 50) -> float:
    """Max |sum(sent) - sum(true)| over rounds with error feedback, relative to one delta's absmax."""
    codec, ef = get_codec(name), ErrorFeedback(numel)
    gen = torch.Generator().manual_seed(1)
    true_sum, sent_sum, worst = torch.zeros(numel), torch.zeros(numel), 0.0
    for _ in range(rounds):
        delta = torch.randn(numel, generator=gen) + 0.05
        x = ef.add(delta)
        sent = codec.roundtrip(x)
        ef.update(x, sent)
        true_sum += delta
        sent_sum += sent
        worst = max(worst, float((sent_sum - true_sum).abs().max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 1024 * 1024, help="values in the Gaussian vector")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gauss = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    real = _real_pseudo_gradient()
    result: dict = {"numel": args.numel, "real_numel": real.numel(), "threads": 1, "codecs": {},
                    "seeds": [0, 1]}  # the model and the Gaussian vector from 0, the real delta's batches from 1
    for name in CODECS:
        codec = get_codec(name)
        data = codec.encode(gauss)
        row = {
            "bytes": len(data),
            "ratio_vs_fp32": len(data) / (4 * args.numel),
            "rel_l2_error_gauss": float((codec.decode(data, args.numel) - gauss).norm() / gauss.norm()),
            "rel_l2_error_real": float((codec.roundtrip(real) - real).norm() / real.norm()),
            "encode_mb_s": 4 * args.numel / 1e6 / _best_seconds(lambda: codec.encode(gauss)),
            "decode_mb_s": 4 * args.numel / 1e6 / _best_seconds(lambda: codec.decode(data, args.numel)),
            "ef_max_drift_50_rounds": _ef_drift(name),
        }
        result["codecs"][name] = row
        coded = get_codec(f"{name}+zstd")
        packed, real_raw = coded.encode(gauss), codec.encode(real)
        result.setdefault("entropy", {})[name] = {
            "bytes": len(packed),
            "ratio_vs_codec_gauss": len(packed) / len(data),
            "ratio_vs_codec_real": len(coded.pack(real_raw)) / len(real_raw),
            "pack_mb_s": len(data) / 1e6 / _best_seconds(lambda: coded.pack(data)),
            "unpack_mb_s": len(data) / 1e6 / _best_seconds(lambda: coded.unpack(packed, args.numel)),
        }
    emit("codecs", result)


if __name__ == "__main__":
    run_main(main)
