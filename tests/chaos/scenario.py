"""What the chaos scenarios share: the datasets and the end-of-run invariants asserted together (see
:mod:`peer.localnet.checks`)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Iterable, Optional

from peer.localnet import wait_for
from peer.localnet.checks import (acknowledged_rounds, held_rounds, loss_thirds, replica_check, round_gaps, round_story,
                                  rounds_lost, stop_all)
from peer.localnet.faults import peer_round

__all__ = ["CHAOS_PREFIX", "CHAOS_SUBNET", "prepare_dataset", "finish_and_check"]

CHAOS_PREFIX = "hpc"
"""Namespace names ``hpc<pid>-p0``...: distinct from the benchmarks' so both can run at once (``<pid>``: the process that made them, :class:`peer.localnet.netns.NetnsBridge`)."""
CHAOS_SUBNET = "10.78.0"

log = logging.getLogger(__name__)


def prepare_dataset(out: Path, levels: int = 2, modules: int = 2):
    """The built-in corpus prepared for a ``levels x modules`` lattice (byte tokenizer)."""
    from models.data import prepared

    return prepared(out, levels, modules, "bytes")


MIN_LOSS_READINGS = 9
"""Loss readings a peer must have printed before "its loss fell" is judged: the first and last thirds
are then means of at least three readings each, not single noisy ones (a peer killed and restarted
twice can reach the end of a scenario having printed only three)."""


def _first_loss_time(lines: list[dict]) -> float:
    """When a peer printed its first loss (inf if never)."""
    return min((p.get("time", math.inf) for p in lines if p.get("loss") is not None), default=math.inf)


def finish_and_check(net, peers: Iterable[str], roots: list[Path], exit_timeout: float = 60.0,
                     min_round: Optional[dict[str, int]] = None, min_pairs: int = 1,
                     others: Iterable[str] = ("archive", "coordinator")) -> dict:
    """Stop everything (SIGTERM, bounded) and assert the four invariants; returns the figures.

    First every peer trains on until it has printed :data:`MIN_LOSS_READINGS` losses (bounded). Peers
    are stopped first, then ``others`` (archive, coordinator), so the archive sees the peers' last
    rounds. Every process must exit 0 within ``exit_timeout``; replicas at equal rounds must be
    bit-identical (above ``min_round``) over at least ``min_pairs`` pairs; no acknowledged round may be
    missing from every holder; every peer's loss must have fallen.
    """
    peers = list(peers)
    wait_for(lambda: all(loss_thirds(net.progress_lines(n))[2] >= MIN_LOSS_READINGS for n in peers), 180,
             f"every peer to print {MIN_LOSS_READINGS} losses")
    stop_s: dict[str, float] = {}
    codes = stop_all(net, peers, exit_timeout, stop_s)
    for name in others:  # in order: the archive still tells the live coordinator it leaves
        codes.update(stop_all(net, [name], exit_timeout, stop_s))
    hung = [n for n, c in codes.items() if c is None]
    assert not hung, f"hung (no exit within {exit_timeout:.0f}s of SIGTERM): {hung}"
    assert all(c == 0 for c in codes.values()), (codes, {n: net.procs.log(n)[-1500:] for n, c in codes.items() if c})
    check = replica_check(roots, min_round)
    assert not check.mismatches, ("replicas differ at equal rounds:\n" + "\n".join(check.mismatches[:10])
                                  + round_story(net, [*peers, *others], check.mismatches))
    assert check.pairs >= min_pairs, f"only {check.pairs} (module, round) pairs to compare"
    acked, held = acknowledged_rounds(roots), held_rounds(roots)
    lost = rounds_lost(acked, held)
    assert not any(lost.values()), f"acknowledged rounds lost: {lost} (acknowledged {acked}, held {held})"
    losses = {}
    lines = {name: net.progress_lines(name) for name in peers}
    readings = {name: loss_thirds(lines[name]) for name in peers}
    # The network's early loss: the first third of the peer that printed a loss first (it trained from
    # the shared initialisation). A peer that joined later began from the others' trained state, so its
    # own first readings can already be low and its loss average, over a few dozen steps, flat: it must
    # end below the network's early loss. A peer that trained from the start must end below its own.
    origin = min(peers, key=lambda name: _first_loss_time(lines[name]))
    for name in peers:
        first, last, n = readings[name]
        bound = max(first, readings[origin][0])
        assert n >= 3 and last < bound, (f"{name}: loss not falling (first third {first:.3f}, last {last:.3f}, "
                                         f"{n} readings; the network's first third {readings[origin][0]:.3f})")
        losses[name] = (round(first, 3), round(last, 3))
    gaps = {name: max(round_gaps(net.procs.log(name)), default=0.0) for name in peers}
    report = {"exit_codes": codes, "stop_s": stop_s, "replica_pairs": check.pairs,
              "replica_max_abs_diff": check.max_abs_diff, "acknowledged": acked, "held": held,
              "loss_thirds": losses, "max_round_gap_s": gaps, "rounds": {n: peer_round(net, n) for n in peers}}
    log.info("invariants hold: %s", report)
    return report
