"""The peer's place in the swarm: who it is, how it reaches the DHT, and what it may write there.

- ``identity``: the persistent libp2p key file (:func:`load_or_create_identity`), one process per file.
- ``dht``: :func:`start_dht` (hivemind's DHT with our identity, admission and bootstrap options), and
  :func:`own_p2p` (a P2P handle of a component's own, never the process's shared one).
- ``relays``: circuit relays for peers behind NAT (:func:`circuit_addrs`; static relays for the daemon).
- ``records``: the schema and key of every DHT record a peer writes (holders, group declarations,
  archive records), validated where read (:func:`read_records`, :func:`records_from_value`).
- ``credentials``: admission credentials signed by the coordinator, checked by every member
  (:class:`CredentialVerifier`).
- ``admission``: :class:`AdmissionValidator`, the DHT record validator that refuses uncredentialed records.
- ``frames``: the peers' p2p doors (:func:`~peer.network.frames.serve`): the stream handlers of the
  services in ``protos/hivepath/peer/v1``, reading each frame with a limit and refusing malformed ones
  with one rate-limited log line. Imported by path (``peer.network.frames``): it needs no DHT.
- ``lanes`` and ``lane_wire``: direct lanes (:class:`~peer.network.lanes.DirectLanes`), TLS connections
  between two peers, opened through the authenticated p2p stream, that carry the all-reduce's parts
  outside the p2p daemons (a third less CPU per byte). Imported by path too.

Imports nothing of ``peer`` outside this package.
"""

from peer.network.admission import AdmissionValidator
from peer.network.credentials import CredentialProvider, CredentialVerifier
from peer.network.dht import DHTOptions, DHTStartError, PeerDHT, own_p2p, start_dht, unwrap_dht
from peer.network.identity import Identity, IdentityError, IdentityInUseError, load_or_create_identity, peer_id_of
from peer.network.relays import circuit_addrs
from peer.network.records import (
    MAX_EXPECTING,
    ArchiveRecord,
    OwnExpirations,
    GroupDeclaration,
    HolderRecord,
    archive_key,
    group_bucket,
    group_buckets,
    level_group_key,
    split_levels,
    top_group_key,
    group_key,
    holders_key,
    is_peer_id,
    is_withdrawal,
    parse_record,
    read_records,
    records_from_value,
    refresh_until,
    store_within,
    STORE_TIMEOUT,
    stamped,
    to_value,
    version_problem,
    withdrawal,
    withdrawn_rounds,
)

__all__ = [
    "AdmissionValidator", "CredentialProvider", "CredentialVerifier", "DHTOptions", "DHTStartError", "PeerDHT",
    "start_dht", "unwrap_dht", "own_p2p", "Identity", "IdentityError", "IdentityInUseError", "load_or_create_identity",
    "peer_id_of", "MAX_EXPECTING", "ArchiveRecord", "OwnExpirations", "GroupDeclaration", "HolderRecord", "archive_key", "group_bucket",
    "group_buckets", "group_key", "top_group_key", "level_group_key", "split_levels",
    "holders_key", "is_peer_id", "is_withdrawal", "parse_record", "read_records", "records_from_value", "refresh_until", "store_within", "STORE_TIMEOUT", "to_value", "withdrawal",
    "withdrawn_rounds", "stamped", "version_problem",
    "circuit_addrs",
]
