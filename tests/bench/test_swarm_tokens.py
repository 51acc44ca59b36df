"""``bench.swarm`` counts a peer's tokens, and a stage server's capacity, from its progress lines across
restarts and role changes."""

from __future__ import annotations

from bench.swarm import _bottleneck, _capacities, _tokens


class _Net:
    def __init__(self, lines: list[dict], by_name: dict[str, list[dict]] | None = None) -> None:
        self.lines = lines
        self.by_name = by_name or {}

    def progress_lines(self, name: str) -> list[dict]:
        return self.by_name.get(name, self.lines)


def _p(t: float, tokens: int, mode: str) -> dict:
    return {"event": "progress", "time": t, "tokens": tokens, "mode": mode}


def test_a_restart_counts_from_zero_again_and_a_role_change_counts_each_roles_own_tokens():
    net = _Net([_p(1, 100, "trainer"), _p(2, 400, "trainer"),  # 300 trained
                _p(3, 0, "trainer"), _p(4, 200, "trainer"),  # restarted: 200 more
                _p(5, 5000, "stage"), _p(6, 5600, "stage")])  # moved to serving: 600 served
    assert _tokens(net, "p", 0, 10, "trainer") == 500
    assert _tokens(net, "p", 0, 10, "stage") == 600
    assert _tokens(net, "p", 0, 10) == 500 + 600  # both roles' own, not the jump between the counters
    assert _tokens(net, "p", 2, 4, "trainer") == 200  # the window's lines only


def _s(t: float, module: str, tokens: int, busy: float) -> dict:
    return {"event": "progress", "time": t, "tokens": tokens, "mode": "stage", "assignment": module,
            "busy_seconds": busy}


def test_a_servers_capacity_is_its_windows_tokens_over_its_busy_seconds_across_restarts_and_moves():
    net = _Net([], {
        "a": [_s(1, "L0M0", 1000, 1.0), _s(2, "L0M0", 3000, 2.0),  # 2000 tokens in 1 s
              _s(3, "L0M0", 0, 0.0), _s(4, "L0M0", 1000, 1.0),  # restarted: 1000 more in 1 s
              _s(5, "L1M0", 0, 0.0), _s(6, "L1M0", 500, 1.0)],  # moved: its own capacity there
        "b": [_s(1, "L1M1", 0, 0.0), _s(6, "L1M1", 1000, 0.5)],
        "idle": [_s(1, "L1M0", 0, 0.0), _s(6, "L1M0", 0, 0.0)]})
    caps = _capacities(net, ["a", "b", "idle"], 0, 10)
    assert caps == {("a", "L0M0"): 1500.0, ("a", "L1M0"): 500.0, ("b", "L1M1"): 2000.0}
    assert _bottleneck(net, ["a", "b", "idle"], 0, 10) == 1500.0  # level 0's 1500 < level 1's 500 + 2000
    assert _capacities(net, ["a"], 2.5, 10) == {("a", "L0M0"): 1000.0, ("a", "L1M0"): 500.0}  # the window only
    assert _bottleneck(net, ["b"], 0, 10) == 0.0  # one level measured: no bottleneck
