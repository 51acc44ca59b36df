"""Which holders may average together: those whose exchange produces the same bytes.

A group's members each reduce a part of the module's vector and every member applies the mean it
gets back; that is one replica only when every member encodes, reduces and decodes the same way.
What decides it, beyond the run config (whose hash fixes the codec and the model), is the averaging
protocol's major (:mod:`protos.versions`) and :data:`BYTES_REVISION`. :func:`wire_key` names both;
matchmaking groups only declarations and joins of the key it has (``GroupDeclaration.wire``,
``JoinRequest.wire``), so peers of releases whose bytes differ form separate groups, never one group
with two results.
"""

from __future__ import annotations

from protos import versions

__all__ = ["BYTES_REVISION", "wire_key"]

BYTES_REVISION = 0
"""Revision of the bytes a group computes within the averaging protocol's major: the codecs'
encodings (pinned by ``tests/peer/compression/test_compression.py``'s golden bytes), the reduction rule and the order
of its sums. A change to any of them raises it (a minor version of the protocol whose messages are
still read by the previous minor, but whose members no longer average with it)."""


def wire_key() -> str:
    """This peer's averaging bytes key: '' for the averaging protocol 1's first bytes (what releases
    that stated no key computed), else ``"{major}.{revision}"``."""
    major = versions.stated("averaging")[0]
    return "" if (major, BYTES_REVISION) == (1, 0) else f"{major}.{BYTES_REVISION}"
