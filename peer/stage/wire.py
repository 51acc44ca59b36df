"""Activations and gradients on the wire between a trainer and a stage server (stage mode).

Tensors travel as :class:`protos.hivepath.peer.v1.stage_pb2.EncodedTensor`: a shape, a codec name and the bytes of the
tensor encoded by one of :data:`peer.compression.ACTIVATION_CODECS`: the pseudo-gradient
codecs on the flat vector (int8 blockwise absmax, fp16 and none; SWARM, Ryabinin et al. 2023,
compresses activations the same way), or ``int4tok+zstd`` (per-token 4-bit codes behind zstd, about a
tenth of fp32's bytes; 5 and 6 bits also, and 4 with stochastic rounding). A trainer resolves its codec
scheme once (:func:`codec_scheme`: a codec per level and direction, e.g. a richer one for the
embedding's output, and whether replies are residual); a server answers in the codec the request
names, residual when asked. Decoding checks
everything a hostile or buggy peer could get wrong -- rank, sizes, codec, byte length, NaN/Inf --
and raises :class:`WireError` with a message naming the problem.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from peer.network.frames import handler_name
from peer.compression import ACTIVATION_CODECS, ActivationCodec
from protos.hivepath.peer.v1.stage_pb2 import DESCRIPTOR as STAGE_PROTO, EncodedTensor

__all__ = ["WireError", "activation_codec", "encode_tensor", "decode_tensor", "stage_handler_name", "stage_prefix",
           "STAGE_RPC", "DEFAULT_ACTIVATION_CODEC", "CodecScheme", "codec_scheme"]

STAGE_RPC = STAGE_PROTO.services_by_name["Stage"].methods_by_name["Stage"]
"""The ``Stage`` rpc of ``stage.proto``: one forward or backward pass (a P2P stream handler)."""

DEFAULT_ACTIVATION_CODEC = "int4tok+zstd/first=int5tok+zstd/residual"
"""The codec scheme of activations and gradients unless the trainer picks another: per-token 4-bit
codes, 5-bit for the embedding's output into level 0 and level 0's reply, with residual replies
(:attr:`CodecScheme.residual`). ``bench.stage_codec`` measures it against fp32 activations over 3 seeds
(its figures in docs/BENCHMARKS.md): under an eighth of fp32's bytes, and a demo path trained through
it within the 2% of validation bits per byte that a default may cost, where the same codecs with full
replies miss it."""


class WireError(ValueError):
    """A tensor on the wire is malformed, oversized, of the wrong shape, or holds NaN/Inf."""


@dataclass(frozen=True)
class CodecScheme:
    """How a trainer's stage requests cross the wire: the codec each names (a server answers in the
    request's codec), and whether replies are residual.

    Written ``BASE[/grad=CODEC][/first=CODEC][/first_grad=CODEC][/residual]`` (:func:`codec_scheme`):
    a plain codec name is that codec everywhere, with full replies. Level 0's forward carries the
    embedding's output, whose position component a coarse codec drowns (``bench.stage_codec``), so it
    may get a richer codec than the other hops; gradients may get their own (stochastic rounding).
    """

    base: str
    """The codec of every request not named below."""
    first: Optional[str] = None
    """Level 0's forward: the embedding's output, and level 0's output in the reply."""
    first_grad: Optional[str] = None
    """Level 0's backward: the gradient w.r.t. its output, and the embedding's gradient in the reply."""
    grad: Optional[str] = None
    """Every other level's backward (and level 0's without ``first_grad``)."""
    residual: bool = False
    """Requests ask for residual replies (:attr:`StageRequest.residual`): a server sends its output
    minus its input, and the gradient w.r.t. its input minus the one w.r.t. its output, which the
    trainer adds to the exact tensor it holds. A module is its input plus its blocks' residual
    branches, so the codec's error lands on the branches only, never on the residual stream that
    skips them."""

    def forward(self, level: int) -> str:
        """The codec of the forward request to the ``level``-th level of the path (0 first)."""
        return self.first if level == 0 and self.first else self.base

    def backward(self, level: int) -> str:
        """The codec of the backward request to the ``level``-th level of the path (0 first)."""
        if level == 0 and self.first_grad:
            return self.first_grad
        return self.grad or self.base

    def __str__(self) -> str:
        return self.base + "".join(f"/{key}={value}" for key, value in
                                   [("grad", self.grad), ("first", self.first), ("first_grad", self.first_grad)]
                                   if value) + ("/residual" if self.residual else "")


