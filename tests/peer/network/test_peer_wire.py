"""The peers' p2p doors against raw bytes: every rpc of every service in ``protos/hivepath/peer/v1``
(the averaging handlers Join, Part and State, and the stage server's Stage) is sent frames that are
not what it expects, over a real p2p daemon, to a real peer process (``tests/helpers/p2p_host.py``).

The frames are generated from the service descriptors, as the coordinator's wire test does: an rpc
added to a ``.proto`` is fuzzed without touching this file, and one without a registered handler
fails here. A frame that does not parse as the request message, a bad marker byte, an announced
length past the limit or an error frame in place of a request gets exactly one error frame,
"malformed request", and the stream closes; a frame that parses is the handler's to judge and gets a
reply, never a handler failure. The process keeps serving (a state request is answered after the
storm), logs no traceback, and logs at most one line per rpc per minute about refused frames.
"""

from __future__ import annotations

import asyncio
import json
import re
import select
import subprocess
import sys
import time
from typing import Optional

import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message_factory import GetMessageClass
from hivemind.proto.p2pd_pb2 import RPCError

from helpers.procs import ROOT
from helpers.protowire import frames, parses
from peer.network.frames import MALFORMED, handler_name
from protos.hivepath.peer.v1 import net_pb2, stage_pb2

pytestmark = pytest.mark.integration

SERVICES = [*net_pb2.DESCRIPTOR.services_by_name.values(), *stage_pb2.DESCRIPTOR.services_by_name.values()]
METHODS = [m for s in SERVICES for m in s.methods]
REPLY_TIMEOUT = 10.0
PENDING_TIMEOUT = 1.0
"""Seconds to wait for a reply the handler may rightly hold back (see :data:`WAITS_FOR_ITS_GROUP`)."""
WAITS_FOR_ITS_GROUP = {"Part", "Result"}
"""Rpcs whose well-formed request may get no reply within the test's patience (a part, or a round's
average, of a group the host does not know waits for that group to form)."""


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    log = tmp_path_factory.mktemp("p2p_host") / "host.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "p2p_host.py")], cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120.0)  # its first line, or EOF when it dies
        line = proc.stdout.readline() if ready else b""
        if not line:
            raise AssertionError(f"the p2p host did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        info = json.loads(line)
        info["log"], info["proc"] = log, proc
        yield info
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _frame(marker: bytes, body: bytes, length: Optional[int] = None) -> bytes:
    return marker + (len(body) if length is None else length).to_bytes(8, "big") + body


class Client:
    """A p2p daemon of our own that opens streams to the host's handlers."""

    def __init__(self, host: dict):
        self.host = host
        self.prefix = f"hivepath_{host['run_id']}"

    async def __aenter__(self) -> "Client":
        from hivemind.p2p import P2P, PeerID

        self.p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=self.host["maddrs"])
        self.peer = PeerID.from_base58(self.host["peer_id"])
        return self

    async def __aexit__(self, *exc) -> None:
        await self.p2p.shutdown()

    async def exchange(self, m: MethodDescriptor, data: bytes, patient: bool = True) -> tuple[str, bytes]:
        """Send ``data`` on a fresh stream to ``m``'s handler; ``("error", text)``, ``("message", bytes)``,
        ``("closed", b"")`` or, when not ``patient``, ``("pending", b"")`` if nothing came back in time."""
        _, reader, writer = await self.p2p.call_binary_stream_handler(self.peer, handler_name(self.prefix, m))
        try:
            writer.write(data)
            await writer.drain()
            try:
                marker = await asyncio.wait_for(reader.readexactly(1), REPLY_TIMEOUT if patient else PENDING_TIMEOUT)
            except asyncio.IncompleteReadError:
                return "closed", b""
            except asyncio.TimeoutError:
                if patient:
                    raise AssertionError(f"{m.name}: no reply within {REPLY_TIMEOUT}s") from None
                return "pending", b""
            size = int.from_bytes(await reader.readexactly(8), "big")
            body = await reader.readexactly(size)
            if marker == b"\x01":
                return "error", RPCError.FromString(body).message.encode()
            return "message", body
        finally:
            writer.close()


def test_raw_frames_to_every_p2p_handler_are_refused_cleanly_and_the_peer_keeps_serving(host):
    assert {m.name for m in METHODS} >= {"Join", "Part", "State", "Stage"}
    started = time.monotonic()

    async def storm() -> dict[str, int]:
        refused: dict[str, int] = {}
        async with Client(host) as client:
            for m in METHODS:
                d = m.input_type
                cases = {name: _frame(b"\x00", f) for name, f in frames(d, m.full_name).items()}
                bad = {name for name, f in frames(d, m.full_name).items() if not parses(d, f)}
                protocol = {  # frames that are wrong whatever their content
                    "marker-7": _frame(b"\x07", b""),
                    "length-2**62": _frame(b"\x00", b"", length=2**62),
                    "error-frame-with-text": _frame(b"\x01", RPCError(message="x").SerializeToString()),
                }
                cases.update(protocol)
                bad |= set(protocol)
                for name, data in cases.items():
                    kind, body = await client.exchange(m, data, patient=name in bad or m.name not in WAITS_FOR_ITS_GROUP)
                    if name in bad:
                        assert (kind, body) == ("error", MALFORMED.encode()), (m.name, name, kind, body)
                        refused[m.name] = refused.get(m.name, 0) + 1
                    else:  # the handler judged it: a reply of its own, never a failure
                        assert kind in ("message", "pending"), (m.name, name, kind, body)
                # cut off mid-frame: nothing to answer, nothing to log beyond a debug line
                assert (await client.exchange(m, b"\x00" + (100).to_bytes(8, "big") + b"abc", patient=False))[0] \
                    in ("pending", "closed")
            # still serving: a well-formed state request is answered with the state
            state_rpc = net_pb2.DESCRIPTOR.services_by_name["Averaging"].methods_by_name["State"]
            request = net_pb2.StateRequest(module_id=host["module"], config_hash=host["config_hash"])
            kind, body = await client.exchange(state_rpc, _frame(b"\x00", request.SerializeToString()))
            assert kind == "message"
            reply = GetMessageClass(state_rpc.output_type).FromString(body)
            assert reply.ok and reply.round_no == 3 and reply.payload_len > 0, reply
        return refused

    refused = asyncio.run(storm())
    assert set(refused) == {m.name for m in METHODS} and min(refused.values()) >= 10, refused
    assert host["proc"].poll() is None, "the peer process died"
    elapsed = time.monotonic() - started
    text = host["log"].read_text(errors="replace")
    for needle in ("Traceback", "Handler failed", "Unhandled exception", "Exception in callback",
                   "Exception while receiving", "handler failed"):
        assert needle not in text, f"{needle!r} in the peer's log:\n{text[-3000:]}"
    for m in METHODS:
        lines = re.findall(rf"refused a malformed frame from \S+ on {re.escape(handler_name('hivepath_' + host['run_id'], m))}:",
                           text)
        assert 1 <= len(lines) <= 1 + int(elapsed // 60), (m.name, len(lines))
