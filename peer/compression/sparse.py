"""The sparse pseudo-gradient codec: per-chunk top-k at 2 or 4 bits, with exact averages.

SparseLoCo (Sarfi et al. 2025) and DeMo (Peng et al. 2024) send, per chunk of the pseudo-gradient,
only its largest values, coarsely quantised, and keep the rest in a decayed error-feedback buffer
(:data:`models.sparse_spec.FEEDBACK_DECAY`): a few percent of the values at 2 bits carry most of
the update, so rounds can be far more frequent at the same bytes. Layouts and sizes are specified in
:mod:`models.sparse_spec`.

Their aggregation (an all-gather with a scatter-add mean) lets replicas drift; here the reducer of a
part answers every member with the same bytes, and the average those bytes decode to is computed by
the same IEEE operations in the same order on every machine: either the reducer's aggregate itself
(``EXACT``, fp32 values of the union of the contributions' positions) or the contributions
themselves (``GATHER``, the members' uplink bytes and weights, decoded and averaged in sorted
peer-id order by :func:`peer.compression.weighted_mean`). The reducer sends whichever is
smaller; members never compute the mean from anything but those bytes.
"""

from __future__ import annotations

import struct
from typing import Mapping, Optional

import numpy as np
import torch
from torch import Tensor

from models.sparse_spec import CHUNK, INDEX_BITS, FEEDBACK_DECAY, SparseSpec, high_bits, low_bits
from peer.compression.base import Codec, check_flat, max_scale
from peer.compression.mean import weighted_mean

__all__ = ["SparseCodec", "EXACT", "GATHER"]

EXACT, GATHER = 0, 1
"""Tags of an average's two formats."""

_WEIGHT = struct.Struct("<d")


def _bits(values: np.ndarray, width: int) -> np.ndarray:
    """Unsigned ints ``(..., n)`` -> their ``width`` bits, MSB first, ``(..., n, width)`` uint8."""
    shifts = np.arange(width - 1, -1, -1, dtype=np.uint32)
    return ((values[..., None].astype(np.uint32) >> shifts) & 1).astype(np.uint8)


def _ints(bits: np.ndarray) -> np.ndarray:
    """``(..., n, width)`` bits, MSB first -> ``(..., n)`` int64."""
    width = bits.shape[-1]
    weights = (1 << np.arange(width - 1, -1, -1)).astype(np.int64)
    return (bits.astype(np.int64) * weights).sum(axis=-1)


def _elias_fano(idx: np.ndarray, count: int) -> np.ndarray:
    """``(nb, kc)`` ascending positions in chunks of ``count`` -> their Elias-Fano bits ``(nb, position
    bits)`` uint8 (layout: :mod:`models.sparse_spec`): the high parts as set bits ``(p >> l) + i``,
    then ``l`` low bits of each position."""
    nb, kc = idx.shape
    lb, high_len = low_bits(count, kc), high_bits(count, kc)
    high = np.zeros((nb, high_len), dtype=np.uint8)
    np.put_along_axis(high, (idx >> lb) + np.arange(kc), 1, axis=1)
    low = _bits(idx & ((1 << lb) - 1), lb).reshape(nb, kc * lb)
    return np.concatenate([high, low], axis=1)


def _elias_fano_positions(bits: np.ndarray, count: int, kc: int, name: str) -> tuple[np.ndarray, int]:
    """The ``(nb, kc)`` positions coded at the start of each row of ``bits`` and the bits they took;
    ValueError unless each chunk's high parts hold exactly ``kc`` ones and the positions are strictly
    ascending within the chunk."""
    nb = bits.shape[0]
    lb, high_len = low_bits(count, kc), high_bits(count, kc)
    if bits.shape[1] < high_len + kc * lb:
        raise ValueError(f"{name}: a chunk is cut short")
    high = bits[:, :high_len]
    if bool((high.sum(axis=1, dtype=np.int64) != kc).any()):
        raise ValueError(f"{name}: a chunk's positions do not hold {kc} entries")
    set_at = np.nonzero(high)[1].reshape(nb, kc).astype(np.int64)  # row-major: ascending in each row
    low = _ints(bits[:, high_len : high_len + kc * lb].reshape(nb, kc, lb))
    idx = ((set_at - np.arange(kc)) << lb) | low
    if bool((idx >= count).any()) or (kc > 1 and bool((idx[:, 1:] <= idx[:, :-1]).any())):
        raise ValueError(f"{name}: positions are out of the chunk or not strictly ascending")
    return idx, high_len + kc * lb


