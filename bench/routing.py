"""Routing purity on the built-in corpus: how well prefix k-means recovers the source domains.

Prepares ``default`` routed to 4 paths (a 2x2 lattice, and a flat 1x4 one for comparison) and
reports the token-weighted purity of the training shards: the share of each shard's tokens that
come from its majority domain. Target: purity >= 0.9.

Run: ``python -m bench.routing``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.common import emit, run_main
from models.corpus import default_corpus
from models.data import Dataset, prepare

MEASURES = (
    "bench/routing.py",
    "models",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""


def purity(manifest: dict, split: str = "train") -> float:
    """Token-weighted share of each shard's tokens from its majority source."""
    shards = [s[split]["sources"] for s in manifest["shards"].values() if s[split]["tokens"]]
    return sum(max(s.values()) for s in shards) / sum(sum(s.values()) for s in shards)


def main() -> dict:
    result: dict = {"paths": 4, "target_purity": 0.9, "seeds": [0]}  # k-means' seeded restarts
    with tempfile.TemporaryDirectory() as tmp:
        for name, levels, modules in (("2x2", 2, 2), ("1x4", 1, 4)):
            start = time.perf_counter()
            prepare(default_corpus(), Path(tmp) / name, levels=levels, modules=modules)
            seconds = time.perf_counter() - start
            ds = Dataset(Path(tmp) / name)
            m = ds.manifest
            key = "" if name == "2x2" else "_1x4"
            result[f"purity{key}"] = round(purity(m), 4)
            result[f"validation_purity{key}"] = round(purity(m, "validation"), 4)
            result[f"prepare_seconds{key}"] = round(seconds, 2)
            result[f"shards{key}"] = {
                n: {"tokens": s["train"]["tokens"], "sources": s["train"]["sources"]} for n, s in m["shards"].items()
            }
            if name == "2x2":
                result["manifest_hash"] = ds.manifest_hash
                result["corpus_tokens"] = m["totals"]["train"]["tokens"] + m["totals"]["validation"]["tokens"]
    result["meets_target"] = result["purity"] >= 0.9
    return emit("routing", result)


if __name__ == "__main__":
    run_main(main)
