"""The volunteer node, one package per subsystem. Each package's ``__init__`` is its API.

Its packages are :data:`LAYERS`, lowest first, each with what it holds: a package imports only
packages of earlier layers (``tests/project/test_layering.py`` reads :data:`LAYERS` and checks every
import), and all of them may import ``models`` and ``protos``, never ``coordinator``. README.md's
layout table shows the same rows (:func:`layout_rows`; ``python tests/golden/regen_readme_layout.py``
writes them, and a test fails when they drift).

Where a decision lives:

- the codec of a module: the run config names it (names, block layout and sizes: ``models.codec_spec``,
  which the coordinator's byte estimate reads too), the coordinator's assignment carries it
  (``WorkAssignment.outer_config``), ``peer.compression.resolve_codec`` turns it into a ``Codec`` (entropy
  stage included) for ``DiLoCoOptimizer``, which resolves it once and passes it down to the averager, and
  for the simulator alike; ``peer.compression`` implements it (``quantizers``, ``entropy``, ``sparse``);
- a dataset file's chunks and their hashes: ``models.manifest`` (format 2); the wire message that
  carries them: ``protos/hivepath/peer/v1/data.proto``; who seeds them: ``peer.datasync.records``;
- the snapshot layout on disk: ``models.checkpoint`` (``peer.node.checkpoint`` maps module states
  onto it);
- the wire messages between peers: ``protos/hivepath/peer/v1/`` (``net.proto``, ``stage.proto``, ``data.proto``);
- a setting (its variable, default, range, help, flag): ``peer.settings`` (the peer's processes),
  ``hivepath.settings`` (the command line's and the images');
- the start-up and teardown of a long-running process (identity, coordinator, DHT, status page,
  signals): ``peer.node.startup``;
- that no process outlives the one that started it: ``peer.node.lifetime``;
- who forms a module's averaging group at a round (whom to wait for, which fork is kept, who leads,
  when to step alone or re-sync): ``peer.averaging.group_decision``, pure functions of what the holders
  declared, which ``peer.averaging.matchmaking.Matchmaker`` calls around its DHT and P2P I/O.

Importing ``peer`` alone pulls in neither torch nor hivemind.
"""

__all__ = [
    "settings", "compression", "outer", "network", "coordinator_client", "averaging", "datasync", "diloco", "stage",
    "node", "localnet", "demo", "simulator", "LAYERS", "layout_rows",
]

LAYERS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("settings", "every setting of the peer's processes, each declared once (`Setting`)"),),
    (("compression", "codecs (`Codec`): quantisers, the entropy stage, sparse top-k, error feedback, activation "
                     "codecs; `resolve_codec`, the one rule that turns a run's outer config into its codec"),),
    (("outer", "DiLoCo's outer step and a module's replicated state: `OuterOptimizer`, `ModuleState`, "
               "`state_digest`"),),
    (("network", "identity file, DHT start-up, DHT record schemas, admission credentials"),
     ("coordinator_client", "the coordinator's gRPC client, its replies and errors (no torch)")),
    (("averaging", "averaging one module among its holders: the reduction rule, matchmaking, partition, "
                   "all-reduce, state transfer, `NetAverager`"),
     ("datasync", "a dataset's files between peers: `Seeder` (serve and announce what it holds), `fetch` (a "
                  "path's shards from seeders, every chunk verified, resumable); neither it nor `averaging` "
                  "imports the other")),
    (("diloco", "`DiLoCoOptimizer` (H inner steps, then an outer round per module), round reports, exchange "
                "plans, re-sync after a missed round"),),
    (("stage", "stage mode (SWARM): stage records, wire format, `StageServer`, `StageClient`"),),
    (("node", "the long-running processes: `hivepath peer join` (`PeerNode`), the path trainer, the stage "
              "runner, the archive, checkpoints, resources, progress, the local status page, spot notices"),),
    (("localnet", "a local network of real `hivepath` processes (coordinator, archives, peers; on loopback or "
                  "in network namespaces with shaped links and NAT), its fault injector and the checks of what "
                  "its processes wrote: the one harness of the demo, the benchmarks and the tests"),),
    (("demo", "`hivepath demo`: a whole network on one machine, and its report"),
     ("simulator", "`hivepath train-local`: K DiLoCo workers in one process")),
)
"""The packages of ``peer``, lowest first, as (name, what it holds) per layer: a package imports only
packages of earlier layers; the packages of one layer do not import each other."""


def layout_rows() -> list[str]:
    """README.md's layout table rows of ``peer``'s packages, lowest layer first."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    return [f"| `peer/{name}{'.py' if (here / f'{name}.py').is_file() else '/'}` | {what} |"
            for layer in LAYERS for name, what in layer]
