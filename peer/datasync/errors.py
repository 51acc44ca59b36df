"""What can go wrong when fetching a dataset, each a one-line :class:`models.errors.HivepathError`.

Exit codes follow ``models.errors``: no seeder is a network problem (3), a manifest that is not the
run's is an incompatible dataset (4), a full disk is the user's to fix (2).
"""

from __future__ import annotations

from models.errors import DataError, HivepathError
from models.manifest import ManifestMismatch

__all__ = ["FetchError", "NoSeeder", "DiskFull", "ManifestMismatch", "SeedError"]


class FetchError(HivepathError):
    """A dataset could not be fetched; the message says which file and what to do."""

    exit_code = 3


class NoSeeder(FetchError):
    """No seeder sent a file (or the manifest) within the deadline."""

    exit_code = 3


class DiskFull(FetchError):
    """The disk has no room for the files; the verified chunks are kept for a resumed fetch."""

    exit_code = 2


class SeedError(DataError):
    """A dataset directory cannot be seeded (not prepared, or a format-1 manifest)."""
