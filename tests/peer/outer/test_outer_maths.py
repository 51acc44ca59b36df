"""The shared training maths against expected values derived without ``peer/``.

``tests/golden/sim_tiny.json`` comes from the simulator, which runs the same outer optimizer and
aggregation as the peers, so it cannot catch a bug in either. Here every expected value is worked
out by hand (small vectors, the working in the comments) or computed by torch's own primitives
(``torch.optim.SGD``), from the definitions in docs (DESIGN.md, "Outer steps") and docstrings:

- outer step (DiLoCo, Douillard et al. 2023): ``delta = global - local`` is the gradient of the
  global copy; ``buf = m * buf + delta``; ``global -= lr * (delta + m * buf)`` (Nesterov), which is
  ``torch.optim.SGD(lr, momentum=m, nesterov=True, dampening=0)`` with ``.grad = delta``;
- aggregation (``peer.averaging.aggregation``): ``sum_k w_k v_k / sum_k w_k`` with w_k the tokens;
  NaN/Inf members dropped; ``norm_bound``: a member longer than ``norm_bound`` x the (lower) median
  norm scaled down to it; ``trimmed_mean``: per coordinate, the first row holding the minimum and the
  first other row holding the maximum left out (4 or more members); ``centered_clip``
  (Karimireddy et al. 2021): from the coordinate-wise lower median, ``v += sum_k w_k clip_tau(x_k - v)
  / sum_k w_k`` with ``tau`` the lower median distance of the members to that median;
- int8/int4 blockwise absmax (``models.codec_spec``): per block of BLOCK values an fp32 scale
  ``absmax / qmax`` then codes ``round(x / scale)`` in [-qmax, qmax];
- error feedback: ``x_t = delta_t + r_{t-1}``, send ``s_t = roundtrip(x_t)``, ``r_t = x_t - s_t``, so
  ``sum_t s_t = sum_t delta_t - r_T``.

Where the inputs are small dyadic numbers every fp32 operation is exact and the comparison is exact
(``torch.equal``); elsewhere each tolerance is derived next to its assertion. "No median" rule:
``models.config.AGGREGATORS`` has none (mean, trimmed_mean, centered_clip).
"""

from __future__ import annotations

import struct
from fractions import Fraction

import pytest
import torch

from models.codec_spec import BLOCK, SPECS
from peer.averaging import MEAN, Aggregation, aggregate, reduce_part
from peer.compression import ErrorFeedback, get_codec, weighted_mean
from peer.outer import OuterOptimizer

U = 2.0**-24
"""Unit roundoff of fp32 (round to nearest): one operation's relative error is at most this."""


def f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def nearest_f32(q: Fraction) -> float:
    """The fp32 value nearest to ``q`` (ties to even): what one correctly rounded IEEE division of two
    exactly representable integers gives. Checked against the two neighbours, not computed by torch."""
    x = torch.tensor(float(q), dtype=torch.float32)  # candidate (double then single rounding)
    lo, hi = torch.nextafter(x, torch.tensor(-float("inf"))), torch.nextafter(x, torch.tensor(float("inf")))
    best = min((x, lo, hi), key=lambda c: abs(Fraction(float(c)) - q))
    return float(best)


# -- the outer step ---------------------------------------------------------------------------------


