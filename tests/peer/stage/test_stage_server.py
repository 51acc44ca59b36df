"""One stage server and one client over real hivemind DHTs and p2p daemons (in this process):
forward/backward match local autograd, and every kind of bad input is refused with a clear error
while the server keeps serving."""

from __future__ import annotations

import pytest
import torch

from models.presets import tiny_cpu
from models.errors import ConfigError
from models.lattice import ModularLM
from peer.network import DHTOptions, start_dht, unwrap_dht
from peer.stage import StageClient, StageRequestError
from protos.hivepath.peer.v1.stage_pb2 import EncodedTensor, StageReply, StageRequest
from peer.stage import StageServer, StageServerOptions
from peer.stage import activation_codec, encode_tensor
from peer.stage.wire import decode_tensor

from peer.localnet import wait_for
from helpers.swarm import loopback_swarm, run

pytestmark = pytest.mark.integration

CFG = tiny_cpu()
C, T = CFG.lattice.d_model, CFG.lattice.seq_len


@pytest.fixture(scope="module")
def stage():
    torch.set_num_threads(1)
    a = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    b = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=a.maddrs()))
    server = StageServer(CFG, "L0M0", a, options=StageServerOptions(max_elements=4 * T * C)).start()
    client = StageClient(b, CFG.run_id, CFG.content_hash(), codec="none", request_timeout=10.0)
    try:
        yield server, client
    finally:
        client.close()
        server.close()
        b.shutdown()
        a.shutdown()


def _forward(x: torch.Tensor, rid: str = "r", codec: str = "none", **kw) -> StageRequest:
    fields = dict(kind=StageRequest.FORWARD, module_id="L0M0", config_hash=CFG.content_hash(), request_id=rid,
                  input=encode_tensor(x, activation_codec(codec)))
    fields.update(kw)
    return StageRequest(**fields)


def test_forward_and_backward_match_local_autograd(stage):
    server, client = stage
    ref = ModularLM(CFG.lattice, seed=CFG.seed, module_ids=["L0M0"]).mods["L0M0"]
    x = torch.randn(2, T, C, generator=torch.Generator().manual_seed(3))  # (B, T, C)
    y, hop = client.forward("L0M0", x)
    xr = x.clone().requires_grad_(True)
    yr = ref(xr)
    assert torch.allclose(y, yr, atol=1e-5), "the server's forward is the module's forward"
    g = torch.randn_like(yr)
    gx = client.backward(hop, g)
    yr.backward(g)
    assert torch.allclose(gx, xr.grad, atol=1e-5), "the server's backward is the module's input gradient"
    assert hop.peer_id == server.peer_id and client.stats.failovers == 0


