"""Each module's exchange plan: the H and codec every holder of the module uses from an agreed round
on, chosen from the links its holders measured so that the exchange stays within the run's
communication budget. Pure functions of (now, holders, current plan, settings) returning
``(plan, reason)``.

A round of module m costs each holder h its compute, ``H * batch * seq_len / tokens_per_s(h)``
seconds, and its exchange, ``o(h) + k(h) * size(m, codec) / upload(h) + k(h) * size(m, codec) /
download(h)`` seconds, where ``size`` is the module's exact encoded size (:mod:`models.codec_spec`),
``k(h)`` the modules h exchanges at once over the same link (a path peer's whole path) and ``o(h)``
what h's exchanges block it beyond their bytes (matchmaking, round trips, waiting for the group: its
measured overhead, :class:`peer.diloco.LinkRates`; a longer round amortises it, a smaller codec does
not): m's round waits for its slowest holder, so m's share is the largest exchange / compute ratio
over its holders. A direction whose rate is not known (0) never counts. An exchange under
:data:`coordinator.links.MIN_SLOW_EXCHANGE_SECONDS` does not count against the plan a module has (a
tiny round is not lengthened for it), but it does count for the plan a module would move to: a
shorter or finer plan is taken only when its whole exchange fits. Were the exemption to justify a move
too, an exchange near the threshold would flip a module between a short plan (under it: no cost) and
a long one (over it: most of a short round) as its measured seconds crossed it.

Candidates, in order of preference: H from the run's ``inner_steps`` doubling up to
``max_inner_steps_factor`` times it, and for each H the run's codec, then each allowed smaller codec
(``planner_codecs``) from largest to smallest: a lighter codec is tried before a longer round. Then,
where ``overlap_budget`` > 0, the same again with the exchange behind the next round: the holders
(path peers) go on training while it runs and apply it a step after it returns, so it blocks nothing
but costs staleness (the steps taken on the global copy it replaces), which ``overlap_budget`` bounds
as a share of a round. A blocking exchange within ``comm_budget`` is preferred at any H: staleness
is a cost in quality, a longer round only in how often modules meet. The
plan is the first candidate within its budget (the last one when none is). H is one for the
lattice (:func:`lattice_h`): each module is planned alone first, then every module again with the
largest H of those as the least it may have, so a module whose own links would allow a shorter
round gets the lattice's H and the codec that fits it. Hysteresis: the
current plan is kept while its share stays within ``comm_budget * (1 + plan_hysteresis)`` and no
preferred candidate fits within ``comm_budget * (1 - plan_hysteresis)``, so measurement noise around
the budget changes nothing. While a holder of the module ignores plans (an older release), only the
run's codec is a candidate. A new plan applies from the module's highest reported round plus
:func:`lead_rounds` (every holder hears of it before it reaches that round), and no plan changes
before the previous one took effect, so a holder needs at most two plans per module to know every
round's H and codec.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from coordinator.links import MIN_SLOW_EXCHANGE_SECONDS
from coordinator.settings import CoordinatorSettings
from models.codec_spec import codec_spec
from models.config import RunConfig

__all__ = ["ModulePlan", "HolderLink", "candidates", "plan_module", "allowed_codecs", "lattice_h", "lead_rounds",
           "held_back_by"]


@dataclass(frozen=True)
class ModulePlan:
    """What every holder of ``module_id`` uses in its rounds from ``from_round`` on."""

    module_id: str
    inner_steps: int
    codec: str
    from_round: int
    reason: str = ""
    decided_at: float = 0.0
    """Wall-clock time of the decision."""
    overlap: bool = False
    """The holders' exchanges of the module's rounds run behind their next round's steps (a path
    peer's overlap mode) instead of blocking them: where no H and codec allowed keeps the exchange
    within ``comm_budget``."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModulePlan":
        return cls(**d)  # a plan stored before ``overlap`` existed reads as one without it

    @property
    def label(self) -> str:
        return _label(self.inner_steps, self.codec, self.overlap)


@dataclass(frozen=True)
class HolderLink:
    """One holder of a module as the planner sees it."""

    peer_id: str
    upload_bps: float
    """Bytes/s (0: unknown): measured from its rounds, or the join probe's until then."""
    download_bps: float
    tokens_per_s: float
    modules: int = 1
    """Modules it exchanges at once over its link each round."""
    follows_plans: bool = True
    """False for a peer of an older coordinator protocol, which ignores plans: its modules keep the
    run's codec (only H may change; such a peer keeps its assignment's H, and rounds pace it)."""
    overhead_s: float = 0.0
    """Seconds its rounds' exchanges block it beyond their bytes at its rates (matchmaking, round
    trips, waiting for its groups), as it measured them (0: unknown or none)."""


def allowed_codecs(run: RunConfig, settings: CoordinatorSettings) -> list[str]:
    """The run's codec, then the ``planner_codecs`` smaller than it, from largest to smallest."""
    base = run.outer.codec
    bits = codec_spec(base).encoded_size(1 << 20)
    extra = {c for c in settings.planner_codec_list() if codec_spec(c).encoded_size(1 << 20) < bits}
    return [base] + sorted(extra, key=lambda c: (-codec_spec(c).encoded_size(1 << 20), c))