def test_outer_step_three_rounds_by_hand_momentum_carried():
    """lr 0.5, momentum 0.5, Nesterov, on dyadic numbers: every fp32 operation is exact.

    theta0 = [1, -2]; d1 = [0.5, 0.25], d2 = [0.25, -0.5], d3 = [-1, 0]
    round 1: buf = d1 = [0.5, 0.25]; upd = d1 + 0.5 buf = [0.75, 0.375]
             theta = theta0 - 0.5 upd = [0.625, -2.1875]
    round 2: buf = 0.5 [0.5, 0.25] + d2 = [0.5, -0.375]; upd = d2 + 0.5 buf = [0.5, -0.6875]
             theta = [0.625 - 0.25, -2.1875 + 0.34375] = [0.375, -1.84375]
    round 3: buf = 0.5 [0.5, -0.375] + d3 = [-0.75, -0.1875]; upd = d3 + 0.5 buf = [-1.375, -0.09375]
             theta = [0.375 + 0.6875, -1.84375 + 0.046875] = [1.0625, -1.796875]
    Without momentum carried (buf reset each round) round 3 would give theta = [1.125, -1.84375].
    """
    opt = OuterOptimizer([f32(1.0, -2.0)], lr=0.5, momentum=0.5, nesterov=True)
    expected = [([0.5, 0.25], [0.625, -2.1875]),
                ([0.5, -0.375], [0.375, -1.84375]),
                ([-0.75, -0.1875], [1.0625, -1.796875])]
    for d, (buf, theta) in zip([f32(0.5, 0.25), f32(0.25, -0.5), f32(-1.0, 0.0)], expected):
        opt.step([d])
        assert torch.equal(opt.momentum_buffers[0], f32(*buf))
        assert torch.equal(opt.global_params[0], f32(*theta))


def test_outer_step_heavy_ball_by_hand():
    """nesterov=False: ``global -= lr * buf``. theta0 = [1, -2], lr 0.5, m 0.5, d1 = [0.5, 0.25], d2 = [0.25, -0.5]:
    round 1: buf = [0.5, 0.25], theta = [0.75, -2.125]; round 2: buf = [0.5, -0.375], theta = [0.5, -1.9375]."""
    opt = OuterOptimizer([f32(1.0, -2.0)], lr=0.5, momentum=0.5, nesterov=False)
    opt.step([f32(0.5, 0.25)])
    assert torch.equal(opt.global_params[0], f32(0.75, -2.125))
    opt.step([f32(0.25, -0.5)])
    assert torch.equal(opt.global_params[0], f32(0.5, -1.9375))


def test_pseudo_gradient_sign_one_plain_step_lands_on_the_local_params():
    """delta = global - local (DESIGN.md), descended: with lr 1 and no momentum, one outer step on a lone
    member's delta moves the global copy exactly onto its local params (dyadic values: exact)."""
    local = [torch.nn.Parameter(f32(1.0, 2.0, -3.0)), torch.nn.Parameter(f32(0.5))]
    opt = OuterOptimizer(local, lr=1.0, momentum=0.0, nesterov=True)
    with torch.no_grad():
        local[0].add_(f32(0.25, -1.0, 0.125))  # what H inner steps did
        local[1].sub_(2.0)
    delta = opt.pseudo_gradient(local)
    assert torch.equal(delta[0], f32(-0.25, 1.0, -0.125)) and torch.equal(delta[1], f32(2.0))
    opt.step(delta)
    assert torch.equal(opt.global_params[0], f32(1.25, 1.0, -2.875))
    assert torch.equal(opt.global_params[1], f32(-1.5))


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_equals_torch_sgd_bit_for_bit_on_dyadic_values(nesterov):
    """torch.optim.SGD(momentum=m, nesterov, dampening=0) with ``.grad = delta`` is the same maths (its first
    step sets buf = grad, which is m * 0 + grad). With lr, m and the data dyadic (multiples of 2^-6, small),
    every product and sum is exact in fp32 whatever the kernel fuses, so the results are equal."""
    g = torch.Generator().manual_seed(23)
    theta0 = torch.randint(-64, 65, (3, 4), generator=g).to(torch.float32) / 64  # (3, 4)
    ref = torch.nn.Parameter(theta0.clone())
    sgd = torch.optim.SGD([ref], lr=0.5, momentum=0.75, nesterov=nesterov, dampening=0.0, foreach=False)
    opt = OuterOptimizer([theta0], lr=0.5, momentum=0.75, nesterov=nesterov)
    for _ in range(4):
        d = torch.randint(-16, 17, (3, 4), generator=g).to(torch.float32) / 64  # (3, 4)
        ref.grad = d.clone()
        sgd.step()
        opt.step([d])
        assert torch.equal(opt.global_params[0], ref.detach())
        assert torch.equal(opt.momentum_buffers[0], sgd.state[ref]["momentum_buffer"])