@pytest.mark.parametrize("name, change, code, needle", [
    ("another module", dict(module_id="L1M1"), StageReply.NOT_HELD, "serves L0M0, not 'L1M1'"),
    ("another run", dict(config_hash="ffff0000ffff0000"), StageReply.NOT_HELD, "differs from the server's"),
    ("another major", dict(protocol="2.0"), StageReply.BAD_REQUEST, "stage protocol: trainer"),
    ("rank 2", dict(input=EncodedTensor(shape=[T, C], codec="none", data=bytes(4 * T * C))),
     StageReply.BAD_REQUEST, "shape (batch, tokens, width)"),
    ("wrong width", dict(input=EncodedTensor(shape=[1, T, C + 1], codec="none", data=bytes(4 * T * (C + 1)))),
     StageReply.BAD_REQUEST, f"differs from the module's d_model {C}"),
    ("too long", dict(input=EncodedTensor(shape=[1, T + 1, C], codec="none", data=bytes(4 * (T + 1) * C))),
     StageReply.BAD_REQUEST, f"more than seq_len={T}"),
    ("oversized", dict(input=EncodedTensor(shape=[64, T, C], codec="int8", data=b"x")),
     StageReply.BAD_REQUEST, "more than this server accepts"),
    ("truncated", dict(input=EncodedTensor(shape=[1, T, C], codec="none", data=bytes(4 * T * C - 4))),
     StageReply.BAD_REQUEST, "payload is malformed"),
    ("unknown codec", dict(input=EncodedTensor(shape=[1, T, C], codec="gzip", data=b"")),
     StageReply.BAD_REQUEST, "is not one of"),
    ("NaN", dict(input=EncodedTensor(shape=[1, T, C], codec="none",
                                     data=torch.full((T * C,), float("nan")).numpy().tobytes())),
     StageReply.BAD_REQUEST, "NaN"),
    ("no kept input", dict(kind=StageRequest.BACKWARD, request_id="never-sent", input=None,
                           grad=encode_tensor(torch.ones(1, T, C), activation_codec("none"))),
     StageReply.UNKNOWN_REQUEST, "no kept input"),
])
def test_bad_input_is_refused_and_the_server_keeps_serving(stage, name, change, code, needle):
    server, client = stage
    rejected = server.counts["rejected"]
    fields = dict(kind=StageRequest.FORWARD, module_id="L0M0", config_hash=CFG.content_hash(), request_id=name,
                  input=encode_tensor(torch.ones(1, T, C), activation_codec("none")))
    fields.update(change)
    fields = {k: v for k, v in fields.items() if v is not None}
    reply = client.send(server.peer_id, StageRequest(**fields), timeout=10.0)
    assert reply.code == code and needle in reply.error, (StageReply.Code.Name(reply.code), reply.error)
    assert server.counts["rejected"] == rejected + 1
    ok = client.send(server.peer_id, _forward(torch.zeros(1, 4, C), rid=f"{name}-after"), timeout=10.0)
    assert ok.code == StageReply.OK and list(ok.output.shape) == [1, 4, C]


def test_backward_with_a_gradient_of_another_shape_is_refused(stage):
    server, client = stage
    assert client.send(server.peer_id, _forward(torch.ones(2, 4, C), rid="g"), timeout=10.0).code == StageReply.OK
    bad = StageRequest(kind=StageRequest.BACKWARD, module_id="L0M0", config_hash=CFG.content_hash(), request_id="g",
                       grad=encode_tensor(torch.ones(2, 5, C), activation_codec("none")))
    reply = client.send(server.peer_id, bad, timeout=10.0)
    assert reply.code == StageReply.BAD_REQUEST and "differs from the expected [2, 4, 32]" in reply.error


def test_client_raises_a_clear_error_for_a_request_every_server_would_refuse(stage):
    _, client = stage
    with pytest.raises(StageRequestError, match="more than this server accepts"):
        client.forward("L0M0", torch.ones(8, T, C))


def test_embeddings_and_heads_are_not_served_as_stages(stage):
    server, _ = stage
    with pytest.raises(ConfigError, match="stage servers serve L<level>M<index> modules"):
        StageServer(CFG, "embed", server.dht)


def test_a_server_that_keeps_failing_is_skipped_until_its_record_expires(stage):
    """A record claims our server serves L1M1 (it does not): two NOT_HELD replies in a row, then the
    client stops asking it while that record lives, and asks again once a fresh record replaces it."""
    from hivemind.utils import get_dht_time

    from peer.stage import StageUnavailable
    from peer.stage.records import StageServerRecord, stage_record_value, stage_servers_key

    server, client = stage
    key = stage_servers_key(CFG.run_id, "L1M1")

    def announce(ttl: float) -> float:
        expires = get_dht_time() + ttl
        record = StageServerRecord("L1M1", CFG.content_hash(), 1000.0, 0)
        assert server.dht.store(key, stage_record_value(record), expires, subkey=server.peer_id)
        return expires

    expires = announce(4.0)
    lonely = StageClient(client.dht, CFG.run_id, CFG.content_hash(), call_timeout=1.5, max_failures=2)
    try:
        with pytest.raises(StageUnavailable, match="no server of L1M1"):
            lonely.forward("L1M1", torch.ones(1, 4, C))
        assert lonely.stats.requests == 2 and lonely.stats.failures == 2
        with pytest.raises(StageUnavailable):
            lonely.forward("L1M1", torch.ones(1, 4, C))
        assert lonely.stats.requests == 2, "a banned server was asked again while its record lived"
        wait_for(lambda: get_dht_time() > expires, 10, "the record to expire")
        announce(30.0)
        with pytest.raises(StageUnavailable):
            lonely.forward("L1M1", torch.ones(1, 4, C))
        assert lonely.stats.requests > 2, "a server with a fresh record was never asked again"
    finally:
        lonely.close()


