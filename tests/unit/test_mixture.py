"""MixtureStream: shares within the bound over every prefix, the order independent of the world
size, exact resume (also at another world size), reshuffle, quarantine, refusals."""

import json
import random

import pytest

from pretrain.data import BatchLoader, MixtureStream, WindowStream
from pretrain.errors import UserError
from tests.conftest import write_synthetic_dataset

SEQ = 8
# Source a: 27 windows; source b: 7 windows (a small source, upsampled); source c: 12 windows.
SIZES = {"a": (41, 100, 17, 66), "b": (60,), "c": (97,)}
FIRST = {"a": 0, "b": 100_000, "c": 200_000}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = {}
    for name, sizes in SIZES.items():
        out[name] = tmp_path_factory.mktemp(f"source_{name}")
        write_synthetic_dataset(out[name], sizes, val_shard_tokens=(50,), first_token=FIRST[name])
    return out


def mixture(dirs, weights=(("a", 0.5), ("b", 0.3), ("c", 0.2)), **kwargs):
    return MixtureStream([(name, dirs[name], w) for name, w in weights], SEQ, **kwargs)


def served(stream, k) -> list[int]:
    """Global ids of the next k windows, checking each window's tokens come from its source."""
    out = []
    for _ in range(k):
        tokens = next(stream)
        source, _ = stream.locate(stream.last_window)
        assert FIRST[stream.names[source]] <= int(tokens[0]) < FIRST[stream.names[source]] + 100_000
        out.append(stream.last_window)
    return out


def test_shares_stay_within_one_window_of_the_weights_over_every_prefix(dirs):
    rng = random.Random(0)
    for trial in range(20):
        weights = [(name, rng.uniform(0.01, 1.0)) for name in ("a", "b", "c")]
        total = sum(w for _, w in weights)
        stream = mixture(dirs, weights, seed=trial)
        counts = {name: 0 for name in SIZES}
        for n in range(1, 400):
            next(stream)
            counts[stream.names[stream.locate(stream.last_window)[0]]] += 1
            for name, w in weights:
                assert abs(counts[name] - n * w / total) < 1.0, (trial, n, name)
        assert stream.source_counts() == counts


