"""A volunteer needs no data of its own: peers seed the dataset files they hold and fetch their
path's shards from each other over hivemind's p2p streams, every chunk verified against the manifest.

- ``seeder``: :class:`Seeder` serves one prepared dataset directory's files chunk by chunk and
  announces on the DHT which files it holds (``hivepath data serve``; any peer may seed what it holds).
- ``fetcher``: :func:`fetch` / :func:`fetch_async` get the manifest (checked against the expected
  manifest hash), then the router, tokenizer and the wanted paths' shards, from several seeders at
  once, resumable, dropping and reporting a seeder that sends bad bytes; :func:`fetch_manifest` for
  ``hivepath data info``.
- ``fetch_job``: the chunks of one fetch and the requests in flight for them; :class:`FetchOptions`,
  :class:`FetchProgress`, :class:`FetchResult`.
- ``seeder_swarm``: the seeders of a dataset as one fetch knows them (rested, banned);
  :func:`find_seeders` for ``hivepath data info``.
- ``cache``: :class:`ShardCache`, a peer's fetched shards under a disk budget (least recently
  trained path out first, never the path being trained).
- ``partial``: a file being fetched (``.part`` plus the record of its verified chunks) and its
  rename into place once whole and verified.
- ``records``: the seeder record (:class:`SeederRecord`, a bitmap of files) under
  :func:`seeders_key`, derived from the manifest hash.
- ``protocol``: the ``Data.Chunk`` rpc of ``protos/hivepath/peer/v1/data.proto`` and its limits, and
- ``session``: :func:`join_swarm`, a data command's DHT node from ``--initial-peers`` and/or the
  coordinator's run spec (no lease, no heartbeats).
- ``errors``: :class:`NoSeeder`, :class:`ManifestMismatch`, :class:`DiskFull` (one-line messages).

What a chunk is and its hash live in :mod:`models.manifest` (manifest format 2). Imports
``peer.network`` only (no torch of its own: hivemind brings it); the command line imports this
package only when a data command that talks to the network runs.
"""

from peer.datasync.cache import USED_FILE, ShardCache
from peer.datasync.errors import DiskFull, FetchError, ManifestMismatch, NoSeeder, SeedError
from peer.datasync.fetch_job import FetchOptions, FetchProgress, FetchResult
from peer.datasync.fetcher import fetch, fetch_async, fetch_manifest
from peer.datasync.partial import STATE_DIR, PartialFile
from peer.datasync.records import RECORD_TTL, SeederRecord, seeders_key
from peer.datasync.seeder import Seeder, SeederOptions, read_local_manifest
from peer.datasync.seeder_swarm import find_seeders
from peer.datasync.session import SwarmAccess, join_swarm

__all__ = [
    "ShardCache", "USED_FILE", "DiskFull", "FetchError", "ManifestMismatch", "NoSeeder", "SeedError", "FetchOptions", "FetchProgress",
    "FetchResult", "fetch", "fetch_async", "fetch_manifest", "find_seeders", "STATE_DIR", "PartialFile", "RECORD_TTL",
    "SeederRecord", "seeders_key", "Seeder", "SeederOptions", "read_local_manifest", "SwarmAccess", "join_swarm",
]