def test_a_loaded_server_serves_queued_requests_in_turns_and_hands_their_replies_back_together(stage):
    """Six forwards queue while the compute thread is busy: it serves them in turns of
    ``serve_batch`` (4) and hands each turn's replies back to the event loop at once (two wake-ups
    of the loop, not six); each reply is its own input's output."""
    import asyncio
    import threading
    from types import SimpleNamespace

    server, _ = stage
    assert server.options.serve_batch == 4
    ref = ModularLM(CFG.lattice, seed=CFG.seed, module_ids=["L0M0"]).mods["L0M0"]
    xs = [torch.randn(1, T, C, generator=torch.Generator().manual_seed(40 + i)) for i in range(6)]  # (1, T, C)
    context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: "trainer-under-test"))
    release, held = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(60)

    holder = threading.Thread(target=server.run_on_compute, args=(hold,))
    holder.start()
    assert held.wait(60), "the compute thread never ran the holding job"
    wakeups: list[str] = []

    async def main() -> list[StageReply]:
        loop = asyncio.get_running_loop()
        wake = loop.call_soon_threadsafe

        def counted(*args: object, **kw: object) -> object:
            wakeups.append(threading.current_thread().name)
            return wake(*args, **kw)

        loop.call_soon_threadsafe = counted  # counts the compute thread's hand-backs (each wakes the loop)
        tasks = [asyncio.ensure_future(server.handle(_forward(x, rid=f"q{i}"), context)) for i, x in enumerate(xs)]
        deadline = asyncio.get_running_loop().time() + 60
        while server.queue_length < len(xs) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert server.queue_length == len(xs), "the requests did not queue behind the busy compute thread"
        release.set()
        return await asyncio.gather(*tasks)

    try:
        replies = asyncio.run(main())
    finally:
        release.set()
        holder.join(60)
    assert all(r.code == StageReply.OK for r in replies), [r.error for r in replies]
    for x, r in zip(xs, replies):
        y = decode_tensor(r.output, "output", 2**20, last_dim=C)
        assert torch.allclose(y, ref(x), atol=1e-5), "a reply carried another request's output"
    from_compute = [n for n in wakeups if n.startswith("stage-L0M0")]
    assert len(from_compute) == 2, f"{len(from_compute)} hand-backs for 6 queued requests (turns of 4: 2)"
    assert server.queue_length == 0


def test_a_module_with_no_usable_server_gives_up_after_the_vacant_timeout_not_the_call_timeout(stage):
    """No server of L1M0 is announced: the call gives up once the module has had none for
    ``vacant_timeout`` seconds, naming the module, though its ``call_timeout`` is far longer (a
    trainer then drives another pipeline); without one it waits the whole ``call_timeout``."""
    from peer.stage import StageUnavailable

    _, client = stage
    quick = StageClient(client.dht, CFG.run_id, CFG.content_hash(), call_timeout=600.0, vacant_timeout=1.0)
    patient = StageClient(client.dht, CFG.run_id, CFG.content_hash(), call_timeout=1.0)
    try:
        with pytest.raises(StageUnavailable, match="no server of L1M0 usable for 1s"):
            quick.forward("L1M0", torch.ones(1, 4, C))
        assert quick.stats.requests == 0
        assert quick.usable("L1M0") == [] and quick.usable("L0M0") == [stage[0].peer_id]
        with pytest.raises(StageUnavailable, match=r"no server of L1M0 answered within 1s \(0 tried\)"):
            patient.forward("L1M0", torch.ones(1, 4, C))
    finally:
        quick.close()
        patient.close()


