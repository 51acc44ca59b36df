"""What a peer's link costs a round: the exact bytes of a module's exchange, and the H a slow link
needs so that its exchange stays within the run's communication budget. Pure functions of the
run, the peer's capabilities and the coordinator's settings."""

from __future__ import annotations

from typing import Sequence

from coordinator.records import Capabilities
from coordinator.settings import CoordinatorSettings
from models.codec_spec import codec_spec
from models.config import RunConfig

__all__ = ["exchange_bytes", "link_overrides", "MIN_SLOW_EXCHANGE_SECONDS"]


def exchange_bytes(run: RunConfig, module_ids: Sequence[str]) -> int:
    """Bytes of one round's pseudo-gradients of ``module_ids`` under the run's codec, each module
    encoded on its own: exact (:meth:`models.codec_spec.CodecSpec.encoded_size`); the zstd stage
    sends less, by an amount that depends on the data (at worst one tag byte more per part)."""
    spec = codec_spec(run.outer.codec)
    return sum(spec.encoded_size(run.lattice.module_param_count(m)) for m in module_ids)


MIN_SLOW_EXCHANGE_SECONDS = 1.0
"""An exchange shorter than this never counts as slow, whatever its share of a (tiny) round."""


def link_overrides(
    caps: Capabilities, module_ids: Sequence[str], run: RunConfig, settings: CoordinatorSettings
) -> tuple[int, str, str]:
    """(inner_steps, codec, reason) for a peer exchanging the pseudo-gradients of ``module_ids`` per round.

    A round computes ``H * batch * seq_len / tokens_per_s`` seconds; exchanging the pseudo-gradient
    costs about ``payload / upload + payload / download``, ``payload`` its :func:`exchange_bytes`. When that passes ``comm_budget`` of a round,
    H doubles, up to ``max_inner_steps_factor``. The codec stays the run's: every member of a module's
    group must encode with the same codec (a reducer refuses parts in another one), so a per-peer
    codec would get a slow peer's contributions dropped and the peer reported as hostile.
    """
    h, codec = run.outer.inner_steps, run.outer.codec
    up, down = caps.upload_bps, caps.download_bps
    if up <= 0 and down <= 0:
        return h, codec, "link not measured"
    payload = exchange_bytes(run, module_ids)
    seconds = (payload / up if up > 0 else 0.0) + (payload / down if down > 0 else 0.0)

    def ratio(h_: int) -> float:
        compute = h_ * (settings.batch_size or run.inner.batch_size) * run.lattice.seq_len / max(caps.tokens_per_s, 1e-9)
        return seconds / compute

    r = ratio(h)
    if r <= settings.comm_budget or seconds < MIN_SLOW_EXCHANGE_SECONDS:
        return h, codec, f"exchange is {r:.0%} of a round ({seconds:.2f}s)"
    max_h = run.outer.inner_steps * settings.max_inner_steps_factor
    while ratio(h) > settings.comm_budget and h * 2 <= max_h:
        h *= 2
    return h, codec, (
        f"slow link ({up / 1e6:.2f} MB/s up, {down / 1e6:.2f} MB/s down): codec {codec}, H={h} "
        f"make the exchange {ratio(h):.0%} of a round (budget {settings.comm_budget:.0%})"
    )
