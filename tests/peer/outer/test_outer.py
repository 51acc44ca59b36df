"""The outer optimizer against hand-computed Nesterov steps, and the averaging rule (LocalAverager)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from peer.averaging import LocalAverager, reduce_encoded
from peer.compression import weighted_mean
from peer.averaging import flatten
from peer.compression import get_codec
from peer.outer import OuterOptimizer

# -- OuterOptimizer ---------------------------------------------------------------------------------


def test_outer_step_matches_hand_computed_nesterov():
    p = torch.tensor([1.0, 2.0, -3.0])
    opt = OuterOptimizer([p], lr=0.7, momentum=0.9, nesterov=True)
    d1 = torch.tensor([0.1, -0.2, 0.0])
    d2 = torch.tensor([0.3, 0.1, -0.5])
    opt.step([d1])
    # buf = d1; global = p - 0.7 * (d1 + 0.9 * d1)
    expected1 = [1.0 - 0.7 * 1.9 * 0.1, 2.0 + 0.7 * 1.9 * 0.2, -3.0]
    assert torch.allclose(opt.global_params[0], torch.tensor(expected1), atol=1e-6)
    opt.step([d2])
    # buf = 0.9 * d1 + d2; global -= 0.7 * (d2 + 0.9 * buf)
    buf = [0.9 * 0.1 + 0.3, 0.9 * -0.2 + 0.1, -0.5]
    expected2 = [e - 0.7 * (d + 0.9 * b) for e, d, b in zip(expected1, [0.3, 0.1, -0.5], buf)]
    assert torch.allclose(opt.global_params[0], torch.tensor(expected2), atol=1e-6)
    assert torch.allclose(opt.momentum_buffers[0], torch.tensor(buf), atol=1e-7)
    assert torch.equal(p, torch.tensor([1.0, 2.0, -3.0]))  # the snapshot is a copy


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_agrees_with_torch_sgd(nesterov):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 5, generator=g)
    ref = torch.nn.Parameter(w.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=nesterov)
    opt = OuterOptimizer([w], lr=0.7, momentum=0.9, nesterov=nesterov)
    for _ in range(5):
        d = torch.randn(4, 5, generator=g)
        ref.grad = d.clone()
        sgd.step()
        opt.step([d])
    assert torch.allclose(opt.global_params[0], ref.detach(), atol=1e-5)


def test_pseudo_gradient_sync_and_state():
    local = [torch.nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(3))]
    opt = OuterOptimizer(local)
    with torch.no_grad():
        local[0].sub_(0.5)
        local[1].add_(2.0)
    delta = opt.pseudo_gradient(local)
    assert torch.equal(delta[0], torch.full((2, 2), 0.5)) and torch.equal(delta[1], torch.full((3,), -2.0))
    assert all(d.dtype == torch.float32 for d in delta)
    opt.step(delta)
    opt.sync_to(local)
    assert local[0].dtype == torch.bfloat16
    assert torch.equal(local[1].detach(), opt.global_params[1])
    other = OuterOptimizer([torch.zeros(2, 2), torch.zeros(3)])
    other.load_state_dict(opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.global_params, opt.global_params))
    assert all(torch.equal(a, b) for a, b in zip(other.momentum_buffers, opt.momentum_buffers))
    with pytest.raises(ValueError, match="shape"):
        opt.step([torch.zeros(2, 2), torch.zeros(4)])
    with pytest.raises(ValueError, match="expected 2"):
        opt.pseudo_gradient([torch.zeros(2, 2)])


# -- the reduction rule -----------------------------------------------------------------------------


def test_reduce_encoded_is_weighted_mean_of_decoded_in_peer_order():
    codec = get_codec("int8")
    g = torch.Generator().manual_seed(1)
    vals = {pid: torch.randn(2500, generator=g) for pid in ("b", "a", "c")}
    weights = {"a": 10.0, "b": 30.0, "c": 60.0}
    contributions = {pid: (codec.encode(v), weights[pid]) for pid, v in vals.items()}
    out = codec.decode(reduce_encoded(codec, contributions, 2500), 2500)
    decoded = {pid: codec.roundtrip(v) for pid, v in vals.items()}
    exact = sum(decoded[p] * weights[p] for p in decoded) / 100.0
    assert float((out - exact).abs().max()) <= float(exact.abs().max()) / 254 * 1.001
    assert torch.equal(out, codec.roundtrip(weighted_mean([decoded[p] for p in "abc"], [10.0, 30.0, 60.0])))
    with pytest.raises(ValueError):
        reduce_encoded(codec, {"a": (b"\0" * 3, 1.0)}, 2500)


def test_weighted_mean_rejects_bad_weights():
    with pytest.raises(ValueError, match="total weight"):
        weighted_mean([torch.ones(2)], [0.0])
    with pytest.raises(ValueError, match="as many"):
        weighted_mean([torch.ones(2)], [1.0, 2.0])


# -- LocalAverager ----------------------------------------------------------------------------------


def _run_members(members, fn):
    results, errors = {}, []

    def target(i, m):
        try:
            results[i] = fn(i, m)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i, m)) for i, m in enumerate(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("codec_name", ["none", "fp16", "int8", "int4"])
def test_local_averager_gives_every_member_the_same_weighted_mean(codec_name):
    hub = LocalAverager()
    members = [hub.member(f"peer{i}") for i in range(3)]
    g = torch.Generator().manual_seed(2)
    data = [[torch.randn(1500, generator=g), torch.randn(3, 7, generator=g)] for _ in range(3)]
    weights = [100.0, 50.0, 25.0]
    codec = get_codec(codec_name)
    res = _run_members(members, lambda i, m: m.average("L0M0", 0, data[i], weights[i], codec, 30.0))
    sent = [codec.roundtrip(flatten(d)) for d in data]
    expected = codec.roundtrip(weighted_mean(sent, weights))
    for i in range(3):
        r = res[i]
        assert r.group_size == 3 and r.peers == ["peer0", "peer1", "peer2"] and r.reason == ""
        assert torch.equal(flatten(r.averaged), expected)
        assert torch.equal(flatten(r.own_decoded), sent[i])
        assert r.bytes_sent == codec.encoded_size(1521) == r.bytes_received
        assert [t.shape for t in r.averaged] == [(1500,), (3, 7)]
    exact = sum(flatten(d) * w for d, w in zip(data, weights)) / sum(weights)
    rel = float((flatten(res[0].averaged) - exact).norm() / exact.norm())
    assert rel < {"none": 1e-6, "fp16": 1e-3, "int8": 0.02, "int4": 0.3}[codec_name]
    assert hub.round_weights("L0M0", 0) == {"peer0": 100.0, "peer1": 50.0, "peer2": 25.0}


def test_local_averager_lone_holder_gets_its_own_roundtrip_at_once():
    hub = LocalAverager()
    solo = hub.member("solo", module_ids=["L1M0"])
    hub.member("other", module_ids=["L1M1"])
    x = torch.randn(2000)
    # nobody else holds L1M0: no waiting for the timeout (an hour: a wait for it would fail the suite's timeout)
    r = solo.average("L1M0", 0, [x], 7.0, get_codec("int4"), 3600.0)
    assert r.reason == "" and r.group_size == 1 and torch.equal(r.averaged[0], get_codec("int4").roundtrip(x))


def test_local_averager_drops_absent_member_after_timeout_and_late_member_fails():
    hub = LocalAverager()
    a, b, late = hub.member("a"), hub.member("b"), hub.member("late")
    xs = [torch.full((10,), 1.0), torch.full((10,), 3.0)]
    t0 = time.monotonic()
    res = _run_members([a, b], lambda i, m: m.average("head", 4, [xs[i]], 1.0, get_codec("none"), 0.5))
    elapsed = time.monotonic() - t0
    assert elapsed > 0.4  # the absent member was waited for until the 0.5 s timeout
    for r in res.values():
        assert r.group_size == 2 and r.peers == ["a", "b"] and "dropped absent late" in r.reason
        assert torch.equal(r.averaged[0], torch.full((10,), 2.0))
    r = late.average("head", 4, [torch.zeros(10)], 1.0, get_codec("none"), 0.5)
    assert r.averaged is None and "closed" in r.reason
    assert hub.round_weights("head", 4) == {"a": 1.0, "b": 1.0}


def test_local_averager_drops_a_wrong_sized_contribution():
    hub = LocalAverager()
    members = [hub.member(p) for p in ("a", "b", "c")]
    sizes = [10, 10, 11]
    res = _run_members(
        members, lambda i, m: m.average("embed", 0, [torch.full((sizes[i],), float(i))], 1.0, get_codec("fp16"), 30.0)
    )
    assert res[0].peers == ["a", "b"] and torch.equal(res[0].averaged[0], torch.full((10,), 0.5))
    assert torch.equal(res[1].averaged[0], res[0].averaged[0])
    assert res[2].averaged is None and "wrong-size c" in res[2].reason


def test_local_averager_refuses_non_finite_and_bad_weight():
    hub = LocalAverager()
    m = hub.member("a")
    r = m.average("embed", 0, [torch.tensor([float("nan")])], 1.0, get_codec("int8"), 1.0)
    assert r.averaged is None and "NaN" in r.reason
    with pytest.raises(ValueError, match="weight"):
        m.average("embed", 1, [torch.ones(1)], 0.0, get_codec("int8"), 1.0)
    with pytest.raises(ValueError, match="already"):
        hub.member("a")
