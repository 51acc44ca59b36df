"""An optimizer-like wrapper that runs DiLoCo outer steps per module, so training loops stay plain PyTorch.

DiLoCo (Douillard et al. 2023) runs H inner AdamW steps, then one outer step on the pseudo-gradient
``delta = global - local`` averaged across workers. DiPaCo (Douillard et al. 2024) does this per
module of a lattice, each module averaged only among the paths that share it, optionally scaling the
averaged delta by the square root of their number. Streaming DiLoCo (Douillard et al. 2025) and DeAR
(Zhang et al. 2021) hide the exchange behind the next round's compute; here its average is applied at
the first inner step after it returned, the steps taken meanwhile kept on top::

    opt = DiLoCoOptimizer(modules={"embed": m0, "L0M1": m1}, inner=InnerConfig(), outer=OuterConfig(),
                          lattice=LatticeConfig(), averager=averager)
    for x, y in batches:
        loss = model(x, y)[1]; loss.backward()
        report = opt.step(tokens=x.numel())   # a RoundReport when an outer round ran
        opt.zero_grad()
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from models.config import InnerConfig, LatticeConfig, OuterConfig
from models.errors import ConfigError
from peer.averaging import Aggregation, AverageResult, LocalAverager, ModuleAverager, unflatten
from peer.compression import Codec, resolve_codec
from peer.diloco.held_module import HeldModule, PendingExchange
from peer.diloco.plans import PlanBook
from peer.diloco.reports import ModuleReport, RoundReport
from peer.outer import ModuleState

__all__ = ["DiLoCoOptimizer", "JOIN_RAMP_ROUNDS", "ramp_factor"]

logger = logging.getLogger(__name__)

EMPTY_ROUND_WEIGHT = 1.0
"""The weight (in tokens) of a round that ended with no inner step (:meth:`DiLoCoOptimizer.end_round_if_others_wait`):
averaging needs a positive weight, and this one is far below any step's tokens."""

PACED_MIN_SHARE = 0.5
"""The share of its round's steps (or seconds) a peer trains before another holder's wait can end its
round (:meth:`DiLoCoOptimizer._others_waiting`). A peer whose exchanges end later than another
holder's (a slower link, or a group with one) begins each round when that holder has computed most
of its own: paced at once, it would train a step a round for as long as that lasts, and the paths it
trains would learn next to nothing (``bench.planner``'s fixed run, once pushed declarations made
pacing answer within a step). A straggler slower at its steps holds the others at most this share of
its round past theirs."""

JOIN_RAMP_ROUNDS = 4
"""Rounds over which a newcomer's weight in its groups ramps up to its tokens (:func:`ramp_factor`):
the value every trainer, stage server and pipeline trainer of this release passes as
``DiLoCoOptimizer(join_ramp_rounds=...)``."""


def ramp_factor(rounds_here: int, ramp_rounds: int) -> float:
    """The share of its tokens a member weighs with in its ``rounds_here``-th round since it began
    training its current assignment (0 for its first): ``min(1, (rounds_here + 1) / (ramp_rounds + 1))``.

    A newcomer (a joiner, a peer moved to another path, a stage server on a new module) trains its
    first rounds from freshly loaded or freshly initialised state and a fresh inner optimizer, so its
    pseudo-gradients of the modules it shares are the furthest from the network's; they enter the
    shared modules' averages with 1/(R+1), 2/(R+1), ... of their tokens' weight, so one newcomer
    cannot pull trained modules back. Members that began together ramp alike, which leaves their
    average as it was. ``ramp_rounds`` 0: no ramp."""
    if ramp_rounds <= 0:
        return 1.0
    return min(1.0, (max(0, rounds_here) + 1) / (ramp_rounds + 1))


