"""Stage mode (SWARM, Ryabinin et al. 2023): one module served as a pipeline stage over P2P.

- ``records``: the DHT records by which stage servers announce themselves (load, throughput).
- ``wire``: activations and gradients on the wire (:func:`activation_codec`, :func:`encode_tensor`,
  :func:`decode_tensor`), in the codecs of :data:`peer.compression.ACTIVATION_CODECS` (the value codecs
  on the flat vector, and ``int4tok+zstd``, per-token 4-bit codes behind zstd).
- ``server``: :class:`StageServer`, forward/backward of one module for trainers, with DiLoCo rounds.
- ``client``: :class:`StageClient`, a trainer's way through the stages, picking servers by throughput.
- ``endpoint``: the stage protocol's one handler per p2p daemon, handing requests to the server now attached.
- ``activity``: :class:`IdleHolds` (an idle server or trainer holds back no round) and :class:`ServedRate`.

The long-running stage processes (a server's life, a stage trainer's loop) are in ``peer.node.stage_runner``.
Imports ``peer.diloco``, ``peer.averaging``, ``peer.compression`` and ``peer.network``.
"""

from peer.stage.client import Hop, StageClient, StageRequestError, StageUnavailable, choose_server
from peer.stage.records import StageServerEntry, StageServerRecord, stage_records_from_value, stage_servers_key
from peer.stage.server import StageEventHook, StageServer, StageServerOptions
from peer.stage.wire import DEFAULT_ACTIVATION_CODEC, WireError, activation_codec, decode_tensor, encode_tensor

__all__ = [
    "Hop", "StageClient", "StageRequestError", "StageUnavailable", "choose_server", "StageServerEntry",
    "StageServerRecord", "stage_records_from_value", "stage_servers_key", "StageEventHook", "StageServer",
    "StageServerOptions", "DEFAULT_ACTIVATION_CODEC", "WireError", "activation_codec", "decode_tensor", "encode_tensor",
]
