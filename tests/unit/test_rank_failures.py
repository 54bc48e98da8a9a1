"""A failed rank reads as one line on every rank and in the supervisor's restart line: the rank,
the signal or status, the step (pretrain/lifeline.py, pretrain/distributed.lost_peer,
pretrain/errors.RankFailed, pretrain/cli/training.as_a_rank)."""

from __future__ import annotations

import json
import signal

import pytest

from pretrain import lifeline
from pretrain.cli.training import as_a_rank
from pretrain.errors import DataError, ExitCode, RankFailed, run_main
from pretrain.parallel.distributed import lost_peer
from pretrain.run_dir import OWNER_ENV

GLOO_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:2461. This is typically caused by a remote worker crashing. Check the logs of the "
    "remote worker before reporting an error."
)


@pytest.fixture
def rank_record(tmp_path, monkeypatch):
    """This process as rank 0 of a supervised job on another host (no lifeline thread), with a
    fresh record; the module's state is restored afterwards."""
    monkeypatch.setattr(lifeline, "_record", {})
    monkeypatch.setattr(lifeline, "_held", [])
    monkeypatch.setattr(lifeline.atexit, "register", lambda f: None)
    monkeypatch.setattr("pretrain.cli.training.PEER_REASON_WAIT_S", 0.3)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}  # (a rank that lost
    monkeypatch.setenv(OWNER_ENV, "elsewhere:1:2.000")  # another ignores them from then on)
    monkeypatch.setenv("RANK", "0")
    lifeline.watch_supervisor(tmp_path)
    yield tmp_path
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def write_record(run_dir, rank, **fields):
    path = run_dir / lifeline.RANK_RECORDS / f"rank-{rank}.json"
    path.write_text(json.dumps({"rank": rank, "node": 0, "host": "h", "pid": 100 + rank} | fields))


def test_lost_peer_names_gloos_words_and_nothing_else():
    assert lost_peer(RuntimeError(GLOO_GONE)) == "Connection closed by peer [127.0.0.1]:2461"
    wrapped = ValueError("a step failed")
    wrapped.__cause__ = RuntimeError(
        "NCCL error: remote process exited or there was a network error, ncclRemoteError: ..."
    )
    assert lost_peer(wrapped).startswith("NCCL error")
    assert lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert lost_peer(ValueError("Connection closed by peer")) is None  # (not a collective's error)


def test_the_launchers_status_gives_the_signal():
    assert lifeline.signal_of_status(247) == signal.SIGKILL  # DeepSpeed's launcher: exit(-9)
    assert lifeline.signal_of_status(137) == signal.SIGKILL  # a shell: 128 + 9
    assert lifeline.signal_of_status(139) == signal.SIGSEGV
    assert lifeline.signal_of_status(1) is None and lifeline.signal_of_status(2) is None


def test_a_killed_rank_is_named_with_its_signal_and_the_survivors_step(rank_record):
    lifeline.note_step(52)
    lifeline.note_exit(why="lost another rank during step 52", now=True)
    write_record(rank_record, 1)  # killed: never marked exited
    assert lifeline.describe_failure(rank_record, 247) == (
        "rank 1 (h, pid 101) was killed by SIGKILL during step 52 (exit status 247)"
    )


def test_a_rank_that_stopped_on_bad_input_is_the_reason_not_the_rank_that_lost_it(rank_record):
    lifeline.note_step(7)
    lifeline.note_exit(why="lost another rank during step 7", now=True)
    write_record(rank_record, 1, exited=True, step=7, why="shard 3 holds id 9000 >= vocab 4096", status=2)
    assert lifeline.describe_failure(rank_record, 2) == (
        "rank 1 stopped during step 7: shard 3 holds id 9000 >= vocab 4096 (exit status 2)"
    )
    lifeline.clear_rank_records(rank_record)
    assert (
        lifeline.rank_records(rank_record) == []
        and lifeline.describe_failure(rank_record, 1) == "exit status 1"
    )


def test_a_rank_that_lost_a_killed_peer_says_so_in_one_line(rank_record, capsys):
    lifeline.note_step(52)

    def collective():
        raise RuntimeError(GLOO_GONE)

    code = run_main(lambda: as_a_rank(collective), debug=False)
    err = capsys.readouterr().err
    assert code == ExitCode.FAILED and err.count("\n") == 1, err
    assert err == (
        "pretrain: rank 0: stopped during step 52: another rank left the job (Connection closed by peer "
        "[127.0.0.1]:2461); the supervisor's line names it\n"
    )
    with pytest.raises(RankFailed):  # --debug: the traceback
        run_main(lambda: as_a_rank(collective), debug=True)


def test_a_rank_that_lost_a_peer_to_bad_input_repeats_its_reason_and_status(rank_record, capsys):
    lifeline.note_step(7)
    write_record(rank_record, 1, exited=True, why="shard 3 holds id 9000 >= vocab 4096", status=2)

    def collective():
        raise RuntimeError(GLOO_GONE)

    assert run_main(lambda: as_a_rank(collective), debug=False) == ExitCode.BAD_INPUT
    assert capsys.readouterr().err == (
        "pretrain: rank 0: stopped during step 7: rank 1 stopped: shard 3 holds id 9000 >= vocab 4096\n"
    )


def test_bad_input_a_rank_finds_is_in_its_record_at_once(rank_record, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")

    def bad():
        raise DataError("shard 3 holds id 9000 >= vocab 4096")

    assert run_main(lambda: as_a_rank(bad), debug=False) == ExitCode.BAD_INPUT
    (record,) = lifeline.rank_records(rank_record)
    assert record["exited"] and record["status"] == 2 and "id 9000" in record["why"]
    assert capsys.readouterr().err.count("\n") == 1
