"""A vector's encoding made in a thread while its group forms, cut into block-aligned parts as they are needed.

The all-reduce knows its members, and so the parts each reducer gets, only once matchmaking is done;
the value codecs' bytes of a part are a slice of the whole vector's (:mod:`models.codec_spec`), so a
member encodes the whole vector ahead (:meth:`Prepared.fill`, in an executor thread) and the all-reduce
takes each part's bytes as soon as the encoding got past it (:meth:`Prepared.part`). A codec makes one
with :meth:`peer.compression.Codec.prepare` (None where its parts' bytes are not slices of the whole).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Protocol

import numpy as np
from torch import Tensor

from models.codec_spec import BLOCK
from peer.compression.phases import phase, tick

__all__ = ["Prepared"]


class _Layout(Protocol):
    """What :class:`Prepared` needs of its codec (a value codec of :mod:`peer.compression.quantizers`)."""

    name: str

    def encoded_size(self, numel: int) -> int: ...

    def _prepare_into(self, flat: Tensor, out: Tensor, raw: np.ndarray, advance: Callable[[int], None]) -> None: ...


class Prepared:
    """A vector's encoding made before its group is known (the all-reduce then only cuts it into parts
    and, with an entropy stage, compresses each): :meth:`fill` encodes the whole vector in a thread,
    chunk by chunk, while matchmaking runs; :meth:`part` gives the bytes of a block-aligned part as
    soon as the encoding got past it. A part's bytes are those the codec makes of the part alone:
    blocks start at element 0 and each lies whole in the bytes (:mod:`models.codec_spec`).

    ``codec``: the value codec whose layout the bytes have (one of :mod:`peer.compression.quantizers`);
    ``pack``: what a part's bytes go through on their way out (the entropy stage,
    :class:`peer.compression.entropy.EntropyCoded`), if anything."""

    WAIT = 60.0
    """Most seconds :meth:`part` waits for :meth:`fill` to get past its part."""

    def __init__(self, codec: _Layout, numel: int, pack: Optional[Callable[[memoryview], bytes]] = None):
        self.codec = codec
        self.numel = numel
        self.pack = pack
        self.raw = np.empty(codec.encoded_size(numel), dtype=np.uint8)
        self._done = 0
        self._error: Optional[BaseException] = None
        self._changed = threading.Condition()

    def fill(self, flat: Tensor, out: Tensor) -> None:
        """Encode ``flat`` (``numel`` values) and write what a receiver decodes into ``out``; raises
        ValueError as :meth:`Codec.encode` does (then every :meth:`part` raises it too)."""
        if flat.numel() != self.numel:
            raise ValueError(f"{self.codec.name}: prepared for {self.numel} values, got {flat.numel()}")
        try:
            with phase("encode"):  # counted chunk by chunk (_advance): a snapshot sees it as it runs
                self.codec._prepare_into(flat, out, self.raw, self._advance)
        except BaseException as e:
            with self._changed:
                self._error = e
                self._changed.notify_all()
            raise

    def _advance(self, done: int) -> None:
        tick()
        with self._changed:
            self._done = done
            self._changed.notify_all()

    def wait(self, upto: int) -> None:
        """Return once the first ``upto`` values are encoded (their bytes and decoded values written);
        ValueError if the encoding failed, TimeoutError after :data:`WAIT` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._done >= upto or self._error is not None, self.WAIT):
                raise TimeoutError(f"{self.codec.name}: the vector's encoding did not reach {upto} in {self.WAIT:.0f}s")
            if self._error is not None:
                raise ValueError(f"{self.codec.name}: the vector could not be encoded: {self._error}")

    def part(self, a: int, b: int) -> bytes:
        """The encoded bytes of values ``[a, b)`` (``a`` and ``b`` multiples of ``BLOCK``, or ``b`` the
        vector's end), through :attr:`pack`; waits for :meth:`fill` to get past ``b``."""
        if not (0 <= a <= b <= self.numel and a % BLOCK == 0 and (b % BLOCK == 0 or b == self.numel)):
            raise ValueError(f"[{a}, {b}) is not a block-aligned part of {self.numel} values")
        self.wait(b)
        view = memoryview(self.raw)[self.codec.encoded_size(a) : self.codec.encoded_size(b)]
        return self.pack(view) if self.pack is not None else view.tobytes()
