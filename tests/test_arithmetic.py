"""The synthetic addition task: problem text, operand widths at their limits, the size of the problem space, and
disjoint, seed-determined splits."""

import pytest

from dhpo_trl.demo.arithmetic import PROMPT_TEMPLATE, Problem, generate_problems, make_splits, to_dataset


def test_problem_text():
    problem = Problem(37, 405)
    assert (problem.question, problem.answer) == ("37+405", "442")
    assert problem.prompt == "Q: 37+405\nA:"
    assert problem.prompt == PROMPT_TEMPLATE.format(question="37+405")
    assert problem.target_completion() == " \\boxed{442}"


@pytest.mark.parametrize(("digits", "low", "high"), [((1, 1), 1, 9), ((2, 2), 10, 99), ((1, 3), 1, 999)])
def test_operands_span_exactly_the_digit_range(digits, low, high):
    problems = generate_problems(400 if digits != (1, 1) else 81, digits=digits, seed=3)
    operands = [n for p in problems for n in (p.left, p.right)]
    assert min(operands) >= low and max(operands) <= high
    widths = {len(str(n)) for n in operands}
    assert widths == set(range(digits[0], digits[1] + 1))  # every width occurs
    assert len(set(problems)) == len(problems)


def test_every_two_digit_operand_can_occur():
    problems = generate_problems(8100, digits=(2, 2), seed=0)  # all 90 x 90 pairs
    assert {p.left for p in problems} == {p.right for p in problems} == set(range(10, 100))


def test_the_whole_problem_space_can_be_drawn_and_no_more():
    everything = generate_problems(81, digits=(1, 1), seed=0)  # 9 x 9 one-digit pairs
    assert {(p.left, p.right) for p in everything} == {(a, b) for a in range(1, 10) for b in range(1, 10)}
    with pytest.raises(ValueError, match=r"count=82 exceeds the 81 distinct problems with digits=\(1, 1\)"):
        generate_problems(82, digits=(1, 1), seed=0)
    excluded = {Problem(1, 1), Problem(2, 3)}
    rest = generate_problems(79, digits=(1, 1), seed=0, exclude=excluded)
    assert not excluded & set(rest)
    with pytest.raises(ValueError, match="exceeds the 79 distinct"):
        generate_problems(80, digits=(1, 1), seed=0, exclude=excluded)
    with pytest.raises(ValueError, match="exceeds the 9801 distinct"):  # (9 + 90) x (9 + 90) pairs of 1-2 digits
        generate_problems(9802, digits=(1, 2), seed=0)


@pytest.mark.parametrize("digits", [(0, 1), (3, 2), (0, 0)])
def test_bad_digit_ranges(digits):
    with pytest.raises(ValueError, match=r"must satisfy 1 <= min <= max"):
        generate_problems(1, digits=digits, seed=0)


def test_splits_are_disjoint_sized_and_seeded():
    train, heldout = make_splits(50, 20, digits=(1, 2), seed=5)
    assert (len(train), len(heldout)) == (50, 20)
    assert not set(train) & set(heldout)
    assert heldout == generate_problems(20, digits=(1, 2), seed=6)  # held-out from seed + 1
    assert train == generate_problems(50, digits=(1, 2), seed=5, exclude=set(heldout))
    assert generate_problems(5, digits=(2, 3), seed=1) == generate_problems(5, digits=(2, 3), seed=1)
    assert generate_problems(5, digits=(2, 3), seed=1) != generate_problems(5, digits=(2, 3), seed=2)


def test_dataset_columns():
    problems = [Problem(1, 2), Problem(30, 4)]
    dataset = to_dataset(problems)
    assert dataset.column_names == ["prompt", "answer"]
    assert dataset["answer"] == ["3", "34"] and dataset["prompt"] == [p.prompt for p in problems]
