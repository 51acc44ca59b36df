"""What every benchmark shares: writing its result where ``docs/BENCHMARKS.md`` expects it."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

__all__ = ["emit", "rate_result_name", "RESULTS", "ISSUE_RATE_MBIT"]

ISSUE_RATE_MBIT = 100
"""The per-peer link rate of issue 3's averaging benchmarks (``bench.comm``, ``bench.comm_hivemind``)."""


def rate_result_name(name: str, rate_mbit: int) -> str:
    """``NAME`` at the issue's rate, ``NAME_RATEmbit`` at any other: a run at another rate (where the
    link, not this machine's CPU, is the limit) keeps the headline result file as it is."""
    return name if rate_mbit == ISSUE_RATE_MBIT else f"{name}_{rate_mbit}mbit"


def emit(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """Write ``bench/results/NAME.json`` and print the result as the last line of output."""
    result = {**result, "bench": name, "host": platform.node(), "unix_time": round(time.time())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, sort_keys=True), flush=True)
    return result
