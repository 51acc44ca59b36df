"""A peer's persistent libp2p identity: one private-key file gives the same peer id on every restart.

The file holds a serialized libp2p private key (hivemind's RSA format). While a peer runs it holds an
exclusive ``flock`` on ``<file>.lock``; a second peer started with the same file is refused with
:class:`IdentityInUseError` (exit code 6) instead of fighting over the peer id on the network.
The lock is released by the kernel when the holder exits, so a crashed peer never leaves it stale.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

from models.errors import HivepathError
from peer.network.pidlock import LockHeld, release, take

__all__ = ["Identity", "IdentityError", "IdentityInUseError", "load_or_create_identity", "peer_id_of"]

log = logging.getLogger(__name__)


class IdentityError(HivepathError):
    """The identity file cannot be created or read."""


class IdentityInUseError(HivepathError):
    """Another live peer on this machine holds the identity file."""

    exit_code = 6


def peer_id_of(path: Union[str, Path]) -> str:
    """The base58 peer id that the identity file at ``path`` gives (no lock taken)."""
    from hivemind.p2p import PeerID

    try:
        return PeerID.from_identity(Path(path).read_bytes()).to_base58()
    except OSError as e:
        raise IdentityError(f"cannot read identity file {path}: {e}; pass another --identity path") from None
    except Exception as e:  # a malformed key raises from the crypto layer
        raise IdentityError(
            f"identity file {path} is not a libp2p private key ({e}); delete it to create a new identity"
        ) from None


class Identity:
    """A locked identity file. Keep the object alive as long as the peer runs; :meth:`release` unlocks."""

    def __init__(self, path: Path, lock_fd: int, peer_id: str):
        self.path = path
        self.peer_id = peer_id
        self._lock_fd: Optional[int] = lock_fd

    def release(self) -> None:
        """Drop the lock so another process may use this identity."""
        if self._lock_fd is not None:
            release(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "Identity":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Identity({str(self.path)!r}, peer_id={self.peer_id})"


def load_or_create_identity(path: Union[str, Path]) -> Identity:
    """Lock ``path`` (creating a new private key there if absent) and return its :class:`Identity`.

    Raises :class:`IdentityInUseError` if a live process holds the file, :class:`IdentityError` if it
    cannot be created or is not a private key.
    """
    from hivemind.p2p import P2P

    path = Path(path).expanduser().resolve()
    if not path.parent.is_dir():
        raise IdentityError(f"directory {path.parent} for identity file {path.name} does not exist; create it first")
    lock_path = path.with_name(path.name + ".lock")
    try:
        fd = take(lock_path)
    except LockHeld as e:
        raise IdentityInUseError(
            f"identity file {path} is in use by a live process{f' (pid {e.pid})' if e.pid else ''}; stop it, or "
            "give this process its own work dir (peer join --work-dir, archive --dir), which holds its own identity"
        ) from None
    except OSError as e:
        raise IdentityError(f"cannot create lock file {lock_path}: {e}; check the directory's permissions") from None
    try:
        if not path.exists():
            log.info("creating a new identity in %s", path)
            P2P.generate_identity(str(path))
        peer_id = peer_id_of(path)
    except BaseException:
        release(fd)
        raise
    log.info("identity %s: peer id %s", path, peer_id)
    return Identity(path, fd, peer_id)

