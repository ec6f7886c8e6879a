"""The long-completion task (dhpo_trl/demo/long_arithmetic.py, long_task.py): lengths, splits, golds checked by an
independent evaluation, the reward on the taught scratchpad, a short run through `python -m dhpo_trl --task long`."""

import ast
import collections
import dataclasses
import itertools
import json
import random
import re
import statistics

import pytest

from dhpo_trl.demo import embedded, long_task
from dhpo_trl.demo.long_arithmetic import ChainProblem, LengthSettings, generate_chains, make_chain_splits
from dhpo_trl.demo.long_task import LongSettings
from dhpo_trl.demo.tiny import build_char_tokenizer

SETTINGS = LongSettings()
TRAIN, HELDOUT = make_chain_splits(SETTINGS.num_train, SETTINGS.num_heldout, seed=0, lengths=SETTINGS.lengths())


def evaluate(question: str) -> int:
    """The question's value, by Python's own parser: "start S, add D, steps a to X" as the sum S + D + ... + D, one D
    per letter from a to X."""
    match = re.fullmatch(r"start (\d+), add (\d), steps a to ([a-z])", question)
    start, step, last = match.groups()
    expression = start + f"+{step}" * (ord(last) - ord("a") + 1)
    tree = ast.parse(expression, mode="eval")

    def value(node):
        if isinstance(node, ast.BinOp):
            assert isinstance(node.op, ast.Add)
            return value(node.left) + value(node.right)
        assert isinstance(node, ast.Constant)
        return node.value

    return value(tree.body)


def test_completion_lengths_are_long_and_long_tailed():
    tokenizer = build_char_tokenizer()
    lengths = [len(tokenizer(p.target_completion())["input_ids"]) + 1 for p in TRAIN]  # + end of text
    assert 30 <= min(lengths) <= 45 and 300 <= max(lengths) < SETTINGS.max_completion_length
    assert statistics.median(lengths) >= 100
    assert statistics.fmean(lengths) > statistics.median(lengths)  # skewed to the right
    assert sorted(lengths)[int(0.95 * len(lengths))] > 2 * statistics.median(lengths)  # a tail


def test_heldout_problems_are_disjoint_from_training_and_deterministic():
    assert not set(TRAIN) & set(HELDOUT)
    assert len(set(TRAIN)) == len(TRAIN) and len(set(HELDOUT)) == len(HELDOUT)
    again = make_chain_splits(SETTINGS.num_train, SETTINGS.num_heldout, seed=0, lengths=SETTINGS.lengths())
    assert again == (TRAIN, HELDOUT)
    assert make_chain_splits(50, 10, seed=1)[1] != HELDOUT[:10]


LINE = re.compile(r"([a-z])(.) (\d+)\+(\d+)=(\d+)")  # label, mark, two summands, total


def test_gold_and_every_scratchpad_line_agree_with_an_independent_evaluation():
    """Every taught scratchpad, whatever its free choices: the labels in order, one summand the previous total and
    the other the step, each total the value of the problem stopped at that step, the gold boxed at the end."""
    rng = random.Random(7)
    for problem in TRAIN[:300] + HELDOUT:
        assert int(problem.answer) == evaluate(problem.question)
        for completion in (problem.target_completion(), problem.sample_completion(rng)):
            lines = completion.strip().split("\n")
            assert lines[-1] == f"\\boxed{{{evaluate(problem.question)}}}"
            previous = problem.start
            for index, line in enumerate(lines[:-1]):
                label, mark, first, second, after = LINE.fullmatch(line).groups()
                assert label == "abcdefghijklmnopqrstuvwxyz"[index] and mark in ":)."
                assert len(line) == len("a: 017+8=025")  # every choice has the same width
                assert sorted([int(first), int(second)]) == sorted([previous, problem.step])
                partial = problem.question.rsplit(" ", 1)[0] + " " + label  # the same problem stopped at this step
                assert evaluate(partial) == int(after)
                previous = int(after)
            assert len(lines) - 1 == problem.count
            assert problem.accepts(completion)


