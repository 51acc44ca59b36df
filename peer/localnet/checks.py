"""What a run of a local network is checked against, read from the files its processes wrote.

The invariants every chaos scenario checks at its end:

- **Replicas identical**: any two snapshots of one module at one round -- across every peer's
  checkpoint directory and the archive's -- are bit-identical (weights and outer momentum).
- **No acknowledged round lost**: a round some holder checkpointed is never missing later from every
  holder: per module, the newest round any snapshot ever recorded is still held (as ``LATEST``) by at
  least one final holder.
- **No process hung**: every process exits when asked (SIGTERM) within a bound.
- **Loss still falling**: over a peer's progress JSON lines, the mean loss of the last third is below
  the mean of the first third.

Everything reads what the real processes wrote: checkpoint directories and progress JSON lines.
"""

from __future__ import annotations

import json
import logging
import math
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch

from peer.node import CheckpointDir

__all__ = ["FORK", "FORK_OTHER", "ReplicaCheck", "acknowledged_rounds", "first_identical_round", "first_loss",
           "first_merged_rounds", "forked_rounds", "held_rounds", "loss_thirds", "module_results", "module_rounds_in",
           "replica_check", "replica_diff", "round_gaps", "round_since", "round_story", "round_waits", "rounds_lost",
           "settled", "snapshots_by_round", "stop_all"]

log = logging.getLogger(__name__)


def _rounds_of(snapshot: Path) -> dict[str, int]:
    meta = json.loads((snapshot / "run.json").read_text())
    return {mid: int(r) for mid, r in meta.get("rounds", {}).items()}


def module_rounds_in(root: Path) -> dict[str, dict[int, Path]]:
    """module id -> round -> snapshot directory, over every complete snapshot under ``root``."""
    out: dict[str, dict[int, Path]] = {}
    if not Path(root).exists():
        return out
    for path in CheckpointDir(root).snapshots():
        try:
            rounds = _rounds_of(path)
        except (OSError, ValueError):
            continue  # pruned while we listed it
        for mid, r in rounds.items():
            out.setdefault(mid, {})[r] = path
    return out


def acknowledged_rounds(roots: Iterable[Path]) -> dict[str, int]:
    """Per module, the newest round any snapshot under any of ``roots`` ever recorded."""
    out: dict[str, int] = {}
    for root in roots:
        for mid, by_round in module_rounds_in(root).items():
            out[mid] = max(out.get(mid, 0), max(by_round))
    return out


def held_rounds(roots: Iterable[Path]) -> dict[str, int]:
    """Per module, the newest round held now: the max over ``roots`` of the round in ``LATEST``."""
    out: dict[str, int] = {}
    for root in roots:
        latest = CheckpointDir(root).latest_path() if Path(root).exists() else None
        if latest is None:
            continue
        for mid, r in _rounds_of(latest).items():
            out[mid] = max(out.get(mid, 0), r)
    return out


def rounds_lost(acknowledged: dict[str, int], held: dict[str, int]) -> dict[str, int]:
    """Per module, how many acknowledged rounds no final holder holds (0 everywhere is the target)."""
    return {mid: max(0, r - held.get(mid, 0)) for mid, r in acknowledged.items()}


def _module_tensors(snapshot: Path, mid: str) -> dict[str, torch.Tensor]:
    """A module's weights and outer momentum (``outer.*``) in one snapshot directory."""
    snap = CheckpointDir(snapshot.parent).load(snapshot)
    return {**snap.groups[f"modules/{mid}"], **{f"outer.{k}": v for k, v in snap.groups.get(f"outer/{mid}", {}).items()}}


@dataclass
class ReplicaCheck:
    """The result of comparing every pair of snapshots at equal (module, round)."""

    pairs: int = 0
    max_abs_diff: float = 0.0
    mismatches: list[str] = field(default_factory=list)
    """``module round R: a vs b (tensor, |diff|)`` for every pair that differs."""


def _window(spec, mid: str) -> tuple[int, int]:
    """``exclude``'s window for one module: a (first, last) pair for every module, or a dict by module."""
    if spec is None:
        return (1, 0)
    if isinstance(spec, dict):
        return spec.get(mid, (1, 0))
    return spec


