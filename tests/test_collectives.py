"""training/collectives: the one all-reduce and the agreements built on it, in this process against a simulated peer
(the two-process tests run them for real: tests/test_zero3_forwards.py, the feature matrix's two-process cells).

`World` stands in for torch.distributed with one other process whose tensor is `peer`: `all_reduce` combines this
process's tensor with the peer's in place by the op it is given, as gloo does; the expected values are written out
from the two processes' inputs.
"""

import pytest
import torch
import torch.distributed as dist

from dhpo_trl.training import collectives


class World:
    def __init__(self, peer):
        self.peer = torch.tensor(peer, dtype=torch.float32)
        self.calls = []

    def all_reduce(self, tensor, op):
        self.calls.append(op)
        combined = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum}[op](tensor, self.peer)
        tensor.copy_(combined)


@pytest.fixture
def world(monkeypatch):
    def install(peer):
        fake = World(peer)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "all_reduce", fake.all_reduce)
        return fake

    return install


def reduce_over(num_processes):
    return lambda tensor, op: collectives.all_reduce(tensor, op, "cpu", num_processes)


@pytest.mark.parametrize(("op", "expected", "reduce_op"), [("sum", [4.0, 7.0, 2.5], dist.ReduceOp.SUM),
                                                            ("max", [3.0, 5.0, 2.0], dist.ReduceOp.MAX)])
def test_all_reduce_combines_with_the_other_process(world, op, expected, reduce_op):
    fake = world([1.0, 5.0, 0.5])
    out = collectives.all_reduce(torch.tensor([3.0, 2.0, 2.0]), op, "cpu", 2)
    assert out.tolist() == expected and fake.calls == [reduce_op]


def test_all_reduce_is_the_identity_alone(world):
    fake = world([100.0])
    tensor = torch.tensor([3.0])
    assert collectives.all_reduce(tensor, "sum", "cpu", 1) is tensor and fake.calls == []


@pytest.mark.parametrize("processes", [1, 2])
def test_an_unknown_op_is_refused_on_any_number_of_processes(world, processes):
    world([1.0])
    with pytest.raises(ValueError, match="op must be one of"):
        collectives.all_reduce(torch.tensor([1.0]), "min", "cpu", processes)


def test_the_agreements_reduce_through_the_callers_collective_with_max():
    """What `max_over_processes` and `any_process` hand to the collective they are given (the trainer's)."""
    seen = []

    def reduce(tensor, op):
        seen.append((tensor.tolist(), op))
        return collectives.all_reduce(tensor, op, "cpu", 1)

    assert collectives.max_over_processes([2, 5], reduce) == [2, 5]
    assert collectives.any_process(True, reduce) is True
    assert seen == [([2.0, 5.0], "max"), ([1.0], "max")]


def test_all_reduce_without_a_process_group_is_the_identity(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("no group: nothing to reduce"))
    tensor = torch.tensor([3.0, 1.0])
    assert collectives.all_reduce(tensor, "max", "cpu", 2) is tensor


def test_max_over_processes_is_the_element_wise_maximum_as_ints(world):
    fake = world([1.0, 6.0, 2.0, 0.0])
    agreed = collectives.max_over_processes([3, 1, 2, 7], reduce_over(2))
    assert agreed == [3, 6, 2, 7] and all(type(value) is int for value in agreed)
    assert fake.calls == [dist.ReduceOp.MAX]  # one collective for the whole list


def test_max_over_processes_of_nothing_runs_no_collective(world):
    fake = world([])
    assert collectives.max_over_processes([], reduce_over(2)) == [] and fake.calls == []


@pytest.mark.parametrize(("mine", "peer", "expected"), [(False, 1.0, True), (False, 0.0, False), (True, 0.0, True),
                                                        (True, 1.0, True)])  # fmt: skip
def test_any_process_is_true_everywhere_when_one_process_says_so(world, mine, peer, expected):
    fake = world([peer])
    assert collectives.any_process(mine, reduce_over(2)) is expected
    assert fake.calls == [dist.ReduceOp.MAX]
