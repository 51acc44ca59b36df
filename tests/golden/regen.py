"""Regenerate ``sim_tiny.json`` ON PURPOSE ONLY (after an intended change of the numerics):

    cd /work/main && .venv/bin/python tests/golden/regen.py

Runs the schedule of ``golden_spec`` through the ``train-local --workers`` simulator and writes each
module's global-copy summary after every outer round. Review the diff before committing it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

import golden_spec as spec  # noqa: E402
from peer.simulator import DiLoCoSimulator  # noqa: E402

OUT = HERE / "sim_tiny.json"


def simulate() -> dict:
    """The golden values: ``rounds[r][module_id]`` is the summary of the global copy after round r."""
    torch.set_num_threads(1)
    cfg = spec.config()
    sim = DiLoCoSimulator(cfg, spec.PATHS, len(spec.PATHS), spec.batches)
    rounds = []
    for _ in range(spec.ROUNDS):
        sim.train(spec.INNER_STEPS)
        rounds.append({mid: spec.summarize(list(sim.global_state(mid).values())) for mid in sim.module_ids})
    return {"config_hash": cfg.content_hash(), "paths": [list(p) for p in spec.PATHS], "rounds": rounds}


def main() -> None:
    golden = simulate()
    OUT.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {OUT} ({len(golden['rounds'])} rounds, modules {', '.join(golden['rounds'][0])})")


if __name__ == "__main__":
    main()
