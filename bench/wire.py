"""bench.wire: sparse pseudo-gradients against synchronous data-parallel, counted on the wire.

``bench.quality`` counts the sparse codec's bytes from its size formula, payload only, in one
process. Here the same point (H = 16, ``topk16b2``: the top sixteenth of each pseudo-gradient with
2-bit values and error feedback) trains in real peer processes, and what crosses each peer's network
interface is counted: the payload, its framing (noise, yamux, TCP/IP), matchmaking, holder records
and the DHT. The harness is :mod:`bench.utilization`'s: ``--peers`` peers in network namespaces
(``hpu-p*``), egress shaped to ``--rate-mbit`` by ``tbf``, ``--rtt-ms`` added by delay relays, the
``demo`` preset's path (0, 0) (embed, L0M0, L1M0, head), each peer on its own batches, fresh processes
per variant:

- ``ddp``: every-step averaging of the fp32 gradients (codec ``none``), ``--steps`` steps;
- ``sparse``: DiLoCo with H = 16 and ``topk16b2``, the same ``--steps`` steps (``steps // 16``
  rounds of the 4 modules). Before it trains, each peer counts for ``--idle-seconds`` what its link
  sends while it holds the modules and no round runs (DHT upkeep and holder records);
- ``sparse_plain_dht``: the same with hivemind's DHT as it is (one search per key and operation,
  ``DHTOptions.coalesce`` off): the control run for :mod:`peer.network.coalescing`.

Keys (``bench/results/wire.json``; per member, means over the peers; "a round" is one outer round of
the path, its 4 modules averaged):

- ``payload_bytes_ratio_vs_ddp``: DDP's payload over the sparse run's, same steps (measured);
- ``wire_bytes_ratio_vs_ddp``: the same on ``eth0``'s sent bytes (measured);
- ``payload_bytes_per_round``, ``wire_bytes_per_round`` of the sparse run (measured);
- ``per_round_control_bytes``: wire minus payload per round (framing, matchmaking, DHT);
  ``per_module_round_control_bytes`` the same over the path's modules (measured);
- ``idle_bytes_per_s`` and ``upkeep_bytes_per_round`` (idle rate times the mean round's seconds):
  the part of the control bytes that holding modules costs with no round at all (measured);
- ``plain_dht_per_round_control_bytes``, ``plain_dht_wire_bytes_ratio_vs_ddp``: the control run's;
  ``control_bytes_cut_vs_plain_dht``: its control bytes per round over the ``sparse`` run's (measured);
- ``payload_ratio_limit`` (projected): the payload ratio per parameter, which the wire ratio
  approaches as the model grows (the codec's own limit);
- ``params_for_1000x_wire`` (projected): the model size from which the wire ratio reaches 1000x,
  from a linear model of both runs per parameter. DDP's wire per H steps is credited its payload
  only (``H * ddp_payload_per_param_step * P``); the sparse round's wire is its payload per parameter
  scaled by DDP's measured wire-over-payload factor (all of DDP's overhead counted as framing that
  grows with the payload) plus ``per_round_control_bytes`` held fixed. Both choices make the
  projection pessimistic for the sparse run. None when the payload ratio itself stays under 1000x.

Run as root: ``python -m bench.wire`` (about 5 minutes on a quiet 2-core machine). Without root it
prints a ``{"skipped": ...}`` line and exits 0.
"""

from __future__ import annotations

import logging
from typing import Optional

from bench.common import emit, run_main
from bench import utilization
from bench.utilization import VARIANT_CODECS, VARIANTS, parser, run_bench

MEASURES = ("bench/wire.py", *utilization.MEASURES)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

__all__ = ["main", "wire_keys"]

VARIANTS_RUN = "ddp,sparse,sparse_plain_dht"
"""The variants of :mod:`bench.utilization` this benchmark runs, in this order."""
TARGET_RATIO = 1000.0
"""The bytes reduction against DDP the sparse codec is held to (``bench.quality``'s goal)."""


