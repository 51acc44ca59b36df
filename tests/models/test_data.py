"""Data preparation: deterministic shards and manifest, tokenizers, batches, the manifest check, the
built-in corpus, and every kind of bad input a user can give them."""

from __future__ import annotations

import hashlib
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import write_corpus
from peer.localnet import hivepath_cmd
from helpers.corpus import _IDENTS, _NAMES, _WORDS
from models.corpus import corpus_from_paths, default_corpus
from models.data import Dataset, DatasetMismatch, prepare
from models.errors import DataError
from models.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, parse_tokenizer_spec, train_tokenizer

def file_hashes(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def dataset(corpus_dir, tmp_path_factory) -> Dataset:
    out = tmp_path_factory.mktemp("ds") / "d"
    prepare(corpus_from_paths([str(corpus_dir)]), out, levels=2, modules=2)
    return Dataset(out)


def test_prepare_is_byte_identical_for_identical_input(corpus_dir, tmp_path):
    for name in ("a", "b"):
        prepare(corpus_from_paths([str(corpus_dir)]), tmp_path / name, levels=2, modules=2)
    a, b = file_hashes(tmp_path / "a"), file_hashes(tmp_path / "b")
    assert a == b and "manifest.json" in a and "shards/1-1.train.tokens" in a
    assert Dataset(tmp_path / "a").manifest_hash == Dataset(tmp_path / "b").manifest_hash
    # The same documents elsewhere on disk (another machine) give the same dataset.
    moved = tmp_path / "elsewhere" / corpus_dir.name
    shutil.copytree(corpus_dir, moved)
    prepare(corpus_from_paths([str(moved)]), tmp_path / "m", levels=2, modules=2)
    assert file_hashes(tmp_path / "m") == a
    # A different input gives a different dataset.
    (corpus_dir / "plays" / "extra.md").write_text("**ROMEO**  \nBut soft, what light through yonder window breaks?\n")
    try:
        prepare(corpus_from_paths([str(corpus_dir)]), tmp_path / "c", levels=2, modules=2)
    finally:
        (corpus_dir / "plays" / "extra.md").unlink()
    assert Dataset(tmp_path / "c").manifest_hash != Dataset(tmp_path / "a").manifest_hash


def test_manifest_counts_match_the_files(dataset):
    m = dataset.manifest
    assert m["tokenizer"] == "bytes" and m["lattice"] == {"levels": 2, "modules_per_level": 2}
    total_docs = 0
    for name, shard in m["shards"].items():
        for split in ("train", "validation"):
            s = shard[split]
            tokens = dataset.dir / "shards" / f"{name}.{split}.tokens"
            assert tokens.stat().st_size == 2 * s["tokens"]
            assert sum(s["sources"].values()) == s["tokens"]
            assert s["bytes"] == s["tokens"]  # byte-level: one token per byte
            total_docs += s["documents"]
    assert total_docs == 3 * 40 + 10
    assert m["totals"]["validation"]["documents"] > 0
    assert set(m["files"]) == {p for p in file_hashes(dataset.dir) if p != "manifest.json"}


def test_validation_documents_decode_to_the_source_text(dataset, corpus_dir):
    texts = {p.read_text() for p in corpus_dir.rglob("*") if p.suffix in (".txt", ".md", ".py")}
    docs = list(dataset.validation_documents())
    assert docs and all(d.n_bytes == len(d.ids) for d in docs)
    decoded = [dataset.tokenizer.decode(d.ids) for d in docs]
    assert sum(t in texts for t in decoded) >= len(docs) - 10  # jsonl lines are the others


def test_batches_are_shifted_windows_and_seeded(dataset):
    it = dataset.path_batches((0, 1), "train", batch_size=4, seq_len=16, seed=5)
    x, y = next(it)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = next(dataset.path_batches((0, 1), "train", batch_size=4, seq_len=16, seed=5))
    assert torch.equal(x, x2)
    x3, _ = next(dataset.path_batches((0, 1), "train", batch_size=4, seq_len=16, seed=6))
    assert not torch.equal(x, x3)
    stream = dataset.tokens((0, 1), "train")
    row = x[0].numpy().astype(np.uint16)
    starts = np.flatnonzero(stream[: len(stream) - 16] == row[0])
    assert any(np.array_equal(stream[s : s + 16], row) for s in starts)
    dx, dy = next(dataset.dense_batches("train", batch_size=3, seq_len=8, seed=0))
    assert dx.shape == (3, 8) and torch.equal(dx[:, 1:], dy[:, :-1])


def test_sequence_longer_than_the_data_is_refused(dataset):
    with pytest.raises(DataError, match="seq_len"):
        next(dataset.path_batches((0, 0), "validation", batch_size=2, seq_len=10**7, seed=0))


def test_check_names_what_differs(dataset, tmp_path):
    dataset.check(dataset.manifest_hash)
    with pytest.raises(DatasetMismatch, match="corpus 'files', tokenizer bytes, lattice 2x2") as e:
        dataset.check("0123456789abcdef")
    assert e.value.exit_code == 4
    other = dict(dataset.manifest, tokenizer="bpe:512")
    with pytest.raises(DatasetMismatch, match="differs in tokenizer"):
        dataset.check("0123456789abcdef", expected_manifest=other)


def test_modified_shard_fails_verification(corpus_dir, tmp_path):
    prepare(corpus_from_paths([str(corpus_dir)]), tmp_path / "d", levels=1, modules=2)
    ds = Dataset(tmp_path / "d")
    shard = tmp_path / "d" / "shards" / "1.train.tokens"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DatasetMismatch, match="1.train.tokens"):
        ds.check(ds.manifest_hash)