def test_failovers_are_progress_events(stage):
    """A backward whose server fails goes to another server, and a request no server answers gives
    up: each is one ``failover`` line of ``--progress json`` (the real JSON-lines writer), naming the
    module, the server left, the one that answered (null: none) and why."""
    import io
    import json

    from hivemind.utils import get_dht_time

    from peer.node.progress import EVENTS, JsonLinesView
    from peer.node.stage_runner import failover_events
    from peer.stage import Hop, StageUnavailable
    from peer.stage.records import StageServerRecord, stage_record_value, stage_servers_key

    server, client = stage
    out = io.StringIO()
    # a live peer that serves no stage, announced as a server of L0M0 (it fails every request)
    other = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                 initial_peers=[str(a) for a in server.dht.get_visible_maddrs()]))
    reporter = StageClient(client.dht, CFG.run_id, CFG.content_hash(), codec="none", request_timeout=2.0,
                           call_timeout=8.0, on_failover=failover_events(JsonLinesView(out)))
    try:
        record = StageServerRecord("L0M0", CFG.content_hash(), 1000.0, 0)
        assert other.dht.store(stage_servers_key(CFG.run_id, "L0M0"), stage_record_value(record), get_dht_time() + 30,
                           subkey=other.peer_id)
        wait_for(lambda: other.peer_id in reporter.servers("L0M0"), 60, "the bogus record to be read")
        x = torch.randn(1, T, C)  # (B, T, C)
        hop = Hop("L0M0", other.peer_id, "gone", encode_tensor(x, activation_codec("none")))
        gx = reporter.backward(hop, torch.ones(1, T, C))  # its forward's server fails: the input is resent
        assert gx.shape == (1, T, C) and reporter.stats.failovers == 1

        assert server.dht.store(stage_servers_key(CFG.run_id, "L1M1"), stage_record_value(
            StageServerRecord("L1M1", CFG.content_hash(), 1000.0, 0)), get_dht_time() + 30, subkey=server.peer_id)
        with pytest.raises(StageUnavailable):
            reporter.forward("L1M1", torch.ones(1, 4, C))
    finally:
        reporter.close()
        other.shutdown()

    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["event"] for e in lines] == ["failover", "failover"]
    switched, gave_up = lines
    assert set(switched) == {"time", "event", *EVENTS["failover"]}
    assert switched["module"] == "L0M0"
    assert (switched["from_server"], switched["to_server"]) == (other.peer_id, server.peer_id)
    assert switched["reason"]
    assert (gave_up["module"], gave_up["from_server"], gave_up["to_server"]) == ("L1M1", server.peer_id, None)
    assert gave_up["reason"].startswith("NOT_HELD"), gave_up["reason"]


def test_a_process_serves_another_module_after_its_first_server_closed():
    """A reassignment from one stage to another in one process: the second server registers the same
    protocol in the same p2p daemon, which the first one's close must have given back."""
    torch.set_num_threads(1)
    a = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    b = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=a.maddrs()))
    client = StageClient(b, CFG.run_id, CFG.content_hash(), codec="none", request_timeout=10.0)
    try:
        StageServer(CFG, "L0M0", a, options=StageServerOptions(max_elements=4 * T * C)).start().close()
        server = StageServer(CFG, "L1M0", a, options=StageServerOptions(max_elements=4 * T * C)).start()
        try:
            x = torch.randn(1, T, C, generator=torch.Generator().manual_seed(5))  # (B, T, C)
            y, _ = client.forward("L1M0", x)
            assert y.shape == x.shape and server.counts["forward"] == 1
        finally:
            server.close()
    finally:
        client.close()
        b.shutdown()
        a.shutdown()


