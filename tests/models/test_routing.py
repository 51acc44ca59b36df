"""DiPaCo prefix routing: features, deterministic k-means, per-level clustering that composes into
paths, and a saved router that sends a prompt to the path of its domain."""

from __future__ import annotations

import numpy as np
import pytest

from models.corpus import corpus_from_paths
from models.data import Dataset, prepare
from models.errors import DataError
from models.routing import PREFIX_TOKENS, Router, fit_router, kmeans, prefix_features
from helpers import write_corpus


def test_features_depend_only_on_the_prefix():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, size=100)
    other = ids.copy()
    other[PREFIX_TOKENS:] = rng.integers(0, 256, size=100 - PREFIX_TOKENS)
    f = prefix_features(ids)
    assert np.array_equal(f, prefix_features(other))
    assert abs(np.linalg.norm(f) - 1.0) < 1e-12
    other[0] = (other[0] + 1) % 256
    assert not np.array_equal(f, prefix_features(other))
    assert not prefix_features(np.zeros(0, dtype=np.int64)).any()


def _blobs(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(3, 8)) * 10
    truth = np.repeat(np.arange(3), 30)
    return centers[truth] + rng.normal(size=(90, 8)), truth


def test_kmeans_is_deterministic_and_recovers_blobs():
    x, truth = _blobs()
    c1, l1 = kmeans(x, 3, seed=4)
    c2, l2 = kmeans(x, 3, seed=4)
    assert np.array_equal(c1, c2) and np.array_equal(l1, l2)
    for k in range(3):  # every blob lands in one cluster
        assert len(set(l1[truth == k])) == 1
    assert len(set(l1)) == 3


def test_kmeans_never_leaves_a_cluster_empty():
    x = np.vstack([np.zeros((20, 4)), np.ones((1, 4))])  # many duplicates: tempting empty clusters
    _, labels = kmeans(x, 4, seed=0)
    assert sorted(set(labels.tolist())) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        kmeans(x[:2], 3, seed=0)


def test_per_level_clustering_composes_into_paths():
    x, truth = _blobs(1)
    router, paths = fit_router(x, levels=2, modules=2, seed=0)
    assert paths.shape == (90, 2)
    assert set(router.centroids) == {"", "0", "1"}
    # Level 1 refines level 0: each level-0 cluster is split again into two non-empty halves.
    for i in range(2):
        assert set(paths[paths[:, 0] == i, 1].tolist()) == {0, 1}
    # The router reproduces the training assignment.
    assert np.array_equal(router.route_features(x), paths)


def test_router_round_trips_through_its_file(tmp_path):
    x, _ = _blobs(2)
    router, paths = fit_router(x, levels=1, modules=3, seed=1)
    router.save(tmp_path)
    loaded = Router.load(tmp_path)
    assert np.array_equal(loaded.route_features(x), paths)
    (tmp_path / "router.json").write_text("{broken")
    with pytest.raises(DataError, match="not a valid router"):
        Router.load(tmp_path)


def test_fewer_documents_than_paths_is_refused():
    x, _ = _blobs(3)
    with pytest.raises(DataError, match="fewer than the 4 paths"):
        fit_router(x[:3], levels=2, modules=2)


def test_prompts_route_to_the_shard_of_their_domain(tmp_path):
    src = write_corpus(tmp_path / "src", per_domain=30)
    prepare(corpus_from_paths([str(src / d) for d in ("scripture", "plays", "code")]), tmp_path / "d", levels=1, modules=3)
    ds = Dataset(tmp_path / "d")
    shard_of = {}
    for name, shard in ds.manifest["shards"].items():
        for source, tokens in shard["train"]["sources"].items():
            if tokens > 0.9 * shard["train"]["tokens"]:
                shard_of[source] = (int(name),)
    assert set(shard_of) == {"scripture", "plays", "code"}  # each domain owns one shard
    tok = ds.tokenizer
    assert ds.router.route_text("Chapter 99\n\n1 And the light of the city was upon the gate.", tok) == shard_of["scripture"]
    assert ds.router.route_text("_Enter VIOLA_\n\n**VIOLA**  \nO water, thou art earth!", tok) == shard_of["plays"]
    assert ds.router.route_text("def parser_7(self):\n    count = token + 3\n", tok) == shard_of["code"]
    # Validation documents sit in the shard their prefix routes to.
    for doc in ds.validation_documents():
        assert ds.router.route_ids(doc.ids) == doc.path
