"""The quality sweeps' evaluation: a fixed validation set, routed bits per byte and routing analysis.

Every point of a sweep is scored on the same :class:`EvalSet`: the first ``docs_per_shard``
validation documents of every shard, each cut to ``max_tokens`` tokens (its byte count is that of the
kept text). Dense models score every document; a lattice scores each document with the path its
prefix routes to (DiPaCo, Douillard et al. 2024, section 2.2), which is the shard it sits in.

The routing analysis scores every document with every path and reports routing on the prefix,
re-routing every W tokens (each window of W tokens goes to the path the router picks from the 32
tokens before it), the oracle that picks each document's lowest-loss path, and the router's accuracy
at picking that path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import Path_, format_path
from models.data import Dataset
from models.evaluate import bits_per_byte
from models.routing import PREFIX_TOKENS
from models.training import autocast

__all__ = ["EvalDoc", "EvalSet", "token_nats", "routed_bpb"]

_LN2 = math.log(2)


@dataclass(frozen=True)
class EvalDoc:
    """A validation document (possibly cut): its shard's path, token ids ``(N,)`` and UTF-8 size."""

    path: Path_
    ids: np.ndarray
    n_bytes: int


@dataclass
class EvalSet:
    """The fixed validation documents every point of a sweep is scored on."""

    tokenizer: str
    documents: list[EvalDoc]

    @classmethod
    def from_dataset(cls, ds: Dataset, docs_per_shard: int, max_tokens: int) -> "EvalSet":
        docs: list[EvalDoc] = []
        for path in ds.paths:
            for i, doc in enumerate(ds.validation_documents(path)):
                if i >= docs_per_shard:
                    break
                ids = np.asarray(doc.ids[:max_tokens], dtype=np.uint16)
                n_bytes = doc.n_bytes if ids.shape[0] == doc.ids.shape[0] else _decoded_bytes(ds, ids)
                docs.append(EvalDoc(tuple(path), ids, n_bytes))
        return cls(ds.manifest["tokenizer"], docs)

    @property
    def n_bytes(self) -> int:
        return sum(d.n_bytes for d in self.documents)

    def summary(self) -> dict[str, Any]:
        return {"documents": len(self.documents), "bytes": self.n_bytes,
                "tokens": int(sum(d.ids.shape[0] for d in self.documents)), "tokenizer": self.tokenizer}


def _decoded_bytes(ds: Dataset, ids: np.ndarray) -> int:
    if ds.manifest["tokenizer"] == "bytes":
        return int(ids.shape[0])
    return len(ds.tokenizer.decode(ids.tolist()).encode("utf-8"))


@torch.no_grad()
def token_nats(model: nn.Module, ids: np.ndarray, seq_len: int, device: torch.device, batch_size: int = 32) -> np.ndarray:
    """Next-token cross-entropy (nats) ``(N-1,)`` of each token after the first, in non-overlapping
    windows of ``seq_len`` (the windows ``models.evaluate.bits_per_byte`` uses)."""
    t = torch.as_tensor(ids.astype(np.int64))  # (N,)
    n = t.shape[0]
    out = np.zeros(max(0, n - 1), dtype=np.float64)
    starts = list(range(0, n - 1, seq_len))
    was_training = model.training
    model.eval()
    try:
        full = [s for s in starts if s + seq_len + 1 <= n]
        for i in range(0, len(full), batch_size):
            chunk = torch.stack([t[s : s + seq_len + 1] for s in full[i : i + batch_size]]).to(device)  # (B, T+1)
            nats = _window_nats(model, chunk, device)  # (B, T)
            for s, row in zip(full[i : i + batch_size], nats):
                out[s : s + seq_len] = row
        for s in (s for s in starts if s + seq_len + 1 > n):
            row = _window_nats(model, t[s:][None].to(device), device)[0]  # (n-s-1,)
            out[s : s + row.shape[0]] = row
    finally:
        model.train(was_training)
    return out


