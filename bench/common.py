"""What every benchmark shares: writing its result where ``docs/BENCHMARKS.md`` expects it."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

__all__ = ["emit", "RESULTS"]


def emit(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """Write ``bench/results/NAME.json`` and print the result as the last line of output."""
    result = {**result, "bench": name, "host": platform.node(), "unix_time": round(time.time())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, sort_keys=True), flush=True)
    return result