def test_the_free_choices_are_taught_uniformly_and_independently():
    """Over many teaching draws each mark is a third of the lines and each order a half, whatever the line's
    neighbour chose: the warm start leaves the policy uncertain at those tokens."""
    rng = random.Random(3)
    lines = [LINE.fullmatch(line).groups() for problem in TRAIN[:400]
             for line in problem.sample_completion(rng).strip().split("\n")[:-1]]  # fmt: skip
    marks = collections.Counter(mark for _, mark, *_ in lines)
    step_first = [int(first) == problem_step for (_, _, first, _, _), problem_step in
                  zip(lines, [p.step for p in TRAIN[:400] for _ in range(p.count)], strict=True)]  # fmt: skip
    assert set(marks) == {":", ")", "."} and all(abs(n / len(lines) - 1 / 3) < 0.02 for n in marks.values())
    # a summand equal to the step on both sides (total 001-009 with the same step) counts as step first: rare
    assert abs(statistics.fmean(step_first) - 0.5) < 0.03
    pairs = collections.Counter((a[1], b[1]) for a, b in itertools.pairwise(lines))
    assert all(abs(n / sum(pairs.values()) - 1 / 9) < 0.02 for n in pairs.values())


def test_accepts_only_right_scratchpads_and_bounds_its_work():
    problem = ChainProblem(start=95, step=3, count=3)
    right = problem.write([(")", True), (".", False), (":", True)])
    assert right == " a) 3+095=098\nb. 098+3=101\nc: 3+101=104\n\\boxed{104}"
    assert problem.accepts(right)
    for wrong in (right.replace("101", "102"),  # a wrong total (and the next line's summand)
                  right.replace("b.", "b;"),  # a mark that is not taught
                  right.replace("b.", "c."),  # a wrong label
                  right.replace("\nb. 098+3=101", ""),  # a missing line
                  right.replace("104}", "105}"),  # the wrong answer boxed
                  right[1:],  # no leading space
                  right + " " * 10**6):  # hostile length: refused by its length
        assert not problem.accepts(wrong)


def test_the_warm_start_teaches_drawn_choices_on_the_completion_only():
    from dhpo_trl.demo import warmstart

    tokenizer = build_char_tokenizer()
    problems = TRAIN[:40]
    batch = warmstart._batch(tokenizer, problems, random.Random(0))
    taught = []
    for problem, labels in zip(problems, batch["labels"].tolist(), strict=True):
        ids = [i for i in labels if i != -100]
        assert ids[-1] == tokenizer.eos_token_id
        taught.append(tokenizer.decode(ids[:-1]))
        assert problem.accepts(taught[-1])  # the prompt is not taught, the completion is a right scratchpad
    marks = collections.Counter(LINE.fullmatch(line).group(2) for text in taught for line in text.strip().split("\n")[:-1])
    assert set(marks) == {":", ")", "."}
    assert sum(text != p.target_completion() for p, text in zip(problems, taught, strict=True)) >= 35


def test_a_changed_set_of_free_choices_changes_the_warm_start_cache_key(monkeypatch):
    from dhpo_trl.demo import long_arithmetic
    from dhpo_trl.demo.warmstart import WarmStartSettings

    key = WarmStartSettings(problems=TRAIN[:30]).cache_key()
    assert WarmStartSettings(problems=TRAIN[:30]).cache_key() == key
    monkeypatch.setattr(long_arithmetic, "MARKS", (":", ")"))
    assert WarmStartSettings(problems=TRAIN[:30]).cache_key() != key


def test_bad_length_settings_are_refused():
    with pytest.raises(ValueError, match="max_steps=27"):
        LengthSettings(max_steps=27)
    with pytest.raises(ValueError, match="median_steps=0"):
        LengthSettings(median_steps=0)
    with pytest.raises(ValueError, match="widen the step range"):
        generate_chains(901, seed=0, lengths=LengthSettings(min_steps=1, max_steps=1))  # 900 distinct problems


def test_a_problem_reads_as_its_steps():
    problem = ChainProblem(start=95, step=3, count=3)
    assert problem.prompt == "Q: start 95, add 3, steps a to c\nA:"
    assert problem.target_completion() == " a: 095+3=098\nb: 098+3=101\nc: 101+3=104\n\\boxed{104}"
    assert len({problem.sample_completion(random.Random(seed)) for seed in range(50)}) > 30  # of 6**3 = 216 variants