class SparseCodec(Codec):
    """Top-``k`` of every :data:`~models.sparse_spec.CHUNK` values at ``bits`` bits (``topk{k}b{bits}``).

    Encoding keeps, per chunk, the ``k_c`` values of largest magnitude, scales them by the largest
    over ``2^(bits-1)`` and rounds each magnitude to a level in 1..2^(bits-1) (the sign is kept):
    decoded values are ``level * scale`` (one IEEE product), zeros elsewhere. What is not sent goes
    to error feedback, decayed by :attr:`feedback_decay` each round."""

    feedback_decay = FEEDBACK_DECAY

    def __init__(self, spec: SparseSpec):
        self.spec = spec
        self.name = spec.name
        self._max_scale = max_scale(spec.levels)

    def encoded_size(self, numel: int) -> int:
        return self.spec.encoded_size(numel)

    # -- uplink -----------------------------------------------------------------------------------

    def _encode_chunks(self, chunks: Tensor) -> tuple[np.ndarray, Tensor]:
        """``(nb, c)`` fp32 -> ``(nb, chunk_bytes)`` uint8 and the decoded ``(nb, c)``."""
        nb, c = chunks.shape
        kc = self.spec.kept(c)
        mags = chunks.abs()
        idx = torch.topk(mags, kc, dim=1, sorted=False).indices.sort(dim=1).values  # (nb, kc) ascending
        vals = torch.gather(chunks, 1, idx)  # (nb, kc)
        absmax = torch.gather(mags, 1, idx).amax(dim=1, keepdim=True)  # (nb, 1)
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError("cannot encode a vector holding NaN or Inf")
        m = self.spec.levels
        scale = absmax / m  # (nb, 1), exact: m is a power of two
        if bool((scale > self._max_scale).any()):
            raise ValueError(f"{self.name}: values beyond {self._max_scale * m:.4g} cannot be encoded")
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        level = torch.div(vals.abs(), safe).round_().clamp_(1, m)  # (nb, kc) in 1..m
        negative = vals < 0  # (nb, kc)
        code = negative.to(torch.int64) << (self.spec.bits - 1) | (level.to(torch.int64) - 1)  # (nb, kc)
        positions = _elias_fano(idx.numpy(), c)  # (nb, position bits)
        codes = _bits(code.numpy(), self.spec.bits).reshape(nb, -1)  # (nb, kc * bits)
        packed = np.packbits(np.concatenate([positions, codes], axis=1), axis=1)
        out = np.empty((nb, 4 + packed.shape[1]), dtype=np.uint8)
        out[:, :4] = scale.numpy().astype("<f4", copy=False).view(np.uint8)
        out[:, 4:] = packed
        decoded = torch.zeros_like(chunks)
        signed = torch.where(negative, level.neg(), level)  # (nb, kc)
        decoded.scatter_(1, idx, signed.mul_(scale).add_(0.0))  # +0.0: the decoder's zero, never -0.0
        return out, decoded

    def _split(self, numel: int) -> list[tuple[int, int, int]]:
        """``(start, chunks, chunk_len)`` runs of equal chunks: the full chunks, then the tail."""
        full, tail = divmod(numel, CHUNK)
        runs = [(0, full, CHUNK)] if full else []
        if tail:
            runs.append((full * CHUNK, 1, tail))
        return runs

    def encode_roundtrip(self, flat: Tensor) -> tuple[bytes, Tensor]:
        flat = check_flat(flat, finite=False)  # checked per chunk
        decoded = torch.zeros_like(flat)
        parts = []
        for start, nb, c in self._split(flat.numel()):
            data, values = self._encode_chunks(flat[start : start + nb * c].view(nb, c))
            parts.append(data.tobytes())
            decoded[start : start + nb * c] = values.reshape(-1)
        return b"".join(parts), decoded

    def encode(self, flat: Tensor) -> bytes:
        return self.encode_roundtrip(flat)[0]

    def decode(self, data: bytes, numel: int) -> Tensor:
        self._check_length(data, numel)
        buf = np.frombuffer(data, dtype=np.uint8)
        out = torch.zeros(numel, dtype=torch.float32)
        offset = 0
        for start, nb, c in self._split(numel):
            stride = self.spec.chunk_bytes(c)
            raw = buf[offset : offset + nb * stride].reshape(nb, stride)
            offset += nb * stride
            out[start : start + nb * c] = self._decode_chunks(raw, c).reshape(-1)
        return out

    def _decode_chunks(self, raw: np.ndarray, c: int) -> Tensor:
        nb = raw.shape[0]
        kc = self.spec.kept(c)
        scale = torch.from_numpy(raw[:, :4].copy().view("<f4").astype(np.float32))  # (nb, 1)
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()) or bool((scale > self._max_scale).any()):
            raise ValueError(f"{self.name}: a chunk scale is negative, NaN, Inf or beyond fp32")
        bits = np.unpackbits(raw[:, 4:], axis=1)
        idx_np, used = _elias_fano_positions(bits, c, kc, self.name)
        end = used + kc * self.spec.bits
        if bits[:, end:].any():
            raise ValueError(f"{self.name}: the padding bits of a chunk are not zero")
        idx = torch.from_numpy(idx_np)  # (nb, kc)
        code = _ints(bits[:, used:end].reshape(nb, kc, self.spec.bits))  # (nb, kc)
        m = self.spec.levels
        level = torch.from_numpy((code & (m - 1)) + 1).to(torch.float32)  # (nb, kc)
        signed = torch.where(torch.from_numpy(code >= m), level.neg(), level)
        out = torch.zeros(nb, c, dtype=torch.float32)
        out.scatter_(1, idx, signed.mul_(scale).add_(0.0))
        return out

    # -- downlink: the average of a part -------------------------------------------------------------

    def average_size_ok(self, length: int, numel: int) -> bool:
        return 1 <= length <= self.spec.average_size(numel)

    def encode_average(self, value: Tensor, contributions: Optional[Mapping[str, tuple[Tensor, float]]] = None,
                       plain_mean: bool = False) -> bytes:
        """The smaller of ``EXACT`` (``value``'s non-zeros) and, when ``value`` is the plain weighted
        mean of ``contributions`` (``plain_mean``), ``GATHER`` (the contributions, re-encoded: a
        decoded contribution encodes to bytes that decode to it exactly, which is checked)."""
        exact = self._encode_exact(check_flat(value))
        if not plain_mean or not contributions or len(contributions) >= 1 << 16:
            return exact
        numel = value.numel()
        gathered = 1 + 2 + len(contributions) * (_WEIGHT.size + self.encoded_size(numel))
        if gathered >= len(exact):
            return exact
        parts = [bytes((GATHER,)), struct.pack("<H", len(contributions))]
        payloads = []
        for pid in sorted(contributions):
            values, weight = contributions[pid]
            data, again = self.encode_roundtrip(values)
            if not torch.equal(again, values.to(torch.float32)):
                return exact  # not a contribution of this codec: send the aggregate itself
            parts.append(_WEIGHT.pack(float(weight)))
            payloads.append(data)
        return b"".join(parts + payloads)

    def decode_average_into(self, data: bytes, out: Tensor) -> None:
        out.copy_(self.decode_average(data, out.numel()))

    def encode_average_into(self, value: Tensor, contributions: Optional[Mapping[str, tuple[Tensor, float]]],
                            plain_mean: bool, out: Tensor) -> bytes:
        data = self.encode_average(value, contributions, plain_mean)  # not this codec's encoding of value
        self.decode_average_into(data, out)
        return data

    def decode_average(self, data: bytes, numel: int) -> Tensor:
        if not self.average_size_ok(len(data), numel):
            raise ValueError(f"{self.name}: an average of {len(data)} bytes cannot hold {numel} values")
        if data[0] == EXACT:
            return self._decode_exact(data, numel)
        if data[0] != GATHER or len(data) < 3:
            raise ValueError(f"{self.name}: unknown average format {data[0]}")
        (count,) = struct.unpack_from("<H", data, 1)
        size = self.encoded_size(numel)
        if count < 1 or len(data) != 3 + count * (_WEIGHT.size + size):
            raise ValueError(f"{self.name}: a gathered average of {len(data)} bytes does not hold {count} contributions")
        weights = [_WEIGHT.unpack_from(data, 3 + i * _WEIGHT.size)[0] for i in range(count)]
        if not all(np.isfinite(w) and w > 0 for w in weights):
            raise ValueError(f"{self.name}: a gathered weight is not a finite number > 0")
        base = 3 + count * _WEIGHT.size
        values = [self.decode(data[base + i * size : base + (i + 1) * size], numel) for i in range(count)]
        return weighted_mean(values, weights)

    def _encode_exact(self, value: Tensor) -> bytes:
        numel = value.numel()
        nz = torch.nonzero(value).reshape(-1)  # (nnz,) ascending
        chunks = -(-numel // CHUNK)
        counts = torch.bincount(nz // CHUNK, minlength=chunks).numpy().astype("<u2")
        local = (nz % CHUNK).numpy()
        idx_bits = np.packbits(_bits(local, INDEX_BITS).reshape(-1)) if nz.numel() else np.zeros(0, np.uint8)
        vals = value[nz].numpy().astype("<f4", copy=False)
        return bytes((EXACT,)) + counts.tobytes() + idx_bits.tobytes() + vals.tobytes()

    def _decode_exact(self, data: bytes, numel: int) -> Tensor:
        chunks = -(-numel // CHUNK)
        if len(data) < 1 + 2 * chunks:
            raise ValueError(f"{self.name}: an exact average is cut short")
        counts = np.frombuffer(data, dtype="<u2", count=chunks, offset=1).astype(np.int64)
        lengths = np.full(chunks, CHUNK, dtype=np.int64)
        if chunks and numel % CHUNK:
            lengths[-1] = numel % CHUNK
        if bool((counts > lengths).any()):
            raise ValueError(f"{self.name}: a chunk of an exact average holds more values than it has")
        nnz = int(counts.sum())
        idx_len = (nnz * INDEX_BITS + 7) // 8
        if len(data) != SparseSpec.exact_size(numel, nnz):
            raise ValueError(f"{self.name}: an exact average of {nnz} values is not {len(data)} bytes")
        off = 1 + 2 * chunks
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8, count=idx_len, offset=off))
        if bits[nnz * INDEX_BITS :].any():
            raise ValueError(f"{self.name}: the padding bits of an exact average are not zero")
        local = _ints(bits[: nnz * INDEX_BITS].reshape(nnz, INDEX_BITS))  # (nnz,)
        chunk_of = np.repeat(np.arange(chunks, dtype=np.int64), counts)  # (nnz,)
        if bool((local >= lengths[chunk_of]).any()):
            raise ValueError(f"{self.name}: a position of an exact average is out of its chunk")
        pos = chunk_of * CHUNK + local
        if nnz > 1 and bool((np.diff(pos) <= 0).any()):
            raise ValueError(f"{self.name}: positions of an exact average are not strictly ascending")
        vals = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=nnz, offset=off + idx_len).astype(np.float32))
        if not bool(torch.isfinite(vals).all()):
            raise ValueError(f"{self.name}: an exact average holds NaN or Inf")
        out = torch.zeros(numel, dtype=torch.float32)
        out[torch.from_numpy(pos)] = vals
        return out

    def __repr__(self) -> str:
        return f"SparseCodec({self.name})"
