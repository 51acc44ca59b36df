"""The ``[coordinator]`` section of ``run.toml``: leases, durability, and the scheduler's policy.

Everything else in the file is the run itself, read by :func:`models.presets.load_run_config`.
Precedence: command-line flags (the serve command's) over this section over the defaults here.

The coordinator reads no environment variable (``tests/project/test_settings.py`` checks it): its process
is configured by the flags of ``hivepath coordinator serve`` and this section. The container image's
``HIVEPATH_*`` variables become those flags in ``deploy/entrypoint.sh``; they are listed with every
other variable in ``hivepath.settings`` (and ``docs/cli.md``).

Each field of :class:`CoordinatorSettings` is declared once, with its type, default and docstring;
``docs/coordinator.md``'s table of them is generated from the class (:func:`markdown_table`; ``python -m
coordinator.settings --update docs/coordinator.md`` rewrites it, a test checks it is current).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from models.config import RunConfig
from models.presets import load_run_config, read_toml
from models.errors import ConfigError, DataError
from models.settings import fill_between, table_main
from protos import versions

__all__ = ["CoordinatorSettings", "load_settings", "load_run_and_settings", "pin_dataset", "MAX_PATHS", "field_docs",
           "markdown_table", "update_markdown", "BEGIN_MARKER", "END_MARKER", "main"]

MAX_PATHS = 65536
"""The scheduler keeps per-path state; lattices with more paths are refused at start-up."""


@dataclass(frozen=True)
class CoordinatorSettings:
    """How the coordinator admits, leases and assigns; read from ``[coordinator]`` in run.toml."""

    lease_timeout: float = 30.0
    """Seconds a lease lives without a heartbeat; then its work is freed for another peer."""
    heartbeat_interval: float = 5.0
    """Seconds between a peer's heartbeats (told to peers at join)."""
    restart_grace: float = 60.0
    """After a restart every live lease gets at least this many seconds, so peers can reconnect
    before any work is reshuffled."""
    flush_interval: float = 1.0
    """Seconds between group commits of heartbeat renewals and progress to SQLite."""
    tick_interval: float = 1.0
    """Seconds between lease-expiry and rebalancing passes."""
    sqlite_synchronous: str = "FULL"
    """SQLite ``synchronous`` pragma: FULL survives power loss, NORMAL survives process crashes."""
    batch_size: int = 0
    """Sequences per step used to judge memory fit (0: the run's ``inner.batch_size``)."""
    memory_headroom: float = 0.8
    """Fraction of a peer's reported memory the scheduler plans to use."""
    rebalance_threshold: float = 0.25
    """Move a peer only when (max - min) / max path throughput exceeds this."""
    min_move_interval: float = 300.0
    """A peer is moved at most once per this many seconds."""
    max_moves_per_tick: int = 1
    """Rebalancing moves per pass, so the network changes gradually."""
    comm_budget: float = 0.1
    """A link is slow when exchanging its pseudo-gradients would take more than this fraction of a
    round's compute; the peer then gets a stronger codec and, if needed, a larger H."""
    stage_mode: bool = True
    """Peers too small for a path serve pipeline stages or drive pipelines (SWARM); false refuses them."""
    server_busy_share: float = 0.8
    """A driven pipeline's stage whose servers are busier than this share of what they can serve is
    its bottleneck: a small peer joins it as a server; below it on every level, as another trainer."""
    servers_per_level: int = 1
    """Servers each level of a driven pipeline gets (when small peers fit its module) before a small
    peer drives it harder or starts another pipeline. 2 suits pools that lose peers often (spot
    instances): a server that stops then costs its trainers a retry on the other (SWARM's redundancy),
    not a pause until it is back or the level is refilled, at the price of the trainers the standby
    servers could have been."""
    max_inner_steps_factor: int = 8
    """Largest multiple of the run's H given to a slow-linked peer, and the largest H the planner
    chooses for a module (the run's H times this)."""
    planner: bool = True
    """Plan each module's H and codec from its holders' measured links (:mod:`coordinator.planner`);
    false keeps the fixed policy: the run's codec, and H doubled per peer at assignment."""
    planner_codecs: str = ""
    """Codecs the planner may give a module's exchange besides the run's, comma-separated (e.g.
    "int4"; only those smaller than the run's codec count); '' lets it change only H."""
    overlap_budget: float = 0.0
    """Where no H and codec the planner may choose keeps a module's exchange within comm_budget, its
    holders' exchanges may run behind their next round, taking at most this share of a round (the
    share of steps taken on the global copy it replaces); 0 (the default): never. Worth it where an
    exchange's own work does not take the training's cores (a GPU peer): on CPU peers it trained no
    more tokens and a worse model (docs/BENCHMARKS.md, bench.planner)."""
    plan_hysteresis: float = 0.25
    """A module's plan changes only when its exchange passes comm_budget by this share, or when a
    preferred plan fits within this share below it."""
    plan_lead_rounds: int = 4
    """A new plan applies from the module's highest reported round plus this many rounds, so every
    holder hears of it (in a heartbeat reply) before it reaches that round."""
    plan_interval: float = 10.0
    """Seconds between planning passes."""
    initial_peers: int = 8
    """Multiaddrs of live peers handed to a joining peer as DHT bootstrap addresses."""
    max_peers: int = 200000
    """Joins beyond this many live leases are refused (RESOURCE_EXHAUSTED)."""
    credential_timeout: float = 3600.0
    """Seconds an admission credential is valid; heartbeats renew it once half of that is left, so a
    banned or vanished peer drops out of averaging groups within this long."""
    ban_reporters: int = 2
    """Ban a peer reported by this many distinct peers within ``ban_window``."""
    ban_reports: int = 5
    """... or reported this many times (distinct reporter, module, round) within ``ban_window``."""
    ban_window: float = 600.0
    """Seconds a report counts towards a ban."""
    history_interval: float = 60.0
    """Seconds between samples of the run's history (tokens/s, peers online, tokens, bytes exchanged)
    for the status page's plots."""
    history_points: int = 2000
    """Most points kept per history series; older points are thinned to make room."""
    min_peer_version: str = ""
    """Least hivepath release a peer must run ('' admits every one): older ones are refused at join
    with the release to install, and a peer already in the run when this is raised (the coordinator
    restarted with a new value) drains and exits with code 7. Releases before 0.2.0 state no version
    and read DHT records strictly: a run with peers of 0.2.0 or later sets at least "0.2.0"
    (docs/upgrade.md)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", float):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ConfigError(f"coordinator.{f.name}", f"expected a finite number, got {value!r}")
                object.__setattr__(self, f.name, float(value))
            elif f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"coordinator.{f.name}", f"expected an integer, got {value!r}")
            elif f.type in ("bool", bool) and not isinstance(value, bool):
                raise ConfigError(f"coordinator.{f.name}", f"expected true or false, got {value!r}")
            elif f.type in ("str", str) and not isinstance(value, str):
                raise ConfigError(f"coordinator.{f.name}", f"expected a string, got {value!r}")
        for name in ("lease_timeout", "heartbeat_interval", "flush_interval", "tick_interval", "comm_budget",
                     "credential_timeout", "ban_window", "history_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"coordinator.{name}", f"must be > 0, got {getattr(self, name)}")
        for name in ("restart_grace", "min_move_interval", "batch_size", "rebalance_threshold"):
            if getattr(self, name) < 0:
                raise ConfigError(f"coordinator.{name}", f"must be >= 0, got {getattr(self, name)}")
        if self.heartbeat_interval >= self.lease_timeout:
            raise ConfigError(
                "coordinator.heartbeat_interval",
                f"{self.heartbeat_interval} must be below lease_timeout={self.lease_timeout}",
            )
        if self.credential_timeout <= 2 * self.heartbeat_interval:
            raise ConfigError(
                "coordinator.credential_timeout",
                f"{self.credential_timeout} must exceed twice heartbeat_interval={self.heartbeat_interval} "
                "(credentials are renewed in heartbeat replies)",
            )
        if self.servers_per_level < 1:
            raise ConfigError("coordinator.servers_per_level", f"must be >= 1, got {self.servers_per_level}")
        if not 0 < self.server_busy_share <= 1:
            raise ConfigError("coordinator.server_busy_share", f"must be in (0, 1], got {self.server_busy_share}")
        if not 0 < self.memory_headroom <= 1:
            raise ConfigError("coordinator.memory_headroom", f"must be in (0, 1], got {self.memory_headroom}")
        if self.sqlite_synchronous.upper() not in ("FULL", "NORMAL", "EXTRA"):
            raise ConfigError("coordinator.sqlite_synchronous", f"'{self.sqlite_synchronous}' is not FULL, NORMAL or EXTRA")
        if not 0 <= self.plan_hysteresis < 1:
            raise ConfigError("coordinator.plan_hysteresis", f"must be in [0, 1), got {self.plan_hysteresis}")
        if not 0 <= self.overlap_budget <= 1:  # past a whole round the exchange would hold the next one up too
            raise ConfigError("coordinator.overlap_budget", f"must be in [0, 1], got {self.overlap_budget}")
        if self.plan_interval <= 0:
            raise ConfigError("coordinator.plan_interval", f"must be > 0, got {self.plan_interval}")
        self.planner_codec_list()
        for name in ("max_moves_per_tick", "max_inner_steps_factor", "max_peers", "ban_reporters", "ban_reports",
                     "plan_lead_rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"coordinator.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.history_points < 16:
            raise ConfigError("coordinator.history_points", f"must be >= 16, got {self.history_points}")
        try:
            versions.release_key(self.min_peer_version)
        except ValueError as e:
            raise ConfigError("coordinator.min_peer_version", f"{e}; write it as \"0.2.0\", or \"\" to admit every release")
        if self.initial_peers < 0:
            raise ConfigError("coordinator.initial_peers", f"must be >= 0, got {self.initial_peers}")

    def planner_codec_list(self) -> list[str]:
        """``planner_codecs`` as names (ConfigError for one that names no codec)."""
        from models.codec_spec import CODECS, is_codec

        names = [c.strip() for c in self.planner_codecs.split(",") if c.strip()]
        for name in names:
            if not is_codec(name):
                raise ConfigError("coordinator.planner_codecs", f"'{name}' is not a codec; use names among "
                                  f"{', '.join(CODECS)} or a sparse topk{{K}}b{{B}}, comma-separated")
        return names

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CoordinatorSettings":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"coordinator.{unknown[0]}", f"unknown field (known: {', '.join(sorted(known))})")
        return cls(**data)

    def replace(self, **changes: Any) -> "CoordinatorSettings":
        return dataclasses.replace(self, **changes)


def load_settings(path: Union[str, Path]) -> CoordinatorSettings:
    """Read the ``[coordinator]`` section of a run config file (defaults when it is absent)."""
    section = read_toml(path).get("coordinator", {})
    if not isinstance(section, dict):
        raise ConfigError("coordinator", "must be a table ([coordinator])")
    return CoordinatorSettings.from_dict(section)


def load_run_and_settings(path: Union[str, Path]) -> tuple[RunConfig, CoordinatorSettings]:
    """The run (every section but ``[coordinator]``) and the coordinator's own settings."""
    run = load_run_config(path, ignore_sections=("coordinator",))
    settings = load_settings(path)
    if run.lattice.num_paths > MAX_PATHS:
        raise ConfigError(
            "lattice.modules_per_level",
            f"{run.lattice.num_paths} paths is more than the coordinator schedules ({MAX_PATHS}); use a smaller lattice",
        )
    return run, settings


