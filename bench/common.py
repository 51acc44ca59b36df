"""What every benchmark shares: writing its result where ``docs/BENCHMARKS.md`` expects it, with the
provenance that traces it (commit, command, machine, seeds), a ``__main__`` that leaves nothing
behind when it is stopped, and a work directory removed at the end (:func:`work_directory`).

Each benchmark module declares ``MEASURES``, the paths of the code its figures depend on;
``python -m bench.report`` reads it to mark a result stale once that code changed after the result's
commit, and :func:`code_hash` of such paths keys the stored points a benchmark may reuse."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from models import strict_json

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent
_STARTED = time.time()
"""When this benchmark process started (its result's ``duration_s`` counts from here)."""

__all__ = ["code_hash", "dirty", "emit", "machine", "provenance", "rate_result_name", "run_main", "work_directory", "RESULTS",
           "ISSUE_RATE_MBIT"]

ISSUE_RATE_MBIT = 100
"""The per-peer link rate of the averaging benchmarks' headline results (``bench.comm``,
``bench.comm_hivemind``)."""


def rate_result_name(name: str, rate_mbit: int) -> str:
    """``NAME`` at :data:`ISSUE_RATE_MBIT`, ``NAME_RATEmbit`` at any other: a run at another rate (where the
    link, not this machine's CPU, is the limit) keeps the headline result file as it is."""
    return name if rate_mbit == ISSUE_RATE_MBIT else f"{name}_{rate_mbit}mbit"


def _cpuinfo() -> list[dict[str, str]]:
    """One ``{field: value}`` per logical CPU of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    cpus = []
    for block in text.strip().split("\n\n"):
        cpus.append({k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())})
    return cpus


def machine() -> dict[str, Any]:
    """The machine a result was measured on: physical ``cores``, hardware ``threads`` (logical CPUs),
    the ``cpu_model``, the CPUs this process may use (``usable_cpus``: a cgroup or affinity can give it
    fewer), torch's intra-op threads when torch is loaded, the Python version and the system."""
    cpus = _cpuinfo()
    threads = os.cpu_count() or len(cpus) or 1
    physical = {(c.get("physical id", "0"), c.get("core id", str(i))) for i, c in enumerate(cpus)}
    cores = len(physical) if cpus and "core id" in cpus[0] else threads
    model = next((c["model name"] for c in cpus if "model name" in c), "") or platform.processor() or platform.machine()
    out: dict[str, Any] = {"cores": cores, "threads": threads, "cpu_model": model,
                           "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else threads,
                           "python": platform.python_version(), "system": platform.platform()}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch_threads"] = torch.get_num_threads()
    return out


def _git(*args: str, root: Path = ROOT) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def dirty(root: Path = ROOT) -> bool:
    """Whether a tracked file that can change a measurement differs from the commit: a benchmark's own
    outputs (results, plots) and prose (``*.md``, edited while benchmarks run) do not count."""
    return bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results",
                     ":(exclude)docs/img", ":(exclude,glob)**/*.md", root=root))


def provenance() -> dict[str, Any]:
    """What a result needs to be traced and rerun: the commit (and whether the tree had changes), the
    exact command, the machine (:func:`machine`), when it started and how long it ran."""
    return {
        "commit": _git("rev-parse", "HEAD") or "unknown",
        "dirty": dirty(),
        "command": " ".join(["python", "-m", f"bench.{Path(sys.argv[0]).stem}"] + sys.argv[1:])
        if sys.argv and sys.argv[0].endswith(".py") else " ".join(sys.argv),
        "machine": machine(),
        "started_unix": round(_STARTED),
        "duration_s": round(time.time() - _STARTED, 1),
    }


def code_hash(paths: Sequence[str]) -> str:
    """SHA-256 over the files under ``paths`` (relative to the repository root; a folder means every
    file in it but compiled bytecode): their relative names and bytes, in sorted order. It changes when
    any of that code changes, committed or not."""
    digest = hashlib.sha256()
    for rel in sorted(set(paths)):
        root = ROOT / rel
        if not root.exists():
            raise FileNotFoundError(f"{rel} does not exist under {ROOT}")
        files = [root] if root.is_file() else sorted(f for f in root.rglob("*")
                                                     if f.is_file() and "__pycache__" not in f.parts)
        for f in files:
            digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()


def tokens_between(lines: Iterable[dict], since: float, until: float, mode: Optional[str] = None) -> int:
    """Tokens a process reported processing between the unix times ``since`` and ``until``, from its
    JSON lines (those of ``event`` "progress" with ``tokens``): the sum of the increases between its
    consecutive progress lines in one role (a restarted process counts from 0 again; a peer moved from
    trainer to server counts what it trained and then what it served, never the jump between the two
    counters). ``mode``: only the lines in that role."""
    seen = [p for p in lines if p.get("event") == "progress" and "tokens" in p and since <= p.get("time", 0) <= until]
    return sum(b["tokens"] - a["tokens"] for a, b in zip(seen, seen[1:])
               if b["tokens"] >= a["tokens"] and a.get("mode") == b.get("mode") and mode in (None, a.get("mode")))


def emit(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """Write ``bench/results/NAME.json`` and print the result as the last line of output.

    Every result records its ``seeds`` (a list: every seed its randomness came from, ``[]`` for a
    benchmark that draws nothing at random) beside its :func:`provenance`; a result without them is a
    programming error. A result that says ``skipped`` (e.g. no network namespaces without root) is
    printed only: ``make bench`` goes on, and the last measured result file is kept.
    """
    if "skipped" in result:
        print(strict_json.dumps(result), flush=True)
        return result
    seeds = result.get("seeds")
    if not isinstance(seeds, list) or not all(isinstance(s, int) for s in seeds):
        raise ValueError(f"bench.{name}'s result records no 'seeds' list of ints ({seeds!r}): add the seeds its "
                         "randomness came from, [] if it draws nothing at random")
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
