"""The admission credential: the coordinator's signed statement "peer P is admitted to run R until T".

A credential is the contract between the coordinator (which signs it at join and renews it in
heartbeat replies) and peers (which carry it in their DHT records, matchmaking join requests and
state-transfer requests, and check each other's). It lives here, beside the other contracts, so both
sides share one byte format without importing each other; it needs only ``cryptography`` (no torch,
no hivemind, no gRPC).

Byte format, version 1 (all integers big-endian)::

    magic     4 bytes   b"HPC1"
    run_len   1 byte    length of run_id (1..255)
    run_id    run_len   UTF-8
    peer_len  1 byte    length of peer_id (1..255)
    peer_id   peer_len  ASCII base58 libp2p peer id
    expires   8 bytes   IEEE-754 float64, unix seconds
    signature 64 bytes  Ed25519 over SIGNING_CONTEXT + every byte above

The signature covers a context string so a credential signature can never be confused with another
use of the coordinator's key. Keys are raw 32-byte Ed25519 public keys (the RunSpec carries it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Union

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "Credential",
    "CredentialError",
    "MAGIC",
    "SIGNING_CONTEXT",
    "MAX_CREDENTIAL_BYTES",
    "PUBLIC_KEY_BYTES",
    "sign_credential",
    "decode_credential",
    "verify_credential",
]

MAGIC = b"HPC1"
SIGNING_CONTEXT = b"hivepath-credential-v1\x00"
PUBLIC_KEY_BYTES = 32
_SIG = 64
MAX_CREDENTIAL_BYTES = len(MAGIC) + 1 + 255 + 1 + 255 + 8 + _SIG
"""No valid credential is longer; longer blobs are refused before parsing."""


class CredentialError(ValueError):
    """A credential blob is malformed (not one that merely fails verification)."""


@dataclass(frozen=True)
class Credential:
    """A decoded credential; :meth:`encode` gives the exact bytes that travel."""

    run_id: str
    peer_id: str
    expires_at: float
    """Unix seconds after which the credential is no longer valid."""
    signature: bytes

    def body(self) -> bytes:
        """Every byte the signature covers, after the context string."""
        run, peer = self.run_id.encode("utf-8"), self.peer_id.encode("ascii")
        if not 0 < len(run) < 256 or not 0 < len(peer) < 256:
            raise CredentialError("run_id and peer_id must each be 1-255 bytes")
        return MAGIC + bytes([len(run)]) + run + bytes([len(peer)]) + peer + struct.pack(">d", self.expires_at)

    def encode(self) -> bytes:
        return self.body() + self.signature


def sign_credential(key: Ed25519PrivateKey, run_id: str, peer_id: str, expires_at: float) -> Credential:
    """The coordinator's side: a credential for ``peer_id`` in ``run_id`` valid until ``expires_at``."""
    unsigned = Credential(run_id, peer_id, float(expires_at), b"")
    return Credential(run_id, peer_id, float(expires_at), key.sign(SIGNING_CONTEXT + unsigned.body()))


def decode_credential(blob: bytes) -> Credential:
    """Parse ``blob`` strictly (exact length, magic, UTF-8/ASCII fields); raises :class:`CredentialError`."""
    if not isinstance(blob, (bytes, bytearray)):
        raise CredentialError(f"credential is a {type(blob).__name__}, not bytes")
    blob = bytes(blob)
    if len(blob) > MAX_CREDENTIAL_BYTES:
        raise CredentialError(f"credential is {len(blob)} bytes, the limit is {MAX_CREDENTIAL_BYTES}")
    if len(blob) < len(MAGIC) + 2 + 8 + _SIG or not blob.startswith(MAGIC):
        raise CredentialError("not a hivepath credential (bad magic or too short)")
    pos = len(MAGIC)
    try:
        run_len = blob[pos]
        run_id = blob[pos + 1:pos + 1 + run_len].decode("utf-8")
        pos += 1 + run_len
        peer_len = blob[pos]
        peer_id = blob[pos + 1:pos + 1 + peer_len].decode("ascii")
        pos += 1 + peer_len
        (expires_at,) = struct.unpack(">d", blob[pos:pos + 8])
    except (IndexError, UnicodeDecodeError, struct.error):
        raise CredentialError("credential fields are truncated or not text") from None
    pos += 8
    if not run_id or not peer_id or len(run_id.encode("utf-8")) != run_len or len(peer_id) != peer_len:
        raise CredentialError("credential fields are truncated")
    if len(blob) - pos != _SIG:
        raise CredentialError(f"credential signature is {len(blob) - pos} bytes, expected {_SIG}")
    return Credential(run_id, peer_id, expires_at, blob[pos:])


def verify_credential(blob: Union[bytes, Credential], public_key: bytes, run_id: str, peer_id: str,
                      now: float) -> tuple[Optional[Credential], str]:
    """Check a credential presented by ``peer_id`` in ``run_id`` at time ``now``.

    Returns ``(credential, "")`` when it is well formed, signed by ``public_key`` (raw Ed25519),
    for this run and this peer, and not expired; else ``(None, reason)`` with the first problem."""
    try:
        cred = blob if isinstance(blob, Credential) else decode_credential(blob)
    except CredentialError as e:
        return None, str(e)
    if cred.run_id != run_id:
        return None, f"credential is for run {cred.run_id!r}, not {run_id!r}"
    if cred.peer_id != peer_id:
        return None, f"credential belongs to {cred.peer_id}, not to the sender {peer_id}"
    if not cred.expires_at > now:  # also refuses NaN
        return None, f"credential expired {now - cred.expires_at:.0f}s ago" if cred.expires_at == cred.expires_at \
            else "credential expiry is not a number"
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(cred.signature, SIGNING_CONTEXT + cred.body())
    except (InvalidSignature, ValueError, CredentialError):
        return None, "credential signature is not the coordinator's"
    return cred, ""
