"""Fixtures shared by every test: seeded randomness, reaped child processes, CUDA and Docker gates."""

from __future__ import annotations

from models.grpc_fork import grpc_fork_safe

grpc_fork_safe()  # before any test module imports grpc: the children the tests start must not be aborted

import random  # noqa: E402

import pytest  # noqa: E402

from helpers.procs import ROOT, TEARDOWN_GRACE  # noqa: E402
from peer.localnet import ProcessGroup  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:
        pass
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:
        pass


LOG_TAIL_LINES = 30
"""Lines of each child's log printed when a test that started it fails (CI keeps no temp dirs)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"_report_{report.when}", report)


@pytest.fixture
def procs(request, tmp_path):
    """Start real child processes; every one is terminated and reaped when the test ends. When the test
    fails, the tail of every child's log is printed (it shows in the failure report)."""
    group = ProcessGroup(tmp_path / "logs", cwd=ROOT)
    try:
        yield group
    finally:
        group.stop(timeout=TEARDOWN_GRACE)
        report = getattr(request.node, "_report_call", None)
        if report is not None and report.failed:
            for name in group.procs:
                lines = group.log(name).splitlines()[-LOG_TAIL_LINES:]
                print(f"----- {name} (exit {group.procs[name].poll()}), last {len(lines)} log lines -----")
                print("\n".join(lines))


SERIAL_FOLDERS = ("chaos", "docker")
"""Test folders whose tests use machine-wide resources, run one at a time, one folder after the other,
in one worker when the suite runs in pytest-xdist workers (``make test``): the chaos suite's network
namespaces (one prefix and subnet, ``chaos.scenario``) and the Docker engine's containers, networks and
images. One worker for both also keeps these two heaviest groups (a dozen processes each) from running
at once on a two-core machine."""


HEAVY_FIRST = ("serial", "tests/peer/test_peer_network.py", "tests/peer/test_stopping.py",
               "tests/peer/stage/test_stage_network.py", "tests/peer/averaging/test_split_rounds.py",
               "tests/peer/stage/test_stage_pipeline.py", "tests/peer/test_peer_drain.py",
               "tests/peer/test_bootstrap.py", "tests/peer/averaging/test_net_averaging.py",
               "tests/peer/test_peer_data_network.py", "tests/models/test_generate.py",
               "tests/peer/simulator/test_train_local.py")
"""Units of work handed out first, longest first (measured: each takes one to ten minutes of a worker on
a two-core machine), so that no long file starts last and keeps one worker busy while the other idles.
The other files follow in collection order. A file missing here costs balance, never correctness."""


EACH_TEST_A_UNIT = ("tests/peer/test_peer_network.py", "tests/peer/test_stopping.py")
"""Files whose tests are units of work of their own (several minutes each file, and their module
fixtures only prepare a small dataset): one worker running a whole file would finish minutes after
the other."""


SAME_UNIT = {"tests/models/test_export.py": "tests/models/test_generate.py"}
"""Files that run in the unit of another because they share its session fixture: ``test_export`` uses
``test_generate``'s two trained runs (tens of seconds of training), built once per worker."""


def work_unit(nodeid: str) -> str:
    """The unit of work of a test under xdist: ``serial`` for the :data:`SERIAL_FOLDERS`, the test itself
    for :data:`EACH_TEST_A_UNIT`, else its file (or the file it shares fixtures with: :data:`SAME_UNIT`)."""
    path = nodeid.split("::", 1)[0]
    if any(folder in path.split("/")[:-1] for folder in SERIAL_FOLDERS):
        return "serial"
    if path in EACH_TEST_A_UNIT:
        return nodeid
    return SAME_UNIT.get(path, path)


def _rank(item) -> int:
    unit = work_unit(item.nodeid)
    unit = unit.split("::", 1)[0]  # a test that is a unit of its own ranks as its file
    return HEAVY_FIRST.index(unit) if unit in HEAVY_FIRST else len(HEAVY_FIRST)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by test file (a file's tests run in order in one worker, so its module-scoped
    fixtures, such as a started swarm whose DHT records expire, serve tests run back to back), except
    that all the tests of the :data:`SERIAL_FOLDERS` form one unit of work, and the units of
    :data:`HEAVY_FIRST` are handed out first. (xdist's own ``--dist loadgroup`` renames node ids to
    group them, which pytest 9 no longer allows: its groups would silently run in parallel.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SerialGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def schedule(self) -> None:
            # the collection's order (pytest_collection_modifyitems: HEAVY_FIRST) instead of xdist's
            # (units with the most tests first)
            self.config.option.loadscopereorder = False
            super().schedule()

    return SerialGroups(config, log)


def pytest_collection_modifyitems(config, items):
    # HEAVY_FIRST's units first, in every worker alike (xdist hands tests out by their index in the
    # workers' collection); stable, so each unit's tests stay together and in their order
    items.sort(key=_rank)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