def test_outer_step_at_paper_defaults_tracks_fp64_torch_sgd_over_eight_rounds():
    """lr 0.7, momentum 0.9 (DiLoCo's defaults) are not dyadic: OuterOptimizer (fp32) against torch's
    SGD on an fp64 copy of the same inputs, over 8 rounds with momentum carried.

    Tolerance. Let D = max |delta|, T = max |theta|, u = 2^-24. Each fp32 operation errs by <= u of its
    result, and lr, m themselves are rounded to fp32 (u each). |buf| <= D / (1 - m) = 10 D; buf = m buf + d
    has three roundings (m, the product, the sum), so its error obeys e <= m e + 3u 10 D: e <= 300 u D.
    The update d + m buf (<= 10 D) then errs by <= 0.9 x 300 u D + 3u 10 D = 300 u D, and each round adds
    to theta lr x 300 u D + u lr 10 D (the product) + u lr 10 D (lr's rounding) + u T (the subtraction)
    = 224 u D + u T. Over 8 rounds: <= 8 u (230 D + T) (the fp64 path errs 2^-29 times less). The check also fails when the Nesterov term is dropped: heavy ball differs from
    Nesterov by far more than that tolerance on these inputs (asserted).
    """
    g = torch.Generator().manual_seed(7)
    theta0 = torch.randn(64, generator=g)  # (64,)
    deltas = [0.05 * torch.randn(64, generator=g) for _ in range(8)]  # (64,) each
    ref = torch.nn.Parameter(theta0.to(torch.float64))
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    opt = OuterOptimizer([theta0], lr=0.7, momentum=0.9, nesterov=True)
    heavy = OuterOptimizer([theta0], lr=0.7, momentum=0.9, nesterov=False)
    D = max(float(d.abs().max()) for d in deltas)
    T = float(theta0.abs().max()) + 8 * 0.7 * 10 * D  # theta moves by at most lr * 10 D a round
    tol = 8 * U * (230 * D + T)
    for d in deltas:
        ref.grad = d.to(torch.float64)
        sgd.step()
        opt.step([d])
        heavy.step([d])
    err = float((opt.global_params[0].to(torch.float64) - ref.detach()).abs().max())
    assert err <= tol, f"{err:.3g} > {tol:.3g}"
    assert float((heavy.global_params[0].to(torch.float64) - ref.detach()).abs().max()) > 1000 * tol


def test_one_diloco_round_of_two_peers_weighted_by_tokens_by_hand():
    """Both peers start from theta = [1, 1]. After inner steps: peer a at [0, 2] (1000 tokens), peer b at
    [2, 0.5] (3000 tokens). Deltas theta - local: a [1, -1], b [-1, 0.5]. Weighted mean:
    (1000 [1, -1] + 3000 [-1, 0.5]) / 4000 = [-2000, 500] / 4000 = [-0.5, 0.125].
    Outer step, lr 0.5, m 0.5: buf = [-0.5, 0.125]; upd = 1.5 buf = [-0.75, 0.1875];
    theta = [1 + 0.375, 1 - 0.09375] = [1.375, 0.90625]. (Equal weights would give [1, 1.1875]: the
    tokens must count.)"""
    peers = {"a": (f32(0.0, 2.0), 1000.0), "b": (f32(2.0, 0.5), 3000.0)}
    opts = {pid: OuterOptimizer([f32(1.0, 1.0)], lr=0.5, momentum=0.5) for pid in peers}
    contributions = {pid: (opts[pid].pseudo_gradient([local])[0], tokens) for pid, (local, tokens) in peers.items()}
    avg = aggregate(contributions, MEAN).value
    assert torch.equal(avg, f32(-0.5, 0.125))
    for opt in opts.values():
        opt.step([avg])
        assert torch.equal(opt.global_params[0], f32(1.375, 0.90625))


