"""The lossless entropy stage on a codec's bytes (``OuterConfig.entropy``, wire codecs ``NAME+zstd``).

Quantised codes are far from uniform, so zstd (level 1) shrinks them. The wire codec
``int8+zstd`` is ``int8`` whose bytes are zstd-compressed behind a one-byte tag, or sent raw behind
the other tag when zstd does not shrink them (:mod:`models.codec_spec`). Its decoded values are
exactly those of ``int8``; its size varies with the data, bounded by ``encoded_size`` (the raw size
plus the tag).
"""

from __future__ import annotations

import threading
from typing import Optional

import zstandard
from torch import Tensor

from models.codec_spec import TAG_BYTES, wire_name
from peer.compression.base import Codec
from peer.compression.phases import phase
from peer.compression.prepared import Prepared

__all__ = ["EntropyCoded", "ENTROPY_CODERS", "ZstdContexts"]


class ZstdContexts:
    """A zstd compressor and decompressor per thread (their contexts are not thread-safe; encoders run
    in several threads): ``contexts.get()`` is this thread's pair, made on first use."""

    def __init__(self, level: int):
        self.level = level
        self._local = threading.local()

    def get(self) -> tuple["zstandard.ZstdCompressor", "zstandard.ZstdDecompressor"]:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = (zstandard.ZstdCompressor(level=self.level, write_content_size=True),
                                     zstandard.ZstdDecompressor())
        return ctx


class EntropyCoded(Codec):
    """``inner``'s bytes through zstd (level 1), behind a one-byte tag: :data:`RAW` then the bytes
    as they are (when zstd would not shrink them), or :data:`ZSTD` then one zstd frame that declares
    its content size. Lossless: decoded values are ``inner``'s, bit for bit."""

    RAW, ZSTD = 0, 1
    LEVEL = 1
    SAMPLE = 16 * 1024
    """Bytes of a large encoding compressed first, to decide whether the rest is worth zstd's CPU."""
    MIN_SAVING = 0.03
    """The least share of the sample zstd must save for the whole to be compressed: below it the
    bytes go raw. The rule: zstd pays where the link time it saves exceeds the CPU it costs. In a round
    a peer compresses each byte it sends once per 1.5 bytes sent and decompresses 1.5 times as many;
    at zstd level 1's speed on one thread, against the time a MB takes on a 100 Mbit/s link, a saving
    just under this share breaks even (``bench.comm`` measures the CPU per MB of each codec). int8 and
    int4 codes of Gaussian deltas save more and are kept; random bytes save nothing and go raw after
    a :attr:`SAMPLE`."""

    def __init__(self, inner: Codec):
        self.inner = inner
        self.name = wire_name(inner.name, "zstd")
        self._zstd = ZstdContexts(self.LEVEL).get  # the all-reduce encodes in threads

    def encoded_size(self, numel: int) -> int:
        return TAG_BYTES + self.inner.encoded_size(numel)

    def size_ok(self, length: int, numel: int) -> bool:
        return TAG_BYTES <= length <= self.encoded_size(numel)

    def pack(self, raw: bytes) -> bytes:
        """Tag and (when it shrinks them) compress ``raw``, an encoding by ``inner``. An encoding of
        more than twice :data:`SAMPLE` bytes whose first :data:`SAMPLE` bytes zstd shrinks by less
        than :data:`MIN_SAVING` goes raw without compressing the rest."""
        with phase("entropy"):
            if len(raw) > 2 * self.SAMPLE:
                sample = memoryview(raw)[: self.SAMPLE]
                if len(self._zstd()[0].compress(sample)) > (1 - self.MIN_SAVING) * self.SAMPLE:
                    return bytes((self.RAW,)) + raw
            frame = self._zstd()[0].compress(raw)
        if len(frame) < len(raw):
            return bytes((self.ZSTD,)) + frame
        return bytes((self.RAW,)) + raw

    def unpack(self, data: bytes, numel: int) -> bytes:
        """``inner``'s encoding of ``numel`` values inside ``data``; ValueError on malformed bytes
        (an unknown tag, a corrupt frame, or content of any other size: never inflated past it)."""
        expected = self.inner.encoded_size(numel)
        if not self.size_ok(len(data), numel):
            raise ValueError(f"{self.name}: {len(data)} bytes cannot encode {numel} values "
                             f"(1 to {self.encoded_size(numel)} expected)")
        tag, body = data[0], memoryview(data)[1:]
        if tag == self.RAW:
            return bytes(body)
        if tag != self.ZSTD:
            raise ValueError(f"{self.name}: unknown entropy tag {tag}")
        try:
            declared = zstandard.frame_content_size(body)
            if declared != expected:
                raise ValueError(f"{self.name}: the zstd frame holds {declared} bytes, expected {expected}")
            with phase("entropy"):
                raw = self._zstd()[1].decompress(body, max_output_size=expected)
        except zstandard.ZstdError as e:
            raise ValueError(f"{self.name}: corrupt zstd frame ({e})") from None
        if len(raw) != expected:
            raise ValueError(f"{self.name}: the zstd frame decompressed to {len(raw)} bytes, expected {expected}")
        return raw

    def encode(self, flat: Tensor) -> bytes:
        return self.pack(self.inner.encode(flat))

    def encode_roundtrip(self, flat: Tensor) -> tuple[bytes, Tensor]:
        raw, decoded = self.inner.encode_roundtrip(flat)
        return self.pack(raw), decoded

    def encode_roundtrip_into(self, flat: Tensor, out: Tensor) -> bytes:
        return self.pack(self.inner.encode_roundtrip_into(flat, out))

    def prepare(self, numel: int) -> Optional[Prepared]:
        prepared = self.inner.prepare(numel)  # inner's bytes, each part through this stage on its way out
        if prepared is not None:
            prepared.pack = self.pack
        return prepared

    def roundtrip(self, flat: Tensor) -> Tensor:
        return self.inner.roundtrip(flat)  # lossless stage: skip it

    def roundtrip_into(self, flat: Tensor, out: Tensor) -> None:
        self.inner.roundtrip_into(flat, out)

    def decode(self, data: bytes, numel: int) -> Tensor:
        return self.inner.decode(self.unpack(data, numel), numel)

    def decode_into(self, data: bytes, out: Tensor) -> None:
        self.inner.decode_into(self.unpack(data, out.numel()), out)

    def __repr__(self) -> str:
        return f"EntropyCoded({self.inner!r})"


ENTROPY_CODERS = {"zstd": EntropyCoded}
"""The implementation of each entropy stage of :data:`models.codec_spec.ENTROPY_STAGES` but ``none``."""
