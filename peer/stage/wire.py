"""Activations and gradients on the wire between a trainer and a stage server (stage mode).

Tensors travel as :class:`protos.hivepath.peer.v1.stage_pb2.EncodedTensor`: a shape, a codec name and the bytes of the
tensor encoded by one of :data:`peer.stage.activation_codec.ACTIVATION_CODECS`: the pseudo-gradient
codecs on the flat vector (int8 blockwise absmax by default; fp16 and none; SWARM, Ryabinin et al. 2023,
compresses activations the same way), or ``int4tok+zstd`` (per-token 4-bit codes behind zstd, about a
tenth of fp32's bytes; 5 and 6 bits also). A trainer resolves its codec scheme once
(:func:`codec_scheme`: a codec per level and direction, e.g. a richer one for the embedding's output);
a server answers in the codec the request names. Decoding checks
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
from peer.stage.activation_codec import ACTIVATION_CODECS, ActivationCodec
from protos.hivepath.peer.v1.stage_pb2 import DESCRIPTOR as STAGE_PROTO, EncodedTensor

__all__ = ["WireError", "activation_codec", "encode_tensor", "decode_tensor", "stage_handler_name", "stage_prefix",
           "STAGE_RPC", "DEFAULT_ACTIVATION_CODEC", "CodecScheme", "codec_scheme"]

STAGE_RPC = STAGE_PROTO.services_by_name["Stage"].methods_by_name["Stage"]
"""The ``Stage`` rpc of ``stage.proto``: one forward or backward pass (a P2P stream handler)."""

DEFAULT_ACTIVATION_CODEC = "int8"
"""Codec of activations and gradients unless the trainer picks another. Not ``int4tok+zstd``: 0.39 of
int8's bytes, but a demo path trained 500 steps through it scores 3.9% more validation bits per byte
than with fp32 activations (mean of 3 seeds; int8: -0.8%, seed noise) (``bench.stage_codec``)."""


class WireError(ValueError):
    """A tensor on the wire is malformed, oversized, of the wrong shape, or holds NaN/Inf."""


@dataclass(frozen=True)
class CodecScheme:
    """Which codec each of a trainer's stage requests names (a server answers in the request's codec).

    Written ``BASE[/first=CODEC][/first_grad=CODEC]`` (:func:`codec_scheme`): a plain codec name is
    that codec everywhere. Level 0's forward carries the embedding's output, whose position component
    a coarse codec drowns (``bench.stage_codec``), so it may get a richer codec than the other hops.
    """

    base: str
    """The codec of every request not named below."""
    first: Optional[str] = None
    """Level 0's forward: the embedding's output, and level 0's output in the reply."""
    first_grad: Optional[str] = None
    """Level 0's backward: the gradient w.r.t. its output, and the embedding's gradient in the reply."""

    def forward(self, level: int) -> str:
        """The codec of the forward request to the ``level``-th level of the path (0 first)."""
        return self.first if level == 0 and self.first else self.base

    def backward(self, level: int) -> str:
        """The codec of the backward request to the ``level``-th level of the path (0 first)."""
        return self.first_grad if level == 0 and self.first_grad else self.base

    def __str__(self) -> str:
        return self.base + (f"/first={self.first}" if self.first else "") + (
            f"/first_grad={self.first_grad}" if self.first_grad else "")


def stage_prefix(run_id: str) -> str:
    """The prefix of a run's P2P protocol names (:func:`peer.network.frames.handler_name`)."""
    return f"hivepath_{run_id}"


def stage_handler_name(run_id: str) -> str:
    """The P2P protocol name under which stage servers of a run answer :class:`StageRequest` s (the
    ``Stage`` rpc of ``stage.proto``)."""
    return handler_name(stage_prefix(run_id), STAGE_RPC)


def activation_codec(name: str, what: str = "tensor") -> ActivationCodec:
    """The codec of activations and gradients called ``name``: one of
    :data:`peer.stage.activation_codec.ACTIVATION_CODECS`; WireError naming ``what`` otherwise."""
    codec = ACTIVATION_CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise WireError(f"{what} codec {name!r} is not one of {', '.join(ACTIVATION_CODECS)}")
    return codec


def codec_scheme(name: str) -> CodecScheme:
    """The :class:`CodecScheme` written ``name`` (``int8``, ``int4tok+zstd/first=int5tok+zstd``, ...);
    WireError naming the problem if a part or a codec is unknown."""
    base, *parts = str(name).split("/")
    fields: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in ("first", "first_grad") or key in fields:
            raise WireError(f"codec scheme {name!r}: {part!r} is not first=CODEC or first_grad=CODEC (once each)")
        fields[key] = value
    for what, codec in [("base", base), *fields.items()]:
        activation_codec(codec, f"codec scheme {name!r}: {what}")
    return CodecScheme(base, **fields)


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