# -- the weighted mean ------------------------------------------------------------------------------


def test_weighted_mean_unequal_token_weights_by_hand():
    """Tokens 1000, 3000, 4000 (total 8000), values v1 = [8, -4, 1], v2 = [0, 4, 2], v3 = [2, 1, -3]:
    (1000 v1 + 3000 v2 + 4000 v3) / 8000 = [16000, 12000, -5000] / 8000 = [2, 1.5, -0.625]
    (integers and an exact quotient: exact in fp32). The unweighted mean would be [10/3, 1/3, 0]."""
    values = [f32(8.0, -4.0, 1.0), f32(0.0, 4.0, 2.0), f32(2.0, 1.0, -3.0)]
    weights = [1000.0, 3000.0, 4000.0]
    expected = f32(2.0, 1.5, -0.625)
    assert torch.equal(weighted_mean(values, weights), expected)
    # aggregate sorts by peer id, whatever order the dict was filled in
    contributions = {"p2": (values[1], 3000.0), "p3": (values[2], 4000.0), "p1": (values[0], 1000.0)}
    out = aggregate(contributions, MEAN)
    assert torch.equal(out.value, expected) and out.used == ["p1", "p2", "p3"] and out.suspects == {}


def test_weighted_mean_drops_a_nan_member():
    """A member holding NaN is dropped; the others' weighted mean: (1 [1, 2] + 3 [3, -2]) / 4 = [2.5, -1]."""
    out = aggregate({"a": (f32(1.0, 2.0), 1.0), "b": (f32(3.0, -2.0), 3.0), "c": (f32(float("nan"), 0.0), 9.0)}, MEAN)
    assert torch.equal(out.value, f32(2.5, -1.0))
    assert out.used == ["a", "b"] and set(out.suspects) == {"c"}


def _int8_bytes(blocks: list[tuple[float, list[int]]]) -> bytes:
    """int8 bytes built by hand from models/codec_spec.py's table: per block an fp32 LE scale, then int8 codes."""
    return b"".join(struct.pack("<f", scale) + struct.pack(f"<{len(codes)}b", *codes) for scale, codes in blocks)


def test_reducer_decodes_weighs_and_encodes_once_int8_by_hand():
    """Contributions as hand-built int8 bytes (one block of 3, scale 1): a = [127, -2, 4] (1 token),
    b = [-127, 6, 0] (3 tokens). Decoded exactly; mean (1 a + 3 b) / 4 = [-254, 16, 4] / 4 = [-63.5, 4, 1].
    Encoded once: absmax 63.5, scale 63.5 / 127 = 0.5, codes [-127, 8, 2]."""
    codec = get_codec("int8")
    contributions = {"b": (_int8_bytes([(1.0, [-127, 6, 0])]), 3.0), "a": (_int8_bytes([(1.0, [127, -2, 4])]), 1.0)}
    data, reduced = reduce_part(codec, contributions, 3)
    assert data == _int8_bytes([(0.5, [-127, 8, 2])])
    assert torch.equal(reduced.value, f32(-63.5, 4.0, 1.0)) and reduced.used == ["a", "b"]


# -- robust rules -----------------------------------------------------------------------------------


