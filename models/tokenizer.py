"""Tokenizers: byte-level (no files, vocabulary 256) and byte-level BPE trained with ``tokenizers``.

Evaluation reports bits per byte of UTF-8 text, so runs with different tokenizers compare fairly.
Token ids are stored as ``uint16``, which bounds a BPE vocabulary at 65,535.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Iterator, Protocol, Union

import numpy as np

from models.errors import DataError

__all__ = ["Tokenizer", "ByteTokenizer", "BPETokenizer", "parse_tokenizer_spec", "train_tokenizer", "load_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
MAX_VOCAB = 65535


class Tokenizer(Protocol):
    """Text <-> token ids."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, lossless on every string."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> ``(N,)`` uint16 ids, one per UTF-8 byte."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        """Byte-level needs no file."""


class BPETokenizer:
    """Byte-level BPE (``tokenizers``): lossless round trips, ``vocab_size`` ids."""

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.name = f"bpe:{self.vocab_size}"

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> ``(N,)`` uint16 ids."""
        return np.asarray(self._tok.encode(text).ids, dtype=np.uint16)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint16) for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def save(self, directory: Path) -> None:
        self._tok.save(str(Path(directory) / TOKENIZER_FILE))


def parse_tokenizer_spec(spec: str) -> tuple[str, int]:
    """``"bytes"`` -> ``("bytes", 256)``; ``"bpe:4096"`` -> ``("bpe", 4096)``."""
    if spec == "bytes":
        return "bytes", 256
    m = re.fullmatch(r"bpe:(\d+)", spec)
    if not m:
        raise DataError(f"tokenizer '{spec}' is not 'bytes' or 'bpe:VOCAB' (e.g. bpe:4096)")
    vocab = int(m.group(1))
    if not 257 <= vocab <= MAX_VOCAB:
        raise DataError(f"tokenizer '{spec}': BPE vocabulary must be between 257 and {MAX_VOCAB}")
    return "bpe", vocab


def train_tokenizer(spec: str, texts: Iterator[str]) -> Union[ByteTokenizer, BPETokenizer]:
    """Build the tokenizer named by ``spec``; BPE is trained on ``texts`` (the training split)."""
    kind, vocab = parse_tokenizer_spec(spec)
    if kind == "bytes":
        return ByteTokenizer()
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok)


def load_tokenizer(spec: str, directory: Union[str, Path]) -> Union[ByteTokenizer, BPETokenizer]:
    """The tokenizer a prepared dataset in ``directory`` was written with."""
    kind, _ = parse_tokenizer_spec(spec)
    if kind == "bytes":
        return ByteTokenizer()
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(directory) / TOKENIZER_FILE
    if not path.exists():
        raise DataError(f"{path} is missing; re-run 'hivepath data prepare' for this dataset")
    return BPETokenizer(HFTokenizer.from_file(str(path)))
