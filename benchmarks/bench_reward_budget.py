"""One reward call of many slow answers stays within its budget, and the quick answers in it keep their scores.

    python benchmarks/bench_reward_budget.py [--answers 256] [--budget 30] [--correct-at 200]

Each slow answer is a distinct integral that the guards let through and sympy cannot settle within the deadline; the
answer at `--correct-at` is a correct one. Prints the wall and CPU time of the call (this process and its workers),
the correct answer's score and the grading counts; then the same call again (every slow answer cached).
"""

from __future__ import annotations

import argparse
import resource
import time

from dhpo_trl.scoring import rewards


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=256)
    parser.add_argument("--budget", type=float, default=None, help="budget_s (default: the reward's default)")
    parser.add_argument("--correct-at", type=int, default=200)
    args = parser.parse_args()
    completions = [
        rf"\boxed{{\int_{{0}}^{{1}} x^{{{k}}} e^{{x}} \sin(3 x) \cos(5 x) \, dx}}" for k in range(1, args.answers + 1)
    ]
    completions[args.correct_at] = r"\boxed{12}"
    reward = rewards.make_math_verify_reward(budget_s=args.budget)
    rewards.score_answer(r"\boxed{1}", "1")  # the workers start outside the measured call
    rewards.pop_grading_counts()
    for label in ("first call", "same answers again"):
        wall, cpu = time.perf_counter(), _cpu()
        scores = reward(completions, answer=["12"] * len(completions))
        wall, cpu = time.perf_counter() - wall, _cpu() - cpu
        print(
            f"{label}: {len(completions)} answers, wall {wall:.1f} s, cpu {cpu:.2f} s (trainer process), correct answer scored "
            f"{scores[args.correct_at]}, others {sum(scores) - scores[args.correct_at]}, "
            f"counts {rewards.pop_grading_counts()}"
        )


if __name__ == "__main__":
    main()
