import json

import numpy as np
import pytest
import torch

from pretrain.data import BatchLoader, WindowStream
from pretrain.data.permutation import permute, round_keys
from pretrain.errors import UserError
from tests.conftest import write_synthetic_dataset

SEQ = 8
# Shards of 41, 100, 17 and 66 tokens: 5 + 12 + 2 + 8 = 27 windows of 9 tokens.
SHARDS = (41, 100, 17, 66)
N = sum((t - 1) // SEQ for t in SHARDS)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("synthetic")
    write_synthetic_dataset(directory, SHARDS, val_shard_tokens=(50, 30))
    return directory


def ids(windows) -> list[int]:
    """A window's id: its first token (tokens are their global positions)."""
    return [int(w[0]) for w in windows]


def take(stream, k):
    return [next(stream) for _ in range(k)]


def all_window_starts() -> set[int]:
    starts, offset = set(), 0
    for tokens in SHARDS:
        starts |= {offset + j * SEQ for j in range((tokens - 1) // SEQ)}
        offset += tokens
    return starts


def test_windows_are_contiguous_slices_within_one_shard(data):
    stream = WindowStream(data, SEQ)
    assert stream.num_windows == N == 27
    for window in take(stream, N):
        assert window.dtype == torch.int64 and window.shape == (SEQ + 1,)
        assert torch.equal(window, torch.arange(int(window[0]), int(window[0]) + SEQ + 1))
    assert set(ids(take(WindowStream(data, SEQ), N))) == all_window_starts()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_are_disjoint_and_cover_each_epoch(data, world_size):
    per_rank = 3 * N  # three epochs' worth, so epoch boundaries fall mid-round for W = 2 and 4
    streams = [WindowStream(data, SEQ, rank=r, world_size=world_size, seed=5) for r in range(world_size)]
    served = [ids(take(s, per_rank)) for s in streams]
    # Interleaving the ranks gives the global order, which is the 1-process order.
    interleaved = [served[g % world_size][g // world_size] for g in range(per_rank * world_size)]
    single = ids(take(WindowStream(data, SEQ, seed=5), per_rank * world_size))
    assert interleaved == single
    for epoch in range(len(single) // N):
        assert sorted(single[epoch * N : (epoch + 1) * N]) == sorted(all_window_starts())
    # Each global batch (world_size windows per rank-step) within an epoch is split disjointly;
    # a batch that straddles an epoch boundary may meet a window again in its next-epoch pass.
    for step in range(per_rank):
        first, last = step * world_size, step * world_size + world_size - 1
        if first // N == last // N:
            assert len({served[r][step] for r in range(world_size)}) == world_size


def test_shuffle_is_keyed_by_seed_and_epoch(data):
    a, b = WindowStream(data, SEQ, seed=1), WindowStream(data, SEQ, seed=2)
    first_a, first_b = ids(take(a, N)), ids(take(b, N))
    assert first_a != first_b and sorted(first_a) == sorted(first_b)
    assert ids(take(a, N)) != first_a  # epoch 1 is ordered differently from epoch 0
    assert ids(take(WindowStream(data, SEQ, seed=1), N)) == first_a  # deterministic


@pytest.mark.parametrize("k", [0, 1, 5, 26, 27, 28, 40, 1100])
def test_exact_resume(data, k):
    uninterrupted = WindowStream(data, SEQ, seed=3)
    expected = ids(take(uninterrupted, k + 30))[k:]
    first = WindowStream(data, SEQ, seed=3)
    take(first, k)
    state = json.loads(json.dumps(first.state_dict()))  # JSON all the way
    resumed = WindowStream(data, SEQ, seed=999)  # the seed comes from the state
    resumed.load_state_dict(state)
    assert ids(take(resumed, 30)) == expected


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 1), (1, 4), (4, 2)])
def test_resume_with_another_world_size(data, before, after):
    steps_before, steps_after = 7, 9  # windows per rank
    single = ids(take(WindowStream(data, SEQ, seed=4), steps_before * before + steps_after * after))
    streams = [WindowStream(data, SEQ, rank=r, world_size=before, seed=4) for r in range(before)]
    for s in streams:
        take(s, steps_before)
    states = [s.state_dict() for s in streams]
    assert all(state == states[0] for state in states)  # the state is the same on every rank
    resumed = [WindowStream(data, SEQ, rank=r, world_size=after) for r in range(after)]
    for s in resumed:
        s.load_state_dict(states[0])
    served = [ids(take(s, steps_after)) for s in resumed]
    continued = [served[g % after][g // after] for g in range(steps_after * after)]
    assert continued == single[steps_before * before :]


def test_reshuffle_loses_and_repeats_nothing(data):
    for k in (0, 1, 10, 26):
        stream = WindowStream(data, SEQ, seed=7)
        consumed = ids(take(stream, k))
        reference = WindowStream(data, SEQ, seed=7)
        take(reference, k)
        stream.reshuffle(seed=8)
        rest = ids(take(stream, N - k))
        assert sorted(consumed + rest) == sorted(all_window_starts()), k
        if N - k > 3:
            assert rest != ids(take(reference, N - k)), "reshuffle must change the order"
        # Later epochs are keyed by the new seed.
        assert ids(take(stream, N)) == ids(take(_at_epoch_start(data, seed=8, epoch=1), N))


def _at_epoch_start(data, seed, epoch):
    stream = WindowStream(data, SEQ)
    stream.load_state_dict(
        {
            "fingerprint": stream.fingerprint,
            "seq_len": SEQ,
            "seed": seed,
            "epoch": epoch,
            "consumed": 0,
            "epoch_seeds": [[0, seed]],
        }
    )
    return stream


def test_repeated_reshuffles_and_resume_after_them(data):
    stream = WindowStream(data, SEQ, rank=1, world_size=2, seed=1)
    partner = WindowStream(data, SEQ, rank=0, world_size=2, seed=1)
    served = ids(take(stream, 3)) + ids(take(partner, 3))
    for seed in (11, 12):
        stream.reshuffle(seed)
        partner.reshuffle(seed)
        served += ids(take(stream, 2)) + ids(take(partner, 2))
    state = stream.state_dict()
    assert state == partner.state_dict() and len(state["epoch_seeds"]) == 3
    resumed = WindowStream(data, SEQ)
    resumed.load_state_dict(state)
    rest = ids(take(resumed, N - len(served)))
    assert sorted(served + rest) == sorted(all_window_starts())


def test_state_refusals(data, tmp_path):
    stream = WindowStream(data, SEQ)
    state = stream.state_dict()
    other = tmp_path / "other"
    write_synthetic_dataset(other, (41, 100, 17, 67))
    with pytest.raises(UserError, match="belongs to corpus"):
        WindowStream(other, SEQ).load_state_dict(state)
    with pytest.raises(UserError, match="seq_len"):
        WindowStream(data, SEQ * 2).load_state_dict(state)
    with pytest.raises(UserError, match="lacks"):
        stream.load_state_dict({"seed": 1})
    with pytest.raises(UserError, match="out of range"):
        stream.load_state_dict(state | {"consumed": N})


def test_validation_stream(data):
    one = WindowStream(data, SEQ, split="validation")
    assert one.num_windows == 6 + 3
    first = ids(one)
    assert first == [0, 8, 16, 24, 32, 40, 50, 58, 66]  # file order, every window once
    assert ids(one) == first  # each iter() is a fresh pass
    ranks = [ids(WindowStream(data, SEQ, rank=r, world_size=2, split="validation")) for r in range(2)]
    assert ranks == [[0, 16, 32, 50], [8, 24, 40, 58]]  # the odd last window is left out


def test_too_little_data(data):
    with pytest.raises(UserError, match="fewer than the"):
        WindowStream(data, 64, world_size=4)


def test_corrupt_shard_is_refused(tmp_path):
    write_synthetic_dataset(tmp_path, (41, 100))
    with open(tmp_path / "train_00001.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(UserError, match="truncated or corrupt"):
        WindowStream(tmp_path, SEQ)
    with pytest.raises(UserError, match="not a prepared dataset"):
        WindowStream(tmp_path / "missing", SEQ)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65, 1000, 4097])
def test_permutation_is_a_bijection(n):
    keys = round_keys("test", n)
    image = permute(np.arange(n), n, keys)
    assert sorted(image.tolist()) == list(range(n))
    if n > 8:
        assert image.tolist() != list(range(n))
        assert image.tolist() != permute(np.arange(n), n, round_keys("other", n)).tolist()


def test_permutation_of_a_huge_domain_needs_no_table():
    n = 10**12  # a trillion windows
    positions = np.array([0, 1, 2, n - 1, 123456789])
    image = permute(positions, n, round_keys(0, 0))
    assert len(set(image.tolist())) == 5 and image.max() < n and image.min() >= 0


def test_batch_loader_state_is_that_of_the_last_batch_handed_out(data):
    loader = BatchLoader(WindowStream(data, SEQ, seed=2), batch_size=3, prefetch=4)
    expected = ids(take(WindowStream(data, SEQ, seed=2), 3 * 12))
    inputs, targets = next(loader)
    assert inputs.shape == targets.shape == (3, SEQ)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    served = ids(inputs) + ids(next(loader)[0])
    state = loader.state_dict()  # the thread has prefetched further by now
    assert served == expected[:6]
    loader.close()
    resumed = BatchLoader(WindowStream(data, SEQ), batch_size=3)
    resumed.load_state_dict(state)
    assert ids(torch.cat([next(resumed)[0] for _ in range(10)])) == expected[6:36]
    resumed.close()


def test_batch_loader_over_validation_is_finite(data):
    loader = BatchLoader(WindowStream(data, SEQ, split="validation"), batch_size=2)
    batches = list(loader)
    assert len(batches) == 4  # 9 windows: the partial last batch is dropped
    assert len(list(loader)) == 4  # and a new pass starts on the next iteration


def test_batch_loader_failure_loses_no_windows(data):
    stream = WindowStream(data, SEQ, seed=2)
    expected = ids(take(WindowStream(data, SEQ, seed=2), 3 * 12))
    reads, read = [0], stream.read

    def failing_read(window):
        reads[0] += 1
        if reads[0] == 17:  # the second window of batch 6
            raise OSError("disk hiccup")
        return read(window)

    stream.read = failing_read
    loader = BatchLoader(stream, batch_size=3, prefetch=2)
    served = [w for _ in range(5) for w in ids(next(loader)[0])]
    with pytest.raises(OSError, match="disk hiccup"):
        next(loader)
    served += [w for _ in range(7) for w in ids(next(loader)[0])]  # a retry continues exactly
    assert served == expected
    loader.close()


def test_batch_loader_reshuffle_loses_and_repeats_nothing(data):
    loader = BatchLoader(WindowStream(data, SEQ, seed=3), batch_size=3, prefetch=4)
    served = ids(torch.cat([next(loader)[0] for _ in range(4)]))  # the thread has read further
    loader.reshuffle(21)
    assert loader.state_dict()["epoch_seeds"] == [[0, 3], [12, 21]]
    served += ids(torch.cat([next(loader)[0] for _ in range(5)]))
    loader.close()
    plain = WindowStream(data, SEQ, seed=3)
    reference = ids(take(plain, 12))
    plain.reshuffle(21)
    reference += ids(take(plain, 15))
    assert served == reference and sorted(served) == sorted(all_window_starts())


def test_integer_seeds_of_any_type_are_the_same_seed(data):
    a, b = WindowStream(data, SEQ, seed=np.int64(3)), WindowStream(data, SEQ, seed=3)
    assert ids(take(a, 10)) == ids(take(b, 10))
    a.reshuffle(np.int32(8))
    b.reshuffle(8)
    assert ids(take(a, 30)) == ids(take(b, 30))
    state = json.loads(json.dumps(a.state_dict()))  # numpy integers would not serialize
    assert state == b.state_dict()
    c = WindowStream(data, SEQ)
    c.load_state_dict(a.state_dict() | {"seed": np.int64(8)})
    assert ids(take(c, 10)) == ids(take(b, 10))
    assert (round_keys("epoch", np.int64(3), np.uint8(0)) == round_keys("epoch", 3, 0)).all()
    with pytest.raises(TypeError):
        WindowStream(data, SEQ, seed=3.0)


def test_validation_stream_refuses_next(data):
    stream = WindowStream(data, SEQ, split="validation")
    with pytest.raises(TypeError, match=r"iterated with iter\(\): one pass per call"):
        next(stream)
    assert ids(stream)[:2] == [0, 8]