def stage_prefix(run_id: str) -> str:
    """The prefix of a run's P2P protocol names (:func:`peer.network.frames.handler_name`)."""
    return f"hivepath_{run_id}"


def stage_handler_name(run_id: str) -> str:
    """The P2P protocol name under which stage servers of a run answer :class:`StageRequest` s (the
    ``Stage`` rpc of ``stage.proto``)."""
    return handler_name(stage_prefix(run_id), STAGE_RPC)


def activation_codec(name: str, what: str = "tensor") -> ActivationCodec:
    """The codec of activations and gradients called ``name``: one of
    :data:`peer.compression.ACTIVATION_CODECS`; WireError naming ``what`` otherwise."""
    codec = ACTIVATION_CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise WireError(f"{what} codec {name!r} is not one of {', '.join(ACTIVATION_CODECS)}")
    return codec


def codec_scheme(name: str) -> CodecScheme:
    """The :class:`CodecScheme` written ``name`` (``int8``, ``int4tok+zstd/first=int5tok+zstd/residual``,
    ...); WireError naming the problem if a part or a codec is unknown."""
    base, *parts = str(name).split("/")
    fields: dict[str, str] = {}
    residual = False
    for part in parts:
        key, sep, value = part.partition("=")
        if part == "residual" and not residual:
            residual = True
            continue
        if not sep or key not in ("grad", "first", "first_grad") or key in fields:
            raise WireError(f"codec scheme {name!r}: {part!r} is not grad=CODEC, first=CODEC, first_grad=CODEC or "
                            "residual (once each)")
        fields[key] = value
    for what, codec in [("base", base), *fields.items()]:
        activation_codec(codec, f"codec scheme {name!r}: {what}")
    return CodecScheme(base, residual=residual, **fields)


def encode_tensor(t: Tensor, codec: ActivationCodec) -> EncodedTensor:
    """``t`` (any shape, any device/dtype) as fp32 encoded by ``codec`` (:func:`activation_codec`);
    WireError if it holds NaN/Inf."""
    x = t.detach().to(device="cpu", dtype=torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise WireError(f"tensor of shape {tuple(t.shape)} holds NaN or Inf values")
    return EncodedTensor(shape=list(t.shape), codec=codec.name, data=codec.encode(x))


def decode_tensor(msg: EncodedTensor, what: str, max_elements: int, last_dim: Optional[int] = None,
                  shape: Optional[Sequence[int]] = None) -> Tensor:
    """Decode ``msg`` to a CPU fp32 tensor (B, T, C), checking it against the limits.

    ``what`` names the tensor in error messages; ``last_dim``: the required C; ``shape``: the exact
    shape required (a gradient must match its activations).
    """
    dims = [int(d) for d in msg.shape]
    if len(dims) != 3:
        raise WireError(f"{what} must have shape (batch, tokens, width), got {dims}")
    if any(d <= 0 for d in dims):
        raise WireError(f"{what} shape {dims} has an empty dimension")
    if last_dim is not None and dims[2] != last_dim:
        raise WireError(f"{what} width {dims[2]} differs from the module's d_model {last_dim}")
    if shape is not None and dims != list(shape):
        raise WireError(f"{what} shape {dims} differs from the expected {list(shape)}")
    numel = math.prod(dims)
    if numel > max_elements:
        raise WireError(f"{what} holds {numel} elements, more than this server accepts ({max_elements})")
    codec = activation_codec(msg.codec, what)
    try:
        x = codec.decode(bytes(msg.data), dims)  # (B, T, C)
    except ValueError as e:
        raise WireError(f"{what} payload is malformed: {e}") from None
    if not bool(torch.isfinite(x).all()):
        raise WireError(f"{what} holds NaN or Inf values")
    return x
