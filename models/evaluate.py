"""Evaluation in bits per byte, per path and routed.

Bits per byte (total cross-entropy in bits over the UTF-8 size of the text) compares byte-level and
BPE runs fairly. Routed evaluation follows DiPaCo (Douillard et al. 2024, section 2.2): each
validation document goes to the path its prefix routes to, and that path's model scores it. The
validation shards were themselves routed by the dataset's router, so a document's shard is its
routed path. A document's first token has no context and is not scored; its bytes still count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import Path_, format_path
from models.training import autocast

__all__ = ["EvalResult", "bits_per_byte", "routed_evaluation", "evaluate_lattice"]


@dataclass
class EvalResult:
    """Bits per byte overall and per path (``"0,1"`` keys), with the totals behind them."""

    bpb: float
    nats: float
    n_bytes: int
    documents: int
    per_path: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready (a path without validation documents has ``bpb`` None rather than NaN)."""
        per_path = {k: {**v, "bpb": _finite(v["bpb"])} if "bpb" in v else dict(v) for k, v in self.per_path.items()}
        return {"bpb": _finite(self.bpb), "nats": self.nats, "bytes": self.n_bytes, "documents": self.documents,
                "per_path": per_path}


def _finite(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


@torch.no_grad()
def _doc_nats(model: nn.Module, ids: torch.Tensor, seq_len: int, device: torch.device, batch_size: int) -> float:
    """Summed next-token cross-entropy (nats) of one document ``ids`` (N,), in windows of ``seq_len``."""
    n = ids.shape[0]
    windows = [ids[s : s + seq_len + 1] for s in range(0, n - 1, seq_len)]
    total = 0.0
    full = [w for w in windows if w.shape[0] == seq_len + 1]
    tail = [w for w in windows if w.shape[0] != seq_len + 1]
    for i in range(0, len(full), batch_size):
        chunk = torch.stack(full[i : i + batch_size]).to(device)  # (B, T+1)
        total += _sum_nats(model, chunk, device)
    for w in tail:
        total += _sum_nats(model, w[None].to(device), device)  # (1, t+1)
    return total


def _sum_nats(model: nn.Module, chunk: torch.Tensor, device: torch.device) -> float:
    x, y = chunk[:, :-1], chunk[:, 1:]  # (B, T), (B, T)
    with autocast(device):
        logits, _ = model(x)  # (B, T, V)
    return float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))


def bits_per_byte(model: nn.Module, documents: Iterable, seq_len: int, device: torch.device | str = "cpu",
                  batch_size: int = 16, max_documents: Optional[int] = None) -> EvalResult:
    """Bits per byte of ``model`` on ``documents`` (objects with ``ids`` and ``n_bytes``)."""
    device = torch.device(device)
    was_training = model.training
    model.eval()
    nats, n_bytes, count = 0.0, 0, 0
    try:
        for doc in documents:
            if max_documents is not None and count >= max_documents:
                break
            ids = torch.as_tensor(doc.ids.astype("int64"))
            if ids.shape[0] >= 2:
                nats += _doc_nats(model, ids, seq_len, device, batch_size)
            n_bytes += doc.n_bytes
            count += 1
    finally:
        model.train(was_training)
    bpb = nats / math.log(2) / n_bytes if n_bytes else float("nan")
    return EvalResult(bpb=bpb, nats=nats, n_bytes=n_bytes, documents=count)


def routed_evaluation(path_model: Callable[[Path_], nn.Module], dataset, paths: Iterable[Path_], seq_len: int,
                      device: torch.device | str = "cpu", max_documents_per_path: Optional[int] = None) -> EvalResult:
    """Route every validation document by its prefix and score it with that path's model.

    ``path_model(path)`` returns the model of a path; documents routed to paths outside ``paths``
    (not trained here) are left out and counted in ``per_path["unrouted"]``. Overall bpb pools the paths.
    """
    paths = [tuple(p) for p in paths]
    routes = [dataset.router.route_ids(doc.ids) for doc in dataset.validation_documents()]
    per_path: dict[str, dict] = {}
    nats, n_bytes, docs = 0.0, 0, 0
    for path in paths:
        chosen = (d for d, r in zip(dataset.validation_documents(), routes) if r == path)
        r = bits_per_byte(path_model(path), chosen, seq_len, device, max_documents=max_documents_per_path)
        per_path[format_path(path)] = {"bpb": r.bpb, "bytes": r.n_bytes, "documents": r.documents}
        nats += r.nats
        n_bytes += r.n_bytes
        docs += r.documents
    outside = sum(1 for r in routes if r not in set(paths))
    if outside:
        per_path["unrouted"] = {"documents": outside}
    bpb = nats / math.log(2) / n_bytes if n_bytes else float("nan")
    return EvalResult(bpb=bpb, nats=nats, n_bytes=n_bytes, documents=docs, per_path=per_path)


def evaluate_lattice(model, dataset, paths: Iterable[Path_], seq_len: int, device: torch.device | str = "cpu",
                     dense: bool = False, max_documents_per_path: Optional[int] = None) -> EvalResult:
    """Validation bits per byte of a lattice ``model`` (``models.lattice.ModularLM``): a dense (1x1)
    model scores every validation document, reported as path ``dense``; a lattice is scored routed
    over ``paths`` (:func:`routed_evaluation`). What ``train-local`` reports and ``eval`` reproduces."""
    if not dense:
        return routed_evaluation(model.path_model, dataset, paths, seq_len, device,
                                 max_documents_per_path=max_documents_per_path)
    result = bits_per_byte(model.path_model((0,)), dataset.validation_documents(), seq_len, device,
                           max_documents=max_documents_per_path)
    result.per_path = {"dense": {"bpb": result.bpb, "bytes": result.n_bytes, "documents": result.documents}}
    return result
