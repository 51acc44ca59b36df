"""Prepared datasets: streaming ``prepare``, the manifest, memory-mapped shards and batch iterators.

A dataset directory holds, for each path ``p`` of the lattice (written ``0-1``) and split ``s``
(``train``/``validation``)::

    shards/{p}.{s}.tokens   uint16 token ids of the split's documents, concatenated
    shards/{p}.{s}.docs     uint64 (n, 2): each document's first token offset and UTF-8 byte count
    router.json             the prefix k-means router (models.routing)
    tokenizer.json          the BPE tokenizer (BPE only)
    manifest.json           sources, counts per shard and split, tokenizer, router, sha256 of every file
                            and of every chunk of it (format 2, see models.manifest)

The manifest's hash identifies the dataset; the same inputs always give the same bytes (nothing in
it depends on time, machine or absolute paths). ``prepare`` streams: it reads the sources three
times (BPE training, prefix features, shard writing) and keeps only per-document features in memory.
It writes into a temporary directory and renames it at the end, so a failed run leaves nothing that
looks like a dataset.

A directory may hold only some paths' shards (a peer fetched its own path's, ``peer.datasync``):
:class:`Dataset` opens it, :attr:`Dataset.local_paths` says which paths are whole on disk, and
:meth:`Dataset.verify` with ``paths`` checks only those.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Union

import numpy as np

from models import strict_json
from models.config import Path_, format_path
from models.corpus import Corpus
from models.durable import fsync_dir
from models.errors import DataError
from models.manifest import (CHUNK_SIZE, FORMAT, MANIFEST_FILE, MAX_CHUNK_SIZE, READABLE_FORMATS, SPLITS, chunk_table,
                             manifest_hash)
from models.manifest import path_name as _path_name
from models.manifest import sha256_file as _sha256
from models.routing import Router, fit_router, prefix_features
from models.tokenizer import load_tokenizer, parse_tokenizer_spec, train_tokenizer

__all__ = ["prepare", "prepared", "Dataset", "DatasetMismatch", "ValidationDocument", "MANIFEST_FILE", "split_of", "manifest_hash",
           "CHUNK_SIZE"]

log = logging.getLogger(__name__)

VALIDATION_FRACTION = 0.1
_PREFIX_CHARS = 1024


class DatasetMismatch(DataError):
    """The local dataset is not the one the run trains on."""

    exit_code = 4


def split_of(text: str, validation_fraction: float = VALIDATION_FRACTION) -> str:
    """``"validation"`` for a deterministic ``validation_fraction`` of documents (by sha256 of the text)."""
    h = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
    return "validation" if h < validation_fraction * 2**64 else "train"


def prepare(
    corpus: Corpus,
    out: Union[str, Path],
    levels: int = 1,
    modules: int = 1,
    tokenizer: str = "bytes",
    seed: int = 0,
    progress: Optional[Callable[[str, int], None]] = None,
    chunk_size: int = CHUNK_SIZE,
) -> dict:
    """Tokenise ``corpus``, route its documents to the ``modules ** levels`` paths and write ``out``.

    Returns the manifest. ``progress(stage, documents_done)`` is called now and then. A bad
    ``tokenizer`` spec is refused before anything is read or written. ``chunk_size``: bytes per
    hashed chunk in the manifest (the unit a fetcher verifies; recorded, so it is part of the hash).
    """
    parse_tokenizer_spec(tokenizer)
    if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise DataError(f"chunk_size must be from 1 to {MAX_CHUNK_SIZE} bytes, got {chunk_size}")
    out = Path(out)
    if out.exists() and not (out / MANIFEST_FILE).exists() and any(out.iterdir()):
        raise DataError(f"{out} exists and is not a hivepath dataset; choose another --out")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "shards").mkdir(parents=True)
    try:
        manifest = _prepare_into(corpus, tmp, levels, modules, tokenizer, seed, progress or (lambda s, n: None),
                                 chunk_size)
        if _same_dataset(out, tmp):  # e.g. another process prepared the same cache meanwhile: keep it
            shutil.rmtree(tmp)
            return manifest
        if out.exists():
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
            fsync_dir(out.parent)
        except OSError:
            if not _same_dataset(out, tmp):
                raise DataError(f"{out} was written by another process while preparing; run prepare again") from None
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def prepared(out: Union[str, Path], levels: int = 1, modules: int = 1, tokenizer: str = "bytes",
             corpus: Optional[Callable[[], Corpus]] = None,
             make: Optional[Callable[[Path], object]] = None) -> "Dataset":
    """The dataset at ``out``, prepared first unless its manifest is there already: the one "prepare
    unless prepared" of the peers, the commands, the benchmarks and the tests.

    Preparing is ``make(out)`` when given (a progress bar, a generated corpus), else :func:`prepare` of
    ``corpus()`` (default: the built-in corpus) for a ``levels x modules`` lattice with ``tokenizer``.
    Processes that start together on one directory prepare it once: the check and the preparing run
    under a lock file beside it (``.NAME.lock``), and whoever comes second finds the manifest.
    """
    out = Path(out)
    if not (out / MANIFEST_FILE).exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f".{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / MANIFEST_FILE).exists():
                if make is not None:
                    make(out)
                else:
                    from models.corpus import default_corpus

                    prepare((corpus or default_corpus)(), out, levels=levels, modules=modules, tokenizer=tokenizer)
    return Dataset(out)


def _same_dataset(out: Path, tmp: Path) -> bool:
    """True when ``out`` already holds the dataset in ``tmp`` (manifests list every file's sha256)."""
    try:
        return (out / MANIFEST_FILE).read_bytes() == (tmp / MANIFEST_FILE).read_bytes()
    except OSError:
        return False


def _prepare_into(corpus, tmp: Path, levels, modules, tok_spec, seed, progress, chunk_size: int) -> dict:
    tok = train_tokenizer(tok_spec, (d.text for d in corpus.documents() if split_of(d.text) == "train"))
    tok.save(tmp)

    # Pass: split and prefix features of every document.
    feats, splits, sources = [], [], []
    source_names: list[str] = [name for name, _ in corpus.sources]
    for n, doc in enumerate(corpus.documents()):
        feats.append(prefix_features(tok.encode(doc.text[:_PREFIX_CHARS])))
        splits.append(split_of(doc.text))
        sources.append(source_names.index(doc.source))
        if n % 500 == 0:
            progress("features", n)
    skipped = dict(sorted(corpus.skipped.items()))
    if not feats:
        raise DataError("the sources contain no readable documents; give files with text (.txt .md .py .rst .jsonl)")
    x = np.stack(feats)  # (N, D)
    is_train = np.array([s == "train" for s in splits])
    if not is_train.any():
        raise DataError("every document fell in the validation split; add documents")
    router, train_paths = fit_router(x[is_train], levels, modules, seed=seed)
    paths = np.zeros((len(splits), levels), dtype=np.int64)
    paths[is_train] = train_paths
    if (~is_train).any():
        paths[~is_train] = router.route_features(x[~is_train])
    router.save(tmp)
    del x, feats

    # Pass: tokenise fully and append to the shard of the document's path and split.
    all_paths = [tuple(int(i) for i in p) for p in np.ndindex(*([modules] * levels))] if levels else [()]
    stats = {
        _path_name(p): {s: {"documents": 0, "tokens": 0, "bytes": 0, "sources": {}} for s in SPLITS} for p in all_paths
    }
    files = {}
    try:
        for p in all_paths:
            for s in SPLITS:
                base = tmp / "shards" / f"{_path_name(p)}.{s}"
                files[(_path_name(p), s)] = (open(f"{base}.tokens", "wb"), open(f"{base}.docs", "wb"))
        count = 0
        for n, doc in enumerate(corpus.documents()):
            if n >= len(splits) or splits[n] != split_of(doc.text):
                raise DataError("the sources changed while preparing; run prepare again")
            name, split = _path_name(tuple(paths[n])), splits[n]
            ids = tok.encode(doc.text)  # (L,) uint16
            nbytes = len(doc.text.encode("utf-8"))
            st = stats[name][split]
            tok_f, doc_f = files[(name, split)]
            doc_f.write(np.array([st["tokens"], nbytes], dtype="<u8").tobytes())
            tok_f.write(ids.astype("<u2").tobytes())
            st["documents"] += 1
            st["tokens"] += int(ids.size)
            st["bytes"] += nbytes
            st["sources"][doc.source] = st["sources"].get(doc.source, 0) + int(ids.size)
            count += 1
            if n % 500 == 0:
                progress("shards", n)
        if count != len(splits):
            raise DataError("the sources changed while preparing; run prepare again")
    finally:
        for tf, df in files.values():
            tf.close()
            df.close()
    for name in stats:
        if stats[name]["train"]["tokens"] == 0:
            raise DataError(f"path {name} received no training documents; add documents or use fewer paths")
        for s in SPLITS:
            stats[name][s]["sources"] = dict(sorted(stats[name][s]["sources"].items()))

    written = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
    file_hashes = {p.relative_to(tmp).as_posix(): _sha256(p) for p in written}
    chunks = {p.relative_to(tmp).as_posix(): chunk_table(p, chunk_size) for p in written}
    totals = {s: {k: sum(stats[n][s][k] for n in stats) for k in ("documents", "tokens", "bytes")} for s in SPLITS}
    manifest = {
        "format": FORMAT,
        "corpus": corpus.name,
        "corpus_info": corpus.info,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "lattice": {"levels": levels, "modules_per_level": modules},
        "split": {"rule": "sha256(utf-8 text)[:8] < fraction * 2**64 -> validation", "validation_fraction": VALIDATION_FRACTION},
        "router": {"kind": "prefix-kmeans", "prefix_tokens": 32, "dim": router.dim, "seed": seed},
        "documents_skipped": skipped,
        "totals": totals,
        "shards": stats,
        "files": file_hashes,
        "chunk_size": chunk_size,
        "chunks": chunks,
    }
    (tmp / MANIFEST_FILE).write_text(strict_json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    log.info("prepared %d documents into %d paths (manifest %s)", count, len(all_paths), manifest_hash(manifest))
    return manifest


@dataclass(frozen=True)
class ValidationDocument:
    """A validation document as tokens, the path its shard belongs to, and its UTF-8 size."""

    path: Path_
    ids: np.ndarray
    n_bytes: int


class Dataset:
    """A prepared dataset directory, read through memory maps (see the module docstring)."""

    def __init__(self, directory: Union[str, Path]):
        self.dir = Path(directory)
        mpath = self.dir / MANIFEST_FILE
        try:
            self.manifest: dict = json.loads(mpath.read_text())
        except FileNotFoundError:
            raise DataError(f"{self.dir} is not a prepared dataset (no {MANIFEST_FILE}); run 'hivepath data prepare'") from None
        except (OSError, ValueError) as e:
            raise DataError(f"{mpath} is unreadable ({e}); run 'hivepath data prepare' again") from None
        if self.manifest.get("format") not in READABLE_FORMATS:
            raise DataError(f"{self.dir} was prepared by another hivepath version; run 'hivepath data prepare' again")
        self.manifest_hash: str = manifest_hash(self.manifest)
        self.levels: int = self.manifest["lattice"]["levels"]
        self.modules_per_level: int = self.manifest["lattice"]["modules_per_level"]
        self.tokenizer = load_tokenizer(self.manifest["tokenizer"], self.dir)
        self.router: Router = Router.load(self.dir)
        self._maps: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}

    @property
    def paths(self) -> list[Path_]:
        """Every path of the dataset (its shards may not all be on disk: see :attr:`local_paths`)."""
        return [tuple(int(i) for i in name.split("-")) for name in sorted(self.manifest["shards"])]

    @property
    def local_paths(self) -> list[Path_]:
        """The paths whose train and validation shards are all on disk (all of them for a prepared
        dataset; a fetched one holds the paths it fetched)."""
        return [p for p in self.paths if all((self.dir / f).is_file() for f in self._shard_files(p))]

    def _shard_files(self, path: Path_) -> list[str]:
        name = _path_name(tuple(path))
        return [f for f in self.manifest["files"] if f.startswith(f"shards/{name}.")]

    def _shard(self, path: Path_, split: str) -> tuple[np.ndarray, np.ndarray]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        name = _path_name(tuple(path))
        if name not in self.manifest["shards"]:
            raise DataError(
                f"path {format_path(tuple(path))} is not in this dataset (prepared for a "
                f"{self.levels}x{self.modules_per_level} lattice); prepare it with --lattice matching the run"
            )
        key = (name, split)
        if key not in self._maps:
            base = self.dir / "shards" / f"{name}.{split}"
            tokens = _memmap(Path(f"{base}.tokens"), np.dtype("<u2"), name)
            docs = _memmap(Path(f"{base}.docs"), np.dtype("<u8"), name).reshape(-1, 2)
            self._maps[key] = (tokens, docs)
        return self._maps[key]

    def tokens(self, path: Path_, split: str = "train") -> np.ndarray:
        """The memory-mapped ``(N,)`` uint16 token stream of one shard."""
        return self._shard(path, split)[0]

    def path_batches(self, path: Path_, split: str, batch_size: int, seq_len: int, seed: int) -> Iterator[tuple]:
        """Endless random windows of one path's shard: ``(x, y)`` LongTensors ``(B, T)``, y shifted by one."""
        return _windows([self.tokens(path, split)], [format_path(tuple(path))], batch_size, seq_len, seed)

    def dense_batches(self, split: str, batch_size: int, seq_len: int, seed: int) -> Iterator[tuple]:
        """Endless random windows over every shard (the dense model's data), shards weighted by size."""
        return _windows([self.tokens(p, split) for p in self.paths], [format_path(p) for p in self.paths],
                        batch_size, seq_len, seed)

    def validation_documents(self, path: Optional[Path_] = None) -> Iterator[ValidationDocument]:
        """Validation documents of one path's shard, or of every shard when ``path`` is None."""
        for p in [tuple(path)] if path is not None else self.paths:
            tokens, docs = self._shard(p, "validation")
            for i in range(docs.shape[0]):
                start = int(docs[i, 0])
                end = int(docs[i + 1, 0]) if i + 1 < docs.shape[0] else tokens.shape[0]
                yield ValidationDocument(p, np.asarray(tokens[start:end]), int(docs[i, 1]))

    def verify(self, paths: Optional[Iterable[Path_]] = None) -> None:
        """Check files against the manifest's sha256; :class:`DatasetMismatch` names the first that differs.

        With ``paths``, only those paths' shards are checked (with the router and tokenizer): a peer
        needs only its own path's shard on disk.
        """
        names = None if paths is None else {_path_name(tuple(p)) for p in paths}
        for rel, digest in sorted(self.manifest["files"].items()):
            if names is not None and rel.startswith("shards/") and rel[len("shards/"):].split(".")[0] not in names:
                continue
            p = self.dir / rel
            if not p.exists():
                raise DatasetMismatch(f"{p} is missing; fetch it ('hivepath data fetch') or run 'hivepath data prepare' "
                                      "again")
            if _sha256(p) != digest:
                raise DatasetMismatch(f"{p} does not match the manifest (modified or corrupt); run 'hivepath data prepare' again")

    def check(self, expected_hash: str, expected_manifest: Optional[dict] = None,
              paths: Optional[Iterable[Path_]] = None) -> None:
        """Refuse this dataset unless its manifest hash is ``expected_hash``, saying what differs.

        Files are verified too (only ``paths``' shards when given; see :meth:`verify`).
        """
        self.verify(paths)
        if self.manifest_hash == expected_hash:
            return
        if expected_manifest is not None:
            diffs = [k for k in sorted(set(self.manifest) | set(expected_manifest))
                     if self.manifest.get(k) != expected_manifest.get(k)]
            what = "differs in " + ", ".join(diffs)
        else:
            m = self.manifest
            what = (f"is corpus '{m['corpus']}', tokenizer {m['tokenizer']}, lattice "
                    f"{self.levels}x{self.modules_per_level}, {m['totals']['train']['documents']} training documents")
        raise DatasetMismatch(
            f"dataset {self.dir} has manifest hash {self.manifest_hash} but the run expects {expected_hash}: it {what}; "
            "prepare the run's corpus with the run's tokenizer and lattice"
        )


def _memmap(path: Path, dtype: np.dtype, path_name: str) -> np.ndarray:
    if not path.exists():
        raise DataError(f"{path} is missing: this directory does not hold path {path_name}'s shards; fetch them "
                        f"('hivepath data fetch --path {path_name}') or run 'hivepath data prepare' again")
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _windows(streams: list[np.ndarray], names: list[str], batch_size: int, seq_len: int, seed: int) -> Iterator[tuple]:
    import torch

    usable = [i for i, s in enumerate(streams) if s.shape[0] > seq_len]
    if not usable:
        longest = max((s.shape[0] for s in streams), default=0)
        raise DataError(
            f"seq_len={seq_len} needs more than {seq_len} tokens but shard {', '.join(names)} has {longest}; "
            "lower seq_len or add documents"
        )
    sizes = np.array([streams[i].shape[0] - seq_len for i in usable], dtype=np.float64)
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq_len + 1)  # (T+1,)
    while True:
        which = rng.choice(len(usable), size=batch_size, p=sizes / sizes.sum()) if len(usable) > 1 else np.zeros(batch_size, int)
        rows = []
        for w in which:
            s = streams[usable[w]]
            start = int(rng.integers(0, s.shape[0] - seq_len))
            rows.append(np.asarray(s[start + offsets]))
        chunk = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
        yield chunk[:, :-1], chunk[:, 1:]  # (B, T), (B, T)
