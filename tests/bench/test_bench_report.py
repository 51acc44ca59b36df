"""docs/BENCHMARKS.md's summary tables are what bench/results says, and every result can be traced.

The generated blocks are rebuilt from the result files and compared with the committed document; a
figure edited by hand, a result rerun without regenerating, or code changed under a result that the
document still calls fresh fails here. ``python -m bench.report`` rewrites the blocks.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report
from bench.common import code_hash, dirty, emit, machine
from bench.quality import load_records, point_key
from bench.quality_scale import tiny
from bench.quality_sweeps import grid
from bench.report_rows import NOT_RUN_YET, ROWS
from helpers.pysource import parse_files

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def _full_history() -> bool:
    out = _git("rev-parse", "--is-shallow-repository")
    return out.returncode == 0 and out.stdout.strip() == "false"


@pytest.mark.skipif(not _full_history(), reason="needs git and the whole history (the results' commits)")
def test_the_generated_tables_match_the_results():
    text = report.DOC.read_text()
    assert report.render(text) == text, (
        "docs/BENCHMARKS.md's generated tables differ from bench/results (a result rerun, code changed under "
        "a result, or a figure edited by hand): run python -m bench.report and commit docs/BENCHMARKS.md")


def test_check_mode_names_an_out_of_date_table(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# x\n<!-- bench.report summary -->\n| old |\n<!-- /bench.report summary -->\n"
                   "<!-- bench.report freshness -->\n<!-- /bench.report freshness -->\n")
    out = subprocess.run([sys.executable, "-m", "bench.report", "--check", "--doc", str(doc)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "out of date" in out.stderr and "Traceback" not in out.stderr, out.stderr
    doc.write_text("# no blocks\n")
    out = subprocess.run([sys.executable, "-m", "bench.report", "--doc", str(doc)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no generated block" in out.stderr and "Traceback" not in out.stderr, out.stderr


def _emitting_modules() -> list[str]:
    """Every benchmark module that writes a result (calls ``emit``)."""
    out = []
    for path, tree in parse_files(sorted((ROOT / "bench").glob("*.py"))).items():
        if any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "emit" for n in ast.walk(tree)):
            out.append(path.stem)
    return out


def test_every_benchmark_declares_the_code_it_measures():
    modules = _emitting_modules()
    assert "comm" in modules and "quality" in modules and "common" not in modules
    for name in modules:
        paths = report.measures(name)
        assert f"bench/{name}.py" in paths, f"bench.{name}'s MEASURES leaves out its own module"
        missing = [p for p in paths if not (ROOT / p).exists()]
        assert not missing, f"bench.{name}'s MEASURES names paths that do not exist: {missing}"


def test_a_variant_measures_what_the_benchmark_it_runs_measures():
    """``bench.swarm_standby`` runs ``bench.swarm`` with a flag: its MEASURES take in swarm's
    (``*swarm.MEASURES``) and add its own module, so a change to either makes its result stale."""
    assert set(report.measures("swarm")) < set(report.measures("swarm_standby"))
    assert "bench/swarm_standby.py" in report.measures("swarm_standby")
    assert report.freshness("", False, report.measures("swarm_standby")).stale


def test_every_row_reads_a_key_its_result_holds():
    assert NOT_RUN_YET <= {row.result for row in ROWS}, "NOT_RUN_YET names a result no row reads"
    for row in ROWS:
        path = report.RESULTS / f"{row.result}.json"
        if row.result in NOT_RUN_YET and not path.exists():
            assert f"bench/{row.bench}.py" in report.measures(row.bench)
            continue
        result = json.loads(path.read_text())
        assert report._value(result, row.key) is not None, f"{row.result}.json holds no {row.key}"
        assert f"bench/{row.bench}.py" in report.measures(row.bench)


def test_freshness_rules():
    assert report.freshness("", False, ("models",)).why == "no commit recorded"
    assert "not in this clone" in report.freshness("0" * 40, False, ("models",)).why
    if not _full_history():
        pytest.skip("needs the whole history")
    first = _git("rev-list", "--max-parents=0", "HEAD").stdout.split()[0]
    old = report.freshness(first, True, ("models", "bench/report.py"))
    assert old.stale and old.changed == ("models", "bench/report.py") and old.dirty
    head = _git("rev-parse", "HEAD").stdout.strip()
    path = "bench/report_rows.py"
    if not _git("status", "--porcelain", "--", path).stdout.strip():  # committed and unchanged in this checkout
        same = report.freshness(head, True, (path,))
        assert not same.stale and same.changed == () and same.dirty  # dirty elsewhere: still fresh


def test_dirty_means_code_that_can_change_a_measurement(tmp_path):
    """Prose and a benchmark's own outputs leave a tree clean; any other tracked edit makes it dirty."""
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    for name in ("peer/a.py", "docs/GUIDE.md", "README.md", "bench/results/x.json", "docs/img/p.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("one\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.email=t@example.org", "-c", "user.name=t", "commit", "-qm", "first")
    assert not dirty(tmp_path)
    for name in ("docs/GUIDE.md", "README.md", "bench/results/x.json", "docs/img/p.png"):
        (tmp_path / name).write_text("two\n")
    (tmp_path / "peer" / "new.py").write_text("untracked\n")
    assert not dirty(tmp_path)
    (tmp_path / "peer" / "a.py").write_text("two\n")
    assert dirty(tmp_path)


def test_a_result_without_seeds_is_refused():
    with pytest.raises(ValueError, match="records no 'seeds'"):
        emit("never_written", {"figure": 1.0})
    assert not (report.RESULTS / "never_written.json").exists()


def test_machine_names_cores_threads_and_cpu():
    m = machine()
    assert m["cores"] >= 1 and m["threads"] >= m["cores"] and m["cpu_model"] and m["usable_cpus"] >= 1


def test_quality_reuses_a_point_only_under_its_key(tmp_path):
    scale = tiny()
    points = grid(scale)
    code = code_hash(("bench/quality_runs.py",))
    keys = {p.name: point_key(p, scale, "cpu", code) for p in points}
    first = points[0]
    assert len(set(keys.values())) == len(points)
    assert point_key(first, scale, "cpu", "other code") != keys[first.name]
    assert point_key(first, scale, "cuda", code) != keys[first.name]
    # a point added to the grid leaves the others' keys; a size every point trains at does not
    assert point_key(first, scale.replace(sync_lrs=(1e-3, 6e-3), priority=()), "cpu", code) == keys[first.name]
    assert point_key(first, scale.replace(steps=scale.steps + 1), "cpu", code) != keys[first.name]
    assert point_key(first, scale.replace(seed=scale.seed + 1), "cpu", code) != keys[first.name]
    records = tmp_path / "points.jsonl"
    lines = [{"name": first.name, "key": "recorded by older code", "status": "ok"},
             {"name": points[1].name, "status": "ok"},  # recorded before keys existed
             {"name": points[2].name, "key": keys[points[2].name], "status": "ok"}]
    records.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert list(load_records(records, keys)) == [points[2].name]


def test_same_code_leaves_out_comments_and_docstrings_only():
    base = 'def f(x):\n    """Doubles."""\n    return 2 * x  # twice\n\nLIMIT = 3\n"""The limit."""\n'
    assert report.same_code(base, base.replace('"""Doubles."""', '"""Twice x, for the sum."""'))
    assert report.same_code(base, base.replace("# twice", "# what and why").replace('"""The limit."""', ""))
    assert report.same_code(base, '"""A module."""\n' + base.replace("2 * x", "2*x"))
    assert not report.same_code(base, base.replace("2 * x", "3 * x"))
    assert not report.same_code(base, base.replace("LIMIT = 3", "LIMIT = 4"))
    assert not report.same_code(base, base.replace("return 2 * x", 'print("Doubles.")\n    return 2 * x'))
    assert not report.same_code("def f(:\n", "def f(: \n")  # unparsable: compared as text


def test_an_edit_to_comments_only_leaves_a_result_fresh(tmp_path):
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    code = tmp_path / "peer" / "a.py"
    code.parent.mkdir()
    code.write_text('def f():\n    """One."""\n    return 1\n')
    (tmp_path / "peer" / "data.toml").write_text("x = 1\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.email=t@example.org", "-c", "user.name=t", "commit", "-qm", "first")
    commit = git("rev-parse", "HEAD").strip()
    code.write_text('def f():\n    """The one, as measured."""\n    # a comment\n    return 1\n')
    assert not report.freshness(commit, False, ("peer",), tmp_path).stale
    code.write_text('def f():\n    return 2\n')
    report.freshness.cache_clear()  # one render caches each answer; these edits are between renders
    assert report.freshness(commit, False, ("peer",), tmp_path).changed == ("peer",)
    code.write_text('def f():\n    """One."""\n    return 1\n')
    (tmp_path / "peer" / "data.toml").write_text("x = 2\n")  # not Python: any edit counts
    report.freshness.cache_clear()
    assert report.freshness(commit, False, ("peer",), tmp_path).stale
