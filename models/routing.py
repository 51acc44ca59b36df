"""DiPaCo coarse routing: documents go to paths by k-means on features of their prefix.

DiPaCo (Douillard et al. 2024, section 2.2) shards the data *before* training: each document's
prefix is embedded and clustered, one cluster per path, and a cheap router sends a new prompt to
the path of its nearest centroid. Here the feature of a document is a hashed bag of the unigrams
and bigrams of its first ``PREFIX_TOKENS`` tokens (square-rooted, L2-normalised).

For a lattice of ``L`` levels and ``M`` modules per level the clustering is per level so that paths
compose: level 0 splits all documents into ``M`` clusters (module ``L0M{i}`` sees cluster ``i``);
level ``l`` splits each level-``l-1`` cluster again into ``M``. A path ``(i, j, ...)`` is a leaf of this
tree, and the router walks it top-down. Everything is float64 numpy with seeded initialisation, so
the same documents give the same router and shards on every machine.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Union

import numpy as np

from models import strict_json
from models.config import Path_, format_path
from models.errors import DataError

__all__ = ["PREFIX_TOKENS", "FEATURE_DIM", "prefix_features", "kmeans", "Router", "fit_router"]

PREFIX_TOKENS = 32
"""Tokens of a document's prefix that decide its path (DiPaCo uses the first 32)."""
FEATURE_DIM = 512
"""Hashed feature buckets."""
ROUTER_FILE = "router.json"
_PREFIX_CHARS = 1024  # more than enough characters to yield PREFIX_TOKENS tokens
_KMEANS_ITERS = 100


def prefix_features(ids: np.ndarray, dim: int = FEATURE_DIM) -> np.ndarray:
    """Feature vector ``(dim,)`` float64 of a token prefix: hashed unigram+bigram counts, sqrt, L2-norm."""
    ids = np.asarray(ids[:PREFIX_TOKENS], dtype=np.int64)  # (P,)
    feat = np.zeros(dim, dtype=np.float64)
    if ids.size == 0:
        return feat
    np.add.at(feat, (ids * 2654435761 + 97) % dim, 1.0)
    if ids.size > 1:
        big = (ids[:-1] * 40503 + ids[1:] * 2246822519 + 13) % dim  # (P-1,)
        np.add.at(feat, big, 1.0)
    feat = np.sqrt(feat)
    return feat / math.sqrt(math.fsum(feat * feat))  # exactly rounded norm (no BLAS)


