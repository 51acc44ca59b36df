"""Networked averaging over real DHTs and p2p daemons on loopback, one process per peer.

The file is also the peer process: ``python tests/peer/averaging/test_net_averaging.py '<json options>'``
starts one peer with its own DHT and p2p daemon, averages with
:class:`peer.averaging.net_averager.NetAverager` and writes what it saw to ``<out>/<name>.pt`` (final module
states, one record per (module, round)). Modes: ``lattice`` trains a path of a tiny 2x2 ``ModularLM`` with
``DiLoCoOptimizer`` (int8); ``direct`` drives ``average()`` and an ``OuterOptimizer`` on one module with
seeded deltas (fault injection, late joining, mismatched config hash). The tests check results, not return
values: replicas are ``torch.equal``, and every average is the exact weighted mean within the codec's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from peer.averaging.partition import fallback_reducer, part_bounds  # noqa: E402
from peer.averaging import AverageResult  # noqa: E402
from peer.averaging import BLOCK, flatten  # noqa: E402
from peer.compression import get_codec  # noqa: E402
from peer.network import DHTOptions, start_dht  # noqa: E402
from peer.outer import ModuleState  # noqa: E402
from peer.averaging.net_averager import DEFAULT_BANDWIDTH, NetAverager  # noqa: E402
from peer.outer import OuterOptimizer  # noqa: E402
from peer.network import HolderRecord, holders_key, read_records  # noqa: E402

try:
    from peer.localnet import wait_for
except ImportError:  # run as a peer process, outside pytest
    wait_for = None

log = logging.getLogger("net_worker")


class Recorder:
    """Wraps a NetAverager and keeps what went in and came out of every exchange."""

    def __init__(self, inner: NetAverager):
        self.inner = inner
        self.records: list[dict] = []

    def __getattr__(self, name: str):
        # the rest of the averager's interface reaches it unchanged: DiLoCoOptimizer sets the round
        # policy (overlap mode) and the aggregation rule through it, as it does on a bare NetAverager
        return getattr(self.inner, name)

    def average(self, module_id, round_no, tensors, weight, codec, timeout, digest="") -> AverageResult:
        t0 = time.monotonic()
        res = self.inner.average(module_id, round_no, tensors, weight, codec, timeout, digest=digest)
        self.records.append(dict(
            module=module_id, round=round_no, weight=weight, sent=flatten(tensors),
            averaged=None if res.averaged is None else flatten(res.averaged), peers=list(res.peers),
            own=None if res.own_decoded is None else flatten(res.own_decoded),
            group_size=res.group_size, reason=res.reason, seconds=time.monotonic() - t0,
            bytes_sent=res.bytes_sent, bytes_received=res.bytes_received, transfer_seconds=res.transfer_seconds,
        ))
        log.info("round %d of %s: group %d %s", round_no, module_id, res.group_size, res.reason)
        return res


def wait_holders(dht, run_id: str, module_id: str, config_hash: str, count: int, min_round: int = 0,
                 timeout: float = 60.0) -> None:
    """Start-up barrier: wait until ``count`` holders of our hash (any hash if None) at round >=
    ``min_round`` are visible."""
    deadline = time.monotonic() + timeout
    while True:
        holders = read_records(dht.dht, holders_key(run_id, module_id), HolderRecord)
        ok = [p for p, h in holders.items()
              if config_hash in (None, h.config_hash) and h.round_no >= min_round]
        if len(ok) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(ok)} of {count} holders of {module_id} appeared")
        time.sleep(0.1)


def run_lattice(opts: dict, dht, out: dict) -> None:
    from models.config import OuterConfig
    from models.presets import tiny_cpu
    from models.lattice import ModularLM
    from peer.diloco import DiLoCoOptimizer

    cfg = tiny_cpu()
    path = tuple(opts["path"])
    mids = cfg.lattice.path_modules(path)
    model = ModularLM(cfg.lattice, seed=0, module_ids=mids)
    pm = model.path_model(path)
    avg = NetAverager(dht, cfg.run_id, cfg.content_hash())
    rec = Recorder(avg)
    for mid in mids:
        avg.hold(mid, 0)
    wait_holders(dht, cfg.run_id, "embed", cfg.content_hash(), opts["peers"])
    outer = OuterConfig(inner_steps=opts["inner_steps"], codec="int8", round_timeout=opts["round_timeout"],
                        overlap=opts.get("overlap", False), max_group_size=opts.get("max_group_size", 0))
    opt = DiLoCoOptimizer(pm.modules_by_id(), inner=cfg.inner, outer=outer, lattice=cfg.lattice, averager=rec)
    gen = torch.Generator().manual_seed(100 + opts["seed"])
    held_out = torch.randint(0, 64, (8, cfg.lattice.seq_len + 1), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out["held_out_loss"] = [float(pm(held_out[:, :-1], held_out[:, 1:])[1])]
    losses = []
    # by rounds, not steps: a member paced by a faster one ends a round early, and a step count would
    # leave it extra rounds alone after the others left (its replicas would then differ, rightly)
    while opt.round < opts["rounds"]:
        x = torch.randint(0, 64, (2, cfg.lattice.seq_len + 1), generator=gen)  # (B, T+1): a small vocabulary
        loss = pm(x[:, :-1], x[:, 1:])[1]
        loss.backward()
        opt.step(tokens=float(x[:, 1:].numel()))
        opt.zero_grad()
        losses.append(float(loss))
    opt.flush()  # overlap mode: apply the exchange still in flight
    with torch.no_grad():
        out["held_out_loss"].append(float(pm(held_out[:, :-1], held_out[:, 1:])[1]))
    out["modules"] = {mid: opt.module_state(mid) for mid in mids}
    out["losses"] = losses
    out["records"] = rec.records
    avg.shutdown()


class _Forged:
    """A place of :class:`peer.averaging.result_relay.ResultRelay` as a hostile inner node serves it: the
    head it got, every part with its first byte changed."""

    def __init__(self, place):
        self.place = place

    @property
    def payloads(self) -> list[bytes]:
        return [bytes([d[0] ^ 0x40]) + d[1:] for d in self.place.payloads]

    @property
    def error(self) -> str:
        return self.place.error

    def until(self, ready, deadline):
        return self.place.until(ready, deadline)


def _lie_down_the_tree() -> None:
    """This process passes other bytes than it got down every split round's tree it serves in."""
    from peer.averaging.result_relay import ResultRelay

    answer = ResultRelay._answer

    async def forged(self, sender, request):
        reply, place = await answer(self, sender, request)
        if place is not None:
            print(f"LIE to {sender}", flush=True)
        return reply, None if place is None else _Forged(place)
    ResultRelay._answer = forged


