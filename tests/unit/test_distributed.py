"""Who a process is, the collectives without a process group, the stop request, and exit statuses."""

import os
import signal

import pytest
import torch

from pretrain import errors
from pretrain.errors import CommandParser, ConfigError, ExitCode, UserError, run_main
from pretrain.parallel.distributed import DistEnv, StopRequest, all_reduce_sum, barrier, broadcast


def test_one_plain_process_is_rank_0_of_1(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # recorded first, so that the values set below are undone too
        monkeypatch.delenv(name)  # (left behind, every later process of this worker would inherit them)
    env = DistEnv.from_environ()
    assert env == DistEnv(0, 0, 1) and env.is_main
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert "MASTER_PORT" not in os.environ  # (a group of one meets in memory: no port to collide)


def test_a_port_handed_out_is_never_handed_out_again_while_its_lease_lasts(monkeypatch, tmp_path):
    """Two jobs started together each get a port none other has: one handed out is free until its
    job binds it, so the bind test alone would hand it out again (EADDRINUSE in one of them)."""
    import random

    from pretrain.parallel import distributed

    picks = iter([25_000, 25_000, 25_001, 25_000])

    class Picker:
        def randrange(self, low, high):
            return next(picks)

    monkeypatch.setattr(random, "SystemRandom", Picker)
    monkeypatch.setattr(distributed, "PORT_LEASES", tmp_path)
    monkeypatch.setattr(distributed, "_first_outgoing_port", lambda: 32_768)
    monkeypatch.setattr(distributed, "_bindable", lambda port: True)  # (whatever else runs here)
    assert distributed.free_port() == 25_000
    assert distributed.free_port() == 25_001  # 25000 is free, and leased
    monkeypatch.setattr(distributed, "PORT_LEASE_SECONDS", 0.0)
    assert distributed.free_port() == 25_000  # its lease over


def test_a_launchers_variables_say_who_a_process_is(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    env = DistEnv.from_environ()
    assert env == DistEnv(5, 1, 8) and not env.is_main


def test_collectives_of_one_process_without_a_group_are_the_identity(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    t = torch.tensor([1.0, 2.0])
    assert all_reduce_sum(t) is t and t.tolist() == [1.0, 2.0]
    assert broadcast(t).tolist() == [1.0, 2.0]
    barrier()


def test_a_collective_of_several_ranks_without_a_group_is_a_bug(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="before the process group started"):
        all_reduce_sum(torch.zeros(1))


def test_stop_request_a_flag_then_an_interrupt_and_the_old_handlers_back():
    previous = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested  # the ranks agree on it at the next step boundary
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second one does not wait
    assert signal.getsignal(signal.SIGINT) == previous


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_request_names_the_signal_this_rank_received(signum):
    with StopRequest() as stop:
        os.kill(os.getpid(), signum)
        assert stop.requester()["why"] == f"{signal.Signals(signum).name} received"


def test_a_rank_asked_to_stop_by_its_supervisor_says_what_the_supervisor_was_asked(tmp_path):
    """Under `pretrain launch` a Ctrl-C reaches the ranks as SIGTERM; the supervisor writes down
    what it was asked first (`tell_ranks_why`), and the rank's stop names that, not the SIGTERM."""
    from pretrain.lifeline import clear_rank_records, tell_ranks_why, why_the_supervisor_stops

    cause = lambda: why_the_supervisor_stops(tmp_path)  # noqa: E731 (as the loop wires it)
    tell_ranks_why(tmp_path, "SIGINT to pretrain launch, passed on as SIGTERM")
    with StopRequest(cause=cause) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requester()["why"] == "SIGINT to pretrain launch, passed on as SIGTERM"
    clear_rank_records(tmp_path)  # the next attempt starts: an earlier attempt's reason is gone
    with StopRequest(cause=cause) as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # (a scheduler's own, say)
        assert stop.requester()["why"] == "SIGTERM received"


def test_exit_statuses_are_one_table():
    assert [int(c) for c in (ExitCode.DONE, ExitCode.BAD_INPUT, ExitCode.STOPPED_BY_MONITOR)] == [0, 2, 3]
    assert UserError.exit_code == ConfigError.exit_code == ExitCode.BAD_INPUT


def test_run_main_turns_bad_input_into_one_line_and_status_2(capsys, monkeypatch):
    def bad():
        raise ConfigError("model.d_model=100 is not divisible by model.n_heads=3: choose n_heads ...")

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    line = "pretrain: error: model.d_model=100 is not divisible by model.n_heads=3: choose n_heads ...\n"
    assert run_main(bad) == 2 and capsys.readouterr().err == line
    # Every rank found it; local rank 0 says it (once per node), the others wait for it to be said.
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    waits = []
    monkeypatch.setattr("pretrain.errors.time.sleep", waits.append)
    assert run_main(bad) == 2 and capsys.readouterr().err == "" and waits == [errors.SPEAKER_GRACE_S]
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert run_main(bad) == 2 and capsys.readouterr().err == line and len(waits) == 1
    with pytest.raises(ConfigError):
        run_main(bad, debug=True)
    assert run_main(lambda: ExitCode.STOPPED_BY_MONITOR) == 3


def test_run_main_turns_ctrl_c_into_status_130(capsys):
    def interrupted():
        raise KeyboardInterrupt

    assert run_main(interrupted, prog="python -m monitoring") == 130
    assert capsys.readouterr().err == "python -m monitoring: interrupted\n"


def test_usage_errors_are_one_line_too(capsys):
    parser = CommandParser(prog="pretrain")
    parser.add_argument("--steps", type=int, required=True)
    with pytest.raises(SystemExit) as exit:
        parser.parse_args(["--steps", "many"])
    assert exit.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "invalid int value: 'many'" in line and "see `pretrain --help`" in line


def test_cpu_ranks_share_the_machines_cores(monkeypatch):
    from pretrain.parallel.distributed import cpu_threads_per_rank

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert cpu_threads_per_rank() == 8  # one process: every core
    monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launcher
    assert cpu_threads_per_rank() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # torchrun's, when both are there; never below 1
    assert cpu_threads_per_rank() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
    assert cpu_threads_per_rank() is None