def _sq_dists(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Squared distances ``(N, K)`` between rows of ``x`` (N, D) and ``c`` (K, D).

    Element-wise (no BLAS matmul) so results do not depend on the machine's BLAS; chunked to bound memory.
    """
    out = np.empty((x.shape[0], c.shape[0]), dtype=np.float64)
    step = max(1, 2_000_000 // max(1, c.shape[0] * c.shape[1]))
    ct = c.T[:, None, :]  # (D, 1, K)
    for s in range(0, x.shape[0], step):
        diff = x[s : s + step].T[:, :, None] - ct  # (D, n, K)
        # Summing over the outer axis adds whole (n, K) slices one after another: the same order of
        # additions for every element on every CPU (an inner-axis sum may reassociate under SIMD).
        out[s : s + step] = (diff * diff).sum(axis=0)  # (n, K)
    return out


def kmeans(x: np.ndarray, k: int, seed: int, n_init: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means with k-means++ init: ``x`` (N, D) -> centroids (k, D), labels (N,).

    Runs ``n_init`` seeded restarts and keeps the one with the lowest inertia (the first on ties), so
    the result is deterministic for a given ``seed``. No cluster is left empty (an empty cluster takes
    the point farthest from its centroid). Requires ``N >= k``.
    """
    n = x.shape[0]
    if n < k:
        raise ValueError(f"{n} points cannot form {k} clusters")
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    for attempt in range(n_init):
        c, labels = _lloyd(x, k, np.random.default_rng([seed, attempt]))
        inertia = float(_sq_dists(x, c)[np.arange(n), labels].sum())
        if best is None or inertia < best[0]:
            best = (inertia, c, labels)
    return best[1], best[2]


def _lloyd(x: np.ndarray, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = x.shape[0]
    centroids = [x[int(rng.integers(n))]]
    for _ in range(1, k):
        d = _sq_dists(x, np.stack(centroids)).min(axis=1)  # (N,)
        total = d.sum()
        idx = int(rng.choice(n, p=d / total)) if total > 0 else int(rng.integers(n))
        centroids.append(x[idx])
    c = np.stack(centroids)  # (k, D)
    labels = np.full(n, -1)
    for _ in range(_KMEANS_ITERS):
        d = _sq_dists(x, c)  # (N, k)
        new = d.argmin(axis=1)
        counts = np.bincount(new, minlength=k)
        for j in np.flatnonzero(counts == 0):
            # Take the point farthest from its centroid among clusters that can spare one.
            spare = np.where(counts[new] > 1, d[np.arange(n), new], -1.0)  # (N,)
            far = int(spare.argmax())
            counts[new[far]] -= 1
            new[far] = j
            counts[j] = 1
        if (new == labels).all():
            break
        labels = new
        c = np.stack([x[labels == j].mean(axis=0) for j in range(k)])
    return c, labels


class Router:
    """Maps a document prefix to a path by walking per-level centroids (see the module docstring)."""

    def __init__(self, levels: int, modules: int, centroids: dict[str, np.ndarray], dim: int = FEATURE_DIM):
        self.levels = levels
        self.modules = modules
        self.dim = dim
        self.centroids = centroids  # key: path prefix "i,j" ("" at level 0) -> (modules, dim)

    def route_features(self, feats: np.ndarray) -> np.ndarray:
        """Features ``(N, D)`` -> paths ``(N, levels)`` int64."""
        n = feats.shape[0]
        out = np.zeros((n, self.levels), dtype=np.int64)
        for level in range(self.levels):
            for prefix in itertools.product(range(self.modules), repeat=level):
                rows = np.all(out[:, :level] == np.asarray(prefix, dtype=np.int64), axis=1) if level else np.ones(n, bool)
                if rows.any():
                    c = self.centroids[format_path(prefix) if prefix else ""]
                    out[rows, level] = _sq_dists(feats[rows], c).argmin(axis=1)
        return out

    def route_ids(self, ids: np.ndarray) -> Path_:
        """A token prefix -> its path."""
        return tuple(int(i) for i in self.route_features(prefix_features(ids, self.dim)[None])[0])

    def route_text(self, text: str, tokenizer) -> Path_:
        """A prompt -> its path (tokenised with the dataset's tokenizer)."""
        return self.route_ids(tokenizer.encode(text[:_PREFIX_CHARS]))

    def to_dict(self) -> dict:
        return {
            "kind": "prefix-kmeans",
            "prefix_tokens": PREFIX_TOKENS,
            "dim": self.dim,
            "levels": self.levels,
            "modules": self.modules,
            "centroids": {k: v.tolist() for k, v in sorted(self.centroids.items())},
        }

    def save(self, directory: Union[str, Path]) -> Path:
        path = Path(directory) / ROUTER_FILE
        path.write_text(strict_json.dumps(self.to_dict(), sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, directory: Union[str, Path]) -> "Router":
        path = Path(directory) / ROUTER_FILE
        try:
            data = json.loads(path.read_text())
            cents = {k: np.asarray(v, dtype=np.float64) for k, v in data["centroids"].items()}
            return cls(int(data["levels"]), int(data["modules"]), cents, int(data["dim"]))
        except FileNotFoundError:
            raise DataError(f"{path} is missing; re-run 'hivepath data prepare'") from None
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path} is not a valid router ({e}); re-run 'hivepath data prepare'") from None


def fit_router(feats: np.ndarray, levels: int, modules: int, seed: int = 0) -> tuple[Router, np.ndarray]:
    """Cluster training features ``(N, D)`` level by level: returns the router and paths ``(N, levels)``.

    Raises :class:`DataError` when some cluster has fewer documents than the next level has modules.
    """
    n = feats.shape[0]
    if n < modules**levels:
        raise DataError(
            f"{n} training documents are fewer than the {modules ** levels} paths; add documents or use fewer paths"
        )
    paths = np.zeros((n, levels), dtype=np.int64)
    centroids: dict[str, np.ndarray] = {}
    for level in range(levels):
        for prefix in itertools.product(range(modules), repeat=level):
            rows = np.all(paths[:, :level] == np.asarray(prefix, dtype=np.int64), axis=1) if level else np.ones(n, bool)
            count = int(rows.sum())
            key = format_path(prefix) if prefix else ""
            if count < modules:
                raise DataError(
                    f"cluster {key or 'root'} has {count} training documents, fewer than the {modules} modules of "
                    f"level {level}; add documents or use a smaller lattice"
                )
            c, labels = kmeans(feats[rows], modules, seed=seed * 1000 + level * 100 + len(centroids))
            centroids[key] = c
            paths[rows, level] = labels
    return Router(levels, modules, centroids, feats.shape[1]), paths