def test_each_source_has_its_own_epochs(dirs):
    stream = mixture(dirs, (("a", 0.5), ("b", 0.5)), seed=1)
    ids = served(stream, 54)  # a's first epoch (27 windows); b's 27 windows: almost 4 epochs of 7
    a = [i for i in ids if stream.locate(i)[0] == 0]
    b = [i for i in ids if stream.locate(i)[0] == 1]
    assert sorted(a) == list(range(27))
    for epoch in range(3):  # every epoch of b serves each of its 7 windows once
        assert sorted(b[7 * epoch : 7 * epoch + 7]) == list(range(27, 34))
    assert stream.state_dict()["sources"]["b"]["stream"]["epoch"] == 3


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_are_disjoint_and_together_serve_the_single_order(dirs, world_size):
    single = served(mixture(dirs, seed=5), 30 * world_size)
    ranks = [mixture(dirs, seed=5, rank=r, world_size=world_size) for r in range(world_size)]
    per_rank = [served(s, 30) for s in ranks]
    assert [per_rank[g % world_size][g // world_size] for g in range(30 * world_size)] == single
    states = [s.state_dict() for s in ranks]
    assert all(state == states[0] for state in states)  # the same on every rank


@pytest.mark.parametrize(("before", "after"), [(1, 1), (2, 3), (3, 1), (1, 2)])
def test_exact_resume_also_at_another_world_size(dirs, before, after):
    single = served(mixture(dirs, seed=4), 11 * before + 13 * after)
    ranks = [mixture(dirs, seed=4, rank=r, world_size=before) for r in range(before)]
    for s in ranks:
        served(s, 11)
    state = json.loads(json.dumps(ranks[0].state_dict()))  # JSON all the way
    assert len(json.dumps(state)) < 2000  # small, whatever the corpus size
    resumed = [mixture(dirs, seed=999, rank=r, world_size=after) for r in range(after)]
    for s in resumed:
        s.load_state_dict(state)
    per_rank = [served(s, 13) for s in resumed]
    assert [per_rank[g % after][g // after] for g in range(13 * after)] == single[11 * before :]


def test_a_mixture_of_one_is_the_window_stream(dirs):
    """data.dir runs: the same windows as before mixtures, and their checkpoints' state resumes."""
    plain = [WindowStream(dirs["a"], SEQ, rank=r, world_size=2, seed=3) for r in range(2)]
    mixed = [MixtureStream([("data", dirs["a"], 1.0)], SEQ, rank=r, world_size=2, seed=3) for r in range(2)]
    for p, m in zip(plain, mixed, strict=True):
        for _ in range(40):
            next(p)
            next(m)
            assert p.last_window == m.last_window
    resumed = MixtureStream([("data", dirs["a"], 1.0)], SEQ, rank=1, world_size=2)
    resumed.load_state_dict(plain[1].state_dict())
    for _ in range(20):
        assert int(next(resumed)[0]) == int(next(plain[1])[0])


def test_reshuffle_loses_and_repeats_nothing_in_any_source(dirs):
    weights = (("a", 0.5), ("c", 0.5))  # 27 and 12 windows
    stream = mixture(dirs, weights, seed=7)
    before = served(stream, 10)
    stream.reshuffle(123)
    after = served(stream, 40)
    plain = mixture(dirs, weights, seed=7)
    served(plain, 10)
    assert after != served(plain, 40)  # a new order
    c = [i for i in before + after if stream.locate(i)[0] == 1][:12]  # c's first epoch, across the reshuffle
    assert sorted(c) == list(range(27, 39))
    a = [i for i in before + after if stream.locate(i)[0] == 0]
    assert len(a) == 25 and len(set(a)) == 25  # a still in its first epoch: nothing twice


def test_quarantined_windows_are_passed_over_for_their_epoch_and_the_state_keeps_them(dirs):
    weights = (("a", 0.5), ("c", 0.5))
    stream = mixture(dirs, weights, seed=2)
    head = served(stream, 6)
    upcoming = stream.windows(6)  # the next positions, all ranks: the stream does not move
    assert [w for w, _ in upcoming] == served(mixture(dirs, weights, seed=2), 12)[6:]
    stream.quarantine(upcoming[:3])
    state = json.loads(json.dumps(stream.state_dict()))
    assert sorted(map(tuple, state["quarantine"])) == sorted(upcoming[:3])
    resumed = [mixture(dirs, weights, rank=r, world_size=2) for r in range(2)]
    for s in resumed:
        s.load_state_dict(state)
    per_rank = [served(s, 40) for s in resumed]
    rest = [per_rank[g % 2][g // 2] for g in range(80)]
    bad = {w for w, _ in upcoming[:3]}
    first_epochs = {0: [], 1: []}
    for w in head + rest:
        first_epochs[stream.locate(w)[0]].append(w)
    for source, size in ((0, 27), (1, 12)):
        q = {w for w in bad if stream.locate(w)[0] == source}
        epoch = first_epochs[source][: size - len(q)]  # the quarantined ones passed over
        first = 0 if source == 0 else 27
        assert sorted(epoch) == sorted(set(range(first, first + size)) - q)
    assert resumed[0].state_dict()["quarantine"] == []  # both sources moved past that epoch
    one = MixtureStream([("a", dirs["a"], 1.0)], SEQ, seed=2)
    one.quarantine([(5, 0)])
    assert one.state_dict() == WindowStream(dirs["a"], SEQ, seed=2).state_dict() | {"quarantine": [[5, 0]]}
    assert 5 not in served(one, 26)


def test_the_loader_hands_out_mixture_batches_and_resumes(dirs):
    stream = mixture(dirs, seed=9)
    loader = BatchLoader(stream, batch_size=4)
    next(loader)
    first = list(loader.last_windows)
    state = loader.state_dict()
    second = next(loader)[0]
    loader.close()
    again = BatchLoader(mixture(dirs), batch_size=4)
    again.load_state_dict(state)
    assert (next(again)[0] == second).all() and len(first) == 4
    again.close()


def test_refusals(dirs, tmp_path):
    for sources, fragment in [
        ([], "names no source"),
        ([("a", dirs["a"], 1.0), ("a", dirs["b"], 1.0)], "appears twice"),
        ([("a b", dirs["a"], 1.0)], "letters, digits"),
        ([("a", dirs["a"], 0.0)], "positive number"),
        ([("a", dirs["a"], float("nan"))], "positive number"),
    ]:
        with pytest.raises(UserError, match=fragment):
            MixtureStream(sources, SEQ)
    other = tmp_path / "other"
    manifest = write_synthetic_dataset(other, (50,))
    manifest["tokenizer"]["sha256"] = "another"
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="different tokenizers"):
        MixtureStream([("a", dirs["a"], 1.0), ("o", other, 1.0)], SEQ)
    stream = mixture(dirs)
    with pytest.raises(UserError, match="this run mixes"):
        mixture(dirs, (("a", 0.5), ("b", 0.5))).load_state_dict(stream.state_dict())