def first_merged_rounds(cut: Path, others: list[Path], forked_from: dict[str, int]) -> dict[str, int]:
    """Per module, the round after ``forked_from`` from which the snapshot under ``cut`` equals one under
    another root (a partitioned peer back in the group's lineage): the first equal round after the last
    round that no other root agrees with. A round in flight when the link went down can still be the
    group's, and the forked rounds come after it. Modules never re-merged are left out (their rounds
    are compared, and fail)."""
    views = {r: module_rounds_in(r) for r in [cut, *others]}
    out: dict[str, int] = {}
    for mid, r0 in forked_from.items():
        merged = None
        for r in sorted(x for x in views[cut].get(mid, {}) if x > r0):
            held = [o for o in others if r in views[o].get(mid, {})]
            if not held:
                continue
            a = _module_tensors(views[cut][mid][r], mid)
            if any(_same(a, _module_tensors(views[o][mid][r], mid)) for o in held):
                merged = r if merged is None else merged
            else:
                merged = None  # forked here: the lineage re-merges later, if at all
        if merged is not None:
            out[mid] = merged
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def replica_check(roots: list[Path], min_round: Optional[dict[str, int]] = None,
                  exclude: Optional[dict[Path, tuple[int, int]]] = None) -> ReplicaCheck:
    """Compare all pairs of snapshots of the same module at the same round under ``roots``.

    ``min_round``: per module, only rounds strictly above it (the start-up rounds before the network
    formed). ``exclude``: per root, a window ``(first, last)`` of rounds left out of every pair with
    that root -- the forked rounds a partitioned peer keeps in its history until it re-merged.
    """
    views = [module_rounds_in(r) for r in roots]
    cache: dict[tuple[Path, str], dict[str, torch.Tensor]] = {}

    def tensors(path: Path, mid: str) -> dict[str, torch.Tensor]:
        if (path, mid) not in cache:
            cache[(path, mid)] = _module_tensors(path, mid)
        return cache[(path, mid)]

    out = ReplicaCheck()
    for i in range(len(views)):
        for j in range(i + 1, len(views)):
            for mid in set(views[i]) & set(views[j]):
                floor = (min_round or {}).get(mid, 0)
                for r in sorted(set(views[i][mid]) & set(views[j][mid])):
                    if r <= floor or any(lo <= r <= hi for root in (roots[i], roots[j])
                                         for lo, hi in [_window((exclude or {}).get(root), mid)]):
                        continue
                    try:
                        a, b = tensors(views[i][mid][r], mid), tensors(views[j][mid][r], mid)
                    except (OSError, ValueError, KeyError):
                        continue  # pruned between listing and loading
                    out.pairs += 1
                    if a.keys() != b.keys():
                        out.mismatches.append(f"{mid} round {r}: different tensors in {roots[i]} and {roots[j]}")
                        out.max_abs_diff = float("inf")
                        continue
                    for k in a:
                        if not torch.equal(a[k], b[k]):
                            diff = float((a[k].float() - b[k].float()).abs().max())
                            out.max_abs_diff = max(out.max_abs_diff, diff)
                            out.mismatches.append(f"{mid} round {r}: {roots[i]} vs {roots[j]} ({k}, |diff| {diff:.3g})")
    return out


def first_identical_round(reference: Path, other: Path, after: int, modules: Iterable[str]) -> int:
    """The first round above ``after`` from which every snapshot of ``modules`` that ``other`` shares
    with ``reference`` is bit-identical (0 if none is yet): when a cut-off peer re-merged."""
    modules = set(modules)
    views = module_rounds_in(reference), module_rounds_in(other)
    bad, good = 0, []
    for mid in modules & set(views[0]) & set(views[1]):
        for r in set(views[0][mid]) & set(views[1][mid]):
            if r <= after:
                continue
            try:
                a, b = _module_tensors(views[0][mid][r], mid), _module_tensors(views[1][mid][r], mid)
            except (OSError, ValueError, KeyError):
                continue  # pruned between listing and loading
            if a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a):
                good.append(r)
            else:
                bad = max(bad, r)
    later = [r for r in good if r > bad]
    return min(later) if later else 0


