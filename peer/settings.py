"""The ``HIVEPATH_*`` environment variables the peer package reads itself, as
:class:`models.settings.Setting` entries (the command line's table, ``hivepath.settings``, shows them too).

Variables only wire deployments (a container, a supervisor); a flag given on the command line wins
over its variable, and the variable over the default written here. Code reads a variable only
through :func:`read` (or :meth:`Setting.read`), never from ``os.environ``: so the table in
``docs/cli.md``, generated from these entries, is every variable there is.

Stdlib and ``models.settings`` only: the spot supervisor and the progress view read it, and importing
it must stay as cheap as the command line's ``--help``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from models.settings import KINDS, Setting

__all__ = ["Setting", "KINDS", "PEER_SETTINGS", "read", "setting"]

_SPOT = "peer join; python -m peer.node.spot (the images' supervisor)"

PEER_SETTINGS: tuple[Setting, ...] = (
    Setting("HIVEPATH_SPOT", "text", "none",
            "watch the cloud's spot/preemption notice and drain on one: none, aws, gcp or auto",
            flag="--spot", read_by=_SPOT),
    Setting("HIVEPATH_SPOT_URL", "text", None,
            "metadata server base URL (default: the provider's own)",
            flag="--spot-url", read_by=_SPOT),
    Setting("HIVEPATH_SPOT_POLL_INTERVAL", "number", 5.0,
            "seconds between spot-notice checks",
            flag="--spot-poll-interval", read_by=_SPOT),
    Setting("HIVEPATH_PEERS_DIR", "text", None,
            "where the peers of this machine register to share its cores, memory and GPUs (default "
            "$XDG_RUNTIME_DIR/hivepath-UID/peers, else the temp dir's)",
            read_by="peer join"),
    Setting("HIVEPATH_PROGRESS_INTERVAL", "number", 5.0,
            "least seconds between two progress lines: a peer's JSON lines (--progress json), the demo's plain "
            "lines (off a terminal or --no-live)", read_by="peer join, demo"),
    Setting("HIVEPATH_TEST_PROTOCOL", "text", None,
            "tests only: speak these protocol versions instead of this release's, e.g. 'all=2.0' or "
            "'dht=1.0,averaging=1.0' (protos.versions)",
            read_by="every peer process (peer join, archive)"),
)
"""The variables of the peer package, each read where its code needs it (see ``read_by``)."""

_BY_NAME = {s.name: s for s in PEER_SETTINGS}


def setting(name: str) -> Setting:
    """The peer's :class:`Setting` called ``name`` (a ``KeyError`` for a variable it does not own)."""
    return _BY_NAME[name]


def read(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The value of the peer's variable ``name`` (see :meth:`Setting.read`)."""
    return _BY_NAME[name].read(environ)
