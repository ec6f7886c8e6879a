"""The `moe/` decision counts of routing replay: a decision flips when a token's live top-k *set* differs from the
replayed one, whatever order the router lists its experts in. Expected values are Python set comparisons."""

import torch

from dhpo_trl.training import routing_replay as rr


def flips_by_sets(live, replayed):
    return [set(a) != set(b) for a, b in zip(live, replayed, strict=True)]


def test_a_top_k_set_listed_in_another_order_is_not_a_flip():
    live = [[1, 2], [3, 0], [2, 5], [4, 4], [0, 1]]
    replayed = [[2, 1], [0, 3], [2, 4], [4, 4], [1, 0]]
    got = rr.decisions_differ(torch.tensor(live), torch.tensor(replayed, dtype=torch.int16).long())
    assert got.tolist() == flips_by_sets(live, replayed) == [False, False, True, False, False]


def test_random_top_k_choices_flip_exactly_where_their_sets_differ():
    gen = torch.Generator().manual_seed(0)
    live = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(200)])
    replayed = live.clone()
    for row in range(0, 200, 3):  # a third of the rows: the same set in another order
        replayed[row] = replayed[row][torch.randperm(3, generator=gen)]
    for row in range(1, 200, 5):  # a fifth: one expert swapped for one outside the set
        outside = [e for e in range(6) if e not in live[row].tolist()][0]
        replayed[row, int(torch.randint(3, (1,), generator=gen))] = outside
    expected = flips_by_sets(live.tolist(), replayed.tolist())
    assert 0 < sum(expected) < 200
    assert rr.decisions_differ(live, replayed).tolist() == expected


def test_metric_sums_carry_the_three_counts():
    stats = rr.Stats(decisions=12, replayed=11, flipped=3)
    assert rr.metric_sums(stats) == {"moe_decisions": 12, "moe_replayed": 11, "moe_flipped": 3}
    assert rr.metric_sums(None) == {}