def stop_all(net, names: Iterable[str], exit_timeout: float = 60.0,
             seconds: Optional[dict[str, float]] = None) -> dict[str, Optional[int]]:
    """SIGTERM every running process in ``names`` at once and wait for each; ``None`` marks one that
    did not exit within ``exit_timeout`` (hung: it is then killed so the test can go on). ``seconds``,
    when given, receives how long each took to exit after the signal."""
    names = [n for n in names if n in net.procs.procs]
    t0 = time.monotonic()
    for n in names:
        if net.procs.procs[n].poll() is None:
            net.procs.signal(n, signal.SIGTERM)
    codes: dict[str, Optional[int]] = {}
    for n in names:
        try:
            codes[n] = net.procs.procs[n].wait(timeout=max(0.1, t0 + exit_timeout - time.monotonic()))
            if seconds is not None:
                seconds[n] = round(time.monotonic() - t0, 1)
        except subprocess.TimeoutExpired:
            log.error("%s did not exit within %.0fs of SIGTERM", n, exit_timeout)
            net.procs.kill(n)
            codes[n] = None
    return codes


def module_results(log_text: str, only_holder: bool = True) -> list[tuple[str, int]]:
    """(module id, group size) of every module result in the trainer's round lines
    (``round N: embed r60 averaged by 3; L1M0 r4 averaged by 1 (the only holder); L1M1 r0 not applied
    (...); ...``); size 0 when the module's round was not applied. Without ``only_holder``, the rounds
    the peer applied alone because it was the module's only live holder are left out."""
    out = []
    for line in log_text.splitlines():
        if "peer.node.trainer: round " not in line:
            continue
        body = line.split(": ", 2)[-1].rsplit("; waited", 1)[0]
        for entry in body.split("; "):
            m = re.match(r"(\w+) r\d+ averaged by (\d+)( \(the only holder\))?", entry)
            if m:
                if only_holder or not m[3]:
                    out.append((m[1], int(m[2])))
            elif re.match(r"\w+ r\d+", entry):
                out.append((entry.split()[0], 0))
    return out


_ROUND_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d) INFO peer\.node\.trainer: round ")


_WAITED = re.compile(r"INFO peer\.node\.trainer: round \d+: .*; waited ([0-9.]+)s$")


def round_waits(log_text: str) -> list[float]:
    """Seconds the peer's training loop waited on each outer round, from the trainer's per-round log
    lines (``...; waited 0.42s``): the exchange's wait, exactly (not counting re-syncs)."""
    return [float(m[1]) for m in map(_WAITED.search, log_text.splitlines()) if m]


def round_gaps(log_text: str) -> list[float]:
    """Seconds between consecutive outer rounds of one peer (its inner steps plus its wait on the
    round), from the trainer's per-round log lines (1 s resolution); a restart or a reassignment (the
    trainer reloads its modules) starts afresh. Their maximum bounds the longest time the peer's
    training loop waited on a round plus one round's inner steps."""
    gaps, last = [], None
    for line in log_text.splitlines():
        if "peer.network.identity: identity" in line or "peer.node.join: reassigned to" in line:
            last = None
            continue
        m = _ROUND_LINE.match(line)
        if not m:
            continue
        t = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])
        if last is not None:
            gaps.append(float((t - last) % 86400))
        last = t
    return gaps


# -- replicas compared ------------------------------------------------------------------------

def snapshots_by_round(root: Path) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    """module id -> round -> tensors (weights and momentum) over every snapshot under ``root``."""
    out: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    ckpt = CheckpointDir(root)
    for path in ckpt.snapshots():
        snap = ckpt.load(path)
        for mid, round_no in snap.meta["rounds"].items():
            tensors = {**snap.groups[f"modules/{mid}"], **{f"outer.{k}": v for k, v in snap.groups[f"outer/{mid}"].items()}}
            out.setdefault(mid, {})[int(round_no)] = tensors
    return out


FORK = re.compile(r"_(\w+?)_r(\d+)_group: holders .* hold another state at this round \(a fork\)")
"""The kept side's line of a fork (``peer.averaging.matchmaking``)."""
FORK_OTHER = re.compile(r"module (\w+) round (\d+): no group \(forked: ")
"""The other side's line (``peer.averaging.net_averager``): a kept side that declared first need not see it."""


def forked_rounds(logs: list[str]) -> dict[str, int]:
    """The last round of each module at which its holders held two states, from the peers' logs. Peers
    that start seconds apart average in smaller groups first and meet as a fork; the majority's state
    is kept and the others re-sync to it (``peer.averaging.matchmaking``), so snapshots at those rounds
    differ by design, and every later round must not."""
    last: dict[str, int] = {}
    for text in logs:
        for mid, r in FORK.findall(text) + FORK_OTHER.findall(text):
            last[mid] = max(last.get(mid, 0), int(r))
    return last