def run_direct(opts: dict, dht, out: dict) -> None:
    mid, numel, run_id = opts["module"], opts["numel"], "nettest"
    config_hash = opts.get("config_hash", "aaaa0000aaaa0000")
    lock = threading.Lock()
    outer = OuterOptimizer([torch.zeros(numel)], lr=0.7, momentum=0.9)
    current = {"round": 0}

    def provider(module_id: str):
        if module_id != mid:
            return None
        with lock:
            return ModuleState([g.clone() for g in outer.global_params],
                               [b.clone() for b in outer.momentum_buffers], current["round"])

    def hook(point: str) -> None:
        if point == opts.get("die_at") and current["round"] == opts.get("die_round"):
            print(f"FAULT {point} round {current['round']}", flush=True)
            os.killpg(os.getpgid(0), signal.SIGKILL)
        if point == opts.get("stall_at") and current["round"] == opts.get("stall_round"):
            if opts.get("stall_once"):  # only the first peer to get here (the file is made once)
                try:
                    os.close(os.open(opts["stall_once"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    return
            print(f"STALL {point} round {current['round']}", flush=True)
            time.sleep(opts["stall_s"])  # holds the averager's loop: everything of ours waits

    reports = out["reports"] = []
    if opts.get("lie_down_tree"):
        _lie_down_the_tree()
    avg = NetAverager(dht, run_id, config_hash, state_provider=provider, event_hook=hook,
                      bandwidth=opts.get("bandwidth"), on_suspect=lambda *report: reports.append(report))
    avg.use_group_cap(opts.get("max_group_size", 0))
    rec = Recorder(avg)
    if opts.get("join_late"):
        wait_holders(dht, run_id, mid, config_hash, opts["peers"] - 1, min_round=opts["join_round"])
        state = avg.fetch_state(mid, timeout=20.0)
        deadline = time.monotonic() + 20.0
        while state.round_no < opts["join_round"] and time.monotonic() < deadline:
            state = avg.fetch_state(mid, timeout=20.0)  # a holder between its average and its outer step
        with lock:
            outer.load_state_dict({"global": state.global_params, "momentum": state.momentum})
            current["round"] = state.round_no
        out["fetched_round"] = state.round_no
        log.info("joined at round %d", state.round_no)
    avg.hold(mid, current["round"])
    wait_holders(dht, run_id, mid, config_hash, opts.get("start_peers", opts["peers"]), min_round=current["round"],
                 timeout=opts.get("start_timeout", 60.0))
    if opts.get("wait_any"):  # also wait for peers of other config hashes (so that rounds overlap)
        wait_holders(dht, run_id, mid, None, opts["wait_any"])
    while current["round"] < opts["rounds"]:
        r = current["round"]
        if r == opts.get("wait_round"):
            wait_holders(dht, run_id, mid, config_hash, opts["peers"], min_round=r)
        gen = torch.Generator().manual_seed(1000 * opts["seed"] + r)
        delta = torch.randn(numel, generator=gen) * 0.01  # (numel,)
        res = rec.average(mid, r, [delta], float(opts["seed"] + 1), get_codec("int8"), opts["round_timeout"])
        with lock:
            if res.averaged is not None:
                outer.step(res.averaged)
            current["round"] = r + 1
    if opts.get("end_barrier"):
        # a split round's inner node passes the average on to its subtree after it applied it: leaving at
        # once would cut the children of the last round off (they ask the delegate only after their deadline)
        try:
            wait_holders(dht, run_id, mid, config_hash, opts["peers"], min_round=opts["rounds"],
                         timeout=2 * opts["round_timeout"])
        except TimeoutError as e:
            log.info("leaving before every holder ended its last round: %s", e)
    out["modules"] = {mid: ModuleState(outer.global_params, outer.momentum_buffers, current["round"])}
    out["records"] = rec.records
    avg.shutdown()



# -- the peer process ---------------------------------------------------------------------------


def main() -> None:
    opts = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(opts.get("seed", 0))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dht = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=opts.get("initial_peers", []),
                               identity_path=opts.get("identity")))
    outdir = Path(opts["out"])
    if opts.get("publish_maddrs"):
        tmp = outdir / f"{opts['name']}.maddrs.tmp"
        tmp.write_text(json.dumps(dht.maddrs()))
        os.replace(tmp, outdir / f"{opts['name']}.maddrs")
    out: dict = {"peer_id": dht.peer_id}
    try:
        (run_lattice if opts["mode"] == "lattice" else run_direct)(opts, dht, out)
        tmp = outdir / f"{opts['name']}.pt.tmp"
        torch.save(out, tmp)
        os.replace(tmp, outdir / f"{opts['name']}.pt")
    finally:
        dht.shutdown()



# -- tests --------------------------------------------------------------------------------------

PEER_TIMEOUT = 120.0


def _start(procs, tmp_path: Path, spec: dict) -> None:
    opts = {**spec, "out": str(tmp_path)}
    # file_descriptor sharing: no torch_shm_manager daemon, whose start-up times out on an overloaded host
    env = {"OMP_NUM_THREADS": "1", "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor"}
    procs.start(spec["name"], [sys.executable, __file__, json.dumps(opts)], env=env)


def _swarm(procs, tmp_path: Path, specs: list[dict]) -> list[str]:
    """Start the first peer, wait for its address, start the rest bootstrapped from it."""
    _start(procs, tmp_path, {**specs[0], "publish_maddrs": True})
    path = tmp_path / f"{specs[0]['name']}.maddrs"
    maddrs = wait_for(lambda: path.exists() and json.loads(path.read_text()), 60, "the first peer's address")
    for spec in specs[1:]:
        _start(procs, tmp_path, {**spec, "initial_peers": maddrs})
    return maddrs


def _result(procs, tmp_path: Path, name: str, timeout: float = PEER_TIMEOUT) -> dict:
    proc = procs.procs[name]
    try:
        proc.wait(timeout=timeout)
    except Exception:
        pytest.fail(f"peer {name} did not finish:\n{procs.log(name)[-3000:]}")
    assert proc.returncode == 0, f"peer {name} exited {proc.returncode}:\n{procs.log(name)[-3000:]}"
    return torch.load(tmp_path / f"{name}.pt", weights_only=False)


def _int8_tol(sent: list[torch.Tensor], exact: torch.Tensor) -> float:
    """Blockwise absmax int8 error bound: each input quantised once, the mean once more."""
    return (max(float(s.abs().max()) for s in sent) + float(exact.abs().max())) / 254 * 1.001 + 1e-7


def _check_groups(outs: dict[str, dict]) -> dict[tuple[str, int], list[str]]:
    """Every group's members got the same bytes, and they are the exact weighted mean within int8 error.
    Returns the members of each (module, round) group."""
    by_key: dict[tuple[str, int], dict[str, dict]] = {}
    for out in outs.values():
        for rec in out["records"]:
            by_key.setdefault((rec["module"], rec["round"]), {})[out["peer_id"]] = rec
    groups = {}
    for key, recs in by_key.items():
        for pid, rec in recs.items():
            if rec["averaged"] is None:
                continue
            members = rec["peers"]
            assert pid in members, f"{key}: {pid} applied an average it is not part of"
            sent = [recs[m]["sent"] for m in members]
            weights = [recs[m]["weight"] for m in members]
            exact = sum(w * s for w, s in zip(weights, sent)) / math.fsum(weights)
            err = float((rec["averaged"] - exact).abs().max())
            assert err <= _int8_tol(sent, exact), f"{key}: average is {err} from the exact weighted mean"
            for m in members:
                if recs[m]["averaged"] is not None:  # None: a peer whose inputs the test re-created
                    assert recs[m]["peers"] == members, f"{key}: {pid} and {m} disagree on the group"
                    assert torch.equal(recs[m]["averaged"], rec["averaged"]), f"{key}: {pid} and {m} differ"
            groups[key] = members
    return groups


# -- unit: part boundaries -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(1, 50 * BLOCK), bw=st.lists(st.floats(0, 1e9, allow_nan=False), min_size=1, max_size=8))
def test_part_bounds_are_block_aligned_and_cover_everything(numel, bw):
    bounds = part_bounds(numel, bw)
    assert len(bounds) == len(bw)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (a, b), (c, _) in zip(bounds, bounds[1:]):
        assert b == c and a <= b and (b % BLOCK == 0 or b == numel)
    if sum(bw) > 0:
        for (a, b), w in zip(bounds, bw):
            if w == 0:
                assert a == b, "a client-mode member (bandwidth 0) must reduce nothing"


def test_part_bounds_follow_bandwidth():
    bounds = part_bounds(100 * BLOCK, [3e6, 1e6, 0.0, 1e6])
    sizes = [(b - a) // BLOCK for a, b in bounds]
    assert sizes == [60, 20, 0, 20]
    assert fallback_reducer(0, bounds) == 1 and fallback_reducer(1, bounds) == 0
    assert fallback_reducer(0, [(0, 5), (5, 5)]) is None


def test_relayed_members_get_parts_a_relayed_connection_carries_and_others_keep_four_segments():
    """Parts between members behind relays fit in ``RELAY_PIECE_BYTES`` (a relay resets a connection after
    128 KiB); a group with one relayed member (which reduces nothing next to reachable ones) or none keeps
    the usual segments, and the cut is the same function of the group on every member."""
    from peer.compression import get_codec
    from peer.averaging.partition import (MAX_SEGMENTS, RELAY_PIECE_BYTES, Group, relayed_segment_bounds,
                                          segment_bounds)

    int8 = get_codec("int8")
    numel = 1_000_003
    both = Group("g", ("a", "b"), (1e3, 1e3), 10.0, (True, True))
    assert both.relayed_pairs() and not Group("g", ("a", "b"), (1e3, 1e6), 10.0, (True, False)).relayed_pairs()
    # next to a reachable member, relayed ones reduce next to nothing: their parts already fit
    with_public = Group("g", ("a", "b", "c"), (1e3, 1e3, 1e6), 10.0, (True, True, False))
    assert relayed_segment_bounds(numel, with_public, int8.encoded_size) == segment_bounds(numel)
    assert not Group("g", ("a", "b"), (1e6, 1e6), 10.0).relayed_pairs()
    segments = relayed_segment_bounds(numel, both, int8.encoded_size)
    assert segments == relayed_segment_bounds(numel, both, int8.encoded_size)
    assert segments[0][0] == 0 and segments[-1][1] == numel
    assert all(b == c for (_, b), (c, _) in zip(segments, segments[1:]))
    relayed_parts = [b - a for s0, s1 in segments
                     for i, (a, b) in enumerate(part_bounds(s1 - s0, both.bandwidths)) if both.relayed[i]]
    assert max(int8.encoded_size(n) for n in relayed_parts) <= RELAY_PIECE_BYTES
    assert len(segments) > MAX_SEGMENTS == len(segment_bounds(numel))
    # one block a part is as small as it goes: a huge codec cost still ends
    assert len(relayed_segment_bounds(4 * BLOCK, both, lambda n: 10 * RELAY_PIECE_BYTES)) == 4


# -- integration: real peers on loopback ---------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_three_peers_on_a_2x2_lattice_stay_bit_identical_with_int8(procs, tmp_path, overlap):
    """Paths (0,0), (0,1), (1,1): embed/head shared by 3, L0M0 by 2, L1M1 by 2, L0M1 and L1M0 alone.
    Trained through ``DiLoCoOptimizer``; with ``overlap`` each exchange runs behind the next round."""
    from models.presets import tiny_cpu
    from models.lattice import ModularLM

    paths = {"a": (0, 0), "b": (0, 1), "c": (1, 1)}
    # a 30 s budget: its 6 s gather deadline rides out a peer that starts late on a loaded machine
    common = dict(mode="lattice", peers=3, rounds=3, inner_steps=2, round_timeout=30.0, overlap=overlap)
    _swarm(procs, tmp_path, [dict(common, name=n, path=p, seed=i) for i, (n, p) in enumerate(paths.items())])
    outs = {n: _result(procs, tmp_path, n) for n in paths}

    groups = _check_groups(outs)
    holders: dict[str, list[str]] = {}
    for out in outs.values():
        for mid in out["modules"]:
            holders.setdefault(mid, []).append(out["peer_id"])
    for mid, pids in holders.items():
        for r in range(3):
            assert groups[(mid, r)] == sorted(pids), f"{mid} round {r} did not group all its holders"
        states = [out["modules"][mid] for out in outs.values() if mid in out["modules"]]
        for s in states[1:]:
            for x, y in zip(s.global_params + s.momentum, states[0].global_params + states[0].momentum):
                assert torch.equal(x, y), f"replicas of {mid} differ"
    assert sorted(len(v) for v in holders.values()) == [1, 1, 2, 2, 3, 3]
    for out in outs.values():  # the link measurement: the all-reduce's seconds, within the exchange's
        for rec in out["records"]:
            if len(holders[rec["module"]]) == 1:
                assert rec["transfer_seconds"] == 0.0 and rec["bytes_sent"] == 0, rec["module"]
            else:
                assert 0.0 < rec["transfer_seconds"] <= rec["seconds"], (rec["module"], rec["round"])
    for out in outs.values():  # training still works: the loss on fixed held-out windows falls on every path
        before, after = out["held_out_loss"]
        assert after < before - 0.1, (out["held_out_loss"], out["losses"])

    # the replicated state is the outer optimizer applied to those averages, from the initial weights
    cfg = tiny_cpu()
    init = ModularLM(cfg.lattice, seed=0)
    out = outs["b"]
    for mid, state in out["modules"].items():
        replay = OuterOptimizer(list(init.mods[mid].parameters()))
        for rec in sorted((r for r in out["records"] if r["module"] == mid), key=lambda r: r["round"]):
            from peer.averaging import unflatten

            replay.step(unflatten(rec["averaged"], replay.global_params))
        assert all(torch.equal(a, b) for a, b in zip(replay.global_params, state.global_params)), mid
        assert not all(torch.equal(a, b.detach()) for a, b in zip(state.global_params, init.mods[mid].parameters()))


@pytest.mark.integration
def test_a_fallback_with_only_our_own_part_loses_the_round_instead_of_forking(procs, tmp_path):
    """Two members; ``c`` kills itself in round 1 once it has averaged its own part (``reduced``). ``a`` is
    the fallback reducer of c's part, nobody else asks and nobody has the original average: a's own part
    applied alone could fork it from a reducer that is alive but cut off from it (a relay's reset does
    that to NATed members, ``bench.nat``), so a's round 1 is not applied, and says why."""
    common = dict(mode="direct", module="L0M0", numel=5 * BLOCK + 77, peers=2, rounds=2, round_timeout=12.0)
    _swarm(procs, tmp_path, [dict(common, name="a", seed=1), dict(common, name="c", seed=3, die_at="reduced",
                                                                    die_round=1)])
    procs.procs["c"].wait(timeout=PEER_TIMEOUT)
    assert procs.procs["c"].returncode == -signal.SIGKILL and "FAULT reduced round 1" in procs.log("c")
    records = {r["round"]: r for r in _result(procs, tmp_path, "a")["records"]}
    assert records[0]["averaged"] is not None and len(records[0]["peers"]) == 2, records[0]["reason"]
    assert records[1]["averaged"] is None, records[1]["peers"]
    assert "no other member reached the fallback" in records[1]["reason"], records[1]["reason"]


@pytest.mark.integration
@pytest.mark.parametrize("die_at", ["reduced", pytest.param("part_replied", marks=pytest.mark.slow)])
def test_member_killed_mid_round_the_rest_finish_identical(procs, tmp_path, die_at):
    """Peer ``c`` kills itself (and its p2p daemon) in round 1, at ``reduced``: the moment it has
    averaged its own part, before sending it back (the part is re-reduced at the fallback reducer
    from the survivors); at ``part_replied``: as soon as one survivor received that average (the
    other may or may not have it yet: if not, the fallback reducer adopts the original average from
    the survivor that has it, so both apply the same bytes). Either way the survivors finish in time
    with identical bytes."""
    timeout = 12.0
    common = dict(mode="direct", module="L0M0", numel=5 * BLOCK + 77, peers=3, rounds=3, round_timeout=timeout)
    specs = [dict(common, name="a", seed=1), dict(common, name="b", seed=2),
             dict(common, name="c", seed=3, die_at=die_at, die_round=1)]
    _swarm(procs, tmp_path, specs)
    procs.procs["c"].wait(timeout=PEER_TIMEOUT)
    assert procs.procs["c"].returncode == -signal.SIGKILL
    assert f"FAULT {die_at} round 1" in procs.log("c"), "the fault did not fire where intended"
    outs = {n: _result(procs, tmp_path, n) for n in ("a", "b")}
    # c wrote nothing: re-create its seeded inputs (as run_direct makes them) and read its peer id from its log
    c_id = re.search(r"DHT up: peer id (\w+)", procs.log("c")).group(1)
    c_sent = {r: torch.randn(common["numel"], generator=torch.Generator().manual_seed(3000 + r)) * 0.01 for r in (0, 1)}
    outs["c"] = {"peer_id": c_id, "records": [dict(module="L0M0", round=r, weight=4.0, sent=c_sent[r], averaged=None,
                                                   peers=[]) for r in (0, 1)]}
    survivors = sorted([outs["a"]["peer_id"], outs["b"]["peer_id"]])
    everyone = sorted(survivors + [c_id])
    groups = _check_groups({n: {**o, "records": [r for r in o["records"] if r["round"] != 1]} for n, o in outs.items()})
    assert groups[("L0M0", 0)] == everyone and groups[("L0M0", 2)] == survivors

    # round 1: c's own part was re-reduced by the fallback reducer from the survivors only; the other
    # parts hold c's contribution if it was delivered before c died, else c was dropped from them
    # after the reducers' deadline. Both survivors hold the same bytes either way.
    r1 = {n: next(r for r in outs[n]["records"] if r["round"] == 1) for n in ("a", "b")}
    for rec in r1.values():
        assert rec["averaged"] is not None, rec["reason"]  # a round cut off by its deadline averages nothing
        assert set(survivors) <= set(rec["peers"]) and (die_at != "reduced" or rec["peers"] == survivors)
    assert torch.equal(r1["a"]["averaged"], r1["b"]["averaged"])
    if die_at == "reduced":
        assert "retrying at the fallback reducer" in procs.log("a") + procs.log("b")
    sent = {outs[n]["peer_id"]: (r1[n]["sent"], r1[n]["weight"]) for n in ("a", "b")}
    sent[c_id] = (c_sent[1], 4.0)
    bounds = part_bounds(common["numel"], [DEFAULT_BANDWIDTH] * 3)
    for j, (lo, hi) in enumerate(bounds):
        errs = {}
        if everyone[j] == c_id:  # c's own part: re-reduced without c, or c's original average adopted
            candidates = (survivors,) if die_at == "reduced" else (everyone,)
        else:
            candidates = (everyone, survivors)
        for members in candidates:
            exact = sum(sent[m][1] * sent[m][0][lo:hi] for m in members) / sum(sent[m][1] for m in members)
            err = float((r1["a"]["averaged"][lo:hi] - exact).abs().max())
            errs[len(members)] = (err, _int8_tol([sent[m][0][lo:hi] for m in members], exact))
        assert any(err <= tol for err, tol in errs.values()), f"part {j} is no weighted mean: {errs}"
    a, b = outs["a"]["modules"]["L0M0"], outs["b"]["modules"]["L0M0"]
    assert torch.equal(a.global_params[0], b.global_params[0]) and torch.equal(a.momentum[0], b.momentum[0])


@pytest.mark.integration
def test_late_joiner_is_bit_identical_and_other_config_hash_never_groups(procs, tmp_path):
    """``a`` and ``b`` average rounds 0-1; ``c`` fetches the state from them and joins round 2; ``x``
    holds the same module under another config hash the whole time and must never be grouped."""
    common = dict(mode="direct", module="L1M1", numel=3 * BLOCK, rounds=4, round_timeout=15.0)
    specs = [dict(common, name="a", seed=1, peers=3, start_peers=2, wait_round=2, wait_any=3),
             dict(common, name="b", seed=2, peers=3, start_peers=2, wait_round=2, wait_any=3),
             dict(common, name="c", seed=3, peers=3, join_late=True, join_round=2),
             dict(common, name="x", seed=4, peers=1, config_hash="bbbb1111bbbb1111", wait_any=3)]
    _swarm(procs, tmp_path, specs)
    outs = {n: _result(procs, tmp_path, n) for n in ("a", "b", "c", "x")}
    assert outs["c"]["fetched_round"] == 2
    groups = _check_groups({n: outs[n] for n in "abc"})
    ab = sorted([outs["a"]["peer_id"], outs["b"]["peer_id"]])
    abc = sorted(ab + [outs["c"]["peer_id"]])
    assert groups[("L1M1", 0)] == ab and groups[("L1M1", 1)] == ab
    assert groups[("L1M1", 2)] == abc and groups[("L1M1", 3)] == abc
    states = [outs[n]["modules"]["L1M1"] for n in "abc"]
    for s in states[1:]:
        assert torch.equal(s.global_params[0], states[0].global_params[0])
        assert torch.equal(s.momentum[0], states[0].momentum[0])
    x = outs["x"]
    assert all(r["peers"] == [x["peer_id"]] for r in x["records"])
    assert not torch.equal(x["modules"]["L1M1"].global_params[0], states[0].global_params[0])
    # whichever side declared second saw the other's declaration and logged both hashes
    logs = "".join(procs.log(n) for n in "abcx")
    assert re.search(r"config hash (aaaa0000aaaa0000 of \w+ differs from ours bbbb1111bbbb1111"
                     r"|bbbb1111bbbb1111 of \w+ differs from ours aaaa0000aaaa0000)", logs)


@pytest.mark.integration
def test_archive_peer_serves_state_but_is_never_waited_for(tmp_path):
    """An archive peer announces a module's state: a newcomer of the same config hash fetches it
    bit-exactly, one of another hash cannot, and averaging never waits for the archive. Also the
    ``others_waiting`` pacing signal: only a same-config peer declared for our round counts."""
    from peer.averaging import StateTransferError

    gen = torch.Generator().manual_seed(5)
    params, momentum = [torch.randn(40, 8, generator=gen), torch.randn(8, generator=gen)], [torch.randn(40, 8), torch.randn(8)]
    host = ["/ip4/127.0.0.1/tcp/0"]
    with start_dht(DHTOptions(host_maddrs=host)) as dht_a, \
            start_dht(DHTOptions(host_maddrs=host, initial_peers=dht_a.maddrs())) as dht_b, \
            start_dht(DHTOptions(host_maddrs=host, initial_peers=dht_a.maddrs())) as dht_c:
        archive = NetAverager(dht_a, "arch", "aaaa0000aaaa0000",
                              state_provider=lambda mid: ModuleState(params, momentum, 7) if mid == "L0M0" else None)
        newcomer = NetAverager(dht_b, "arch", "aaaa0000aaaa0000")
        stranger = NetAverager(dht_c, "arch", "bbbb1111bbbb1111")
        try:
            archive.announce_archive("L0M0", 7)
            state = newcomer.fetch_state("L0M0", timeout=20.0, like=params)
            assert state.round_no == 7
            assert all(torch.equal(x, y) for x, y in zip(state.global_params + state.momentum, params + momentum))
            with pytest.raises(StateTransferError, match="no live holder of L0M0 with config hash bbbb1111bbbb1111"):
                stranger.fetch_state("L0M0", timeout=5.0)
            with pytest.raises(StateTransferError):  # the archive does not hold L1M1
                newcomer.fetch_state("L1M1", timeout=5.0)
            # pacing signal for DiLoCoOptimizer: a same-config peer waits in matchmaking for our round
            from hivemind.utils import get_dht_time

            from peer.network import GroupDeclaration, group_key, records_from_value, to_value

            exp = get_dht_time() + 60
            assert dht_c.dht.store(group_key("arch", "L1M0", 3), to_value(GroupDeclaration("bbbb1111bbbb1111", "", 1.0)),
                                   exp, subkey=dht_c.peer_id)
            assert not newcomer.others_waiting({"L1M1": 3})
            assert dht_a.dht.store(group_key("arch", "L1M1", 3), to_value(GroupDeclaration("aaaa0000aaaa0000", "", 1.0)),
                                   exp, subkey=dht_a.peer_id)
            wait_for(lambda: newcomer.others_waiting({"L1M1": 3}), 20, "the waiting peer to be noticed")
            assert newcomer.last_waiting == ("L1M1", 3, dht_a.peer_id)
            assert not newcomer.others_waiting({"L1M1": 4})  # another round: not waiting for us
            # a holder that ended its own round early for a waiting one paces nobody in turn
            assert dht_a.dht.store(group_key("arch", "L1M1", 5),
                                   to_value(GroupDeclaration("aaaa0000aaaa0000", "", 1.0, paced=True)),
                                   exp, subkey=dht_a.peer_id)
            assert dht_a.dht.store(group_key("arch", "L1M1", 6), to_value(GroupDeclaration("aaaa0000aaaa0000", "", 1.0)),
                                   exp, subkey=dht_a.peer_id)
            wait_for(lambda: newcomer.others_waiting({"L1M1": 6}), 20, "the unpaced declaration to be noticed")
            end = time.monotonic() + 2.5  # over 2 checks, the paced declaration never counts
            while time.monotonic() < end:
                assert not newcomer.others_waiting({"L1M1": 5})
                time.sleep(0.05)
            # ... except for a peer whose steps are far apart (a stage server): every round waits on it
            wait_for(lambda: newcomer.others_waiting({"L1M1": 5}, paced_too=True), 20,
                     "the paced declaration to be noticed by a sparse stepper")
            # ... unless that paced declaration is another sparse stepper's: sparse steppers answering each
            # other would end each other's rounds a step apart, and group without the holders computing
            assert dht_a.dht.store(group_key("arch", "L1M1", 8),
                                   to_value(GroupDeclaration("aaaa0000aaaa0000", "", 1.0, paced=True, sparse=True)),
                                   exp, subkey=dht_a.peer_id)

            def check(round_no: int) -> tuple:
                return asyncio.run_coroutine_threadsafe(newcomer._pacing._check_waiting((("L1M1", round_no),)),
                                                        newcomer._loop).result(30)

            def declared(round_no: int) -> dict:
                return records_from_value(dht_b.dht.get(group_key("arch", "L1M1", round_no), latest=True),
                                          GroupDeclaration)

            wait_for(lambda: dht_a.peer_id in declared(8), 20, "the sparse declaration to be readable")
            assert declared(8)[dht_a.peer_id].paced and declared(8)[dht_a.peer_id].sparse
            assert check(8)[1:] == (None, None)  # read, and yet nobody waits that a sparse stepper answers
            assert check(5)[1:] == (None, ("L1M1", 5, dht_a.peer_id))  # a paced path peer is answered
            end = time.monotonic() + 2.5  # over 2 checks, the other config's declaration never counts
            while time.monotonic() < end:
                assert not newcomer.others_waiting({"L1M0": 3})
                time.sleep(0.05)
            res = newcomer.average("L0M0", 7, [torch.ones(10)], 1.0, get_codec("int8"), timeout=20.0)
            # "lone holder", not "holders behind us did not catch up (...)": the archive peer was never
            # counted as a holder to wait for
            assert res.reason == "lone holder" and torch.equal(res.averaged[0], torch.ones(10))
        finally:
            for avg in (archive, newcomer, stranger):
                avg.shutdown()


@pytest.mark.integration
def test_client_mode_peer_averages_without_reducing(tmp_path):
    """A peer that accepts no connections (client mode, bandwidth 0) joins the group, reduces no part,
    and ends with the same bytes as the two peers that reduce."""
    from concurrent.futures import ThreadPoolExecutor

    host = ["/ip4/127.0.0.1/tcp/0"]
    with start_dht(DHTOptions(host_maddrs=host)) as d0, \
            start_dht(DHTOptions(host_maddrs=host, initial_peers=d0.maddrs())) as d1, \
            start_dht(DHTOptions(initial_peers=d0.maddrs(), client_mode=True)) as d2:
        assert d2.maddrs() == []
        with pytest.raises(ValueError, match="No multiaddrs"):  # its p2p daemon listens nowhere
            d2.dht.get_visible_maddrs()
        avgs = [NetAverager(d, "client", "aaaa0000aaaa0000") for d in (d0, d1, d2)]
        try:
            assert avgs[2].bandwidth == 0.0
            for a in avgs:
                a.hold("L0M0", 0)
            for a in avgs:
                wait_for(lambda: len(read_records(a.dht, holders_key("client", "L0M0"), HolderRecord)) == 3, 30,
                         "every holder record")
            deltas = [torch.randn(3 * BLOCK + 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
            with ThreadPoolExecutor(3) as pool:
                fp16 = get_codec("fp16")
                results = list(pool.map(lambda i: avgs[i].average("L0M0", 0, [deltas[i]], float(i + 1), fp16, 20.0),
                                        range(3)))
        finally:
            for a in avgs:
                a.shutdown()
    ids = sorted(a.peer_id for a in avgs)
    for res in results:
        assert res.peers == ids and res.group_size == 3, res.reason
        assert torch.equal(res.averaged[0], results[0].averaged[0])
    exact = sum((i + 1) * d for i, d in enumerate(deltas)) / 6
    assert float((results[0].averaged[0] - exact).abs().max()) < 1e-2 * float(exact.abs().max())
    # the client sent its 3 parts and received 3 averages, but served no part to anyone
    assert results[2].bytes_sent == sum(2 * n for n in _parts_sizes(3 * BLOCK + 5, ids, avgs))


@contextlib.contextmanager
def _two_holders_at_round_4(run_id: str):
    """Two averagers ``a``, ``b`` on loopback DHTs, both holding L0M0 at round 4 and seeing each other's
    holder record; yields (``a``'s DHT, a, b) and shuts both down."""
    host = ["/ip4/127.0.0.1/tcp/0"]
    with start_dht(DHTOptions(host_maddrs=host)) as d0, \
            start_dht(DHTOptions(host_maddrs=host, initial_peers=d0.maddrs())) as d1:
        a, b = (NetAverager(d, run_id, "aaaa0000aaaa0000") for d in (d0, d1))
        try:
            for avg in (a, b):
                avg.hold("L0M0", 4)
            wait_for(lambda: len(read_records(b.dht, holders_key(run_id, "L0M0"), HolderRecord)) == 2, 30,
                     "both holder records")
            yield d0, a, b
        finally:
            a.shutdown()
            b.shutdown()


def _b_answers_a_waiting(a, b, paced_too: bool) -> list:
    """``a`` begins round 4 of L0M0; once ``b`` sees it waiting (``paced_too``: as a peer whose steps are
    far apart), ``b`` joins: both results."""
    from concurrent.futures import ThreadPoolExecutor

    int8 = get_codec("int8")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(a.average, "L0M0", 4, [torch.ones(2 * BLOCK)], 1.0, int8, 20.0)
        wait_for(lambda: b.others_waiting({"L0M0": 4}, paced_too=paced_too), 20, "a waiting for round 4")
        second = pool.submit(b.average, "L0M0", 4, [torch.zeros(2 * BLOCK)], 1.0, int8, 20.0)
        return [first.result(timeout=60), second.result(timeout=60)]


@pytest.mark.integration
def test_a_member_that_ended_its_round_for_a_waiting_one_declares_it_paced():
    """Pacing: ``b`` sees ``a`` waiting in matchmaking for their round, ends its own (what
    ``DiLoCoOptimizer`` does on ``others_waiting``) and joins: its declaration says it was paced, ``a``'s
    (a whole round) does not, so ``b``'s declaration never ends a third holder's round."""
    from peer.network import GroupDeclaration, group_key, records_from_value

    with _two_holders_at_round_4("paced") as (d0, a, b):
        results = _b_answers_a_waiting(a, b, paced_too=False)
        decls = records_from_value(d0.dht.get(group_key("paced", "L0M0", 4), latest=True), GroupDeclaration)
    assert all(r.group_size == 2 for r in results), [r.reason for r in results]
    assert decls[a.peer_id].paced is False and decls[b.peer_id].paced is True


@pytest.mark.integration
def test_a_holder_whose_group_had_a_sparse_stepper_counts_its_module_shared_with_one():
    """``b`` answers ``a``'s wait as a peer whose steps are far apart does (``paced_too``): its
    declaration says sparse, so ``a``'s gather of that round counts the module as shared with such a
    peer for the next few rounds (``DiLoCoOptimizer(overlap_beside_sparse)`` reads it), and ``b``, which
    read only ``a``'s whole-round declaration, does not."""
    from peer.averaging.net_averager import SPARSE_ROUNDS

    with _two_holders_at_round_4("sparse") as (_, a, b):
        assert not a.shares_with_sparse("L0M0", 4)
        results = _b_answers_a_waiting(a, b, paced_too=True)
        shared = [a.shares_with_sparse("L0M0", 5), a.shares_with_sparse("L0M0", 4 + SPARSE_ROUNDS),
                  a.shares_with_sparse("L0M0", 5 + SPARSE_ROUNDS), b.shares_with_sparse("L0M0", 5)]
    assert all(r.group_size == 2 for r in results), [r.reason for r in results]
    assert shared == [True, True, False, False]


def _parts_sizes(numel: int, ids: list[str], avgs: list) -> list[int]:
    bw = {a.peer_id: a.bandwidth for a in avgs}
    return [b - a for a, b in part_bounds(numel, [bw[p] for p in ids])]


if __name__ == "__main__":
    main()
