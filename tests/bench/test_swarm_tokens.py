"""``bench.swarm`` counts a peer's tokens from its progress lines across restarts and role changes."""

from __future__ import annotations

from bench.swarm import _tokens


class _Net:
    def __init__(self, lines: list[dict]) -> None:
        self.lines = lines

    def progress_lines(self, name: str) -> list[dict]:
        return self.lines


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