def test_norm_bound_scales_a_long_member_to_the_bound_by_hand():
    """norm_bound 2, four members (weights 1, 2, 3, 2) of norms 5, 10, 1, 80:
    a = [3, 4], b = [-6, 8], c = [0, 1], d = [48, -64]. Sorted norms [1, 5, 10, 80]; lower median 5;
    bound 2 x 5 = 10. b (norm 10) is not longer than 10: kept as is. d is scaled by 10 / 80 = 1/8 to
    [6, -8]. Weighted mean: (1 [3, 4] + 2 [-6, 8] + 3 [0, 1] + 2 [6, -8]) / 8 = [3, 7] / 8 = [0.375, 0.875].
    Without the bound: (1 [3, 4] + 2 [-6, 8] + 3 [0, 1] + 2 [48, -64]) / 8 = [87, -105] / 8."""
    contributions = {"a": (f32(3.0, 4.0), 1.0), "b": (f32(-6.0, 8.0), 2.0), "c": (f32(0.0, 1.0), 3.0),
                     "d": (f32(48.0, -64.0), 2.0)}
    out = aggregate(contributions, Aggregation("mean", norm_bound=2.0))
    assert torch.equal(out.value, f32(0.375, 0.875))
    assert list(out.suspects) == ["d"] and out.suspects["d"].startswith("clipped")
    assert torch.equal(aggregate(contributions, MEAN).value, f32(87 / 8, -105 / 8))


def test_trimmed_mean_by_hand_with_ties():
    """Five members a..e, weights 1, 2, 3, 4, 5; per coordinate the first row holding the minimum and the
    first other row holding the maximum are left out, the rest averaged with their weights.

    coord 0: [-50, -1.5, 2, 1.5, 7]: drop a (min), e (max); keep b, c, d: (2 -1.5 + 3 2 + 4 1.5) / 9 = 9/9 = 1
    coord 1: [10, 4.5, 3, 0, -10]: drop e (min), a (max); keep b, c, d: (9 + 9 + 0) / 9 = 2
    coord 2: [1, 1, 3, 5, 5] (ties): drop a (first min), d (first max); keep b, c, e: (2 + 9 + 25) / 10 = 3.6,
             not dyadic: the fp32 nearest to 36/10 (num and den are exact integers, one division rounds)
    coord 3: [0.5, 0, 0, 0, 9]: drop b (first min), e (max); keep a, c, d: (1 x 0.5 + 0 + 0) / 8 = 0.0625
    a and e are each trimmed at 3 of 4 coordinates (75%, under the 90% report threshold): no suspect.
    """
    rows = {"a": [-50.0, 10.0, 1.0, 0.5], "b": [-1.5, 4.5, 1.0, 0.0], "c": [2.0, 3.0, 3.0, 0.0],
            "d": [1.5, 0.0, 5.0, 0.0], "e": [7.0, -10.0, 5.0, 9.0]}
    weights = dict(zip("abcde", [1.0, 2.0, 3.0, 4.0, 5.0]))
    out = aggregate({p: (f32(*v), weights[p]) for p, v in rows.items()}, Aggregation("trimmed_mean"))
    assert torch.equal(out.value, f32(1.0, 2.0, nearest_f32(Fraction(36, 10)), 0.0625))
    assert out.suspects == {}


def test_trimmed_mean_reports_a_member_trimmed_everywhere_and_needs_four():
    """a is the maximum of every coordinate (trimmed at 100% > 90%): reported; b and c are each the minimum
    of one (50%): not. Values a = [100, 100], b = [1, 4], c = [2, 2], d = [3, 6], weights 1: coord 0 drops
    b (min), a (max): (2 + 3) / 2 = 2.5; coord 1 drops c (min), a (max): (4 + 6) / 2 = 5. With three
    members (b, c, d) there is no trimming: the plain mean [(1 + 2 + 3) / 3, (4 + 2 + 6) / 3] = [2, 4]."""
    rows = {"a": f32(100.0, 100.0), "b": f32(1.0, 4.0), "c": f32(2.0, 2.0), "d": f32(3.0, 6.0)}
    out = aggregate({p: (v, 1.0) for p, v in rows.items()}, Aggregation("trimmed_mean"))
    assert torch.equal(out.value, f32(2.5, 5.0))
    assert set(out.suspects) == {"a"} and "trimmed" in out.suspects["a"]
    three = aggregate({p: (rows[p], 1.0) for p in "bcd"}, Aggregation("trimmed_mean"))
    assert torch.equal(three.value, f32(2.0, 4.0))