def candidates(run: RunConfig, settings: CoordinatorSettings) -> list[tuple[int, str, bool]]:
    """(H, codec, overlap) in order of preference (see the module docstring): every H and codec with
    the exchange waited for, then, where ``overlap_budget`` allows it, the same behind the next round."""
    codecs = allowed_codecs(run, settings)
    h0 = run.outer.inner_steps
    blocking, h = [], h0
    while h <= h0 * settings.max_inner_steps_factor:
        blocking.extend((h, c, False) for c in codecs)
        h *= 2
    return blocking + ([(h, c, True) for h, c, _ in blocking] if settings.overlap_budget > 0 else [])


def _budget(option: tuple[int, str, bool], settings: CoordinatorSettings) -> float:
    """The share of a round a candidate's exchange may take: ``comm_budget`` when training waits for
    it, ``overlap_budget`` when it runs behind the next round (the share of that round's steps taken
    on the global copy the exchange is about to replace)."""
    return settings.overlap_budget if option[2] else settings.comm_budget


def _costs(holders: Sequence[HolderLink]) -> list[tuple[float, float, float, HolderLink]]:
    """The holders that can be a candidate's slowest, as (o, a, tokens_per_s, holder): ``o`` its
    exchange overhead in seconds, ``a`` its seconds of exchange per byte of the module (``k / upload +
    k / download``), so a candidate of ``size`` bytes takes it ``o + size * a`` seconds and costs
    ``(o + size * a) * tokens_per_s / tokens`` of a round of ``tokens``. A holder another one matches
    or beats in all three is left out (whatever the candidate, its exchange and share are no larger),
    as are holders with neither an overhead nor a known rate. One pass per module, whatever the
    candidates; the few left are what each candidate looks at."""
    items = []
    for link in holders:
        a = max(1, link.modules) * ((1.0 / link.upload_bps if link.upload_bps > 0 else 0.0)
                                    + (1.0 / link.download_bps if link.download_bps > 0 else 0.0))
        o = max(0.0, link.overhead_s)
        if a > 0 or o > 0:
            items.append((o, a, max(link.tokens_per_s, 1e-9), link))
    items.sort(key=lambda t: (-t[1], -t[0], -t[2], t[3].peer_id))
    kept: list[tuple[float, float, float, HolderLink]] = []
    for item in items:  # every kept one has an ``a`` at least as large
        if not any(k[0] >= item[0] and k[2] >= item[2] for k in kept):
            kept.append(item)
    return kept


def _share(numel: int, h: int, codec: str, costs: Sequence[tuple[float, float, float, HolderLink]], run: RunConfig,
           settings: CoordinatorSettings, exempt: bool = True) -> tuple[float, Optional[HolderLink], float]:
    """(largest exchange / compute ratio over the holders, that holder, its exchange seconds); with
    ``exempt``, an exchange under :data:`MIN_SLOW_EXCHANGE_SECONDS` does not count."""
    size = codec_spec(codec).encoded_size(numel)
    tokens = h * (settings.batch_size or run.inner.batch_size) * run.lattice.seq_len
    worst: tuple[float, Optional[HolderLink], float] = (0.0, None, 0.0)
    for o, a, tokens_per_s, link in costs:
        seconds = o + size * a
        if exempt and seconds < MIN_SLOW_EXCHANGE_SECONDS:
            continue
        share = seconds * tokens_per_s / tokens
        if share > worst[0]:
            worst = (share, link, seconds)
    return worst


def _describe(h: int, codec: str, overlap: bool, share: float, link: Optional[HolderLink], seconds: float) -> str:
    label = _label(h, codec, overlap)
    if link is None:
        return f"{label}: every holder's exchange under {MIN_SLOW_EXCHANGE_SECONDS:g}s or of unknown rate"
    what = f"{label}: exchange {share:.0%} of a round"
    overhead = f"{link.overhead_s:.1f}s overhead + bytes, " if link.overhead_s > 0 else ""
    return (f"{what} ({seconds:.1f}s at slowest holder {link.peer_id[-8:]}: {overhead}"
            f"{link.upload_bps * 8e-6:.1f} Mbit/s up, {link.download_bps * 8e-6:.1f} down)")


