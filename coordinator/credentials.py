"""The coordinator's signing key and the credentials it issues (format: :mod:`protos.credential`).

The key is an Ed25519 private key kept in a file beside the database (``<db>.key`` unless
``--key`` says otherwise), created with mode 0600 on first start and reused afterwards, so
credentials issued before a restart stay valid. Its public half goes into every RunSpec; peers
verify each other's credentials against it. The key is never logged; only its fingerprint is.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Optional

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from models.errors import HivepathError
from protos.credential import Credential, sign_credential

__all__ = ["CredentialIssuer", "CredentialBook", "load_or_create_key", "default_key_path"]

log = logging.getLogger(__name__)


def default_key_path(db: str) -> Optional[str]:
    """``<db>.key``; None for an in-memory database (the key then lives only in memory too)."""
    return None if db == ":memory:" else f"{db}.key"


def load_or_create_key(path: Optional[str]) -> Ed25519PrivateKey:
    """The Ed25519 key in ``path`` (PEM, PKCS8), created there with mode 0600 when missing."""
    if path is None:
        return Ed25519PrivateKey.generate()
    p = Path(path)
    if p.exists():
        try:
            key = serialization.load_pem_private_key(p.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as e:
            raise HivepathError(f"--key {path}: cannot read the coordinator key ({type(e).__name__}); "
                                "restore it or move it away to create a new one (peers must then re-join)") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise HivepathError(f"--key {path}: not an Ed25519 key; move it away to create a new one")
        return key
    if not p.resolve().parent.is_dir():
        raise HivepathError(f"--key {path}: directory {p.parent} does not exist; create it first")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    log.info("created the coordinator key %s", p)
    return key


class CredentialIssuer:
    """Signs credentials for one run: ``issue(peer_id, now)`` lasts ``credential_timeout`` seconds."""

    def __init__(self, key: Ed25519PrivateKey, run_id: str, credential_timeout: float):
        self._key = key
        self.run_id = run_id
        self.credential_timeout = credential_timeout
        self.public_key = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.fingerprint = hashlib.sha256(self.public_key).hexdigest()[:16]

    def issue(self, peer_id: str, now: float) -> Credential:
        return sign_credential(self._key, self.run_id, peer_id, now + self.credential_timeout)

    def needs_renewal(self, expires_at: float, now: float) -> bool:
        """Renew once less than half the credential's life is left (heartbeats come far more often)."""
        return expires_at - now < self.credential_timeout / 2

    def __repr__(self) -> str:  # never show the key
        return f"CredentialIssuer(run_id={self.run_id!r}, fingerprint={self.fingerprint})"


class CredentialBook:
    """When each peer's latest credential expires, so that a heartbeat renews it in time. Not
    thread-safe: the coordinator holds its lock around every call."""

    def __init__(self, issuer: CredentialIssuer):
        self._issuer = issuer
        self._expiry: dict[str, float] = {}

    def issue(self, peer_id: str, now: float) -> bytes:
        """A new credential for ``peer_id``, encoded."""
        cred = self._issuer.issue(peer_id, now)
        self._expiry[peer_id] = cred.expires_at
        return cred.encode()

    def renewal(self, peer_id: str, now: float) -> bytes:
        """A new credential when ``peer_id``'s is due for renewal (or it has none), else ``b""``."""
        return self.issue(peer_id, now) if self._issuer.needs_renewal(self._expiry.get(peer_id, 0.0), now) else b""

    def forget(self, peer_id: str) -> None:
        """Forget ``peer_id``'s credential (a banned peer: it holds no lease to heartbeat with)."""
        self._expiry.pop(peer_id, None)