def test_tokenizer_round_trips():
    text = "Hello, wörld! ∑ 𝄞 tabs\tand\nnewlines"
    byte = ByteTokenizer()
    ids = byte.encode(text)
    assert ids.dtype == np.uint16 and len(ids) == len(text.encode()) and byte.decode(ids) == text
    corpus = [f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(200)]
    bpe = train_tokenizer("bpe:300", iter(corpus))
    assert isinstance(bpe, BPETokenizer) and bpe.vocab_size <= 300
    for t in (text, corpus[3], ""):
        assert bpe.decode(bpe.encode(t)) == t
    assert len(bpe.encode(corpus[5])) < len(corpus[5])  # merges learned
    for bad in ("bpe", "bpe:100", "bpe:70000", "words"):
        with pytest.raises(DataError):
            parse_tokenizer_spec(bad)


def test_bpe_dataset_is_deterministic_and_reloads(corpus_dir, tmp_path):
    for name in ("a", "b"):
        prepare(corpus_from_paths([str(corpus_dir)]), tmp_path / name, levels=1, modules=2, tokenizer="bpe:320")
    assert file_hashes(tmp_path / "a") == file_hashes(tmp_path / "b")
    ds = Dataset(tmp_path / "a")
    assert ds.manifest["tokenizer"].startswith("bpe:") and (tmp_path / "a" / "tokenizer.json").exists()
    tok = load_tokenizer(ds.manifest["tokenizer"], tmp_path / "a")
    doc = next(ds.validation_documents())
    assert len(tok.decode(doc.ids).encode()) == doc.n_bytes