BUILT_IN_CORPUS = "default"
"""The ``[data] corpus`` every peer can prepare itself, always to the same bytes."""


def pin_dataset(run: RunConfig, data_dir: Union[str, Path, None]) -> RunConfig:
    """The run with its dataset pinned: ``[data] manifest_hash`` filled from the prepared dataset at
    ``data_dir`` (``coordinator serve --data``) when the config leaves it empty.

    Refused, with one line: a ``data_dir`` whose manifest differs from a pinned hash (exit 4), and an
    empty hash without ``data_dir`` for a corpus other than the built-in one (exit 2): peers could
    neither check nor fetch such data, and the run's checkpoints would name no dataset for ``eval``
    and ``generate``. A run on the built-in corpus may leave it empty: every peer prepares the same
    bytes, and its checkpoints record the hash of what it trained on."""
    from models.manifest import MANIFEST_FILE, manifest_hash

    pinned = run.data.manifest_hash
    if data_dir is None:
        if not pinned and run.data.corpus != BUILT_IN_CORPUS:
            raise ConfigError("data.manifest_hash", f"is empty, and peers cannot prepare the corpus {run.data.corpus!r} "
                              "themselves; pass --data DIR (the prepared dataset, whose manifest hash is used) or set "
                              "it to the hash 'hivepath data prepare' printed")
        return run
    manifest = Path(data_dir) / MANIFEST_FILE
    try:
        import json

        found = manifest_hash(json.loads(manifest.read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:
        raise DataError(f"--data {data_dir}: cannot read {MANIFEST_FILE} ({e}); pass a dataset 'hivepath data "
                        "prepare' wrote") from None
    if pinned and pinned != found:
        err = DataError(f"--data {data_dir} has manifest {found} but the run config pins {pinned}; pass the run's "
                        "dataset or set [data] manifest_hash to its hash")
        err.exit_code = 4
        raise err
    return run.replace(data={"manifest_hash": found})


BEGIN_MARKER = "<!-- coordinator settings table: generated by python -m coordinator.settings; do not edit -->"
END_MARKER = "<!-- end of coordinator settings table -->"


def field_docs() -> dict[str, str]:
    """Each field of :class:`CoordinatorSettings` -> its docstring (the string under it in the class),
    on one line."""
    tree = ast.parse(inspect.getsource(CoordinatorSettings))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def markdown_table() -> str:
    """The ``[coordinator]`` fields as a Markdown table: field, type, default, what it does."""
    docs = field_docs()
    lines = ["| field | type | default | what it does |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(CoordinatorSettings):
        default = f'"{f.default}"' if isinstance(f.default, str) else str(f.default).lower() \
            if isinstance(f.default, bool) else f"{f.default}"
        doc = docs.get(f.name, "").replace("|", "\\|")
        lines.append(f"| `{f.name}` | {f.type} | `{default}` | {doc} |")
    return "\n".join(lines) + "\n"


def update_markdown(text: str) -> str:
    """``text`` with the part between :data:`BEGIN_MARKER` and :data:`END_MARKER` replaced by the table."""
    return fill_between(text, BEGIN_MARKER, END_MARKER, markdown_table())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m coordinator.settings --markdown`` prints the table; ``--update FILE`` rewrites it in FILE."""
    return table_main(list(argv) if argv is not None else None, "coordinator.settings", "the [coordinator] fields",
                      markdown_table, update_markdown)


if __name__ == "__main__":
    sys.exit(main())
