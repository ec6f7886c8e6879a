"""Sample, score and aggregate: the part of an evaluation shared by the CLI and the training callback.

Prompts use the SimpleRL format from `dhpo_trl.scoring.data.format_prompt`; completions are scored by
`dhpo_trl.scoring.rewards.score_answer`, the function the training reward uses, against the normalised gold, whatever
backend sampled them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..scoring.data import format_prompt
from ..scoring.rewards import FALLBACKS, extract_answer, score_answer
from .backends import SamplingSettings
from .benchmarks import BENCHMARKS, Problem
from .metrics import average_score, benchmark_score


def encode_prompts(tokenizer, questions: Sequence[str]) -> list[list[int]]:
    """SimpleRL prompt token ids, identical for every backend."""
    encoded = []
    for question in questions:
        prompt = format_prompt(question, tokenizer)
        if isinstance(prompt, list):
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            # The rendered chat template already holds its special tokens; adding them again would double a BOS.
            encoded.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            encoded.append(tokenizer(prompt)["input_ids"])
    return encoded


def evaluate_problems(
    backend,
    tokenizer,
    problems_by_benchmark: Mapping[str, Sequence[Problem]],
    settings: SamplingSettings,
    samples: Mapping[str, int] | None = None,
    *,
    fallback: str = "none",
    log=None,
) -> dict:
    """Scores per benchmark (percent), their mean, and per-problem completions, predictions and correctness.

    `samples[name]` overrides the paper's samples per problem (Avg@32 for AIME, Avg@4 for AMC23, one otherwise).
    `fallback="last_number"` reads the last number of a completion without a `\\boxed{}`, as SimpleRL-Zoo's
    evaluation does; the default scores such a completion 0, as the training reward does.
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}.")
    samples = dict(samples or {})
    results = {}
    for name, problems in problems_by_benchmark.items():
        spec = BENCHMARKS[name]
        num_samples = samples.get(name, spec.num_samples)
        if num_samples < 1:
            raise ValueError(f"samples for '{name}' must be >= 1, got {num_samples}.")
        if log:
            log(f"[{name}] sampling {len(problems)} problems x {num_samples} ...")
        completions = backend.generate(
            encode_prompts(tokenizer, [p.question for p in problems]), num_samples, settings
        )
        if len(completions) != len(problems):
            raise ValueError(
                f"[{name}] the backend returned samples for {len(completions)} problems, expected {len(problems)}."
            )
        records = []
        for problem, texts in zip(problems, completions):
            if len(texts) != num_samples:  # a short count would silently turn Avg@k into an average over fewer
                raise ValueError(
                    f"[{name}] the backend returned {len(texts)} samples for problem {problem.index}, "
                    f"expected {num_samples}."
                )
            correct = [score_answer(text, problem.answer, fallback=fallback) for text in texts]
            records.append(
                {
                    "index": problem.index,
                    "question": problem.question,
                    "answer": problem.answer,
                    "completions": texts,
                    "predictions": [extract_answer(text, fallback) for text in texts],
                    "correct": correct,
                    "score": sum(correct) / len(correct),
                }
            )
        score = benchmark_score([record["correct"] for record in records])
        results[name] = {
            "score": score,
            "metric": spec.metric_label(num_samples),
            "header": spec.header(num_samples),
            "num_problems": len(records),
            "samples_per_problem": num_samples,
            "num_samples": sum(len(record["correct"]) for record in records),
            "problems": records,
        }
        if log:
            log(f"[{name}] {spec.metric_label(num_samples)} = {score:.1f}")
    average = average_score({name: result["score"] for name, result in results.items()})
    return {"benchmarks": results, "average": average, "average_over": list(results)}
