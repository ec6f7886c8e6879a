"""dhpo_trl.evaluation.metrics against hand computations: per-problem fractions, Avg@k in percent over ragged sample
counts, the unweighted AVG column, and the Table-1 markdown layout down to its padding and rounding."""

import pytest

from dhpo_trl.evaluation.metrics import average_score, benchmark_score, format_table, problem_score


def test_problem_score_is_the_fraction_correct():
    assert problem_score([1, 0, 0]) == pytest.approx(1 / 3)
    assert problem_score([1.0, 1.0]) == 1.0
    assert problem_score([0.0]) == 0.0
    assert problem_score([0.5, 1.0, 0.0, 0.0]) == pytest.approx(0.375)  # graded, not only 0/1
    with pytest.raises(ValueError, match=r"^A problem needs at least one scored sample\.$"):
        problem_score([])


def test_benchmark_score_is_a_percentage_over_problems():
    assert benchmark_score([[1]]) == 100.0
    assert benchmark_score([[0], [0]]) == 0.0
    assert benchmark_score([[1], [0], [0], [0]]) == pytest.approx(25.0)  # Pass@1
    # ragged: each problem counts once, whatever its samples: (1/2 + 3/4 + 0/1) / 3 = 41.666...
    assert benchmark_score([[1, 0], [1, 1, 1, 0], [0]]) == pytest.approx(41.6666667)
    # not pooled over samples: pooling would give 4/7 = 57.1
    assert benchmark_score([[0, 0, 0, 0, 0, 1], [1]]) == pytest.approx(58.3333333)
    with pytest.raises(ValueError, match=r"^A benchmark needs at least one problem to score\.$"):
        benchmark_score([])
    with pytest.raises(ValueError, match=r"^A problem needs at least one scored sample\.$"):
        benchmark_score([[1], []])  # a problem without samples is refused, not skipped


def test_average_score_is_unweighted():
    assert average_score({"aime24": 10.0, "gsm8k": 20.0, "math500": 60.0}) == pytest.approx(30.0)
    assert average_score({"gsm8k": 42.5}) == 42.5
    with pytest.raises(ValueError, match=r"^No benchmark scores to average\.$"):
        average_score({})


def test_table_exact_layout_rounding_and_order():
    rows = {
        "Long model": {"gsm8k": 66.666, "amc23": 0.04},  # benchmark order inside a row does not matter
        "A": {"amc23": 100 / 3, "gsm8k": 50.0},
    }
    table = format_table(rows, {"amc23": 4, "math500": 1})  # math500 is in no row: no column; gsm8k: default 1
    assert table.splitlines() == [
        "| Model      | AMC23 (Avg@4) | GSM8K | AVG  |",
        "|------------|---------------|-------|------|",
        "| Long model | 0.0           | 66.7  | 33.4 |",
        "| A          | 33.3          | 50.0  | 41.7 |",
    ]


def test_table_headers_default_to_the_paper_samples():
    table = format_table({"m": {"aime24": 12.34, "gsm8k": 1.0}}, {})
    assert table.splitlines() == [
        "| Model | AIME24 (Avg@32) | GSM8K | AVG |",
        "|-------|-----------------|-------|-----|",
        "| m     | 12.3            | 1.0   | 6.7 |",
    ]
    one_sample = format_table({"m": {"aime24": 5.0}}, {"aime24": 1})
    assert one_sample.splitlines()[0] == "| Model | AIME24 | AVG |"


def test_table_marks_missing_scores_and_withholds_their_average():
    table = format_table(
        {"first": {"aime25": 20.0}, "second": {"gsm8k": 30.0, "aime25": 10.0}}, {"aime25": 2, "gsm8k": 1}
    )
    assert table.splitlines() == [
        "| Model  | AIME25 (Avg@2) | GSM8K | AVG  |",
        "|--------|----------------|-------|------|",
        "| first  | 20.0           | -     | -    |",
        "| second | 10.0           | 30.0  | 20.0 |",
    ]


def test_table_average_covers_only_the_columns_shown():
    # a score outside the seven benchmarks (here "mmlu") gets no column and does not enter AVG
    table = format_table({"m": {"gsm8k": 10.0, "mmlu": 90.0, "math500": 20.0}}, {})
    assert table.splitlines() == [
        "| Model | MATH 500 | GSM8K | AVG  |",
        "|-------|----------|-------|------|",
        "| m     | 20.0     | 10.0  | 15.0 |",
    ]