def plan_module(
    now: float,
    module_id: str,
    numel: int,
    holders: Sequence[HolderLink],
    current: Optional[ModulePlan],
    module_round: int,
    run: RunConfig,
    settings: CoordinatorSettings,
    h_floor: int = 0,
) -> tuple[Optional[ModulePlan], str]:
    """(a new plan, reason) when the module's plan should change, else (None, reason).

    ``numel``: the module's parameter count; ``holders``: its live holders; ``current``: its plan
    (None: the run's H and codec, never planned); ``module_round``: the highest round its holders
    reported; ``h_floor``: the least H a candidate may have (the H other modules need: see
    :func:`lattice_h`)."""
    slack = settings.plan_hysteresis
    options = candidates(run, settings)
    if h_floor:
        options = [o for o in options if o[0] >= h_floor] or [o for o in options if o[0] == options[-1][0]]
    now_option = ((current.inner_steps, current.codec, current.overlap) if current
                  else (run.outer.inner_steps, run.outer.codec, False))
    if current is not None and module_round < current.from_round:
        return None, f"{_label(*now_option)} from round {current.from_round} (module at round {module_round})"
    if not holders:
        return None, f"{_label(*now_option)}: no holder"
    stale = sum(1 for link in holders if not link.follows_plans)
    if stale:  # a holder that ignores plans encodes with the run's codec whatever a plan says
        options = [o for o in options if o[1] == run.outer.codec]
    costs = _costs(holders)
    exempted = [_share(numel, h, c, costs, run, settings) for h, c, _ in options]
    shares = [_share(numel, h, c, costs, run, settings, exempt=False) for h, c, _ in options]
    budgets = [_budget(o, settings) for o in options]
    # a new plan is the first candidate whose whole exchange fits; the exemption only keeps a plan
    best = next((i for i, s in enumerate(shares) if s[0] <= budgets[i]),
                next((i for i, s in enumerate(exempted) if s[0] <= budgets[i]), len(options) - 1))
    here = options.index(now_option) if now_option in options else None
    if here is None and stale:
        why = (f"{stale} holder(s) of an older release ignore plans, so the codec is the run's; "
               f"{_describe(*options[best], *shares[best])}")
    elif here is None and h_floor > now_option[0]:
        why = (f"the lattice's modules need H={options[0][0]} (a peer's modules end a round together); "
               f"{_describe(*options[best], *shares[best])}")
    elif here is None:
        why = f"the allowed H and codecs changed; {_describe(*options[best], *shares[best])}"
    elif exempted[here][0] > budgets[here] * (1 + slack):
        why = (f"{_describe(*now_option, *exempted[here])} passes the budget {budgets[here]:.0%}; "
               f"{_describe(*options[best], *shares[best])}")
        if shares[best][0] > budgets[best]:
            why += " (the least the allowed H and codecs reach)"
    elif (shorter := next((i for i in range(here) if shares[i][0] <= budgets[i] * (1 - slack)), None)) is not None:
        best = shorter
        why = f"links allow a shorter or finer exchange: {_describe(*options[best], *shares[best])}"
    else:
        return None, f"keeps {_describe(*now_option, *exempted[here])} (budget {budgets[here]:.0%})"
    if options[best] == now_option:
        return None, f"keeps {_describe(*now_option, *exempted[best])} (budget {budgets[best]:.0%})"
    h, codec, overlap = options[best]
    plan = ModulePlan(module_id, h, codec, module_round + lead_rounds(now_option[0], holders, run, settings), why,
                      now, overlap)
    return plan, why


def lattice_h(wanted: dict[str, int]) -> int:
    """The one H for every module, from the H each module's own plan would have (``wanted``): the
    largest. A peer's modules end a round together (its round lasts the largest H among them), and a
    path peer's modules span the lattice, so a module planned shorter than another would have
    holders whose rounds last the other's H: they would declare its rounds late, and its groups would
    form without them."""
    return max(wanted.values(), default=0)


def lead_rounds(h: int, holders: Sequence[HolderLink], run: RunConfig, settings: CoordinatorSettings) -> int:
    """Rounds between the module's highest reported round and a new plan's first: ``plan_lead_rounds``,
    or more where its fastest holder's rounds (of ``h`` steps) are so short that three heartbeat
    intervals (its round reported, the plan sent back, a margin) would span more of them. A holder
    that learns of a plan after its first round encodes that round in the old codec and the group
    drops its parts."""
    tokens = h * (settings.batch_size or run.inner.batch_size) * run.lattice.seq_len
    fastest = max((link.tokens_per_s for link in holders), default=0.0)
    if fastest <= 0:
        return settings.plan_lead_rounds
    round_seconds = tokens / fastest
    return max(settings.plan_lead_rounds, math.ceil(3 * settings.heartbeat_interval / round_seconds))


def _label(h: int, codec: str, overlap: bool = False) -> str:
    return f"H={h}, {codec}" + (", behind the next round" if overlap else "")


def held_back_by(numel: int, holders: Sequence[HolderLink], run: RunConfig,
                 settings: CoordinatorSettings) -> Optional[HolderLink]:
    """The one holder whose link alone puts the module's exchange past ``comm_budget`` at the run's H
    and codec (without it the rest fit): the peer to move elsewhere. None when the module fits, or
    when it would not fit without that holder either (several slow links: the plan is the remedy)."""
    h, codec = run.outer.inner_steps, run.outer.codec
    share, worst, _ = _share(numel, h, codec, _costs(holders), run, settings)
    if worst is None or share <= settings.comm_budget:
        return None
    rest = [link for link in holders if link.peer_id != worst.peer_id]
    if _share(numel, h, codec, _costs(rest), run, settings)[0] <= settings.comm_budget:
        return worst
    return None
