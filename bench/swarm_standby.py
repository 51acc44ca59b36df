"""Benchmark ``bench.swarm_standby``: ``bench.swarm`` with ``servers_per_level = 2``, the coordinator
setting for pools that lose peers often. Each driven level gets a standby server before more
trainers, so a server killed every 30 s costs its trainers a retry on the other, not a pause, while
the pipeline has the trainers the standbys could have been fewer. Same keys as ``bench.swarm``
(``kill_retention`` is the one this run is for), written to ``bench/results/swarm_standby.json``.

Run: ``python -m bench.swarm_standby`` (``--quick`` for a short smoke run).
"""

from __future__ import annotations

import sys
from typing import Optional

from bench import swarm
from bench.common import run_main

MEASURES = (*swarm.MEASURES, "bench/swarm_standby.py")
"""What ``bench.swarm`` measures, and this file."""


def main(argv: Optional[list[str]] = None) -> dict:
    return swarm.main(["--servers-per-level", "2", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    run_main(main)
