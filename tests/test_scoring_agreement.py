"""Reward and evaluation agree: the training loader and the benchmark loader normalise the same rows to the same
golds, and `math_verify_reward` and `evaluate_problems` score the same completions the same way, because both go
through `dhpo_trl.scoring.rewards.score_answer`."""

import pytest
from benchmark_fixtures import FIXTURES

from dhpo_trl.evaluation import SamplingSettings, evaluate_problems
from dhpo_trl.evaluation.audit import near_misses, rewrite
from dhpo_trl.evaluation.benchmarks import load_benchmark
from dhpo_trl.scoring.data import load_math_dataset
from dhpo_trl.scoring.rewards import math_verify_reward

# benchmark -> (question column, answer column) for the training loader; Minerva keeps its gold inside a worked
# solution, which only the benchmark loader extracts, so it has no training-loader counterpart here.
COLUMNS = {
    "aime24": ("problem", "answer"),
    "aime25": ("problem", "answer"),
    "amc23": ("problem", "answer"),
    "olympiadbench": ("question", "final_answer"),
    "math500": ("problem", "answer"),
    "gsm8k": ("question", "answer"),
}


class ListBackend:
    name = "list"

    def __init__(self, completions):
        self.completions = completions

    def generate(self, prompt_ids, num_samples, settings):
        return [list(c) for c in self.completions]


@pytest.mark.parametrize("name", list(COLUMNS))
def test_loaders_normalise_golds_identically(name):
    question_column, answer_column = COLUMNS[name]
    train = load_math_dataset(
        FIXTURES / name / "test.jsonl", question_column=question_column, answer_column=answer_column
    )
    assert train["answer"] == [p.answer for p in load_benchmark(name, FIXTURES / name)]


@pytest.mark.parametrize("name", list(COLUMNS))
def test_reward_and_evaluation_score_alike(name, tokenizer):
    problems = load_benchmark(name, FIXTURES / name)
    question_column, answer_column = COLUMNS[name]
    train = load_math_dataset(
        FIXTURES / name / "test.jsonl", question_column=question_column, answer_column=answer_column
    )
    # per problem: a correct answer in another form, its near misses, the next problem's gold, and no answer
    completions = [
        [rf"\boxed{{{rewrite(p.answer)}}}"]
        + [rf"\boxed{{{wrong}}}" for _, wrong in near_misses(p.answer)]
        + [rf"\boxed{{{problems[(i + 1) % len(problems)].answer}}}", "no box here"]
        for i, p in enumerate(problems)
    ]
    width = min(len(c) for c in completions)
    completions = [c[:width] for c in completions]
    evaluated = evaluate_problems(
        ListBackend(completions), tokenizer, {name: problems}, SamplingSettings(max_new_tokens=4), {name: width}
    )
    eval_scores = [record["correct"] for record in evaluated["benchmarks"][name]["problems"]]
    reward_scores = [
        math_verify_reward(texts, answer=[gold] * len(texts)) for texts, gold in zip(completions, train["answer"])
    ]
    assert reward_scores == eval_scores
    assert all(scores[0] == 1.0 and sum(scores) == 1.0 for scores in eval_scores)  # only the rewrite is right