def _window_nats(model: nn.Module, chunk: torch.Tensor, device: torch.device) -> np.ndarray:
    x, y = chunk[:, :-1], chunk[:, 1:]  # (B, T), (B, T)
    with autocast(device):
        logits, _ = model(x)  # (B, T, V)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")  # (B*T,)
    return ce.reshape(y.shape).double().cpu().numpy()


def routed_bpb(path_model: Callable[[Path_], nn.Module], es: EvalSet, paths: Sequence[Path_], seq_len: int,
               device: torch.device, router, analysis: bool = False,
               reroute_windows: Sequence[int] = ()) -> dict[str, Any]:
    """Bits per byte with each document scored by its shard's (routed) path; with ``analysis``, also
    re-routing every W tokens, the per-document oracle and the router's accuracy."""
    paths = [tuple(p) for p in paths]
    if not analysis:
        nats, n_bytes, per_path = 0.0, 0, {}
        for p in paths:
            r = bits_per_byte(path_model(p), [d for d in es.documents if d.path == p], seq_len, device)
            per_path[format_path(p)] = {"bpb": r.bpb, "bytes": r.n_bytes, "documents": r.documents}
            nats += r.nats
            n_bytes += r.n_bytes
        return {"bpb": nats / _LN2 / n_bytes if n_bytes else float("nan"), "per_path": per_path}
    return _analysis(path_model, es, paths, seq_len, device, router, reroute_windows)


def _analysis(path_model, es: EvalSet, paths: list[Path_], seq_len: int, device, router,
              reroute_windows: Sequence[int]) -> dict[str, Any]:
    models = {p: path_model(p) for p in paths}
    total_bytes = es.n_bytes
    prefix = oracle = 0.0
    rerouted = {int(w): 0.0 for w in reroute_windows}
    hits = hit_bytes = 0
    per_path: dict[str, dict[str, float]] = {format_path(p): {"nats": 0.0, "bytes": 0, "documents": 0} for p in paths}
    for doc in es.documents:
        nats = {p: token_nats(models[p], doc.ids, seq_len, device) for p in paths}  # each (N-1,)
        totals = {p: float(nats[p].sum()) for p in paths}
        routed = tuple(router.route_ids(doc.ids))
        routed = routed if routed in nats else doc.path
        best = min(paths, key=lambda p: totals[p])
        prefix += totals[routed]
        oracle += totals[best]
        hits += int(best == routed)
        hit_bytes += doc.n_bytes if best == routed else 0
        st = per_path[format_path(routed)]
        st["nats"] += totals[routed]
        st["bytes"] += doc.n_bytes
        st["documents"] += 1
        for w in rerouted:
            rerouted[w] += _rerouted_nats(doc.ids, nats, routed, router, w)
    docs = max(1, len(es.documents))
    bits = lambda n: n / _LN2 / total_bytes if total_bytes else float("nan")  # noqa: E731
    return {
        "bpb": bits(prefix),
        "bpb_prefix_routed": bits(prefix),
        "bpb_oracle_per_document": bits(oracle),
        "bpb_rerouted": {str(w): bits(n) for w, n in rerouted.items()},
        "router_accuracy": hits / docs,
        "router_accuracy_bytes": hit_bytes / total_bytes if total_bytes else float("nan"),
        "per_path": {k: {"bpb": _bits_of(v), "bytes": v["bytes"], "documents": v["documents"]}
                     for k, v in per_path.items()},
        "documents": len(es.documents),
    }


def _bits_of(stats: dict[str, float]) -> Optional[float]:
    return stats["nats"] / _LN2 / stats["bytes"] if stats["bytes"] else None


def _rerouted_nats(ids: np.ndarray, nats: dict[Path_, np.ndarray], first: Path_, router, window: int) -> float:
    """Nats when the path is re-chosen every ``window`` tokens from the ``PREFIX_TOKENS`` tokens before."""
    n = ids.shape[0] - 1
    total, path = 0.0, first
    for start in range(0, n, window):
        if start > 0:
            chosen = tuple(router.route_ids(ids[max(0, start + 1 - PREFIX_TOKENS) : start + 1]))
            path = chosen if chosen in nats else path
        total += float(nats[path][start : start + window].sum())
    return total
