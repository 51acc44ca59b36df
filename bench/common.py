"""What every benchmark shares: writing its result where ``docs/BENCHMARKS.md`` expects it, a
``__main__`` that leaves nothing behind when it is stopped, and a work directory removed at the end
(:func:`work_directory`)."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from models import strict_json

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent
_STARTED = time.time()
"""When this benchmark process started (its result's ``duration_s`` counts from here)."""

__all__ = ["emit", "provenance", "rate_result_name", "run_main", "work_directory", "RESULTS", "ISSUE_RATE_MBIT"]

ISSUE_RATE_MBIT = 100
"""The per-peer link rate of issue 3's averaging benchmarks (``bench.comm``, ``bench.comm_hivemind``)."""


def rate_result_name(name: str, rate_mbit: int) -> str:
    """``NAME`` at the issue's rate, ``NAME_RATEmbit`` at any other: a run at another rate (where the
    link, not this machine's CPU, is the limit) keeps the headline result file as it is."""
    return name if rate_mbit == ISSUE_RATE_MBIT else f"{name}_{rate_mbit}mbit"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def provenance() -> dict[str, Any]:
    """What a result needs to be traced and rerun: the commit (and whether the tree had changes), the
    exact command, the machine, when it started and how long it ran."""
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": _git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(dirty),
        "command": " ".join(["python", "-m", f"bench.{Path(sys.argv[0]).stem}"] + sys.argv[1:])
        if sys.argv and sys.argv[0].endswith(".py") else " ".join(sys.argv),
        "machine": {"cores": os.cpu_count(), "cpu_model": _cpu_model(), "python": platform.python_version(),
                    "system": platform.platform()},
        "started_unix": round(_STARTED),
        "duration_s": round(time.time() - _STARTED, 1),
    }


def emit(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """Write ``bench/results/NAME.json`` and print the result as the last line of output.

    A result that says ``skipped`` (e.g. no network namespaces without root) is printed only: ``make
    bench`` goes on, and the last measured result file is kept.
    """
    if "skipped" in result:
        print(strict_json.dumps(result), flush=True)
        return result
    result = {**provenance(), **result, "bench": name, "host": platform.node(), "unix_time": round(time.time())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(strict_json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(strict_json.dumps(result, sort_keys=True), flush=True)
    return result


@contextlib.contextmanager
def work_directory(prefix: str, given: Optional[Path] = None, keep: bool = False) -> Iterator[Path]:
    """Where a benchmark's processes write (logs, checkpoints, datasets): ``given`` (its ``--work``),
    kept; else a new temp dir (``prefix``), removed when the block ends, by an error or a stop signal
    too (:func:`run_main` makes them ``KeyboardInterrupt``), unless ``keep`` (``--keep``). A kept
    directory is named on stderr at the end. Enter it outside the block that stops the processes, so
    they are gone before their files."""
    name = f"bench.{Path(sys.argv[0]).stem}" if sys.argv and sys.argv[0] else "bench"
    work = given if given is not None else Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    finally:
        if given is not None or keep:
            print(f"{name}: work directory kept at {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def run_main(main: Callable[[], Any]) -> None:
    """Run a benchmark's ``main`` as ``python -m bench.NAME`` does, and exit.

    SIGTERM and SIGHUP stop it as Ctrl-C does (``KeyboardInterrupt``), so every ``finally`` and context
    manager that stops its processes, removes its network namespaces and temp dirs runs; a watchdog
    stops its processes if it dies without a word (:mod:`peer.node.lifetime`). Exit code 130 when
    stopped, ``main``'s own when it returns an int, else 0.
    """
    from peer.node.lifetime import stop_on_signals, watch_descendants

    watch_descendants()
    try:
        with stop_on_signals():
            code = main()
    except KeyboardInterrupt as e:
        print(f"{Path(sys.argv[0]).stem}: stopped ({e or 'SIGINT'}); its processes were stopped", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