def replica_diff(roots: list[Path], forked: Optional[dict[str, int]] = None) -> tuple[int, float, str]:
    """Over every pair of snapshots of the same module at the same round under ``roots`` (except at
    rounds up to a start-up fork of that module, ``forked``: :func:`forked_rounds`): the number of pairs
    compared, the largest absolute difference, and the first differing pair named ('' if none)."""
    forked = forked or {}
    views = [snapshots_by_round(r) for r in roots]
    pairs, diff, first = 0, 0.0, ""
    for i in range(len(views)):
        for j in range(i + 1, len(views)):
            for mid in set(views[i]) & set(views[j]):
                for r in sorted(set(views[i][mid]) & set(views[j][mid])):
                    if r == 0 or r <= forked.get(mid, 0):
                        continue
                    a, b = views[i][mid][r], views[j][mid][r]
                    if a.keys() != b.keys():
                        raise AssertionError(f"{mid} round {r}: {roots[i]} and {roots[j]} hold different tensors")
                    for k in a:
                        if torch.equal(a[k], b[k]):
                            continue
                        d = float((a[k].float() - b[k].float()).abs().max()) if a[k].shape == b[k].shape else math.inf
                        diff = max(diff, d if d > 0 else math.inf)  # NaN: a difference too
                        first = first or f"{mid} round {r} differs in {k} between {roots[i]} and {roots[j]}"
                    pairs += 1
    return pairs, diff, first


# -- progress read back ----------------------------------------------------------------------

def _losses(lines: list[dict]) -> list[float]:
    """The loss readings of progress lines, in time order."""
    return [p["loss"] for p in sorted(lines, key=lambda p: p.get("time", 0)) if p.get("loss") is not None]


def first_loss(lines: list[dict]) -> float:
    """The first loss reading of progress lines (NaN without one)."""
    losses = _losses(lines)
    return losses[0] if losses else float("nan")


def loss_thirds(lines: list[dict]) -> tuple[float, float, int]:
    """``(mean loss of the first third, of the last third, number of readings)`` of progress lines."""
    losses = _losses(lines)
    if len(losses) < 3:
        return float("nan"), float("nan"), len(losses)
    k = len(losses) // 3
    return sum(losses[:k]) / k, sum(losses[-k:]) / k, len(losses)


def round_since(net, name: str, since: float) -> int:
    """The highest round ``name`` reported in progress lines written after unix time ``since``."""
    return max((p.get("round_no") or 0 for p in net.progress_lines(name) if p.get("time", 0) > since), default=0)


def settled(net, names: Iterable[str], rounds: int = 3) -> bool:
    """The network has formed: every peer finished ``rounds`` rounds and its last two rounds averaged
    ``embed`` (held by every path) with all the peers, with no fork left. Peers join seconds apart, so
    the first ones train in smaller groups and the later ones fork from them at the same round numbers
    until the majority's state wins (``peer.averaging.matchmaking``); those start-up rounds are history, and a
    scenario's faults and identity checks start after them."""
    names = list(names)
    everyone = re.compile(rf"embed r\d+ averaged by {len(names)}\b")
    for name in names:
        lines = [l for l in net.procs.log(name).splitlines() if "peer.node.trainer: round " in l]
        if len(lines) < rounds or not all(everyone.search(l) and "forked" not in l for l in lines[-2:]):
            return False
    return True


def round_story(net, names: Iterable[str], mismatches: list[str], limit: int = 60) -> str:
    """What each process logged about the (module, round)s of ``mismatches`` (``head round 11: ...``)
    and the rounds next to them, and when it was told to stop: how a fork came about, in a CI log."""
    import re

    wanted = {(m, int(r)) for m, r in re.findall(r"^(\w+) round (\d+):", "\n".join(mismatches), re.M)}
    marks = [f" {m} r{r}" for mid, rr in wanted for m, r in ((mid, rr - 1), (mid, rr), (mid, rr + 1))]
    marks += [f"_{m}_r{r}_" for m, r in wanted] + [f"module {m} round {r}" for m, r in wanted]
    marks += [f"fetched {m} at round" for m, _ in wanted] + [f"module {m}:" for m, _ in wanted] + ["stopping:"]
    out = []
    for name in names:
        lines = [line[:400] for line in net.procs.log(name).splitlines() if any(k in line for k in marks)]
        if lines:
            out.append(f"----- {name}\n" + "\n".join(lines[-limit:]))
    return ("\nwhat the processes logged about those rounds:\n" + "\n".join(out)) if out else ""