class DiLoCoOptimizer:
    """Inner optimizer every call, one DiLoCo outer step per module every round (see module docstring).

    A round ends after ``outer.inner_steps`` calls to :meth:`step`, or earlier when
    ``outer.round_seconds > 0`` and that many clock seconds have passed since the last round ended
    (a slow peer then contributes fewer tokens, hence a smaller weight). Every module's exchange runs
    at once on its own exchange thread; results are applied in the lattice's fixed order. Per
    module: ``x = global - local (+ residual)``; a delta holding NaN/Inf is never sent (the
    round is skipped for that module and local progress kept); ``averager.average(..., weight=tokens,
    codec=self.codec, timeout=outer.round_timeout)``; optional DiPaCo sqrt scaling; Nesterov outer
    step on the global copy; ``local <- global``. A failed exchange keeps local progress, so the delta
    carries into the next round; it does not block the other modules. Without an ``averager`` the
    peer is a lone holder of every module and applies the codec round trip of its own delta.

    ``join_ramp_rounds``: a module's weight in its group is its round's tokens times
    :func:`ramp_factor` of the rounds this optimizer has ended (not restored from a checkpoint: a
    restarted peer re-syncs and ramps again). The weight is what this member declares when joining
    its group (``JoinRequest.weight``, :attr:`peer.averaging.partition.Group.weights`) and sends with
    every part, so every member's mean uses the same weights; reports keep the round's real tokens.

    ``paced_min_share``: the share of a round trained before another holder's wait can end it
    (:data:`PACED_MIN_SHARE`); 0 for a peer whose steps are far apart (a stage server, a pipeline
    trainer), which must answer a waiting holder at once to be averaged at all.

    ``overlap_beside_sparse`` (a path peer; ignored with ``outer.overlap``): the rounds run in overlap
    mode (below) while the averager saw a peer whose steps are far apart in a recent group of one of
    our modules (``shares_with_sparse``), and wait for their exchange again once it saw none for a few
    rounds and nothing is in flight. Such a member ends its round only once it noticed us waiting, and
    its group then forms on its machine's time: a good part of a round (:attr:`overlapping`). Such a
    peer also runs its rounds in overlap mode while the coordinator's plan for one of its modules'
    rounds says so (:meth:`peer.diloco.PlanBook.overlap_at`: no H and codec allowed keeps that
    module's exchange within the run's communication budget).

    The codec is decided once, here: ``outer.codec`` (the run's, as the coordinator's assignment
    carries it) under ``outer.entropy``, resolved to :attr:`codec` (:func:`peer.compression.resolve_codec`,
    as the simulator resolves its own) and passed to every exchange.

    With ``outer.overlap`` the exchange of round t runs on a background thread during round t+1 and is
    applied at the first inner step after it returned (at the latest at the end of round t+1), keeping
    the local progress made meanwhile on top of the new global copy: the steps computed before the new
    global copy are those the exchange took, not a whole round's. :meth:`step` returns round t's report
    then. Global copies and outer momentum stay bit-identical across the group in both modes.
    Where round t's exchange is still in flight when round t+1 has had its steps (or seconds), the peer
    goes on stepping rather than waiting idle (``train_through_waits``): round t+1 ends at the first
    step after that exchange is done, after at most ``outer.inner_steps`` (or ``round_seconds``) more,
    or as soon as another holder waits for us (pacing). Its declaration comes no later than if it had
    waited, and the extra steps count in its tokens (the round's weight), as a slower member's fewer
    steps do.
    """

    def __init__(
        self,
        modules: Mapping[str, Union[nn.Module, Iterable[Tensor]]],
        inner: Union[torch.optim.Optimizer, InnerConfig],
        outer: OuterConfig,
        lattice: Optional[LatticeConfig] = None,
        averager: Optional[ModuleAverager] = None,
        clock: Callable[[], float] = time.monotonic,
        train_through_waits: bool = True,
        join_ramp_rounds: int = 0,
        paced_min_share: float = PACED_MIN_SHARE,
        overlap_beside_sparse: bool = False,
    ):
        if not modules:
            raise ConfigError("modules", "the optimizer needs at least one module to train")
        if outer.sqrt_sharing and lattice is None:
            raise ConfigError("outer.sqrt_sharing", "needs the lattice config to count paths sharing a module")
        if outer.sqrt_sharing:
            unknown = sorted(set(modules) - set(lattice.module_ids()))
            if unknown:
                raise ConfigError(
                    "modules", f"{', '.join(unknown)} not in the lattice: sqrt_sharing cannot count its paths"
                )
        self.outer_cfg = outer
        self.lattice = lattice
        self.codec: Codec = resolve_codec(outer)
        """The wire codec every module's exchange uses where no plan says otherwise (the group refuses
        parts in any other)."""
        self.plans: Optional[PlanBook] = None
        """The coordinator's exchange plans (:class:`peer.diloco.PlanBook`): where one applies to a
        module's round, its codec is that round's and the round lasts its H (the largest H among the
        modules' plans: every module of this peer ends its round at once). None: the config's H and codec."""
        self._codecs: dict[str, Codec] = {outer.codec: self.codec}  # by the codec a plan names
        if averager is None:
            averager = LocalAverager().member("local")
        self.averager = averager
        configure = getattr(averager, "use_aggregation", None)
        if configure is not None:  # the run's reduction rule (outer.aggregator, outer.norm_bound)
            configure(Aggregation.from_config(outer))
        cap = getattr(averager, "use_group_cap", None)
        if cap is not None:  # a widely held module's round splits into groups of about this size
            cap(outer.max_group_size)
        rounds = getattr(averager, "use_round_policy", None)
        if rounds is not None:  # overlap members do not wait for holders behind them
            rounds(wait_for_behind=not outer.overlap)
        self.overlapping = outer.overlap
        """Whether the round being computed will exchange behind the next one (overlap mode): the
        config's ``outer.overlap``, or, with ``overlap_beside_sparse``, while a module is shared with a
        peer whose steps are far apart."""
        self.overlap_beside_sparse = overlap_beside_sparse and not outer.overlap
        self.clock = clock
        self.train_through_waits = train_through_waits
        if not (isinstance(join_ramp_rounds, int) and join_ramp_rounds >= 0):
            raise ConfigError("join_ramp_rounds", f"must be an integer >= 0, got {join_ramp_rounds!r}")
        self.join_ramp_rounds = join_ramp_rounds
        self.paced_min_share = paced_min_share
        self.rounds_here = 0
        """Rounds this optimizer has ended since it was built (the newcomer ramp's count)."""
        self.on_round_end: Optional[Callable[[], None]] = None
        """Called when a round ends, before its exchanges start (and before it waits for them): a peer's
        status shows it averaging from then on, whether the round ended on its budget or early because
        another holder waits for us."""
        self._modules: dict[str, HeldModule] = {}
        seen: set[int] = set()
        for mid in self._ordered(modules):
            mod = modules[mid]
            params = list(mod.parameters()) if isinstance(mod, nn.Module) else list(mod)
            if not params:
                raise ConfigError("modules", f"module '{mid}' has no parameters")
            for p in params:
                if id(p) in seen:
                    raise ConfigError("modules", f"a parameter of '{mid}' also belongs to another module")
                seen.add(id(p))
            self._modules[mid] = HeldModule(mid, params, outer, lattice)
        all_params = [p for m in self._modules.values() for p in m.params]
        self._inner_cfg: Optional[InnerConfig] = None
        if isinstance(inner, InnerConfig):
            from models.training import make_adamw  # the simulator's inner optimizer, so peers match it

            self._inner_cfg = inner
            inner = make_adamw(all_params, inner)
        self.inner: torch.optim.Optimizer = inner
        self._inner_step = 0
        self.round = 0
        self._steps_in_round = 0
        self._tokens_in_round = 0.0
        self._round_start = clock()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._in_flight_round: Optional[tuple[int, int, float, float]] = None
        """Overlap mode: (round, inner steps, tokens, seconds) of the round whose exchange is in flight."""
        self._applied_early: dict[str, ModuleReport] = {}
        """Overlap mode: that round's modules already applied, at the first step after their exchange
        returned; its report comes once every module's is applied."""
        self._state_lock = threading.RLock()  # module_state() may be called from a state-serving thread
        self.before_launch: Optional[Callable[[str, ModuleReport], None]] = None
        """Overlap mode: called with a module's failed report after its exchange completed and before
        the next one launches (the module has no exchange in flight then): the hook for re-syncing a
        member that missed a round (:func:`peer.diloco.resync.resync_module`), which in overlap mode can only
        happen at this point. Non-overlap members re-sync after :meth:`step` returns."""

    # -- the training-loop API -------------------------------------------------------------------

    @property
    def module_ids(self) -> list[str]:
        """Held module ids in the fixed averaging order."""
        return list(self._modules)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, tokens: Optional[float] = None) -> Optional[RoundReport]:
        """One inner step; at the end of a round, the outer steps. ``tokens``: tokens in this step's
        batch (the round's weight is their sum; each step counts 1 when not given)."""
        if self._inner_cfg is not None:
            cfg = self._inner_cfg
            if cfg.grad_clip > 0:
                nn.utils.clip_grad_norm_([p for m in self._modules.values() for p in m.params], cfg.grad_clip)
            from models.training import warmup_lr

            for group in self.inner.param_groups:
                group["lr"] = warmup_lr(cfg, self._inner_step)
        self.inner.step()
        self._inner_step += 1
        self._steps_in_round += 1
        self._tokens_in_round += 1.0 if tokens is None else float(tokens)
        applied = self._apply_returned()
        elapsed = self.clock() - self._round_start
        if self._budget_spent(self._steps_in_round, elapsed) and not self._exchange_still_running(elapsed):
            return self._end_round(elapsed) or applied
        if self._others_waiting():
            waiting = getattr(self.averager, "last_waiting", None)
            logger.info("round %d ends early, after %d steps in %.2fs: %s", self.round, self._steps_in_round, elapsed,
                        "another holder waits" if waiting is None else
                        f"{waiting[2][-8:]} waits to average {waiting[0]} round {waiting[1]}")
            return self._end_round(elapsed) or applied
        return applied

    def _apply_returned(self) -> Optional[RoundReport]:
        """Overlap mode: apply each module's exchange that has returned (the local progress made since
        its delta was taken kept on top), so a round's average lands a step after it came back rather
        than at the next round's end; the round's report once every module's is applied."""
        if self._in_flight_round is None:
            return None
        for mid, st in self._modules.items():
            if st.pending is not None and (st.pending.future is None or st.pending.future.done()):
                self._applied_early[mid] = self._completed(mid, st)
        if any(st.pending is not None for st in self._modules.values()):
            return None
        return self._in_flight_report()

    def _completed(self, mid: str, st: HeldModule) -> ModuleReport:
        """Overlap mode: apply ``mid``'s exchange (waiting for it where it is still in flight) and, when it
        failed, re-sync before its next launch (:attr:`before_launch`)."""
        report = self._complete(st)
        if not report.applied and self.before_launch is not None:
            try:
                self.before_launch(mid, report)
            except Exception as e:  # a failed re-sync is retried after the next failed round
                logger.warning("module %s: re-sync before the next exchange failed: %r", mid, e)
        return report

    def _in_flight_report(self) -> Optional[RoundReport]:
        """The report of the round whose exchange was in flight, all its modules applied (or not)."""
        if self._in_flight_round is None:
            return None
        round_no, steps, tokens, seconds = self._in_flight_round
        reports, self._applied_early, self._in_flight_round = self._applied_early, {}, None
        return RoundReport(round_no, steps, tokens, seconds, reports, overlap=True)

    def _choose_mode(self) -> None:
        """With ``overlap_beside_sparse``: exchange behind the next round while the averager saw, in a
        recent round of one of our modules, a member whose steps are far apart (a pipeline trainer or
        stage server, ``NetAverager.shares_with_sparse``), or while the plan of one of our modules'
        rounds about to exchange says so. Such a member declares once it noticed us
        waiting and on a machine of its own pace, so its group forms a good part of a round after ours
        would: waiting for it would hold every round of ours up. Back to waiting for the exchange only
        once none is in flight (a step returns one round's report)."""
        if not self.overlap_beside_sparse:
            return
        probe = getattr(self.averager, "shares_with_sparse", None)
        sparse = probe is not None and any(probe(mid, st.round_no) for mid, st in self._modules.items())
        planned = self.plans is not None and any(self.plans.overlap_at(mid, st.round_no)
                                                 for mid, st in self._modules.items())
        want = sparse or planned
        if want == self.overlapping or (not want and self._in_flight_round is not None):
            return
        self.overlapping = want
        logger.info("round %d on: %s", self.round,
                    "exchanges run behind the next round: " + ("a module is shared with a peer whose steps are "
                                                               "far apart" if sparse else "a module's plan says so")
                    if want else "exchanges are waited for again")
        rounds = getattr(self.averager, "use_round_policy", None)
        if rounds is not None:
            rounds(wait_for_behind=not want)

    def end_round_if_others_wait(self, sparse: bool = False) -> Optional[RoundReport]:
        """End the round now, between inner steps, when another holder already waits to average it and
        this round has had at least one step: for a peer whose steps are far apart (a stage server
        steps once a whole batch came back through the pipeline), waiting for its next step would
        hold the waiting holder past its gather deadline. Call it on the thread that calls
        :meth:`step`. Returns the round's report, or None when nothing ended.

        ``sparse``: this peer's steps can be further apart than a holder waits for a declaration (a
        stage server, a pipeline trainer): it answers any waiting holder, one that ended its own round
        early too (such a holder paces no ordinary peer, to stop a cascade of early rounds), unless that
        holder's steps are far apart too (its paced declaration says so: peers that answer each other's
        paced declarations would end each other's rounds a step or two apart, and begin those rounds'
        groups without the holders still computing theirs), and a round with no step ends too, taking the
        round's average with weight :data:`EMPTY_ROUND_WEIGHT` and a delta of zero (its parameters are
        the global copy the last round left), which moves the average by that weight's share of the
        round's tokens (a tiny share), instead of failing the waiting holder's round."""
        if (self._steps_in_round == 0 and not sparse) or not self._others_waiting(paced_too=sparse):
            return None
        elapsed = self.clock() - self._round_start
        logger.info("round %d ends between steps, after %d steps in %.2fs: another holder waits", self.round,
                    self._steps_in_round, elapsed)
        return self._end_round(elapsed)

    def _budget_spent(self, steps: int, elapsed: float, times: int = 1) -> bool:
        """Whether ``steps`` inner steps or ``elapsed`` seconds are ``times`` a round's budget
        (:meth:`round_steps`, ``outer.round_seconds`` when > 0)."""
        cfg = self.outer_cfg
        return steps >= times * self.round_steps() or (cfg.round_seconds > 0 and elapsed >= times * cfg.round_seconds)

    def round_steps(self) -> int:
        """Inner steps of the round going on: the largest H the plans give our modules' current rounds
        (``outer.inner_steps`` for a module without one)."""
        if self.plans is None:
            return self.outer_cfg.inner_steps
        hs = [planned[0] if planned else self.outer_cfg.inner_steps
              for planned in (self.plans.at(mid, st.round_no) for mid, st in self._modules.items())]
        return max(hs)

    def codec_for(self, module_id: str, round_no: int) -> Codec:
        """The wire codec of ``module_id``'s round ``round_no``: its plan's, else :attr:`codec`."""
        planned = self.plans.at(module_id, round_no) if self.plans is not None else None
        if planned is None:
            return self.codec
        codec = self._codecs.get(planned[1])
        if codec is None:
            codec = self._codecs[planned[1]] = resolve_codec(self.outer_cfg, planned[1])
        return codec

    def _exchange_still_running(self, elapsed: float) -> bool:
        """Overlap mode with ``train_through_waits``: the last round's exchange of some module is still
        in flight, and this round has not yet had twice its steps (or seconds): keep stepping."""
        if not (self.overlapping and self.train_through_waits) or self._budget_spent(self._steps_in_round,
                                                                                          elapsed, times=2):
            return False
        return any(st.pending is not None and st.pending.future is not None and not st.pending.future.done()
                   for st in self._modules.values())

    def _others_waiting(self, paced_too: bool = False) -> bool:
        """True when another holder already waits to average one of our modules' current round.

        Then this peer ends its round now with the tokens it has (a smaller weight) instead of
        making the group wait for its remaining steps: the fastest member paces the round, as
        with hivemind's target batch size. In overlap mode too: the others' exchange of this round
        can only begin once we declare it, and they would wait for it at the end of their next
        round. Only a holder that computed its whole round counts (the averager's rule: one that
        ended early itself paces nobody, :attr:`peer.network.records.GroupDeclaration.paced`).
        Averagers without this signal never end rounds early.

        Not before ``paced_min_share`` of the round, unless ``paced_too`` (a peer whose steps are far
        apart answers at once, as it must to be averaged at all).
        """
        probe = getattr(self.averager, "others_waiting", None)
        if probe is None:
            return False
        if not paced_too and self.paced_min_share > 0 and not self._budget_spent(
                self._steps_in_round, self.clock() - self._round_start, times=self.paced_min_share):
            return False
        rounds = {mid: st.round_no for mid, st in self._modules.items()}
        return bool(probe(rounds, paced_too=True) if paced_too else probe(rounds))

    def flush(self) -> Optional[RoundReport]:
        """Overlap mode: wait for the exchanges in flight and apply them (local progress kept).
        A no-op returning None otherwise."""
        for mid, st in self._modules.items():
            if st.pending is not None:
                self._applied_early[mid] = self._complete(st)
        return self._in_flight_report()

    def close(self) -> None:
        """Flush and stop the exchange threads."""
        try:
            self.flush()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def __enter__(self) -> "DiLoCoOptimizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- rounds ---------------------------------------------------------------------------------

    def _ordered(self, modules: Iterable[str]) -> list[str]:
        """Lattice order (embeddings, levels, heads), then any other ids sorted: the same on every peer."""
        ids = list(modules)
        rank = {m: i for i, m in enumerate(self.lattice.module_ids())} if self.lattice is not None else {}
        return sorted(ids, key=lambda m: (rank.get(m, len(rank)), m))

    def round_weight(self, tokens: float) -> float:
        """The weight this member declares for a round of ``tokens``: at least
        :data:`EMPTY_ROUND_WEIGHT`, times :func:`ramp_factor` of :attr:`rounds_here`."""
        return max(tokens, EMPTY_ROUND_WEIGHT) * ramp_factor(self.rounds_here, self.join_ramp_rounds)

    def _end_round(self, elapsed: float) -> Optional[RoundReport]:
        if self.on_round_end is not None:
            self.on_round_end()
        tokens, steps = self._tokens_in_round, self._steps_in_round
        weight = self.round_weight(tokens)
        reports = {}
        self._choose_mode()
        if self.overlapping:
            for mid, st in self._modules.items():
                if st.pending is not None:
                    self._applied_early[mid] = self._completed(mid, st)
            report = self._in_flight_report()
            for st in self._modules.values():
                self._launch(st, tokens, weight, keep_anchor=True)
            self._in_flight_round = (self.round, steps, tokens, elapsed)
        else:
            for st in self._modules.values():  # all modules exchange at once: one slow group blocks no other
                self._launch(st, tokens, weight, keep_anchor=False)
            reports = {mid: self._complete(st) for mid, st in self._modules.items()}
            report = RoundReport(self.round, steps, tokens, elapsed, reports)
        self.round += 1
        self.rounds_here += 1
        self._steps_in_round = 0
        self._tokens_in_round = 0.0
        self._round_start = self.clock()
        return report

    def exchange_now(self, module_id: str, tokens: float) -> ModuleReport:
        """Average ``module_id``'s current round now, between our rounds, with the delta it holds (its
        local progress since its global copy) weighted by ``tokens``, and apply it as a round would:
        for a member whose round of the module failed behind its group while the group still gathers
        the next round (:func:`peer.diloco.resync.resync_after_round`). The other modules are not
        touched. Not in overlap mode, nor with the module's exchange in flight."""
        st = self._module(module_id)
        if self.overlapping or st.pending is not None:
            raise RuntimeError(f"module {module_id}: an exchange between rounds needs no exchange in flight "
                               "and no overlap mode")
        self._launch(st, tokens, self.round_weight(tokens), keep_anchor=False)
        return self._complete(st)

    def _exchange(self, st: HeldModule, round_no: int, sent: Tensor, weight: float,
                  digest: str) -> tuple[AverageResult, float]:
        """The module's exchange of ``round_no`` and the seconds it took."""
        t0 = time.perf_counter()
        try:
            res = self.averager.average(
                st.module_id, round_no, unflatten(sent, st.outer.global_params), weight,
                self.codec_for(st.module_id, round_no),
                self.outer_cfg.round_timeout, digest=digest,
            )
        except Exception as e:  # an exchange failure must not take the training loop or other modules down
            logger.warning("module %s round %d: exchange failed: %r", st.module_id, round_no, e)
            res = AverageResult(None, None, 0, [], 0, 0, reason=f"exchange failed: {e!r}")
        return res, time.perf_counter() - t0

    def _report(self, st: HeldModule, round_no: int, tokens: float, res: AverageResult, wait: float,
                exchange_seconds: float = 0.0) -> ModuleReport:
        if not res.ok:
            logger.info("module %s round %d not applied: %s", st.module_id, round_no, res.reason)
        return ModuleReport(
            st.module_id, round_no, res.ok, res.reason, res.group_size, list(res.peers), res.bytes_sent,
            res.bytes_received, tokens, wait, transfer_seconds=res.transfer_seconds, adopt=res.adopt,
            ahead=res.ahead, ahead_left=res.ahead_left, link_times=res.link_times, exchange_seconds=exchange_seconds,
        )

    def _launch(self, st: HeldModule, tokens: float, weight: float, keep_anchor: bool) -> None:
        """Take the module's delta and start its exchange on the exchange threads.

        The round number moves on and the exchange becomes pending under ``_state_lock`` in one go,
        so :meth:`module_state` never labels this round's pre-step global copy with the next round."""
        round_no = st.round_no
        sent, refused = st.prepare(round_no)
        if sent is None:
            with self._state_lock:
                st.pending = PendingExchange(round_no, tokens, refused=refused)
                st.round_no = round_no + 1
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=len(self._modules), thread_name_prefix="diloco-exchange")
        anchor = None
        if keep_anchor:
            anchor = [p.detach().to(device="cpu", dtype=torch.float32, copy=True) for p in st.params]
        with self._state_lock:
            digest = st.outer.digest()  # the state the group's mean will be applied to
            future = self._executor.submit(self._exchange, st, round_no, sent, weight, digest)
            st.pending = PendingExchange(round_no, tokens, sent, anchor, future)
            st.round_no = round_no + 1

    @torch.no_grad()
    def _complete(self, st: HeldModule) -> ModuleReport:
        """Wait for the module's exchange and apply it: ``local <- global``, plus (overlap mode) the
        local progress made since the delta was taken."""
        pending = st.pending
        if pending.future is None:
            with self._state_lock:
                st.pending = None
                st.roll_back(pending)
            return ModuleReport(st.module_id, pending.round_no, False, pending.refused, tokens=pending.tokens)
        t0 = time.perf_counter()
        res, took = pending.future.result()
        wait = time.perf_counter() - t0
        with self._state_lock:  # the post-step global copy and the end of the pending state, atomically
            st.pending = None
            if res.ok:
                st.apply(pending.sent, res)
            else:
                st.roll_back(pending)
        if res.ok:
            give_back = getattr(self.averager, "give_back", None)
            if give_back is not None:  # applied: nothing reads the round's vectors any more, reuse them
                give_back(res)
            st.adopt_local(pending.anchor)
        return self._report(st, pending.round_no, pending.tokens, res, wait, took)

    # -- state ----------------------------------------------------------------------------------

    def module_round(self, module_id: str) -> int:
        """The group round number this peer will contribute to next for ``module_id``."""
        return self._module(module_id).round_no

    def module_state(self, module_id: str) -> ModuleState:
        """Copies of a module's global params, outer momentum and the round they are ready for (to
        serve a newcomer). Safe to call from another thread: while a round's exchange is in flight
        the global copy is still that of the round being averaged, and its number is reported."""
        st = self._module(module_id)
        with self._state_lock:
            return st.state()

    def module_digest(self, module_id: str) -> str:
        """:attr:`ModuleState.digest` of what :meth:`module_state` would return, without copying it."""
        st = self._module(module_id)
        with self._state_lock:
            return st.outer.digest()

    def rebase_module_state(
        self, module_id: str, global_params: Sequence[Tensor], momentum: Sequence[Tensor], round_no: int
    ) -> None:
        """Adopt the group's state after missing a round, keeping this peer's local progress.

        ``local <- new_global + (local - old_global)``: the pseudo-gradient accumulated here is
        carried into the next round instead of being lost; the error-feedback residual is kept.
        """
        st = self._module(module_id)
        if st.pending is not None and st.pending.future is not None:
            raise RuntimeError(f"module {module_id} has an exchange in flight; flush() before rebasing")
        with self._state_lock:
            st.rebase(global_params, momentum, round_no)

    def renumber_module(self, module_id: str, round_no: int) -> None:
        """Number a module's state (unchanged) as ready for ``round_no``: the rounds before it were lost
        with the holders that applied them (:func:`peer.diloco.resync.skip_lost_rounds`)."""
        st = self._module(module_id)
        if st.pending is not None and st.pending.future is not None:
            raise RuntimeError(f"module {module_id} has an exchange in flight; flush() before renumbering")
        with self._state_lock:
            st.round_no = int(round_no)

    def load_module_state(
        self, module_id: str, global_params: Sequence[Tensor], momentum: Sequence[Tensor], round_no: int
    ) -> None:
        """Adopt a module's state from a peer (newcomer joining mid-run): global copy, momentum and
        round number; local params are reset to the global copy and the residual cleared."""
        self._module(module_id).load(global_params, momentum, round_no)

    def state_dict(self) -> dict[str, Any]:
        """Every module's global copy, momentum, error-feedback residual and round number, the inner
        optimizer's state and this peer's round counters. Overlap mode flushes first."""
        self.flush()
        return {
            "round": self.round,
            "inner_step": self._inner_step,
            "modules": {mid: st.state_dict() for mid, st in self._modules.items()},
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], sync_local: bool = True) -> None:
        """Restore :meth:`state_dict`'s output. ``sync_local`` resets local params to the global copy
        (right for checkpoints taken at a round boundary; pass False after loading mid-round weights)."""
        missing = sorted(set(self._modules) - set(state["modules"]))
        if missing:
            raise ConfigError("checkpoint", f"holds no state for module(s) {', '.join(missing)}")
        for mid, st in self._modules.items():
            st.load_state_dict(state["modules"][mid], sync_local)
        self.inner.load_state_dict(state["inner"])
        self.round = int(state["round"])
        self._inner_step = int(state.get("inner_step", 0))
        self._steps_in_round = 0
        self._tokens_in_round = 0.0
        self._round_start = self.clock()

    def _module(self, module_id: str) -> HeldModule:
        try:
            return self._modules[module_id]
        except KeyError:
            held = ", ".join(self._modules)
            raise ConfigError("module", f"'{module_id}' is not held by this peer (it holds {held})") from None
