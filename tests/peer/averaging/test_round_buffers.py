"""A round's module-sized vectors are reused, not allocated afresh (each fresh page is a page fault).

The average and our decoded contribution of a round are handed back to the averager once applied
(``AverageResult.buffers``, ``NetAverager.give_back``), error feedback reads the decoded contribution
in place and updates its residual in place: a 64 MB module faults in no fresh 64 MB vectors a round.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers.averagers import loopback_holders
from models.config import OuterConfig
from peer.averaging import BLOCK, LocalAverager, flat_view, flatten, unflatten
from peer.compression import ErrorFeedback, get_codec
from peer.diloco import DiLoCoOptimizer


def test_flat_view_is_the_vector_unflatten_cut_and_a_copy_otherwise():
    flat = torch.arange(10, dtype=torch.float32)
    parts = unflatten(flat, [torch.empty(2, 3), torch.empty(4)])
    view = flat_view(parts)
    assert torch.equal(view, flat) and view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    tail = unflatten(flat[4:], [torch.empty(2), torch.empty(4)])  # a view at an offset
    assert flat_view(tail).storage_offset() == 4 and torch.equal(flat_view(tail), flat[4:])
    apart = [flat[:3], flat[5:]]  # not consecutive: copied
    got = flat_view(apart)
    assert torch.equal(got, torch.cat(apart)) and got.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    halves = [torch.ones(3), torch.zeros(2, dtype=torch.float64)]  # another dtype: copied as fp32
    assert torch.equal(flat_view(halves), flatten(halves))


def test_error_feedback_updates_its_residual_in_place():
    ef = ErrorFeedback(6)
    before = ef.residual
    sent_input, sent = torch.arange(6, dtype=torch.float32), torch.full((6,), 0.5)
    ef.update(sent_input, sent)
    assert ef.residual is before and torch.equal(ef.residual, sent_input - sent)
    ef.update(sent_input.view(2, 3), torch.zeros(2, 3))  # any shape of the same size
    assert torch.equal(ef.residual, sent_input)


class _Returning:
    """A member averager that records what the optimizer hands back."""

    def __init__(self, member, fail_call: int = -1):
        self.member, self.fail_call, self.returned, self.calls = member, fail_call, [], 0

    def average(self, module_id, round_no, tensors, weight, codec, timeout, digest=""):
        self.calls += 1
        if self.calls == self.fail_call:
            from peer.averaging import AverageResult

            return AverageResult(None, None, 0, [], 0, 0, reason="failed on purpose")
        return self.member.average(module_id, round_no, tensors, weight, codec, timeout, digest=digest)

    def give_back(self, result):
        self.returned.append(result)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_optimizer_hands_back_each_applied_result_once(overlap):
    """Every applied module round is handed back once, after its outer step; a failed one is not."""
    params = [torch.nn.Parameter(torch.randn(8, generator=torch.Generator().manual_seed(0)))]
    averager = _Returning(LocalAverager().member("a"), fail_call=2)
    opt = DiLoCoOptimizer({"L0M0": params}, torch.optim.SGD(params, lr=0.1),
                          OuterConfig(inner_steps=1, codec="int8", round_timeout=5.0, overlap=overlap),
                          averager=averager, train_through_waits=False)
    reports = []
    for _ in range(4):
        params[0].grad = torch.ones(8)
        reports.append(opt.step())
    reports.append(opt.flush())  # overlap: the last exchange
    opt.close()
    done = [m for r in reports if r is not None for m in r.modules.values()]
    assert len(done) == 4 and [m.applied for m in done].count(False) == 1  # the second exchange failed
    assert len(averager.returned) == 3 and all(r.ok for r in averager.returned)


@pytest.mark.integration
def test_a_given_back_round_s_vectors_are_reused_by_the_next_round():
    """Two holders on loopback, codec none (exact): round 1 writes into the vectors round 0 returned,
    and its average is still the exact weighted mean."""
    with loopback_holders(2, "buffers", "L0M0", 0) as avgs:
        exact = get_codec("none")
        n = 3 * BLOCK + 5
        results = []
        for r in range(2):
            deltas = [torch.randn(n, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(2)]
            with ThreadPoolExecutor(2) as pool:
                got = list(pool.map(lambda i: avgs[i].average("L0M0", r, [deltas[i]], float(i + 1), exact, 20.0),
                                    range(2)))
            assert all(res.ok and res.group_size == 2 for res in got), [res.reason for res in got]
            mean = (deltas[0] + 2 * deltas[1]) / 3
            for i, res in enumerate(got):
                assert torch.allclose(res.averaged[0], mean, atol=1e-6)
                assert torch.equal(res.own_decoded[0], deltas[i])  # codec none: sent as it is
            results.append(got)
            if r == 0:
                first = [{b.untyped_storage().data_ptr() for b in res.buffers} for res in got]
                assert all(len(ptrs) == 2 for ptrs in first)
                for avg, res in zip(avgs, got):
                    avg.give_back(res)
        for i, res in enumerate(results[1]):
            assert res.averaged[0].untyped_storage().data_ptr() in first[i]
            assert res.own_decoded[0].untyped_storage().data_ptr() in first[i]


@pytest.mark.integration
def test_a_lone_holder_applies_its_vector_encoded_while_it_looked_for_a_group():
    """A holder alone: the int8 encoding made while matchmaking ran (``Codec.prepare``) is what it
    applies, exactly the codec's round trip of its delta; its vector is handed back and reused."""
    with loopback_holders(1, "lone", "L0M0", 0) as (avg,):
        codec = get_codec("int8+zstd")
        n = 5 * BLOCK + 3
        used = set()
        for r in range(2):
            delta = torch.randn(n, generator=torch.Generator().manual_seed(r)) * 0.01
            res = avg.average("L0M0", r, [delta], 1.0, codec, 20.0)
            assert res.ok and res.group_size == 1, res.reason
            assert torch.equal(res.own_decoded[0], codec.roundtrip(delta))
            assert torch.equal(res.averaged[0], res.own_decoded[0])
            assert len(res.buffers) == 1
            used.add(res.own_decoded[0].untyped_storage().data_ptr())
            avg.give_back(res)
        assert len(used) == 1  # round 1 encoded into the vector round 0 handed back
