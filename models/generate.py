"""Sampling text from a trained lattice: the router picks the path, the path model samples.

DiPaCo (Douillard et al. 2024, sections 2.2 and 4) routes a prompt once, by its prefix, to one path,
which is then a plain transformer LM; at inference it may also re-route every ``W`` tokens, which the
paper reports helps. Here the first decision uses the prompt's first ``PREFIX_TOKENS`` tokens (the
same features documents were routed by in training) and each re-routing decision uses the last
``PREFIX_TOKENS`` tokens of the context so far.

When the router picks a path whose modules this model source lacks (a run that trained only some
paths), the nearest available path is used instead and the fallback is logged: nearest means sharing
the most modules with the routed path, ties broken by the prompt's distance to the candidate's
centroids along the routing tree.

Sampling is deterministic for a seed on any device: logits go to CPU float32 and a seeded CPU
generator draws the token. On CUDA the forward pass runs under bf16 autocast (models.training).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Protocol, Sequence, Union

import numpy as np
import torch
import torch.nn as nn

from models.config import LatticeConfig, Path_, format_path
from models.errors import ConfigError, DataError, HivepathError
from models.routing import PREFIX_TOKENS, Router, prefix_features
from models.training import autocast

__all__ = [
    "SamplingConfig",
    "PromptError",
    "PathSource",
    "RouteDecision",
    "Generation",
    "sample_next",
    "nearest_path",
    "choose_path",
    "generate",
]

log = logging.getLogger(__name__)


class PromptError(HivepathError):
    """The prompt cannot be generated from (empty, or no tokens)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample a continuation."""

    max_new_tokens: int = 64
    """Tokens to generate (the models have no end-of-text token, so exactly this many)."""
    temperature: float = 1.0
    """Divides the logits before the softmax; lower is more conservative. Must be > 0."""
    top_k: int = 0
    """Sample only among the ``top_k`` most likely tokens (0: all tokens; 1: greedy)."""
    seed: int = 0
    """Seed of the sampling generator: the same seed gives the same text."""
    reroute_every: int = 0
    """Re-route every ``W`` generated tokens on the last ``PREFIX_TOKENS`` tokens (0: route once)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError("max-tokens", f"must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.temperature, (int, float)) or not np.isfinite(self.temperature) or self.temperature <= 0:
            raise ConfigError("temperature", f"must be > 0, got {self.temperature} (use --top-k 1 for greedy decoding)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError("top-k", f"must be >= 0 (0 samples from every token), got {self.top_k}")
        if not isinstance(self.reroute_every, int) or self.reroute_every < 0:
            raise ConfigError("reroute-every", f"must be >= 0 (0 routes once), got {self.reroute_every}")


class PathSource(Protocol):
    """Where paths come from: a run directory (:class:`models.run_dir.RunDir`) or an exported model."""

    lattice: LatticeConfig
    tokenizer: Any
    router: Optional[Router]

    def available_paths(self) -> list[Path_]: ...

    def path_model(self, path: Path_) -> nn.Module: ...


@dataclass(frozen=True)
class RouteDecision:
    """One routing decision: from generated token ``at_token`` on, ``path`` produces the text."""

    at_token: int
    path: Path_
    routed: Optional[Path_]
    """What the router chose (``None`` when the path was forced or there is no router)."""
    reason: str
    """``router``, ``forced``, ``single path`` or ``fallback``."""

    def to_dict(self) -> dict[str, Any]:
        return {"at_token": self.at_token, "path": format_path(self.path),
                "routed": format_path(self.routed) if self.routed is not None else None, "reason": self.reason}


@dataclass
class Generation:
    """A prompt, the tokens sampled after it, their text, and the routing decisions that chose paths."""

    prompt: str
    prompt_ids: list[int]
    new_ids: list[int]
    text: str
    decisions: list[RouteDecision] = field(default_factory=list)
    sampling: Optional[SamplingConfig] = None

    @property
    def path(self) -> Path_:
        """The path of the first decision (the prompt's path)."""
        return self.decisions[0].path

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "text": self.text,
            "tokens": len(self.new_ids),
            "prompt_tokens": len(self.prompt_ids),
            "ids": list(self.new_ids),
            "path": format_path(self.path),
            "decisions": [d.to_dict() for d in self.decisions],
            "sampling": asdict(self.sampling) if self.sampling is not None else None,
        }


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Draw one token id from ``logits`` (V,) with temperature and top-k, using the CPU ``generator``."""
    scaled = logits.detach().to("cpu", torch.float32) / temperature  # (V,)
    if 0 < top_k < scaled.shape[0]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))  # (V,)
    probs = torch.softmax(scaled, dim=-1)  # (V,)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _centroid_distance(router: Router, feat: np.ndarray, path: Path_) -> float:
    """Sum over levels of the squared distance from ``feat`` (D,) to the path's centroid at that level."""
    total = 0.0
    for level, index in enumerate(path):
        c = router.centroids[format_path(path[:level]) if level else ""]  # (modules, D)
        total += float(((feat - c[index]) ** 2).sum())
    return total


def nearest_path(router: Optional[Router], ids: Sequence[int], wanted: Path_, available: Sequence[Path_]) -> Path_:
    """The available path closest to ``wanted``: most modules in common, then nearest centroids to ``ids``."""
    if not available:
        raise DataError("this model holds no complete path; export or train at least one path")
    feat = prefix_features(np.asarray(ids, dtype=np.int64), router.dim) if router is not None else None

    def key(p: Path_) -> tuple:
        shared = sum(a == b for a, b in zip(p, wanted))
        dist = _centroid_distance(router, feat, p) if feat is not None else 0.0
        return (-shared, dist, p)

    return min(available, key=key)


def choose_path(source: PathSource, ids: Sequence[int], at_token: int, forced: Optional[Path_] = None) -> RouteDecision:
    """Route the token prefix ``ids`` to a path ``source`` can run (see the module docstring)."""
    available = source.available_paths()
    if forced is not None:
        forced = source.lattice.check_path(tuple(forced))
        source.path_model(forced)  # raises a clear DataError when a module is missing
        return RouteDecision(at_token, forced, None, "forced")
    if not available:
        raise DataError("this model holds no complete path; export or train at least one path")
    if source.router is None:
        return RouteDecision(at_token, available[0], None, "single path")
    routed = source.router.route_ids(np.asarray(ids, dtype=np.int64))
    if routed in available:
        return RouteDecision(at_token, routed, routed, "router")
    path = nearest_path(source.router, ids, routed, available)
    log.info("the router picked path %s whose modules are absent here; using the nearest available path %s",
             format_path(routed), format_path(path))
    return RouteDecision(at_token, path, routed, "fallback")


def generate(
    source: PathSource,
    prompt: str,
    sampling: SamplingConfig,
    path: Optional[Path_] = None,
    device: Union[str, torch.device] = "cpu",
) -> Generation:
    """Continue ``prompt`` with ``sampling.max_new_tokens`` tokens sampled from the routed path.

    ``path`` forces a path (no routing, no re-routing); a source without a router (a dense run, an
    export) uses its single path. The context fed to the model is the last ``seq_len`` tokens
    (learned positions end there).
    """
    if not prompt:
        raise PromptError('the prompt is empty; give some text to continue, e.g. "To be, or not"')
    device = torch.device(device)
    prompt_ids = [int(i) for i in source.tokenizer.encode(prompt)]
    if not prompt_ids:
        raise PromptError("the prompt encodes to no tokens; give some text to continue")
    gen = torch.Generator().manual_seed(sampling.seed)
    T = source.lattice.seq_len
    context = list(prompt_ids)
    new_ids: list[int] = []
    decision = choose_path(source, prompt_ids, 0, forced=path)
    decisions = [decision]
    model = source.path_model(decision.path).to(device).eval()
    with torch.no_grad():
        for step in range(sampling.max_new_tokens):
            reroute = path is None and source.router is not None and sampling.reroute_every > 0
            if reroute and step and step % sampling.reroute_every == 0:
                decision = choose_path(source, context[-PREFIX_TOKENS:], step)
                decisions.append(decision)
                model = source.path_model(decision.path).to(device).eval()
            idx = torch.tensor([context[-T:]], dtype=torch.long, device=device)  # (1, t)
            with autocast(device):
                logits, _ = model(idx)  # (1, t, V)
            token = sample_next(logits[0, -1], sampling.temperature, sampling.top_k, gen)
            context.append(token)
            new_ids.append(token)
    text = source.tokenizer.decode(new_ids)
    log.info("generated %d tokens on path(s) %s", len(new_ids),
             " ".join(f"{format_path(d.path)}@{d.at_token}" for d in decisions))
    return Generation(prompt, prompt_ids, new_ids, text, decisions, sampling)
