"""Manifest format 2: per-chunk sha256 of every file, deterministic, and what a fetcher
reads of it (layouts, the files of some paths, a fetched manifest's hash); format-1 datasets still
open and train, and are refused for serving with a one-line message; a directory holding only some
paths' shards opens and trains those paths."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from helpers import write_corpus
from models import strict_json
from models.corpus import corpus_from_paths
from models.data import Dataset, DatasetMismatch, prepare
from models.errors import DataError
from models.manifest import FORMAT, ManifestMismatch, layouts, manifest_hash, parse_manifest, path_files

CHUNK = 4096


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), per_domain=30, seed=3)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds") / "d"
    prepare(corpus_from_paths([str(corpus)]), out, levels=1, modules=3, chunk_size=CHUNK)
    return out


def test_every_file_has_its_chunk_hashes(prepared):
    m = json.loads((prepared / "manifest.json").read_text())
    assert m["format"] == FORMAT == 2 and m["chunk_size"] == CHUNK
    assert set(m["chunks"]) == set(m["files"])
    several = 0
    for name, entry in m["chunks"].items():
        data = (prepared / name).read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == [hashlib.sha256(data[i:i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK)]
        several += len(entry["sha256"]) > 1
    assert several >= 3  # the test's small chunk size really splits shards
    table = layouts(m)
    span = table["shards/0.train.tokens"].span(1)
    assert span == (CHUNK, min(CHUNK, m["chunks"]["shards/0.train.tokens"]["size"] - CHUNK))


def test_prepare_stays_deterministic_and_the_chunk_size_is_part_of_the_hash(corpus, prepared, tmp_path):
    prepare(corpus_from_paths([str(corpus)]), tmp_path / "again", levels=1, modules=3, chunk_size=CHUNK)
    assert (tmp_path / "again" / "manifest.json").read_bytes() == (prepared / "manifest.json").read_bytes()
    prepare(corpus_from_paths([str(corpus)]), tmp_path / "big", levels=1, modules=3, chunk_size=2 * CHUNK)
    assert Dataset(tmp_path / "big").manifest_hash != Dataset(prepared).manifest_hash


def _as_format_1(src: Path, dst: Path) -> Dataset:
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["format"] = 1
    del m["chunk_size"], m["chunks"]
    (dst / "manifest.json").write_text(strict_json.dumps(m, indent=1, sort_keys=True) + "\n")
    return Dataset(dst)


def test_a_format_1_dataset_still_trains_but_is_not_served(prepared, tmp_path):
    old = _as_format_1(prepared, tmp_path / "old")
    old.verify()
    old.check(old.manifest_hash)
    x, y = next(old.path_batches((1,), "train", batch_size=2, seq_len=8, seed=0))
    assert x.shape == (2, 8)
    with pytest.raises(DataError, match=r"format 1, without per-chunk hashes.*re-run 'hivepath data prepare'") as e:
        layouts(old.manifest)
    assert "\n" not in str(e.value)


def test_the_files_of_some_paths(prepared):
    m = json.loads((prepared / "manifest.json").read_text())
    # the training shard first: a peer can start training once it is in place
    assert path_files(m, [(1,)]) == ["router.json", "shards/1.train.tokens", "shards/1.train.docs",
                                     "shards/1.validation.tokens", "shards/1.validation.docs"]
    with pytest.raises(DataError, match="path 7 is not in this dataset"):
        path_files(m, [(7,)])


def test_a_fetched_manifest_is_checked_against_the_expected_hash(prepared):
    blob = (prepared / "manifest.json").read_bytes()
    h = manifest_hash(json.loads(blob))
    assert parse_manifest(blob, h)["chunk_size"] == CHUNK
    forged = json.loads(blob)
    forged["chunks"]["router.json"]["sha256"][0] = "0" * 64
    with pytest.raises(ManifestMismatch, match=f"not the expected {h}") as e:
        parse_manifest(strict_json.dumps(forged).encode(), h)
    assert e.value.exit_code == 4
    with pytest.raises(ManifestMismatch, match="not JSON"):
        parse_manifest(b"\xff{", h)


def test_a_malformed_chunk_table_is_refused(prepared):
    m = json.loads((prepared / "manifest.json").read_text())
    m["chunks"]["../etc/passwd"] = m["chunks"].pop("router.json")
    m["files"]["../etc/passwd"] = m["files"].pop("router.json")
    with pytest.raises(DataError, match="malformed"):
        layouts(m)


def test_a_dataset_with_only_some_paths_opens_and_trains_them(prepared, tmp_path):
    part = tmp_path / "part"
    shutil.copytree(prepared, part)
    for f in (part / "shards").iterdir():
        if not f.name.startswith("2."):
            f.unlink()
    ds = Dataset(part)
    assert ds.local_paths == [(2,)] and len(ds.paths) == 3
    ds.verify([(2,)])
    ds.check(Dataset(prepared).manifest_hash, paths=[(2,)])
    x, _ = next(ds.path_batches((2,), "train", batch_size=2, seq_len=8, seed=0))
    assert x.shape == (2, 8)
    assert list(ds.validation_documents((2,)))
    with pytest.raises(DataError, match=r"does not hold path 0's shards; fetch them \('hivepath data fetch --path 0'\)"):
        ds.tokens((0,))
    with pytest.raises(DatasetMismatch, match="missing; fetch it"):
        ds.verify()
