"""``hivepath data``: prepare token shards routed to lattice paths, describe a prepared dataset, and
carry datasets between peers: ``serve`` seeds a prepared dataset, ``fetch`` gets some paths' shards
from seeders (every chunk verified, resumable), ``info --manifest-hash`` shows who seeds what.
The network commands call ``peer.datasync``; this module only parses flags and prints."""

from __future__ import annotations

import argparse
import re
import signal
import sys
import threading

from hivepath.numbers import count, seconds, seed
from hivepath.options import add_token_flags, read_token
from hivepath.paths import certificate, dataset, key_file, source, write_dir
from hivepath.progress import fetch_with_progress, prepare_with_progress
from hivepath.settings import add_flag
from models import strict_json
from models.errors import DataError

__all__ = ["register", "run", "parse_lattice", "path_arg", "manifest_hash_arg"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop ``data serve`` cleanly (a terminal's Ctrl-C, ``docker stop``, a closed SSH session)."""


def path_arg(text: str) -> tuple[int, ...]:
    """``"0-1"`` (or ``"0,1"``) -> ``(0, 1)``: a lattice path as ``--path`` takes it."""
    if not re.fullmatch(r"\d{1,4}([-,]\d{1,4})*", text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a lattice path; write one module index per level, e.g. 0-1")
    return tuple(int(i) for i in re.split(r"[-,]", text.strip()))


def manifest_hash_arg(text: str) -> str:
    """A manifest hash as ``hivepath data info DIR`` prints it (16 hex digits; up to 64 accepted)."""
    if not re.fullmatch(r"[0-9a-f]{16,64}", text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a manifest hash; pass the 16 hex digits 'hivepath data "
                                         "info DIR' prints")
    return text.strip()


def parse_lattice(text: str) -> tuple[int, int]:
    """``"2x2"`` -> ``(levels, modules_per_level)``."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise DataError(f"--lattice '{text}' is not LEVELSxMODULES (e.g. 2x2)")
    return int(m.group(1)), int(m.group(2))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="prepare token shards routed to lattice paths; describe a prepared dataset",
        description="Prepare and inspect datasets. See docs/data.md.",
    )
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = dsub.add_parser(
        "prepare",
        help="tokenise documents, route them to paths with prefix k-means, write shards and a manifest",
        description=(
            "Read documents from SRC files and directories (.txt .md .py .rst whole; .jsonl one document "
            "per line with a 'text' field), or the built-in corpus with --corpus default; split train/"
            "validation by a hash of each document; tokenise; cluster each document's first 32 tokens per "
            "lattice level (DiPaCo routing); write one memory-mapped shard per path and split, the router and "
            "a manifest. Identical input gives byte-identical output."
        ),
    )
    prep.add_argument("sources", nargs="*", type=source(), metavar="SRC", help="files or directories of documents")
    prep.add_argument("--corpus", choices=["default"], help="use the built-in corpus (Shakespeare, KJV Bible, Python stdlib)")
    prep.add_argument("--out", type=write_dir(atomic=True), required=True, metavar="DIR",
                      help="output directory (written atomically)")
    shape = prep.add_mutually_exclusive_group()
    shape.add_argument("--paths", type=count(), metavar="N", help="one level of N modules: N paths")
    shape.add_argument("--lattice", metavar="LxM", help="LEVELS x MODULES per level, e.g. 2x2 (default 2x2)")
    prep.add_argument("--tokenizer", default="bytes", metavar="SPEC", help="bytes (default) or bpe:VOCAB, BPE trained on the training split")
    prep.add_argument("--seed", type=seed(), default=0, metavar="N", help="k-means seed (default 0)")
    prep.set_defaults(func=run)

    info = dsub.add_parser("info", help="summarise a prepared dataset, or show who seeds one",
                           description="Print a dataset's manifest summary; with --manifest-hash (and --initial-peers "
                           "or --coordinator), the seeders of that dataset on the network and the files each holds.")
    info.add_argument("dir", nargs="?", type=dataset(), metavar="DIR", help="a directory written by 'hivepath data prepare'")
    info.add_argument("--json", action="store_true", help="print the whole manifest (or the seeders) as JSON")
    info.add_argument("--verify", action="store_true", help="also check every file's sha256 against the manifest")
    info.add_argument("--manifest-hash", type=manifest_hash_arg, metavar="H",
                      help="show the seeders of dataset H on the network instead")
    _add_swarm_flags(info)
    info.set_defaults(func=run)

    serve = dsub.add_parser(
        "serve", help="seed a prepared dataset to peers that fetch it (no training)",
        description="Serve the files of a prepared dataset (manifest format 2) to fetchers over the p2p network and "
        "announce them on the DHT, until SIGINT, SIGTERM or SIGHUP. Prints the multiaddrs fetchers pass as "
        "--initial-peers. Without --initial-peers or --coordinator it starts a swarm of its own.")
    serve.add_argument("dir", type=dataset(), metavar="DIR", help="a directory written by 'hivepath data prepare'")
    _add_swarm_flags(serve)
    serve.add_argument("--no-verify", action="store_true",
                       help="serve files without hashing them first (fetchers still check every chunk)")
    serve.set_defaults(func=run)

    fetch = dsub.add_parser(
        "fetch", help="fetch some paths' shards of a dataset from its seeders, verified",
        description="Fetch the manifest (checked against --manifest-hash), the router and tokenizer, and the train and "
        "validation shards of each --path from the seeders on the network, several at once; every chunk is checked "
        "against the manifest before it is written. Interrupted, the same command resumes where it stopped. The "
        "result is a dataset directory to pass as --data.")
    fetch.add_argument("--manifest-hash", type=manifest_hash_arg, metavar="H",
                       help="the dataset to fetch (default: the run's, from --coordinator)")
    fetch.add_argument("--path", nargs="+", type=path_arg, required=True, metavar="I-J",
                       help="lattice path(s) whose shards to fetch, e.g. 0-1 (one module index per level)")
    fetch.add_argument("--out", type=write_dir(), required=True, metavar="DIR",
                       help="directory to fetch into (created; an earlier fetch's directory resumes)")
    fetch.add_argument("--timeout", type=seconds(), default=60.0, metavar="S",
                       help="fail when no seeder sends a shard for S seconds (default 60)")
    fetch.add_argument("--parallel", type=count(), default=16, metavar="N",
                       help="chunk requests in flight at once, over all seeders (default 16)")
    fetch.add_argument("--progress", choices=["bar", "json"], default="bar",
                       help="a progress bar (default) or JSON lines on stdout")
    _add_swarm_flags(fetch)
    fetch.set_defaults(func=run)


def _add_swarm_flags(p: argparse.ArgumentParser) -> None:
    """How a data command reaches the swarm: bootstrap peers and/or the coordinator, and where it listens."""
    add_flag(p, "HIVEPATH_INITIAL_PEERS", help="DHT bootstrap multiaddrs, e.g. those 'hivepath data serve' prints")
    add_flag(p, "HIVEPATH_COORDINATOR", metavar="HOST:PORT", help="also bootstrap from the run's coordinator, which "
             "names the run's dataset (needs the run token)")
    add_token_flags(p)
    add_flag(p, "HIVEPATH_TLS_CA", type=certificate())
    p.add_argument("--host-maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/0"], metavar="MADDR",
                   help="multiaddrs to listen on (default /ip4/0.0.0.0/tcp/0)")
    p.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR",
                   help="multiaddrs other peers should dial (behind port forwarding)")
    p.add_argument("--identity", type=key_file(lock=True, parent_exists=False), metavar="FILE",
                   help="identity key file for a stable peer id (default: a fresh one)")


def run(args: argparse.Namespace) -> int:
    if args.data_command == "prepare":
        return _prepare(args)
    if args.data_command == "serve":
        return _serve(args)
    if args.data_command == "fetch":
        return _fetch(args)
    if args.manifest_hash:
        return _seeders_info(args)
    if not args.dir:
        raise DataError("pass a dataset directory, or --manifest-hash H to see who seeds dataset H")
    return _info(args)


def _access(args: argparse.Namespace):
    from pathlib import Path

    from peer.datasync import SwarmAccess

    return SwarmAccess(
        initial_peers=tuple(args.initial_peers or ()), coordinator=args.coordinator or "",
        token=read_token(args.token, args.token_file) if args.coordinator else "", tls_ca=args.tls_ca,
        host_maddrs=tuple(args.host_maddrs), announce_maddrs=tuple(args.announce_maddrs),
        identity=Path(args.identity).expanduser() if args.identity else None)


def _serve(args: argparse.Namespace) -> int:
    from peer.datasync import Seeder, SeederOptions, join_swarm, read_local_manifest
    from models.manifest import layouts

    _, manifest = read_local_manifest(args.dir)
    try:
        layouts(manifest)  # a format-1 dataset is refused before any network starts
    except DataError as e:
        raise DataError(f"cannot seed {args.dir}: {e}") from None
    stop = threading.Event()
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: stop.set())
    dht, _ = join_swarm(_access(args), need_peers=False)
    try:
        seeder = Seeder(dht, args.dir, SeederOptions(verify=not args.no_verify)).start()
        try:
            print(f"seeding dataset {seeder.manifest_hash}: {len(seeder.held)} of {len(seeder.names)} files of "
                  f"{args.dir}; fetch with --manifest-hash {seeder.manifest_hash} --initial-peers and one of:")
            for maddr in dht.maddrs():
                print(maddr)
            sys.stdout.flush()
            stop.wait()
        finally:
            seeder.close()
    finally:
        dht.shutdown()
    print(f"stopped seeding {seeder.manifest_hash} ({sum(seeder.served.values())} chunks sent)")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from peer.datasync import FetchOptions, join_swarm

    dht, run_hash = join_swarm(_access(args), need_peers=True)
    try:
        manifest_hash = args.manifest_hash or run_hash
        if not manifest_hash:
            raise DataError("no dataset named: pass --manifest-hash H, or --coordinator of a run that pins one")
        options = FetchOptions(no_seeder_timeout=args.timeout, parallel=args.parallel)
        result = fetch_with_progress(dht, manifest_hash, args.path, args.out, options, args.progress)
    finally:
        dht.shutdown()
    names = ", ".join("-".join(map(str, p)) for p in args.path)
    print(f"fetched path(s) {names} of dataset {manifest_hash} into {args.out}: {len(result.files)} files, "
          f"{result.fetched} chunks from {len(result.by_seeder)} seeder(s), {result.reused} kept from before; "
          f"train with --data {args.out}")
    return 0


def _seeders_info(args: argparse.Namespace) -> int:
    import asyncio

    from peer.datasync import FetchOptions, fetch_manifest, find_seeders, join_swarm
    from peer.network.dht import own_p2p

    dht, _ = join_swarm(_access(args), need_peers=True)
    try:
        async def look():
            p2p = await own_p2p(dht)
            try:
                found = await find_seeders(dht, args.manifest_hash)
                manifest = None
                if found:
                    _, manifest = await fetch_manifest(dht.dht, p2p, args.manifest_hash, FetchOptions(no_seeder_timeout=10.0))
                return found, manifest
            finally:
                await p2p.shutdown()

        found, manifest = asyncio.run(look())
    finally:
        dht.shutdown()
    names = sorted(manifest["files"]) if manifest else []
    held = {peer: sorted(record.holds(names)) for peer, record in sorted(found.items())}
    if args.json:
        strict_json.dump({"manifest_hash": args.manifest_hash, "seeders": held}, sys.stdout, indent=1, sort_keys=True)
        print()
        return 0
    print(f"dataset {args.manifest_hash}: {len(held)} seeder(s)")
    for peer, files in held.items():
        paths = sorted({f.split("/")[1].split(".")[0] for f in files if f.startswith("shards/")})
        print(f"{peer}  {len(files)} of {len(names)} files  paths {', '.join(paths) or 'none'}")
    for name in names:
        n = sum(name in files for files in held.values())
        if n == 0:
            print(f"no seeder holds {name}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from models.data import Dataset

    if args.paths is not None:
        if args.paths < 1:
            raise DataError(f"--paths must be >= 1, got {args.paths}")
        levels, modules = 1, args.paths
    else:
        levels, modules = parse_lattice(args.lattice or "2x2")
    if not args.sources and not args.corpus:
        raise DataError("no sources given; pass files or directories, or --corpus default")
    prepare_with_progress(args.sources, args.corpus, args.out, levels, modules, args.tokenizer, args.seed)
    ds = Dataset(args.out)
    t = ds.manifest["totals"]
    print(f"prepared {args.out}: {t['train']['documents']} training and {t['validation']['documents']} validation "
          f"documents, {t['train']['tokens']} training tokens, {levels}x{modules} lattice, manifest {ds.manifest_hash}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from models.data import Dataset

    ds = Dataset(args.dir)
    if args.verify:
        ds.verify()
    m = ds.manifest
    if args.json:
        strict_json.dump({"manifest_hash": ds.manifest_hash, **m}, sys.stdout, indent=1, sort_keys=True)
        print()
        return 0
    print(f"dataset {args.dir}  manifest {ds.manifest_hash}")
    print(f"corpus {m['corpus']}  tokenizer {m['tokenizer']}  lattice {ds.levels}x{ds.modules_per_level}")
    if m["documents_skipped"]:
        print("skipped: " + ", ".join(f"{n} {why}" for why, n in m["documents_skipped"].items()))
    print(f"{'path':>8} {'train docs':>10} {'train tokens':>13} {'val docs':>9} {'val tokens':>11}  sources (train tokens)")
    for name, s in sorted(m["shards"].items()):
        src = ", ".join(f"{k} {v}" for k, v in s["train"]["sources"].items())
        print(f"{name.replace('-', ','):>8} {s['train']['documents']:>10} {s['train']['tokens']:>13} "
              f"{s['validation']['documents']:>9} {s['validation']['tokens']:>11}  {src}")
    if args.verify:
        print("all files match the manifest")
    return 0
