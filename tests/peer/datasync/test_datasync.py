"""Seeding and fetching a dataset over real hivemind DHTs and p2p daemons on loopback:
a fetcher with an empty directory gets one path's shards from two seeders, byte for byte, and nothing
of the other paths; ``Dataset`` trains from them. A seeder whose file rots after it started (bad
bytes in one chunk) is dropped and reported, and the chunk comes from an honest seeder, with no
verified chunk asked twice; a fetch interrupted halfway resumes without asking again for a verified
chunk; no seeder, another dataset in the output, and a format-1 dataset are one-line errors.

Chunks are 512 bytes here so that shards of a few kilobytes have many."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from helpers import write_corpus
from peer.localnet import wait_for
from models.corpus import corpus_from_paths
from models.data import Dataset, prepare
from models.errors import DataError
from peer.datasync import (FetchOptions, NoSeeder, STATE_DIR, SeedError, Seeder, SeederOptions, fetch,
                           fetch_manifest, find_seeders)
from peer.network import DHTOptions, start_dht

pytestmark = pytest.mark.integration

CHUNK = 512
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
FAST = FetchOptions(no_seeder_timeout=20.0, request_timeout=10.0, parallel=8, per_seeder=2, refresh_interval=0.2,
                    retry_after=0.1)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"), per_domain=30, seed=7)
    out = tmp_path_factory.mktemp("source") / "ds"
    prepare(corpus_from_paths([str(corpus)]), out, levels=1, modules=3, chunk_size=CHUNK)
    return out


@pytest.fixture
def swarm():
    """A bootstrap DHT node; ``node()`` starts another joined to it. All are shut down at the end."""
    nodes = [start_dht(DHTOptions(host_maddrs=LOOPBACK))]

    def node():
        nodes.append(start_dht(DHTOptions(host_maddrs=LOOPBACK, initial_peers=nodes[0].maddrs())))
        return nodes[-1]

    yield node
    for n in reversed(nodes):
        n.shutdown()


@pytest.fixture
def seeders():
    started: list[Seeder] = []

    def seed(dht, directory, **options) -> Seeder:
        started.append(Seeder(dht, directory, SeederOptions(**options)).start())
        return started[-1]

    yield seed
    for s in started:
        s.close()


def _hash(directory: Path) -> str:
    return Dataset(directory).manifest_hash


def _wait_for_seeders(dht, manifest_hash: str, n: int) -> None:
    import asyncio

    wait_for(lambda: len(asyncio.run(find_seeders(dht, manifest_hash))) >= n, 30, f"{n} seeder records on the DHT")


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _chunks(directory: Path, names) -> int:
    return sum(-(-(directory / n).stat().st_size // CHUNK) for n in names)


def test_one_path_from_two_seeders_byte_for_byte(source, swarm, seeders, tmp_path):
    h = _hash(source)
    a, b = seeders(swarm(), source), seeders(swarm(), source)
    fetcher = swarm()
    _wait_for_seeders(fetcher, h, 2)
    out = tmp_path / "fetched"
    result = fetch(fetcher, h, [(1,)], out, FAST)

    got, want = _files(out), _files(source)
    assert set(got) == {"manifest.json", "router.json", "shards/1.train.tokens", "shards/1.train.docs",
                        "shards/1.validation.tokens", "shards/1.validation.docs"}
    assert all(got[name] == want[name] for name in got)
    assert not (out / STATE_DIR).exists()
    assert set(result.by_seeder) == {a.peer_id, b.peer_id}  # chunks came from both at once
    assert result.fetched == _chunks(source, [n for n in got if n != "manifest.json"]) and result.reused == 0
    ds = Dataset(out)
    assert ds.manifest_hash == h and ds.local_paths == [(1,)]
    ds.check(h, paths=[(1,)])
    x, y = next(ds.path_batches((1,), "train", batch_size=2, seq_len=16, seed=0))
    assert x.shape == (2, 16)


def test_a_seeder_sending_bad_bytes_is_dropped_and_reported(source, swarm, seeders, tmp_path):
    h = _hash(source)
    bad_dir = tmp_path / "rotting"
    shutil.copytree(source, bad_dir)
    bad = seeders(swarm(), bad_dir)  # verified its files at start...
    shard = bad_dir / "shards" / "0.train.tokens"
    data = bytearray(shard.read_bytes())
    assert len(data) > 4 * CHUNK
    data[3 * CHUNK + 5] ^= 0xFF  # ...then chunk 3 of the training shard rots on its disk
    shard.write_bytes(bytes(data))

    fetcher = swarm()
    _wait_for_seeders(fetcher, h, 1)
    reports, outcome = [], {}
    out = tmp_path / "fetched"

    def run():
        try:
            outcome["result"] = fetch(fetcher, h, [(0,)], out, FAST, on_bad_seeder=lambda p, what: reports.append((p, what)))
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_for(lambda: reports, 30, "the bad seeder to be reported")
        assert reports == [(bad.peer_id, "sent bad bytes for chunk 3 of shards/0.train.tokens")]
        honest = seeders(swarm(), source)  # the only seeder is banned: the fetch waits for another
    finally:
        thread.join(60)
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert result.bad_seeders == {bad.peer_id}
    assert all(_files(out)[n] == _files(source)[n] for n in _files(out))
    assert honest.served[("shards/0.train.tokens", 3)] == 1
    # nothing verified from the bad seeder was asked again: the honest one sent the rest, each chunk once
    assert set(bad.served) & set(honest.served) == {("shards/0.train.tokens", 3)}
    assert max(honest.served.values()) == 1
    assert result.fetched == sum(bad.served.values()) - 2 + sum(honest.served.values())  # less the manifest, the bad chunk


def test_an_interrupted_fetch_resumes_without_asking_again(source, swarm, seeders, tmp_path):
    h = _hash(source)
    seeder = seeders(swarm(), source)
    fetcher = swarm()
    _wait_for_seeders(fetcher, h, 1)
    out = tmp_path / "fetched"

    def interrupt_halfway(progress):
        if progress.done_bytes * 2 >= progress.total_bytes:
            raise KeyboardInterrupt  # what Ctrl-C raises

    with pytest.raises(KeyboardInterrupt):
        fetch(fetcher, h, [(2,)], out, FAST, on_progress=interrupt_halfway)
    first = sum(seeder.served.values())
    kept = sum(n for (f, _), n in seeder.served.items() if f != "manifest.json")
    assert not (out / "manifest.json").exists()  # not a dataset yet
    with pytest.raises(DataError):
        Dataset(out)
    for name, data in _files(out).items():  # whatever is at its final name is whole and verified
        assert name.startswith(STATE_DIR + "/") or data == (source / name).read_bytes()

    result = fetch(fetcher, h, [(2,)], out, FAST)
    total = _chunks(source, [n for n in _files(out) if n != "manifest.json"])
    assert 0 < kept < total
    assert result.reused >= kept - FAST.parallel  # requests in flight at the interrupt may be lost, never more
    assert result.requested == result.fetched == total - result.reused  # the manifest was kept, too
    assert max(seeder.served.values()) == 1 or all(
        n <= 2 for n in seeder.served.values())  # a chunk in flight at the interrupt may be sent twice
    # requests in flight at the interrupt may be answered (and counted) after ``first`` was read
    assert 0 <= sum(seeder.served.values()) - first - result.fetched <= FAST.parallel
    assert _files(out) == {n: d for n, d in _files(source).items() if n in _files(out)}


def test_errors_are_one_line(source, swarm, seeders, tmp_path):
    h = _hash(source)
    partial = tmp_path / "partial"
    shutil.copytree(source, partial)
    for f in (partial / "shards").glob("2.*"):
        f.unlink()
    seeders(swarm(), partial)
    fetcher = swarm()
    _wait_for_seeders(fetcher, h, 1)
    quick = FetchOptions(no_seeder_timeout=1.0, refresh_interval=0.2)

    with pytest.raises(NoSeeder, match=r"^no seeder sent shards/2\.train\.tokens within 1s \(0 seeders tried: none "
                                       r"of the 1 seeder\(s\) found announces it\)") as e:
        fetch(fetcher, h, [(2,)], tmp_path / "out", quick)
    assert "\n" not in str(e.value) and e.value.exit_code == 3
    assert not (tmp_path / "out" / "manifest.json").exists()

    with pytest.raises(NoSeeder, match=r"no seeder sent the manifest of dataset 0123456789abcdef within 1s "
                                       r"\(0 seeder\(s\) tried\)"):
        fetch(fetcher, "0123456789abcdef", [(0,)], tmp_path / "other", quick)

    with pytest.raises(DataError, match=f"holds dataset {h}, not 0123456789abcdef; pass another --out"):
        fetch(fetcher, "0123456789abcdef", [(0,)], source, quick)

    with pytest.raises(DataError, match="path 5 is not in this dataset"):
        fetch(fetcher, h, [(5,)], tmp_path / "five", quick)

    import asyncio

    async def manifest_only():
        p2p = await fetcher.dht.replicate_p2p()
        try:
            return await fetch_manifest(fetcher.dht, p2p, h, quick)
        finally:
            await p2p.shutdown()

    blob, manifest = asyncio.run(manifest_only())
    assert blob == (source / "manifest.json").read_bytes() and manifest["chunk_size"] == CHUNK


def test_a_format_1_dataset_is_not_seeded(source, swarm, tmp_path):
    import json

    from models import strict_json

    old = tmp_path / "old"
    shutil.copytree(source, old)
    m = json.loads((old / "manifest.json").read_text())
    m["format"] = 1
    del m["chunk_size"], m["chunks"]
    (old / "manifest.json").write_text(strict_json.dumps(m))
    with pytest.raises(SeedError, match=r"format 1, without per-chunk hashes.*re-run 'hivepath data prepare'") as e:
        Seeder(swarm(), old)
    assert "\n" not in str(e.value) and e.value.exit_code == 2


def test_train_first_then_validation_each_file_announced_and_excluded_seeders_never_asked(source, swarm, seeders,
                                                                                           tmp_path):
    """What ``peer join`` does: the training shard first (training starts), the validation shard next;
    its own seeder announces each file as it lands; a seeder dropped earlier is not asked again."""
    h = _hash(source)
    a, b = seeders(swarm(), source), seeders(swarm(), source)
    fetcher = swarm()
    _wait_for_seeders(fetcher, h, 2)
    out = tmp_path / "fetched"
    landed: list[str] = []
    first = fetch(fetcher, h, [(2,)], out, FAST, splits=("train",), on_file=landed.append, exclude={b.peer_id})
    assert set(first.by_seeder) == {a.peer_id}
    assert sorted(landed) == ["router.json", "shards/2.train.docs", "shards/2.train.tokens"]
    assert Dataset(out).local_paths == []  # validation not there yet
    own = Seeder(fetcher, out, SeederOptions(verify=False)).start()
    try:
        assert own.held_paths() == []
        fetch(fetcher, h, [(2,)], out, FAST, splits=("validation",), on_file=lambda name: own.add(name))
        assert own.held_paths() == ["2"] and "shards/2.validation.tokens" in own.held
        own.drop("shards/2.validation.tokens")
        assert own.held_paths() == []
    finally:
        own.close()
    assert all((out / n).read_bytes() == (source / n).read_bytes() for n in landed)
    assert Dataset(out).local_paths == [(2,)]


def test_the_shard_cache_evicts_least_recently_trained_paths_never_the_current_one(source, tmp_path):
    from peer.datasync import ShardCache

    out = tmp_path / "copy"
    shutil.copytree(source, out)
    manifest = Dataset(out).manifest
    clock = iter(range(100, 200)).__next__
    cache = ShardCache(out, manifest, None, clock=lambda: float(clock()))
    sizes = {p: cache.size(p) for p in [(0,), (1,), (2,)]}
    for p in [(1,), (0,), (2,)]:  # 1 is the least recently trained, then 0
        cache.touch(p)
    assert cache.make_room((2,)) == []  # no budget: keep everything
    cache.max_bytes = sizes[(2,)] + sizes[(0,)]
    removed = cache.make_room((2,))
    assert removed == cache.files((1,)) and not cache.holds((1,)) and cache.holds((0,)) and cache.holds((2,))
    cache.max_bytes = 1  # smaller than the path being trained: it stays
    assert cache.make_room((2,)) == cache.files((0,)) and cache.holds((2,))
    assert (out / "router.json").is_file() and (out / "manifest.json").is_file()


class _StoresNeverAnswer:
    """A real DHT node whose stores never complete (its DHT process stuck on a dead connection)."""

    def __init__(self, dht):
        self._dht = dht

    def store(self, *args, return_future=False, **kwargs):
        from concurrent.futures import Future

        future = Future()  # never resolved
        return future if return_future else future.result()  # hivemind's store waits on it unless told not to

    def __getattr__(self, name):
        return getattr(self._dht, name)


def test_a_store_that_never_answers_does_not_hang_the_seeder(source, swarm):
    """A DHT store with no answer is given up after ``store_timeout`` and retried by the refresh loop:
    ``start`` returns and serving goes on, where a blocking store would hang the peer's start for as long
    as the store goes unanswered."""
    stuck = _StoresNeverAnswer(swarm().dht)  # hivemind's DHT, as a peer's seeder gets it
    seeder = Seeder(stuck, source, SeederOptions(store_timeout=0.5)).start()
    try:
        assert not seeder.announce()
        assert seeder.held  # it serves its files all the same
    finally:
        seeder.close()


def test_peers_sharing_a_data_directory_record_their_paths_at_once(tmp_path):
    """Peers on one machine share the data directory, and each records the path it trains in the same
    ``.used.json``: writers at once must not take each other's temporary file (a ``bench.swarm`` path
    peer died of it: FileNotFoundError renaming ``.used.json.tmp``)."""
    import json

    from peer.datasync.cache import USED_FILE, ShardCache

    caches = [ShardCache(tmp_path, {}) for _ in range(2)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(caches))

    def write(cache: ShardCache, path: tuple[int, ...]) -> None:
        start.wait()
        try:
            for _ in range(200):
                cache.touch(path)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(c, (i,))) for i, c in enumerate(caches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert set(json.loads((tmp_path / USED_FILE).read_text())) <= {"0", "1"}
    assert not list(tmp_path.glob("*.tmp"))
