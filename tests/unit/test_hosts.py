"""The supervisor's host set (monitoring/hosts.py): which hosts a start takes, which wait as
spares, when the job shrinks and by how much, and what it refuses. Pure: the checks' results are
given, nothing is started."""

import pytest

from monitoring.hosts import HostSet

HEALTHY = {"a": None, "b": None, "c": None}


def hosts(nodes=2, min_nodes=None, slots=1, micro=4, accum=1) -> HostSet:
    return HostSet(
        slots={h: slots for h in "abc"},
        nodes=nodes,
        min_nodes=nodes if min_nodes is None else min_nodes,
        micro_batch=micro,
        grad_accum=accum,
    )


def test_a_start_takes_n_hosts_in_hostfile_order_and_keeps_the_rest_as_spares():
    chosen = hosts()
    choice = chosen.choose(HEALTHY)
    assert (choice.hosts, choice.grad_accum) == (["a", "b"], 1)
    chosen.in_use = choice.hosts
    assert chosen.spares() == ["c"] and chosen.ranks("b") == [1] and chosen.ranks("c") == []
    assert chosen.view() == {"in_use": ["a", "b"], "spares": ["c"], "excluded": {}, "lost": []}


def test_a_lost_host_is_replaced_by_a_spare_and_the_others_keep_their_place():
    chosen = hosts()
    chosen.in_use = ["a", "b"]
    chosen.lost.append("b")
    assert chosen.choose(HEALTHY | {"b": "ssh: Connection refused"}).hosts == ["a", "c"]
    assert chosen.excluded == {"b": "ssh: Connection refused"}
    chosen.in_use = ["a", "c"]
    # b answers again: it is a spare, taken last (it was lost in this run)
    assert chosen.choose(HEALTHY).hosts == ["a", "c"] and chosen.preference() == ["a", "c", "b"]


def test_with_no_spare_the_job_shrinks_to_min_nodes_keeping_the_global_batch():
    chosen = hosts(nodes=2, min_nodes=1, micro=4, accum=1)  # global batch 4 x 1 x 2 = 8
    choice = chosen.choose({"a": None, "b": "down", "c": "down"})
    assert (choice.hosts, choice.grad_accum) == (["a"], 2)  # 4 x 2 x 1 = 8
    assert hosts(nodes=2).choose({"a": None, "b": "down", "c": "down"}) is None  # min_nodes = nodes


def test_a_size_the_global_batch_does_not_divide_is_refused_and_said():
    chosen = HostSet(
        slots={"a": 1, "b": 1, "c": 1}, nodes=3, min_nodes=1, micro_batch=1, grad_accum=2
    )  # global batch 6: 2 nodes (2 processes) divide it; so does 1
    choice = chosen.choose({"a": None, "b": None, "c": "down"})
    assert (choice.hosts, choice.grad_accum, choice.refused) == (["a", "b"], 3, [])
    odd = HostSet(slots={"a": 2, "b": 2, "c": 1}, nodes=2, min_nodes=1, micro_batch=1, grad_accum=1)
    choice = odd.choose({"a": "down", "b": None, "c": None})  # global 4: b+c = 3 processes do not divide it
    assert choice.hosts == ["b"] and choice.grad_accum == 2
    assert choice.refused == [
        "2 node(s): the global batch 4 is not a multiple of train.micro_batch_size 1 x 3 processes"
    ]


def test_a_straggler_is_left_out_for_the_rest_of_the_run_whatever_its_check_says():
    chosen = hosts()
    chosen.in_use = ["a", "b"]
    chosen.banned["b"] = "straggler: 2.1x the median rank"
    assert chosen.choose(HEALTHY).hosts == ["a", "c"]
    assert chosen.view()["excluded"] == {"b": "straggler: 2.1x the median rank"}


@pytest.mark.parametrize("slots", [1, 2])
def test_ranks_follow_the_hostfile_order_of_the_start(slots):
    chosen = hosts(slots=slots)
    assert chosen.ranks("c", ["a", "c"]) == list(range(slots, 2 * slots))
