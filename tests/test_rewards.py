r"""The math-verify reward: equivalences that must score 1, near misses that must score 0, and hard time bounds."""

import threading
import time

import pytest

from dhpo_trl.rewards import DEFAULT_TIMEOUT_S, extract_boxed_answer, math_verify_reward, score_answer

# A pathological answer may take at most the per-sample deadline plus process/IPC slack.
TIME_BOUND_S = DEFAULT_TIMEOUT_S + 2.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so the answer is $\boxed{42}$.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{1}, then \boxed{2}", "2"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{a^{b^{c}}}", "a^{b^{c}}"),
        (r"\boxed {7}", "7"),
        (r"\boxed 7$ done", "7"),
        (r"\fbox{3}", "3"),
        (r"\boxed{1} and finally \boxed{", None),  # cut off: the last box is unterminated
        ("no box at all", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_boxed_answer(text, expected):
    assert extract_boxed_answer(text) == expected


@pytest.mark.parametrize(
    ("completion", "truth"),
    [
        (r"Thus $\boxed{\frac{1}{2}}$.", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{1/2}", r"\frac12"),
        (r"\boxed{\dfrac{3}{4}}", "0.75"),
        (r"\boxed{\sqrt{2}}", r"\sqrt 2"),
        (r"\boxed{2\sqrt{3}}", r"\sqrt{12}"),
        (r"\boxed{\pi}", r"\pi"),
        (r"\boxed{5\text{ cm}}", "5"),
        (r"\boxed{30^\circ}", "30"),
        (r"\boxed{50\%}", "50"),
        (r"\boxed{27}", 27.0),
        (r"\boxed{27}", 27),
        (r"\boxed{27}", "27.0"),
        (r"\boxed{(1,2)}", "(1, 2)"),
        (r"\boxed{\{1, 2\}}", r"\{2,1\}"),
        (r"\boxed{1} then on reflection \boxed{2}", "2"),
        (r"\boxed{4}", ["four", "4"]),
        (r"\boxed{3}", r"$\boxed{3}$"),
        ([{"role": "assistant", "content": r"So \boxed{6}."}], "6"),
    ],
)
def test_equivalent_answers_score_one(completion, truth):
    assert score_answer(completion, truth) == 1.0


@pytest.mark.parametrize(
    ("completion", "truth"),
    [
        (r"\boxed{2} then on reflection \boxed{1}", "2"),  # only the last box counts
        ("the answer is 2", "2"),  # no box
        (r"\boxed{0.51}", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{3}}", r"\sqrt{2}"),
        (r"\boxed{B}", "A"),
        (r"\boxed{7", "7"),  # unterminated
        (r"\boxed{}", "0"),
        (r"\boxed{3}", None),
        (r"\boxed{3}", ""),
        (r"\boxed{3}", []),
        (None, "3"),
        (12345, "3"),
        ("\x00\x01 }{ \\boxed{ {{ garbage", "3"),
        ([{"role": "user", "content": r"\boxed{6}"}], "6"),  # only assistant turns are the completion
    ],
)
def test_wrong_missing_or_garbage_answers_score_zero(completion, truth):
    assert score_answer(completion, truth) == 0.0


def test_reward_function_signature_and_broadcasting():
    completions = [r"\boxed{2}", r"\boxed{3}", "nothing"]
    assert math_verify_reward(completions, answer=["2", "2", "2"]) == [1.0, 0.0, 0.0]
    conversational = [[{"role": "assistant", "content": r"\boxed{\frac{2}{4}}"}]]
    assert math_verify_reward(conversational, answer=["0.5"], prompts=["p"], trainer_state=None) == [1.0]
    # A wrong number of answers scores the unmatched completions 0 instead of raising mid-training.
    assert math_verify_reward(completions, answer=["2"]) == [1.0, 0.0, 0.0]
    assert math_verify_reward(completions) == [0.0, 0.0, 0.0]


def test_megabyte_completion_is_fast():
    completion = "reasoning " * 100_000 + r"\boxed{42}"  # 1 MB
    start = time.perf_counter()
    assert score_answer(completion, "42") == 1.0
    assert time.perf_counter() - start < 1.0
    unterminated = "{" * 1_000_000 + r"\boxed{" + "{" * 1_000_000
    start = time.perf_counter()
    assert score_answer(unterminated, "42") == 0.0
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "answer",
    [r"9^{9^{9^{9}}}", r"(10^{10})!", "(" * 400 + "1" + ")" * 400],
    ids=["power-tower", "huge-factorial", "deep-parentheses"],
)
def test_pathological_answers_are_cut_off_by_the_deadline(answer):
    start = time.perf_counter()
    assert score_answer(r"\boxed{" + answer + "}", "2") == 0.0
    assert time.perf_counter() - start < TIME_BOUND_S


def test_bounded_and_correct_off_the_main_thread():
    """TRL runs async reward functions in a thread, where SIGALRM cannot interrupt: a worker process does."""
    results, elapsed = {}, {}

    def score_in_thread():
        start = time.perf_counter()
        results["values"] = [
            score_answer(r"\boxed{\frac{1}{2}}", "0.5"),
            score_answer(r"\boxed{9^{9^{9^{9}}}}", "2"),  # overruns: worker is stopped
            score_answer(r"\boxed{\pi}", r"\pi"),  # a fresh worker answers
        ]
        elapsed["s"] = time.perf_counter() - start

    thread = threading.Thread(target=score_in_thread)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert results["values"] == [1.0, 0.0, 1.0]
    # two worker start-ups (~1 s each on a shared CPU) plus one deadline
    assert elapsed["s"] < 2 * 5.0 + TIME_BOUND_S


def test_main_thread_timer_is_restored():
    import signal

    signal.setitimer(signal.ITIMER_REAL, 100.0)
    try:
        assert score_answer(r"\boxed{1}", "1") == 1.0
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 90.0 < remaining <= 100.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def test_a_stuck_worker_is_killed_at_the_deadline():
    """A comparison stuck in C code ignores SIGALRM; the caller then kills the worker instead of waiting."""
    import subprocess
    import sys

    from dhpo_trl.rewards import _VerifyWorker

    worker = _VerifyWorker()
    stuck = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfor line in sys.stdin: time.sleep(600)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
    )  # fmt: skip
    worker._process = stuck
    start = time.perf_counter()
    assert worker.answers_match("1", ["1"], timeout_s=0.2) is False
    assert time.perf_counter() - start < 0.2 + 1.0 + 1.0
    assert stuck.poll() is not None  # killed
    assert worker._process is None  # the next request starts a fresh worker


def test_deadline_survives_a_swallowed_alarm(monkeypatch):
    """An alarm raised where Python swallows it (a weakref callback) must not disarm the deadline."""
    from dhpo_trl import _math_verify_core as core

    def swallows_first_alarm_then_spins(answer, truths):
        try:
            while True:
                time.sleep(0.001)
        except core._DeadlineExceeded:
            pass  # swallowed, as Python does for exceptions in weakref callbacks
        while True:  # the parse goes on
            time.sleep(0.001)

    monkeypatch.setattr(core, "answers_match", swallows_first_alarm_then_spins)
    start = time.perf_counter()
    assert core.answers_match_with_deadline("1", ["1"], timeout_s=0.2) is False
    assert time.perf_counter() - start < 1.0
