"""The split of a final accuracy's seed std into evaluation and training noise (dhpo_trl/evaluation/seed_noise.py),
against numpy's covariance matrix and on rows whose noise is known by construction."""

import random

import numpy as np
import pytest

from dhpo_trl.evaluation.seed_noise import seed_noise


def bits(rows):
    return ["".join(str(int(b)) for b in row) for row in rows]


def test_the_split_is_the_covariance_matrix_of_the_scores():
    rng = np.random.default_rng(0)
    scores = (rng.random((4, 500)) < rng.uniform(0.2, 0.6, size=(4, 1))).astype(int)
    noise = seed_noise(bits(scores))
    covariance = np.cov(scores.T)  # problems x problems, over the seeds
    accuracy = scores.mean(axis=1)
    assert noise["mean"] == pytest.approx(accuracy.mean(), abs=1e-12)
    assert noise["seed_std"] == pytest.approx(accuracy.std(ddof=1), abs=1e-12)
    assert noise["seed_std"] ** 2 == pytest.approx(covariance.mean(), abs=1e-12)
    assert noise["evaluation_std"] == pytest.approx(np.sqrt(np.trace(covariance)) / 500, abs=1e-12)
    rest = covariance.mean() - np.trace(covariance) / 500**2
    assert noise["training_std"] == pytest.approx(np.sqrt(max(rest, 0.0)), abs=1e-12)
    assert noise["binomial_std"] == pytest.approx(np.sqrt(accuracy.mean() * (1 - accuracy.mean()) / 500), abs=1e-12)
    assert (noise["problems"], noise["seeds"]) == (500, 4)


def test_seeds_that_agree_have_no_noise_and_nested_policies_only_training_noise():
    same = seed_noise(["0110100", "0110100", "0110100"])
    assert same["seed_std"] == same["evaluation_std"] == same["training_std"] == 0.0 and same["binomial_std"] > 0
    # each seed solves the problems the previous one solves and more: the problems move together
    nested = seed_noise(["1" * k + "0" * (400 - k) for k in (100, 140, 180)])
    assert nested["seed_std"] == pytest.approx(0.1, abs=1e-12)
    assert nested["training_std"] > 4 * nested["evaluation_std"]


def test_independent_coin_flips_are_evaluation_noise_at_the_binomial():
    rng = random.Random(1)
    flips = ["".join("1" if rng.random() < 0.35 else "0" for _ in range(20000)) for _ in range(5)]
    noise = seed_noise(flips)
    assert noise["evaluation_std"] == pytest.approx(noise["binomial_std"], rel=0.02)


@pytest.mark.parametrize("correct", [["0101"], ["0101", "011"], ["0101", "01a1"], ["", ""]])
def test_rows_without_two_seeds_on_one_set_are_refused(correct):
    with pytest.raises(ValueError, match="seed_noise"):
        seed_noise(correct)


def test_two_seeds_on_one_problem_are_the_smallest_row_split():
    """The fewest seeds a sample std takes and the fewest problems: accuracies 1 and 0 (by hand: sample variance 0.5,
    all of it the one problem's disagreement, so no training noise)."""
    noise = seed_noise(["1", "0"])
    assert noise["mean"] == 0.5 and noise["binomial_std"] == pytest.approx(0.5, abs=1e-12)
    assert noise["seed_std"] == pytest.approx(0.5**0.5, abs=1e-12)
    assert noise["evaluation_std"] == pytest.approx(0.5**0.5, abs=1e-12) and noise["training_std"] == 0.0
    assert (noise["problems"], noise["seeds"]) == (1, 2)
