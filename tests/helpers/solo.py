"""A peer's averager with nobody else, and a one-path dataset: for tests that drive a trainer in
this process."""

from __future__ import annotations

from pathlib import Path


def one_path_dataset(root: Path):
    """A small corpus under ``root`` prepared for a 1x1 lattice: a :class:`models.data.Dataset`."""
    from helpers import write_corpus
    from models.corpus import corpus_from_paths
    from models.data import prepared

    return prepared(root / "data", corpus=lambda: corpus_from_paths([str(write_corpus(root / "src", per_domain=4))]))


class SoloAverager:
    """The in-process :class:`peer.averaging.LocalAverager` with this peer as its only member, plus
    the holder announcements a network averager makes (nobody to announce to without a network)."""

    def __init__(self) -> None:
        from peer.averaging import LocalAverager

        self.member = LocalAverager().member("solo")

    def average(self, *args, **kwargs):
        return self.member.average(*args, **kwargs)

    def use_aggregation(self, rule) -> None:
        self.member.use_aggregation(rule)

    def serve_states(self, provider) -> None:
        self.provider = provider

    def hold(self, module_id: str, round_no: int, wait: bool = True, digest: str = "") -> None:
        pass

    def release(self, module_id: str) -> None:
        pass