def _centered_clip_fp64(xs: list[list[float]], ws: list[float], iters: int) -> list[float]:
    """The rule written out in plain Python floats (fp64) from its docstring, for the tolerance check."""
    k, n = len(xs), len(xs[0])
    v = [sorted(x[j] for x in xs)[(k - 1) // 2] for j in range(n)]  # coordinate-wise lower median

    def dist(x: list[float], c: list[float]) -> float:
        return sum((a - b) ** 2 for a, b in zip(x, c)) ** 0.5

    tau = sorted(dist(x, v) for x in xs)[(k - 1) // 2]
    for _ in range(iters):
        step = [0.0] * n
        for x, w in zip(xs, ws):
            dx = dist(x, v)
            s = tau / dx if dx > tau else 1.0
            step = [a + w * s * (xj - vj) for a, xj, vj in zip(step, x, v)]
        v = [vj + a / sum(ws) for vj, a in zip(v, step)]
    return v


def test_centered_clip_by_hand():
    """Four members in one dimension, weights 1: [1], [2], [3], [66]. Lower median 2; distances to it
    1, 0, 1, 64; tau = lower median of [0, 1, 1, 64] = 1.
    iter 1: diffs -1, 0, 1, 64 -> clipped to |.| <= 1: -1, 0, 1, 1; v = 2 + 1/4 = 2.25
    iter 2: diffs -1.25, -0.25, 0.75, 63.75 -> -1, -0.25, 0.75, 1; v = 2.25 + 0.5/4 = 2.375
    iter 3: diffs -1.375, -0.375, 0.625, 63.625 -> -1, -0.375, 0.625, 1; v = 2.375 + 0.25/4 = 2.4375
    (the plain mean is 18). After one iteration everything is dyadic (1 / 64 and 1 / 1 exact): exact.
    Three iterations clip by 1 / 1.25 and 1 / 1.375, not dyadic: each clipped term is |.| <= tau = 1 with
    <= 3 roundings (tau / dist, w x scale, diff x that), the sum of 4 adds 3 more, the update 2 more:
    < 20 u per iteration on values below 3, so 3 iterations stay within 60 u x 3 < 1.1e-5; we allow 2e-5.
    Only [66] is reported: its final clip scale 1 / 63.625 < 0.5; [1]'s is 1 / 1.375 = 0.73.
    """
    contributions = {p: (f32(x), 1.0) for p, x in zip("abcd", [1.0, 2.0, 3.0, 66.0])}
    one = aggregate(contributions, Aggregation("centered_clip", clip_iters=1))
    assert torch.equal(one.value, f32(2.25))
    three = aggregate(contributions, Aggregation("centered_clip", clip_iters=3))
    assert abs(float(three.value[0]) - 2.4375) <= 2e-5
    assert abs(_centered_clip_fp64([[1.0], [2.0], [3.0], [66.0]], [1.0] * 4, 3)[0] - 2.4375) <= 1e-12
    assert list(three.suspects) == ["d"]


def test_centered_clip_weighted_in_two_dimensions_against_the_fp64_rule():
    """Five members in 2-D with unequal weights, one far away; the fp32 aggregate against the rule in fp64
    (:func:`_centered_clip_fp64`). Tolerance: as in the 1-D case each of the 3 iterations adds < 20 u of
    the largest |value| (here < 16) per coordinate: 3 x 20 x 16 u < 6e-5; we allow 1e-4. A wrong tau, a
    missing weight or a start from the mean moves the result by > 0.01 on these inputs (asserted for
    the weights)."""
    xs = [[1.0, 2.0], [1.5, 1.0], [0.5, 2.5], [2.0, 1.5], [-15.0, 14.0]]
    ws = [1.0, 4.0, 2.0, 3.0, 5.0]
    out = aggregate({f"p{i}": (f32(*x), w) for i, (x, w) in enumerate(zip(xs, ws))}, Aggregation("centered_clip"))
    expected = _centered_clip_fp64(xs, ws, 3)
    assert max(abs(float(a) - b) for a, b in zip(out.value, expected)) <= 1e-4
    unweighted = _centered_clip_fp64(xs, [1.0] * 5, 3)
    assert max(abs(a - b) for a, b in zip(unweighted, expected)) > 0.01
    assert "p4" in out.suspects


# -- the int8 / int4 codecs -------------------------------------------------------------------------


def test_int8_encode_by_hand_rounds_half_to_even():
    """One block [127, 0.5, 1.5, -2.5, 63.25]: absmax 127, scale 127 / 127 = 1; codes round(x / 1) with
    ties to even: [127, 0, 2, -2, 63]; decoded [127, 0, 2, -2, 63]; errors [0, 0.5, 0.5, 0.5, 0.25],
    the largest exactly absmax / 127 / 2 = 0.5: the bound below is tight. Bytes per models/codec_spec.py:
    fp32 LE scale then the int8 codes (4 + 5 = 9 bytes)."""
    codec = get_codec("int8")
    x = f32(127.0, 0.5, 1.5, -2.5, 63.25)
    data, decoded = codec.encode_roundtrip(x)
    assert data == _int8_bytes([(1.0, [127, 0, 2, -2, 63])])
    assert torch.equal(decoded, f32(127.0, 0.0, 2.0, -2.0, 63.0))
    assert float((decoded - x).abs().max()) == 127.0 / 127 / 2


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_blockwise_roundtrip_error_within_the_derived_bound(name):
    """Per block with absmax A, qmax Q (127 or 7), u = 2^-24: s = fl(A / Q) = (A / Q)(1 + e1);
    t = fl(x / s) = (x / s)(1 + e2), so |x - t s| <= |x| u <= A u; q = round(t), |t - q| <= 1/2 (|t| <=
    Q (1 + 2u) < Q + 1/2, so the clamp never cuts); y = fl(q s) = q s (1 + e3), |q s e3| <= Q s u.
    |x - y| <= A u + s / 2 + Q s u <= A / (2Q) + A u (1 + 1/(2Q) + 1 + u) < A / (2Q) + 3 A u.
    Checked on several blocks of very different magnitudes (the scale is per block), with a tail block."""
    codec = get_codec(name)
    qmax = SPECS[name].qmax
    g = torch.Generator().manual_seed(3)
    mags = [1e-6, 1e-2, 1.0, 37.0, 1e4]
    x = torch.cat([torch.randn(BLOCK, generator=g) * m for m in mags] + [torch.randn(300, generator=g)])  # (5 BLOCK + 300,)
    y = codec.roundtrip(x)
    assert len(codec.encode(x)) == SPECS[name].encoded_size(x.numel())
    for start in range(0, x.numel(), BLOCK):
        block = x[start:start + BLOCK].to(torch.float64)
        A = float(block.abs().max())
        err = float((y[start:start + BLOCK].to(torch.float64) - block).abs().max())
        assert err <= A / (2 * qmax) + 3 * A * U, f"block at {start}: {err:.3g} > {A / (2 * qmax):.3g}"
        assert err >= A / (2 * qmax) * 0.5, "random values must use most of the half step (the bound is not slack)"


# -- error feedback ---------------------------------------------------------------------------------


def test_error_feedback_by_hand_sends_what_rounding_dropped():
    """int8, one block, element 0 = 127 every round (so the scale is exactly 1 and codes are round(x)),
    element 1 = 0.375 every round; ties to even.
    round 1: x = 0.375 + 0 = 0.375 -> sent 0, residual 0.375
    round 2: x = 0.375 + 0.375 = 0.75 -> sent 1, residual -0.25
    round 3: x = 0.375 - 0.25 = 0.125 -> sent 0, residual 0.125
    round 4: x = 0.375 + 0.125 = 0.5 -> sent 0 (0.5 rounds to even 0), residual 0.5
    sum sent = 1 = 4 x 0.375 - 0.5 = sum true - last residual. Without error feedback: 0 every round."""
    codec = get_codec("int8")
    ef = ErrorFeedback(2)
    delta = f32(127.0, 0.375)
    sent_total = torch.zeros(2)
    for sent_1, residual_1 in [(0.0, 0.375), (1.0, -0.25), (0.0, 0.125), (0.0, 0.5)]:
        x = ef.add(delta)
        _, sent = codec.encode_roundtrip(x)
        ef.update(x, sent)
        assert torch.equal(sent, f32(127.0, sent_1)) and torch.equal(ef.residual, f32(0.0, residual_1))
        sent_total += sent
    assert torch.equal(sent_total, 4 * delta - ef.residual)
    assert torch.equal(codec.roundtrip(delta), f32(127.0, 0.0))


def test_error_feedback_sum_of_sent_is_sum_of_true_minus_last_residual_exactly():
    """Dyadic deltas (multiples of 1/8, |.| <= 20) plus a pinned 127 in each block keep every scale at
    exactly 1, so codes are integers, residuals multiples of 1/8 in [-0.5, 0.5] and every fp32 sum below
    exact: sum_t sent_t == sum_t delta_t - r_T holds bit for bit, over 12 rounds and 2 blocks + a tail."""
    codec = get_codec("int8")
    n = 2 * BLOCK + 10
    g = torch.Generator().manual_seed(11)
    ef = ErrorFeedback(n)
    true_total, sent_total = torch.zeros(n), torch.zeros(n)
    for _ in range(12):
        delta = torch.randint(-160, 161, (n,), generator=g).to(torch.float32) / 8  # (n,)
        delta[0::BLOCK] = 127.0  # one per block (and in the tail): scale 127 / 127 = 1
        x = ef.add(delta)
        _, sent = codec.encode_roundtrip(x)
        ef.update(x, sent)
        assert torch.equal(sent, torch.round(x)) and float(ef.residual.abs().max()) <= 0.5
        true_total += delta
        sent_total += sent
    assert torch.equal(sent_total, true_total - ef.residual)


def test_error_feedback_on_gaussian_deltas_within_the_rounding_of_the_adds():
    """Gaussian deltas, int8, 20 rounds. r_t = x_t - s_t is exact (s_t is 0, or within half a step of
    x_t with the same sign, so x_t / 2 <= s_t <= 2 x_t: Sterbenz), so the only rounding is x_t =
    fl(delta_t + r_{t-1}), off by <= u |x_t|. Summed exactly (fp64), sum s - (sum delta - r_T) is the
    sum of those 20 roundings: <= 20 u max |x|."""
    codec = get_codec("int8")
    n = BLOCK + 100
    g = torch.Generator().manual_seed(5)
    ef = ErrorFeedback(n)
    true_total, sent_total = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    xmax = 0.0
    for _ in range(20):
        delta = 0.01 * torch.randn(n, generator=g)  # (n,)
        x = ef.add(delta)
        _, sent = codec.encode_roundtrip(x)
        ef.update(x, sent)
        assert torch.equal(ef.residual.to(torch.float64), x.to(torch.float64) - sent.to(torch.float64))
        xmax = max(xmax, float(x.abs().max()))
        true_total += delta.to(torch.float64)
        sent_total += sent.to(torch.float64)
    gap = float((sent_total - (true_total - ef.residual.to(torch.float64))).abs().max())
    assert gap <= 20 * U * xmax