TINY = LongSettings(num_train=24, num_heldout=4, hidden_size=16, warmup_steps=2, warmup_target_accuracy=None,
                    warmup_batch_size=4, max_steps=2, prompts_per_generation=2, num_generations=2,
                    steps_per_generation=2, max_completion_length=24, eval_every=1)  # fmt: skip


def test_the_long_task_runs_through_the_command(tmp_path, monkeypatch):
    """`python -m dhpo_trl --task long` trains on the chain problems (tiny settings: a smoke of the run path)."""
    import dhpo_trl.demo.long_task as long_task

    monkeypatch.setattr(long_task, "LongSettings", lambda: TINY)
    out = tmp_path / "run"
    assert embedded.main(["--task", "long", "--output-dir", str(out), "--cache-dir", str(tmp_path / "cache")]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "long" and summary["optimizer_steps"] == 2
    assert summary["settings"] == json.loads(json.dumps({**dataclasses.asdict(TINY), "max_steps": 2, "eval_every": 1}))
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    steps = [e for e in history if "loss" in e]
    assert all(e["off_policy/log_ratio_spread"] >= 0 for e in steps)
    assert (out / "checkpoint-final" / "README.md").read_text().count("tiny-qwen3-long-DHPO-E") >= 1


def _rule_completion(prompt: str) -> str:
    """A stand-in policy, right exactly on the problems whose start is a multiple of 3."""
    start, step, last = re.search(r"start (\d+), add (\d), steps a to ([a-z])", prompt).groups()
    total = int(start) + int(step) * (ord(last) - ord("a") + 1)
    return f" \\boxed{{{total if int(start) % 3 == 0 else total + 1}}}"


def test_the_final_heldout_set_is_disjoint_scored_on_itself_and_keeps_the_warm_start(tmp_path, monkeypatch):
    """`run_embedded(final_heldout=N)` scores N further problems, none a training or curve problem, with an accuracy
    that is its own count of right answers over N, and starts from the warm start a run without the set caches."""
    train, heldout = make_chain_splits(TINY.num_train, TINY.num_heldout, seed=0, lengths=TINY.lengths())
    plain = embedded.run_embedded("GRPO", settings=TINY, output_dir=tmp_path / "plain", cache_dir=tmp_path / "cache",
                                  disable_tqdm=True)  # fmt: skip
    calls = []

    def policy(model, tokenizer, prompts, max_new_tokens):
        calls.append(list(prompts))
        return [_rule_completion(p) for p in prompts]

    monkeypatch.setattr(embedded, "greedy_completions", policy)
    summary = embedded.run_embedded("GRPO", settings=TINY, output_dir=tmp_path / "final", cache_dir=tmp_path / "cache",
                                    disable_tqdm=True, final_heldout=30)  # fmt: skip
    assert summary["warm_start_from_cache"] and summary["warm_start_key"] == plain["warm_start_key"]
    final_prompts = calls[-1]  # the last greedy evaluation is the final set's, batched by length
    used = {p.prompt for p in (*train, *heldout)}
    assert len(final_prompts) == len(set(final_prompts)) == 30 and not set(final_prompts) & used
    in_order = [p.prompt for p in TINY.final_heldout(30, train, heldout)]  # the set's order, which the scores keep
    assert set(in_order) == set(final_prompts) and in_order != final_prompts
    right = [int(re.search(r"start (\d+)", p).group(1)) % 3 == 0 for p in in_order]
    assert 0 < sum(right) < 30  # the count can tell sets apart
    final = summary["final_heldout"]
    assert final["num_problems"] == 30 and final["correct"] == "".join("1" if r else "0" for r in right)
    assert final["accuracy"] == pytest.approx(sum(right) / 30, abs=1e-12)
    saved = json.loads((tmp_path / "final" / "summary.json").read_text())
    assert saved["final_heldout"] == final and plain["final_heldout"] is None


def test_the_final_heldout_set_of_the_study_task_avoids_its_splits_and_is_deterministic():
    first = SETTINGS.final_heldout(2000, TRAIN, HELDOUT)
    assert first == SETTINGS.final_heldout(2000, TRAIN, HELDOUT) and len(set(first)) == 2000
    assert not set(first) & {*TRAIN, *HELDOUT}
    assert SETTINGS.final_heldout(100, TRAIN, HELDOUT) == first[:100]  # a larger set extends a smaller one


def test_a_final_heldout_set_that_cannot_act_is_refused_before_the_warm_start(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "load_task", lambda *a, **k: pytest.fail("warm start before checking final_heldout"))
    with pytest.raises(ValueError, match="final_heldout=5: EmbeddedSettings has no final held-out set"):
        embedded.run_embedded("GRPO", output_dir=tmp_path, final_heldout=5)
    with pytest.raises(ValueError, match="final_heldout=0 must be a positive integer"):
        embedded.run_embedded("GRPO", settings=TINY, output_dir=tmp_path, final_heldout=0)


def test_scores_batched_by_length_come_back_in_the_problems_order(monkeypatch):
    problems = generate_chains(9, seed=5, lengths=SETTINGS.lengths())
    calls = []

    def policy(model, tokenizer, prompts, max_new_tokens):
        calls.append(list(prompts))
        return [_rule_completion(p) for p in prompts]

    monkeypatch.setattr(embedded, "greedy_completions", policy)

    class Model:
        training = False

        def eval(self):
            pass

        def train(self, mode):
            pass

    scores = embedded.greedy_scores(Model(), "tok", problems, max_new_tokens=9, batch_size=4, by_length=True)
    assert scores == [float(p.start % 3 == 0) for p in problems] and 0 < sum(scores) < 9
    lengths = [[len(p.target_completion()) for p in problems if p.prompt in batch] for batch in calls]
    assert [len(b) for b in calls] == [4, 4, 1] and all(max(a) <= min(b) for a, b in itertools.pairwise(lengths))
    assert sorted(p for batch in calls for p in batch) == sorted(p.prompt for p in problems)


# Every setting away from its default: the step range 3-4 lines, not the default 2-26.
NARROW = LongSettings(num_train=40, num_heldout=6, median_steps=3.0, sigma=0.2, min_steps=3, max_steps_per_problem=4,
                      hidden_size=16, num_layers=1, warmup_steps=7, warmup_batch_size=5, warmup_learning_rate=1e-3,
                      warmup_target_accuracy=0.25, warmup_check_every=3)  # fmt: skip


def test_the_length_settings_are_the_ones_given():
    assert NARROW.lengths() == LengthSettings(median_steps=3.0, sigma=0.2, min_steps=3, max_steps=4)


def test_load_task_hands_its_settings_to_the_splits_and_the_warm_start(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(long_task, "load_or_warm_start", lambda warm, **kwargs: seen.update(warm=warm, **kwargs) or 7)
    train, heldout, warm = NARROW.load_task(cache_dir=tmp_path)
    assert (len(train), len(heldout), warm) == (40, 6, 7)
    assert {problem.count for problem in train + heldout} <= {3, 4}
    given = seen.pop("warm")
    assert (given.hidden_size, given.num_layers, given.steps, given.batch_size, given.learning_rate,
            given.target_accuracy, given.check_every, given.problems) == (16, 1, 7, 5, 1e-3, 0.25, 3, train)
    assert seen == {"cache_dir": tmp_path, "use_cache": True, "log": print}  # the warm start's progress printed
    _, fewer, _ = NARROW.load_task(2, use_cache=False)
    assert len(fewer) == 2 and (seen["cache_dir"], seen["use_cache"]) == (None, False)


def test_the_final_heldout_set_takes_one_problem_and_the_length_settings():
    train, heldout = make_chain_splits(40, 6, seed=0, lengths=NARROW.lengths())
    assert len(NARROW.final_heldout(1, train, heldout)) == 1
    assert {problem.count for problem in NARROW.final_heldout(60, train, heldout)} <= {3, 4}
    with pytest.raises(ValueError, match="final_heldout=0"):
        NARROW.final_heldout(0, train, heldout)
