"""The ``Data.Chunk`` rpc of ``protos/hivepath/peer/v1/data.proto``, both ends' framing and limits.

A fetcher opens one stream per chunk to the handler ``hivepath_data_{manifest_hash}_chunk``
(:func:`data_prefix`, ``peer.network.frames.handler_name``), sends a :class:`ChunkRequest` and reads
a :class:`ChunkReply` and the chunk's bytes as a length-prefixed blob. A request is bounded by
:data:`MAX_REQUEST_BYTES` (a file name and two numbers), a reply's blob by the chunk's size in the
manifest (or :data:`MANIFEST_CHUNK` for the manifest itself): nothing larger is read.
"""

from __future__ import annotations

import asyncio
from typing import Any

from peer.network.frames import handler_name, linger, read_payload
from protos import versions
from protos.hivepath.peer.v1.data_pb2 import DESCRIPTOR as DATA, ChunkReply, ChunkRequest

__all__ = ["CHUNK", "ChunkReply", "ChunkRequest", "MANIFEST_CHUNK", "MAX_MANIFEST_BYTES", "MAX_REQUEST_BYTES",
           "data_prefix", "request_chunk", "linger"]

CHUNK = DATA.services_by_name["Data"].methods_by_name["Chunk"]
"""The ``Chunk`` rpc: one chunk of one file of a dataset."""

MAX_REQUEST_BYTES = 1024
"""A chunk request is a manifest hash, a file name and an index: anything larger is refused unread."""

MANIFEST_CHUNK = 1 << 20
"""Bytes of ``manifest.json`` per chunk (its own size is not in any manifest)."""

MAX_MANIFEST_BYTES = 256 << 20
"""The largest manifest a fetcher accepts (per-chunk hashes of a 4 TB dataset at 1 MiB chunks)."""


def data_prefix(manifest_hash: str) -> str:
    """The handler prefix of one dataset's seeders: ``hivepath_data_{manifest_hash}``."""
    return f"hivepath_data_{manifest_hash}"


async def request_chunk(p2p: Any, peer_id: str, manifest_hash: str, file: str, index: int, limit: int,
                        timeout: float) -> tuple[ChunkReply, bytes]:
    """Ask ``peer_id`` for chunk ``index`` of ``file``; its reply and at most ``limit`` bytes, within
    ``timeout`` seconds. A refusal is a reply with ``ok`` false (and no bytes); a broken stream,
    an error frame or a blob over ``limit`` raises."""
    from hivemind.p2p import P2P, PeerID

    async def ask() -> tuple[ChunkReply, bytes]:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id),
                                                                 handler_name(data_prefix(manifest_hash), CHUNK))
        try:
            request = ChunkRequest(manifest_hash=manifest_hash, file=file, index=index,
                                   protocol=versions.stamp("data", "ChunkRequest.protocol"))
            await P2P.send_protobuf(request, writer)
            reply, err = await P2P.receive_protobuf(ChunkReply, reader)
            if reply is None:
                raise ConnectionError(f"the seeder answered with an error: {err.message}")
            blob = await read_payload(reader, limit if reply.ok else 0)
            return reply, bytes(blob)
        finally:
            writer.close()

    return await asyncio.wait_for(ask(), timeout)
