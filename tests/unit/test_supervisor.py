"""The supervisor's pure parts, and `pretrain launch` refusing bad input before it starts anything
(in this process: nothing is started)."""

from monitoring.supervisor import HangWatch
from tests.helpers import FAST, TINY, assert_one_line_error


def test_hang_watch():
    watch = HangWatch(factor=3, min_seconds=5, startup_seconds=100)
    watch.start(now=0)
    assert watch.overdue(99) is None and "no first step for 101 s" in watch.overdue(101)
    watch.step(10)
    assert watch.limit() == 5  # one step seen: no interval yet, the floor
    watch.step(14)  # a 4 s interval: limit 3 × 4 = 12 s
    assert watch.limit() == 12 and watch.overdue(26) is None and "no step for 13 s" in watch.overdue(27)
    watch.step(15)  # a shorter interval does not lower the limit
    assert watch.limit() == 12
    watch.start(now=100)  # a restart: the startup limit again, the step intervals remembered
    assert watch.overdue(150) is None
    watch.step(160)
    assert watch.limit() == 12 and watch.overdue(173)


def test_launch_refuses_bad_input_before_starting_anything(tmp_path, train_data, cli):
    run_dir = tmp_path / "run"
    common = ["--config", TINY, f"run.dir={run_dir}", f"data.dir={train_data}", *FAST]
    for args in (["--nproc", "0"], ["--hostfile", str(tmp_path / "missing")], ["--node-rank", "1"]):
        assert_one_line_error(cli("launch", *args, *common))
    result = cli("launch", "--nproc", "2", *common, "faults.kill_step=3", "faults.kill_rank=2")
    assert_one_line_error(result, "faults.kill_rank=2 but the job has 2 rank(s)")
    assert_one_line_error(
        cli("launch", "--nproc", "2", *common, "train.global_batch_size=6"), "global_batch_size"
    )
    assert not run_dir.exists()  # no run directory, token or endpoint that looks like a run
