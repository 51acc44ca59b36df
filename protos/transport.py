"""The gRPC transport limits both ends of the coordinator's contract must agree on, written once:
the peer's client (``peer.coordinator_client``) and the coordinator's server (``coordinator.server``)
both build their channel options from these.

- Keepalive: a peer pings every :data:`PING_INTERVAL_MS` and gives the link :data:`PING_TIMEOUT_MS`
  to answer, so a link that silently drops packets (a partition, a moved container) is noticed and
  the channel reconnects; the coordinator accepts pings as often as :data:`MIN_PING_INTERVAL_MS`
  (more often is answered with GOAWAY, as gRPC does by default for anything under 5 minutes), which
  must not exceed the peers' interval.
- Message sizes: a request to the coordinator is at most :data:`MAX_REQUEST_BYTES`; a reply at most
  :data:`MAX_REPLY_BYTES` (status replies list every live peer).

Stdlib only: the coordinator's image and the peer both import it.
"""

from __future__ import annotations

__all__ = ["PING_INTERVAL_MS", "PING_TIMEOUT_MS", "MIN_PING_INTERVAL_MS", "MAX_REQUEST_BYTES", "MAX_REPLY_BYTES"]

PING_INTERVAL_MS = 10_000
"""A peer's HTTP/2 ping interval on its channel to the coordinator."""
PING_TIMEOUT_MS = 5_000
"""How long a peer waits for a ping's answer before it takes the connection as dead."""
MIN_PING_INTERVAL_MS = 5_000
"""The least interval between pings the coordinator accepts (at most :data:`PING_INTERVAL_MS`)."""
MAX_REQUEST_BYTES = 1 << 20
"""The largest message the coordinator receives."""
MAX_REPLY_BYTES = 64 << 20
"""The largest message the coordinator sends and a peer receives: 64 MiB holds a status reply of a
few hundred thousand peers."""