def wire_keys(ddp: dict, sparse: dict, *, steps: int, modules: int, params: int) -> dict:
    """The wire figures from the two variants' summaries (:func:`bench.utilization.run_bench`)."""
    rounds = sparse["rounds"]
    h = VARIANTS["sparse"][0]
    payload, wire = sparse["bytes_sent_per_peer"], sparse["wire_tx_bytes_per_peer"]
    control = (wire - payload) / rounds
    round_s = sparse["wall_seconds"] / rounds
    idle = sparse.get("idle_tx_bytes_per_peer_s")
    ddp_payload_pp = ddp["bytes_sent_per_peer"] / (steps * params)  # per parameter and step
    framing = ddp["wire_tx_bytes_per_peer"] / ddp["bytes_sent_per_peer"]
    sparse_payload_pp = payload / (rounds * params)  # per parameter and round
    sparse_pp = sparse_payload_pp * framing  # framed as DDP's payload is
    a = h * ddp_payload_pp
    params_1000x = (TARGET_RATIO * control / (a - TARGET_RATIO * sparse_pp)) if a > TARGET_RATIO * sparse_pp else None
    return dict(
        payload_bytes_ratio_vs_ddp=round(ddp["bytes_sent_per_peer"] / payload, 1),
        wire_bytes_ratio_vs_ddp=round(ddp["wire_tx_bytes_per_peer"] / wire, 1),
        sparse_rounds=rounds,
        payload_bytes_per_round=round(payload / rounds),
        wire_bytes_per_round=round(wire / rounds),
        per_round_control_bytes=round(control),
        per_module_round_control_bytes=round(control / modules),
        round_seconds_mean=round(round_s, 3),
        idle_bytes_per_s=idle,
        upkeep_bytes_per_round=round(idle * round_s) if idle is not None else None,
        ddp_payload_bytes_per_step=round(ddp["bytes_sent_per_peer"] / steps),
        ddp_wire_bytes_per_step=round(ddp["wire_tx_bytes_per_peer"] / steps),
        ddp_wire_over_payload=round(framing, 4),
        params_for_1000x_wire=round(params_1000x) if params_1000x is not None else None,
        payload_ratio_limit=round(a / sparse_payload_pp, 1),
    )


def main(argv: Optional[list[str]] = None) -> None:
    ap = parser("python -m bench.wire", __doc__.split("\n")[0])
    ap.set_defaults(variants=VARIANTS_RUN, steps=256, idle_seconds=20.0)
    args = ap.parse_args(argv)
    if args.variants != VARIANTS_RUN:
        ap.error(f"--variants: bench.wire runs {VARIANTS_RUN} (python -m bench.utilization runs the others)")
    if args.steps % VARIANTS["sparse"][0]:
        ap.error(f"--steps {args.steps}: a multiple of the sparse run's H = {VARIANTS['sparse'][0]}, so both runs train the same steps")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from models.presets import PRESETS
    from bench.utilization import PATH

    result = run_bench(args)
    if "skipped" not in result:
        lattice = PRESETS[args.preset]().lattice
        v = result["variants"]
        shape = dict(steps=args.steps, modules=len(lattice.path_modules(PATH)), params=lattice.path_param_count(PATH))
        keys = wire_keys(v["ddp"], v["sparse"], **shape)
        plain = wire_keys(v["ddp"], v["sparse_plain_dht"], **shape)
        result.update(codec=VARIANT_CODECS["sparse"], sparse_inner_steps=VARIANTS["sparse"][0], **keys,
                      plain_dht_per_round_control_bytes=plain["per_round_control_bytes"],
                      plain_dht_wire_bytes_ratio_vs_ddp=plain["wire_bytes_ratio_vs_ddp"],
                      control_bytes_cut_vs_plain_dht=round(plain["per_round_control_bytes"]
                                                           / max(1, keys["per_round_control_bytes"]), 2))
    # the model from seed 0, peer k's batches from 1000 + k and its torch state from k, validation from 4242
    emit("wire", {**result, "seeds": sorted({0, 4242, *range(args.peers), *(1000 + k for k in range(args.peers))})})


if __name__ == "__main__":
    run_main(main)