def test_residual_replies_keep_the_codec_error_off_the_residual_stream():
    """A client of scheme ``int4tok+zstd/residual`` gets the module's output and input gradient with
    the codec's error on the residual branch only: several times closer to exact autograd than full
    replies in the same codec; the server flags its replies residual, and a request without the flag
    gets the whole tensors."""
    import dataclasses

    torch.set_num_threads(1)
    cfg = dataclasses.replace(CFG, inner=dataclasses.replace(CFG.inner, batch_size=10_000))  # no inner step here
    a = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    b = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=a.maddrs()))
    server = StageServer(cfg, "L0M0", a).start()
    clients = {name: StageClient(b, cfg.run_id, cfg.content_hash(), codec=name, request_timeout=10.0)
               for name in ("int4tok+zstd", "int4tok+zstd/residual")}
    try:
        ref = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=["L0M0"]).mods["L0M0"]
        ref.load_state_dict(server.run_on_compute(lambda: {k: v.clone() for k, v in server.module.state_dict().items()}))
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(4, T, C, generator=gen)  # (B, T, C)
        g = torch.randn(4, T, C, generator=gen)  # (B, T, C)
        xr = x.clone().requires_grad_(True)
        yr = ref(xr)
        yr.backward(g)
        err = {}
        for name, client in clients.items():
            y, hop = client.forward("L0M0", x)
            gx = client.backward(hop, g)
            err[name] = ((y - yr.detach()).norm() / yr.norm()).item(), ((gx - xr.grad).norm() / xr.grad.norm()).item()
        full, res = err["int4tok+zstd"], err["int4tok+zstd/residual"]
        assert res[0] < full[0] / 3 and res[1] < full[1] / 3, err
        raw = clients["int4tok+zstd/residual"].send(server.peer_id, _forward(x, "raw", "none", residual=True,
                                                                                    config_hash=cfg.content_hash()), 10.0)
        plain = clients["int4tok+zstd"].send(server.peer_id, _forward(x, "plain", "none",
                                                                             config_hash=cfg.content_hash()), 10.0)
        from peer.stage import decode_tensor

        assert raw.code == plain.code == StageReply.OK and raw.residual and not plain.residual, (raw.error, plain.error)
        assert torch.allclose(decode_tensor(raw.output, "t", x.numel()) + x, yr.detach(), atol=1e-5)
        assert torch.allclose(decode_tensor(plain.output, "t", x.numel()), yr.detach(), atol=1e-5)
    finally:
        for client in clients.values():
            client.close()
        server.close()
        b.shutdown()
        a.shutdown()



def test_a_trainer_moved_to_a_stage_serves_after_its_client_closed():
    """A reassignment from trainer to stage server in one process. The averager's doors sit on the
    process's shared p2p handle (``DHT.replicate_p2p``); closing the trainer's client must take down
    neither them nor the handle the stage endpoint registers on afterwards."""
    torch.set_num_threads(1)

    async def door(_info, reader, writer):  # an averager's door, answering one byte
        writer.write(await reader.readexactly(1))
        await writer.drain()
        writer.close()

    async def setup(i: int, _node, shared):
        if i == 0:
            await shared.add_binary_stream_handler("test_averager_door", door)
        return shared

    with loopback_swarm(2, setup) as ((a, b), (_, shared_b), loop):
        async def knock() -> bytes:
            _, reader, writer = await shared_b.call_binary_stream_handler(unwrap_dht(a).peer_id, "test_averager_door")
            writer.write(b"k")
            await writer.drain()
            return await reader.readexactly(1)

        client = StageClient(b, CFG.run_id, CFG.content_hash(), codec="none", request_timeout=10.0)
        try:
            StageClient(a, CFG.run_id, CFG.content_hash(), codec="none", request_timeout=10.0).close()
            server = StageServer(CFG, "L1M1", a, options=StageServerOptions(max_elements=4 * T * C)).start()
            try:
                x = torch.randn(1, T, C, generator=torch.Generator().manual_seed(6))  # (B, T, C)
                y, _ = client.forward("L1M1", x)
                assert y.shape == x.shape and server.counts["forward"] == 1
                assert run(loop, knock()) == b"k"
            finally:
                server.close()
        finally:
            client.close()