def test_unreadable_and_malformed_inputs_are_skipped_and_counted(tmp_path):
    src = write_corpus(tmp_path / "src", per_domain=5)
    (src / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (src / "bad.jsonl").write_text('{"text": "ok line"}\n{"body": "no text field"}\nnot json\n')
    prepare(corpus_from_paths([str(src)]), tmp_path / "d", levels=1, modules=2)
    skipped = Dataset(tmp_path / "d").manifest["documents_skipped"]
    assert skipped == {"jsonl line without a text field": 2, "not UTF-8": 1}


def test_bad_inputs_raise_and_leave_nothing_behind(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        corpus_from_paths([str(tmp_path / "missing")])
    with pytest.raises(DataError, match="no sources"):
        corpus_from_paths([])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no readable documents"):
        prepare(corpus_from_paths([str(tmp_path / "empty")]), tmp_path / "out", levels=1, modules=2)
    few = write_corpus(tmp_path / "few", per_domain=1)
    with pytest.raises(DataError, match="fewer than"):
        prepare(corpus_from_paths([str(few)]), tmp_path / "out", levels=2, modules=4)
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    (tmp_path / "notdata").mkdir()
    (tmp_path / "notdata" / "precious.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a hivepath dataset"):
        prepare(corpus_from_paths([str(few)]), tmp_path / "notdata", levels=1, modules=1)
    assert (tmp_path / "notdata" / "precious.txt").read_text() == "keep me"


def test_cli_prepare_info_and_one_line_errors(corpus_dir, tmp_path):
    out = tmp_path / "d"
    r = subprocess.run(hivepath_cmd("data", "prepare", str(corpus_dir), "--out", str(out), "--paths", "3"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ds = Dataset(out)
    assert ds.manifest["lattice"] == {"levels": 1, "modules_per_level": 3} and ds.manifest_hash in r.stdout
    r = subprocess.run(hivepath_cmd("data", "info", str(out), "--verify"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "all files match" in r.stdout and ds.manifest_hash in r.stdout
    r = subprocess.run(hivepath_cmd("data", "prepare", str(tmp_path / "nope"), "--out", str(tmp_path / "x")),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"hivepath: error: argument SRC: {tmp_path / 'nope'}: does not exist; pass an "
                                             "existing file or directory (see 'hivepath data prepare --help')"]
    r = subprocess.run(hivepath_cmd("data", "prepare", str(corpus_dir), "--out", str(tmp_path / "x"), "--lattice", "2by2"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "LEVELSxMODULES" in r.stderr and not (tmp_path / "x").exists()


def test_default_corpus_has_three_domains_and_records_python(tmp_path):
    corpus = default_corpus()
    assert corpus.info["sources"] == ["shakespeare", "bible", "python"]
    first = {}
    for doc in corpus.documents():
        first.setdefault(doc.source, doc)
    assert set(first) == {"shakespeare", "bible", "python"}
    assert first["bible"].text.startswith("Genesis 1\n\n1 In the beginning God created")
    prepare(corpus, tmp_path / "d", levels=2, modules=2)
    m = Dataset(tmp_path / "d").manifest
    assert m["corpus_info"]["python_version"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert m["totals"]["train"]["documents"] > 1500
    # Routing finds the domains: the shards are nearly pure (token-weighted).
    pure = sum(max(s["train"]["sources"].values()) for s in m["shards"].values())
    assert pure / m["totals"]["train"]["tokens"] > 0.9


def _write_bulk(root: Path, megabytes: int) -> Path:
    rng = random.Random(1)
    words = [w.encode() for w in _WORDS + _IDENTS + [n.lower() for n in _NAMES]]
    root.mkdir(parents=True)
    for i in range(megabytes * 10):  # 100 kB files
        (root / f"doc{i:05d}.txt").write_bytes(b" ".join(rng.choices(words, k=20_000))[:100_000])
    return root


@pytest.mark.parametrize("megabytes, limit_mb", [(12, 150), pytest.param(100, 1024, marks=pytest.mark.slow)])
def test_prepare_streams_with_bounded_memory(tmp_path, megabytes, limit_mb):
    src = _write_bulk(tmp_path / "bulk", megabytes)
    code = (
        "import sys\nfrom hivepath.cli import main\n"
        f"rc = main(['data', 'prepare', {str(src)!r}, '--out', {str(tmp_path / 'd')!r}, '--paths', '4'])\n"
        # VmHWM is this process's own peak (ru_maxrss would include the parent's, kept across exec).
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
        "print('MAXRSS_KB', hwm)\nsys.exit(rc)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    peak_mb = int(r.stdout.split("MAXRSS_KB")[1].split()[0]) / 1024
    tokens = Dataset(tmp_path / "d").manifest["totals"]
    assert tokens["train"]["tokens"] + tokens["validation"]["tokens"] >= megabytes * 1_000_000 * 0.99
    print(f"peak RSS {peak_mb:.0f} MB preparing a {megabytes} MB corpus")
    assert peak_mb < limit_mb, f"peak RSS {peak_mb:.0f} MB for a {megabytes} MB corpus"


def test_preparing_an_existing_identical_dataset_keeps_it(corpus_dir, tmp_path):
    out = tmp_path / "d"
    prepare(corpus_from_paths([str(corpus_dir)]), out, levels=1, modules=2)
    marker = out / "shards" / "0.train.tokens"
    inode = marker.stat().st_ino
    prepare(corpus_from_paths([str(corpus_dir)]), out, levels=1, modules=2)  # same input: kept as is
    assert marker.stat().st_ino == inode
    prepare(corpus_from_paths([str(corpus_dir)]), out, levels=1, modules=3)  # different: replaced
    assert Dataset(out).manifest["lattice"]["modules_per_level"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_a_peer_needs_only_its_own_shard(corpus_dir, tmp_path):
    prepare(corpus_from_paths([str(corpus_dir)]), tmp_path / "d", levels=2, modules=2)
    for f in (tmp_path / "d" / "shards").iterdir():
        if not f.name.startswith("1-0."):
            f.unlink()
    ds = Dataset(tmp_path / "d")
    ds.check(ds.manifest_hash, paths=[(1, 0)])
    x, _ = next(ds.path_batches((1, 0), "train", 2, 8, seed=0))
    assert x.shape == (2, 8)
    with pytest.raises(DatasetMismatch, match=r"0-0\.train\.docs is missing"):
        ds.check(ds.manifest_hash)
    with pytest.raises(DataError, match="missing"):
        next(ds.path_batches((0, 0), "train", 2, 8, seed=0))


def test_prepared_prepares_once_and_then_reads(tmp_path):
    """``models.data.prepared``: the first call prepares (here through ``make``), later ones find the
    manifest and only read it; both give the same dataset."""
    from models.data import prepared

    src = write_corpus(tmp_path / "src", per_domain=2)
    calls = []

    def make(out: Path) -> None:
        calls.append(out)
        prepare(corpus_from_paths([str(src)]), out, levels=1, modules=1)

    first = prepared(tmp_path / "data", make=make)
    again = prepared(tmp_path / "data", make=make)
    assert calls == [tmp_path / "data"]
    assert first.manifest_hash == again.manifest_hash and again.dir == tmp_path / "data"
    by_corpus = prepared(tmp_path / "other", corpus=lambda: corpus_from_paths([str(src)]))
    assert by_corpus.manifest_hash == first.manifest_hash, "make and corpus prepare the same bytes"
