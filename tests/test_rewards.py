r"""The one scoring function (reward and evaluation): equivalences that must score 1, near misses that must score 0,
SimpleRL-Zoo's no-box fallback as an option, loader/reward edge cases, and hard time bounds."""

import os
import threading
import time

import pytest

import dhpo_trl
from dhpo_trl.scoring.rewards import (
    DEFAULT_TIMEOUT_S,
    completion_text,
    extract_answer,
    extract_boxed_answer,
    gold_text,
    math_verify_reward,
    score_answer,
)

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
        (r"\boxed{\{1, 2}", r"\{1, 2"),  # an escaped brace that is never closed is text, not a group
        (r"\boxed{x \}", None),  # the only closing brace is escaped: the box never closes
        (r"\boxed{a \} b}", r"a \} b"),
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
        (r"\boxed{2\pi r \text{ cm}}", r"2\pi r"),  # a formula with a unit: the unit is dropped, its variable kept
        ("\\boxed{\u22125}", "-5"),  # a Unicode minus sign
        ("\\boxed{2\u03c0}", r"2\pi"),  # a Unicode pi
        (r"\boxed{\$5}", "5"),  # an escaped dollar sign
        (r"\boxed{\displaystyle \frac{1}{2}}", "0.5"),
        (r"\boxed{1\!000}", "1000"),  # a negative thin space
        (r"\boxed{30^\circ}", "30"),
        (r"\boxed{50\%}", "50"),
        (r"\boxed{27}", 27.0),
        (r"\boxed{27}", 27),
        (r"\boxed{27}", "27.0"),
        (r"\boxed{(1,2)}", "(1, 2)"),
        (r"\boxed{\{1, 2\}}", r"\{2,1\}"),
        (r"\boxed{1} then on reflection \boxed{2}", "2"),
        (r"\boxed{1, 2}", ["1", "", "  ", "2"]),  # a list is one answer with components; blanks dropped
        (r"\boxed{\{2, 1\}}", ("1", "2")),  # a tuple means the same
        (r"\boxed{4.5 \times 10^{33}}", "4.5e33"),  # e-notation gold
        (r"\boxed{3 \cdot 10^{6}}", "3e6"),
        (r"\boxed{4.5e33}", r"4.5 \times 10^{33}"),  # e-notation answer
        (r"\boxed{-\frac{1}{3}}", "-1./3"),  # Python-syntax gold
        (r"\boxed{\arcsin\left(\frac{10}{13}\right)}", "np.arcsin(10/13)"),
        (r"\boxed{(-\infty, 0) \cup \{1\}}", r"$(-\infty, 0) \cup\{1\}$."),  # trailing full stop
        (r"\boxed{52_8}", "52_{8}"),  # base subscripts
        (r"\boxed{(52)_{8}}", "52_8"),
        (r"\boxed{(1E)_{16}}", "1E_{16}"),  # a last digit E is no symbol E_16
        (r"\boxed{1E}", "1E_{16}"),
        (r"\boxed{52}", "52_8"),  # the question fixed the base
        (r"\boxed{\frac{2}{3}E_2 + \frac{1}{3}E_1}", r"\frac{1}{3} E_{1}+\frac{2}{3} E_{2}"),  # structure kept
        (r"\boxed{E_2, E_1}", "E_{1},E_{2}"),
        (r"\boxed{62.5}", r"62.5\%"),  # percentages: the number, or the fraction
        (r"\boxed{0.625}", r"62.5\%"),
        (r"\boxed{62.5\%}", "0.625"),
        (r"\boxed{90°}", r"90^\circ"),  # degrees
        (r"\boxed{90 \text{ degrees}}", "90"),
        (r"\boxed{12 \text{ cm}^2}", "12"),  # units text
        (r"\boxed{\$18.90}", r"\$18.90"),
        (r"\boxed{C}", r"\text{(C)}"),  # multiple-choice letters
        (r"\boxed{\textbf{(C)} Plane}", r"\text{(C)}"),
        (r"\boxed{(c)}", r"\text{(C)}"),
        (r"\boxed{\text{Evelyn}}", r"\text{evelyn}"),  # words
        (r"\boxed{\text{northeast}}", r"\text{North-East}"),  # only letters and digits count in words
        (r"\boxed{1,450,000}", "1450000"),  # thousands separators
        (r"\boxed{x = 5}", "5"),
        (r"\boxed{2x + 3}", "y = 2x + 3"),
        (r"\boxed{6m}", "6m"),  # a variable m, not metres
        (r"\boxed{\frac{37 m}{4}}", r"\frac{37}{4} m"),
        (r"\boxed{0 = x' + \frac{r}{V} x - r c}", r"x^{\prime}+\frac{r}{V} x-r c=0"),  # c is the gold's variable
        (r"\boxed{2 i + 1}", "1+2i"),
        (r"\boxed{i2}", "2i"),  # the gold's i is imaginary, so the answer's is too (math-verify sees no lone i in i2)
        (r"\boxed{0.33333}", r"\frac{1}{3}"),  # decimals: relative 1e-4, as SimpleRL-Zoo
        (r"\boxed{2.8800 \times 10^{-19}}", "2.88e-19"),
        (r"\boxed{3}", r"$\boxed{3}$"),
        ([{"role": "assistant", "content": r"So \boxed{6}."}], "6"),
        (r"\boxed{\frac{dy_{1}}{dt} = 2y_1}", r"\frac{d y_1}{d t}=2 y_{1}"),  # one derivative symbol, however braced
        (r"\boxed{2 M_{\Earth}}", r"2 M_{\text{Earth}}"),  # a command in a subscript reads as its name, capitals too
        (r"\boxed{2\lambda_{\alpha}}", r"2\lambda_\alpha"),  # a Greek letter in a subscript stays a Greek letter
        (r"\boxed{3 v_{\text{max }}}", r"3v_{max}"),  # spaces in a subscript do not count
        (r"\boxed{(\frac{1}{8}, 2)}", "(0.125, 2)"),  # inside a tuple, numbers compare as they do alone
        (r"\boxed{|x|}", r"\sqrt{x^2}"),  # variables are real numbers, as math-verify reads them
        (r"\boxed{\binom{6}{2} = 15 = 15}", "15"),  # a chain the parser refuses (15 = 15 is True): its last part
        (r"\boxed{y^{\prime\prime} + y = 0}", "y'' + y = 0"),  # primes however written, after capitals too
        (r"\boxed{Y^{\prime}}", "Y'"),
        (r"\boxed{\frac{1}{2}.}", "0.5"),  # a sentence's trailing punctuation inside the box
        (r"\boxed{12,}", "12"),
        (r"\boxed{x = 5;}", "5"),
        (r"\boxed{3:}", "3"),
        (r"\boxed{x=1 \quad \text{or} \quad x=2}", "1, 2"),  # LaTeX spacing is a space
        (r"\boxed{2\quad\pi}", r"2\pi"),
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
        (r"\boxed{6e3}", "3e6"),  # e-notation read as e x 3 used to match
        (r"\boxed{52_9}", "52_8"),  # a wrong base
        (r"\boxed{42}", "52_8"),  # 52 in base 8, written in base 10: the question asked for base 8
        (r"\boxed{\frac{2}{3}}", r"\frac{1}{3} E_{1}+\frac{2}{3} E_{2}"),  # a coefficient is not the answer
        (r"\boxed{E_1}", "E_{1},E_{2}"),
        (r"\boxed{1}", ["1", "", "2"]),  # one component of a list answer is not the answer
        (r"\boxed{6.25}", r"62.5\%"),
        (r"\boxed{D}", r"\text{(C)}"),
        (r"\boxed{Circle}", r"\text{(C)}"),
        (r"\boxed{west}", r"\text{east}"),
        (r"\boxed{1450001}", "1450000"),  # exact integers, however large
        (r"\boxed{2.89 \times 10^{-19}}", "2.88e-19"),  # relative, not absolute, tolerance
        (r"\boxed{0.3332}", r"\frac{1}{3}"),
        (r"\boxed{6}", "6m"),
        (r"\boxed{\frac{dx}{dt} = a - kx}", r"\frac{d x}{d t}=k x-a"),  # dx/dt is not the derivative of a constant
        (r"\boxed{\frac{dV}{dt} = 3}", r"\frac{dW}{dt} = 3"),  # the derivatives of two capitals are two symbols
        (r"\boxed{(0.123456, 2)}", "(0.123457, 2)"),  # ... and no further
        (r"\boxed{y' + 4y = 1}", "y'+4y=0"),
        (r"\boxed{\frac{1}{3}}", "unreadable gold: the sum of all happy numbers"),
        (r"\boxed{5}", r"\text{(C)} 5"),
        (r"\boxed{\binom{6}{2} = 15 = 15}", "16"),
        (r"\boxed{Y}", "Y'"),  # the parser would drop the quote
        (r"\boxed{0.5772}", r"\gamma"),  # a variable, not Euler's constant (which sympy names gamma)
        (r"\boxed{0.5772}", r"\Gamma"),
        (r"\boxed{(0.1234567, 2)}", "(0.1234568, 2)"),  # inside a tuple too, the gold's last digit is not free
    ],
)
def test_wrong_missing_or_garbage_answers_score_zero(completion, truth):
    assert score_answer(completion, truth) == 0.0


@pytest.mark.parametrize(
    ("text", "fallback", "expected"),
    [
        (r"so \boxed{12}, or 13", "last_number", "12"),  # a box always wins
        ("so the answer is 1,234.5 apples", "last_number", "1234.5"),  # SimpleRL's last-number fallback
        ("x = -3 and then .5", "last_number", ".5"),
        ("no number at all", "last_number", None),
        (r"first 3 then \boxed{4", "last_number", None),  # a box was written but cut off: no guess
        ("the answer is 7", "none", None),
    ],
)
def test_no_box_fallback_is_an_option(text, fallback, expected):
    assert extract_answer(text, fallback) == expected


def test_fallback_scores_and_unknown_fallbacks_are_refused():
    assert score_answer("The answer is 7.", "7") == 0.0
    assert score_answer("The answer is 7.", "7", fallback="last_number") == 1.0
    assert score_answer("The answer is 7.", "8", fallback="last_number") == 0.0
    with pytest.raises(ValueError, match="fallback must be one of"):
        score_answer(r"\boxed{7}", "7", fallback="last-number")


def test_messages_without_a_role_count_as_the_completion():
    assert score_answer([{"content": r"So \boxed{6}."}], "6") == 1.0
    assert score_answer([{"role": "user", "content": r"\boxed{5}"}, {"content": r"\boxed{6}"}], "6") == 1.0
    assert score_answer([{"role": "assistant", "content": [{"type": "text", "text": r"\boxed{6}"}]}], "6") == 1.0


def test_gold_text_is_normalised_once_and_list_golds_have_one_meaning():
    assert gold_text("4.5e33") == r"4.5 \times 10^{33}"
    assert gold_text(["$1$", "", "$2$"]) == gold_text(("1", "2")) == "1, 2"
    assert gold_text("He has 5 + 7 = 12 apples.\n#### 1,200") == "1200"
    assert gold_text("a #### b\n#### 7") == "7"  # more than one ####: the last one holds the answer
    assert gold_text(r"$\boxed{3}$") == "3"
    assert gold_text([]) is None and gold_text(float("nan")) is None


def test_reward_function_signature_and_broadcasting():
    completions = [r"\boxed{2}", r"\boxed{3}", "nothing"]
    assert math_verify_reward(completions, answer=["2", "2", "2"]) == [1.0, 0.0, 0.0]
    conversational = [[{"role": "assistant", "content": r"\boxed{\frac{2}{4}}"}]]
    assert math_verify_reward(conversational, answer=["0.5"], prompts=["p"], trainer_state=None) == [1.0]
    # A wrong number of answers scores the unmatched completions 0 instead of raising mid-training.
    assert math_verify_reward(completions, answer=["2"]) == [1.0, 0.0, 0.0]
    assert math_verify_reward(completions) == [0.0, 0.0, 0.0]


def grader_ready() -> None:
    """Every worker of the pool started and ready (one killed before is replaced): a timed call that follows pays
    no start, which takes tens of seconds on a loaded machine."""
    from dhpo_trl.scoring import rewards

    assert score_answer(r"\boxed{1}", "1") == 1.0
    for worker in rewards._POOL._workers:
        worker.ensure_ready()


def test_megabyte_completion_is_fast():
    grader_ready()  # a start is not the completion's cost
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
    grader_ready()
    start = time.perf_counter()
    assert score_answer(r"\boxed{" + answer + "}", "2") == 0.0
    assert time.perf_counter() - start < TIME_BOUND_S


def test_bounded_and_correct_off_the_main_thread():
    """TRL runs async reward functions in a thread, where SIGALRM cannot interrupt: a worker process does."""
    from dhpo_trl.scoring import rewards

    rewards._POOL.close()  # a fresh worker: the first answer's time is one worker start as the machine is now
    results, elapsed = {}, {}

    def score_in_thread():
        start = time.perf_counter()
        results["values"] = [score_answer(r"\boxed{\frac{1}{2}}", "0.5")]
        elapsed["start"] = time.perf_counter() - start
        results["values"] += [
            score_answer(r"\boxed{9^{9^{9^{9}}}}", "2"),  # overruns: worker is stopped
            score_answer(r"\boxed{\pi}", r"\pi"),  # a fresh worker answers
        ]
        elapsed["s"] = time.perf_counter() - start

    thread = threading.Thread(target=score_in_thread)
    thread.start()
    thread.join(timeout=600)
    assert not thread.is_alive()
    assert results["values"] == [1.0, 0.0, 1.0]
    # the start measured above, the spare's (started with the first worker, it may still be starting when it takes
    # over) and one deadline; a start-up takes about 1 s on a quiet CPU, tens of seconds on a loaded one
    assert elapsed["s"] < 2 * max(elapsed["start"], 1.0) + TIME_BOUND_S


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

    from dhpo_trl.scoring.rewards import _VerifyWorker

    worker = _VerifyWorker()
    import processes

    stuck = processes.popen(
        [sys.executable, "-c", "import sys, time\nfor line in sys.stdin: time.sleep(600)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
    )  # fmt: skip
    try:
        worker._process = stuck
        start = time.perf_counter()
        assert worker.answers_match("1", "1", timeout_s=0.2) is False
        assert time.perf_counter() - start < 0.2 + 1.0 + 1.0
        assert stuck.poll() is not None  # killed
        assert worker._process is None  # the next request starts a fresh worker
    finally:
        processes.kill_group(stuck)


def test_deadline_survives_a_swallowed_alarm(monkeypatch):
    """An alarm raised where Python swallows it (a weakref callback) must not disarm the deadline."""
    from dhpo_trl.scoring import _math_verify_core as core

    def swallows_first_alarm_then_spins(answer, gold):
        try:
            while True:
                time.sleep(0.001)
        except core._DeadlineExceeded:
            pass  # swallowed, as Python does for exceptions in weakref callbacks
        while True:  # the parse goes on
            time.sleep(0.001)

    monkeypatch.setattr(core, "answers_match", swallows_first_alarm_then_spins)
    start = time.perf_counter()
    assert core.answers_match_with_deadline("1", "1", timeout_s=0.2) is False
    assert time.perf_counter() - start < 1.0


# ------------------------------------------------------------------ extraction boundaries and forms
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\boxed{" + "1" * 1000 + "}", "1" * 1000),  # MAX_ANSWER_CHARS exactly: read
        (r"\boxed{" + "1" * 1001 + "}", None),  # one past: not parsed
        (r"\boxed " + "1" * 1000, "1" * 1000),
        (r"\boxed " + "1" * 1001, None),
        ("\\boxed" + " " * 8 + "{3}", "3"),  # spacing before the brace
        ("\\boxed" + " " * 9 + "{3}", "{3}"),  # one space more than allowed: no brace follows the command
        (r"\boxedX{3}", None),  # only spaces and tabs may stand between the command and its answer
        (r"\boxed3", None),  # a bare answer needs a space
        ("so \\boxed   ", None),  # spaces and then nothing
        ("\\boxed\t{3}", "3"),
        (r"\boxed{a\\}", r"a\\"),  # \\ is an escaped backslash: the brace after it closes
        (r"\boxed{\}}", r"\}"),
        (r"\boxed{\{}", r"\{"),
        (r"\boxed{}", ""),
        (r"\boxed{a}{b}", "a"),
        (r"\fbox{1} then \boxed{2}", "2"),  # whichever command comes last
        (r"\boxed{1} then \fbox{2}", "2"),
        (r"\boxed{\fbox{3}}", "3"),
        (r"\boxed 7 and more", "7"),
        (r"\boxed $", None),
        (r"\boxed", None),
        (r"\boxed{1} and \boxed", None),  # the last box has no answer: no earlier one instead
    ],
    ids=[f"box{i}" for i in range(22)],
)
def test_extract_boxed_answer_bounds_and_forms(text, expected):
    assert extract_boxed_answer(text) == expected


@pytest.mark.parametrize(
    ("completion", "text"),
    [
        ("plain", "plain"),
        ({"content": "one message"}, "one message"),
        ([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}], "a\nb"),
        ([{"role": "user", "content": "q"}, {"content": "a"}, {"role": "system", "content": "s"}], "a"),
        ([{"role": "assistant", "content": None}], ""),
        ([{"role": "assistant"}], ""),
        (["not a message", {"content": "kept"}], "kept"),
        (({"content": "a tuple"},), "a tuple"),
        (
            [{"content": [{"type": "text", "text": "a"}, {"type": "image"}, "s", {"text": 5}, {"text": "b"}]}],
            "a\nb",
        ),
        ([], ""),
        (None, None),
        (42, None),
    ],
    ids=[f"completion{i}" for i in range(12)],
)
def test_completion_text(completion, text):
    assert completion_text(completion) == text


def test_last_number_fallback_reads_the_last_ten_thousand_characters():
    assert extract_answer("12 " + "x" * 9997, "last_number") == "12"  # 10,000 characters: all read
    assert extract_answer("12 " + "x" * 9998, "last_number") == "2"  # 10,001: the first one is not
    assert extract_answer("a -3.5 b", "last_number") == "-3.5"
    assert extract_answer(r"a 3 \fbox{", "last_number") is None
    assert extract_answer(None, "last_number") is None
    with pytest.raises(ValueError) as error:
        extract_answer("7", "first_number")
    assert str(error.value) == "fallback must be one of ('none', 'last_number'), got 'first_number'."


def test_gold_text_bounds():
    assert gold_text("1" * 1000) == "1" * 1000
    assert gold_text("1" * 1001) is None  # an answer, not a derivation
    assert gold_text(["1", ["2", ""]]) == "1, 2"  # unhashable components: normalised without the cache
    assert gold_text([{"a": 1}]) is None
    assert gold_text(r"\fbox{7}") == "7"
    assert gold_text(" ") is None


# ------------------------------------------------------------------ equal values in other forms, near misses
@pytest.mark.parametrize(
    ("completion", "truth", "reward"),
    [
        (r"\boxed{\dfrac{1}{2}}", "0.5", 1.0),
        (r"\boxed{\tfrac{1}{2}}", "1/2", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.50", 1.0),
        (r"\boxed{\left(\frac{1}{2}\right)}", "0.5", 1.0),
        (r"\boxed{{{7}}}", "7", 1.0),  # nested braces
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{1000}", "1,000", 1.0),
        (r"\boxed{1{,}000}", "1000", 1.0),
        (r"\boxed{1000}", "1000.0", 1.0),
        (r"\boxed{10^3}", "1000", 1.0),
        (r"\boxed{[1, 2)}", "[1,2)", 1.0),  # intervals
        (r"\boxed{(1, 2]}", "[1,2)", 0.0),
        (r"\boxed{[0,1]}", "(0,1)", 0.0),
        (r"\boxed{x \in [0,1]}", "[0,1]", 1.0),
        (r"\boxed{(0, \infty)}", r"(0,\infty)", 1.0),
        (r"\boxed{+\infty}", r"\infty", 1.0),  # infinity alone: equal to itself, never to its negative
        (r"\boxed{-\infty}", r"-\infty", 1.0),
        (r"\boxed{-\infty}", r"\infty", 0.0),
        (r"\boxed{\infty}", r"-\infty", 0.0),
        (r"\boxed{10^{100}}", r"\infty", 0.0),
        (r"\boxed{1, 2, 3}", "3, 2, 1", 1.0),  # an unordered collection
        (r"\boxed{(1,2,3)}", "(1,2,3)", 1.0),  # a tuple is ordered
        (r"\boxed{(1,2,3)}", "(1,3,2)", 0.0),
        (r"\boxed{(1,2)}", "(2,1)", 0.0),
        (r"\boxed{-5}", "5", 0.0),
        ("\\boxed{\u22125}", "5", 0.0),
        (r"\boxed{0.5}", "1/3", 0.0),
        (r"\boxed{ }", "0", 0.0),  # a blank answer
        ("", "0", 0.0),
        ([], "0", 0.0),
        ({"content": r"\boxed{6}"}, "6", 1.0),
        ([{"role": "assistant", "content": None}], "6", 0.0),
    ],
    ids=[f"form{i}" for i in range(32)],
)
def test_equal_values_in_other_forms_and_near_misses(completion, truth, reward):
    score = score_answer(completion, truth)
    assert type(score) is float and score == reward


# ------------------------------------------------------------------ the verifier is called with what and how long
class FakePool:
    def __init__(self, result):
        self.result, self.calls = result, []

    def grade(self, pairs, timeout_s, budget_s, workers):
        self.calls.append((list(pairs), timeout_s))
        if isinstance(self.result, BaseException):
            raise self.result
        return dict.fromkeys(pairs, self.result)


def test_verifier_arguments_errors_and_timeouts(monkeypatch):
    """Every comparison goes to the worker process, with the extracted answer, the normalised gold and the deadline;
    from the main thread (where TRL calls the reward) and from any other thread alike."""
    from dhpo_trl.scoring import rewards

    worker = FakePool(True)
    monkeypatch.setattr(rewards, "_POOL", worker)
    assert DEFAULT_TIMEOUT_S == 2.0
    assert score_answer(r"so \boxed{\frac{1}{2}}.", "$0.5$.") == 1.0
    assert score_answer(r"\boxed{3}", "4.5e33", timeout_s=0.7) == 1.0
    assert math_verify_reward([r"\boxed{9}", "no box", r"\boxed{8}"], answer=["#### 9", "1", "8"]) == [1.0, 0.0, 1.0]
    out = []
    thread = threading.Thread(target=lambda: out.append(score_answer(r"\boxed{2}", "2", timeout_s=0.3)))
    thread.start()
    thread.join(10)
    assert out == [1.0]
    assert worker.calls == [
        ([(r"\frac{1}{2}", "0.5")], 2.0),
        ([("3", r"4.5 \times 10^{33}")], 0.7),
        ([("9", "9"), ("8", "8")], 2.0),  # one round trip for the whole list, the box-less completion not asked
        ([("2", "2")], 0.3),
    ]
    assert score_answer(r"\boxed{3}", None) == 0.0 and len(worker.calls) == 4  # no gold: the verifier is not asked
    assert score_answer(r"\boxed{ }", "0") == 0.0 and len(worker.calls) == 4  # nor for a blank answer
    assert score_answer("no box", "0") == 0.0 and len(worker.calls) == 4
    assert score_answer(r"\boxed{9^{9^{9}}}", "0") == 0.0 and len(worker.calls) == 4  # nor for a refused one
    for bad in (0, -1.0, float("inf"), float("nan"), "2"):
        with pytest.raises(ValueError, match="timeout_s"):
            score_answer(r"\boxed{3}", "3", timeout_s=bad)

    monkeypatch.setattr(rewards, "_POOL", FakePool(RuntimeError("parser crashed")))
    assert score_answer(r"\boxed{3}", "3") == 0.0  # a crash scores 0 instead of taking the step down
    assert math_verify_reward([r"\boxed{3}", r"\boxed{4}"], answer=["3", "4"]) == [0.0, 0.0]
    monkeypatch.setattr(rewards, "_POOL", FakePool(False))
    assert score_answer(r"\boxed{3}", "3") == 0.0  # a deadline overrun reads as no match
    unavailable = rewards.GraderUnavailableError("the grading worker process did not start")
    monkeypatch.setattr(rewards, "_POOL", FakePool(unavailable))
    with pytest.raises(rewards.GraderUnavailableError):  # loud: never an unbounded grade, never silent zeros
        math_verify_reward([r"\boxed{3}"], answer=["3"])


def test_reward_answers_broadcast_pad_and_truncate(caplog):
    import logging

    completions = [r"\boxed{1}", r"\boxed{2}"]
    assert math_verify_reward(completions, answer="2") == [0.0, 1.0]  # one gold for every completion
    assert math_verify_reward(completions, answer=("1", "2")) == [1.0, 1.0]  # a tuple column, one gold each
    assert math_verify_reward(iter(completions), answer=["1", "2"]) == [1.0, 1.0]  # read once
    assert math_verify_reward([], answer=[]) == []
    with caplog.at_level(logging.WARNING, logger="dhpo_trl.scoring.rewards"):
        assert math_verify_reward(completions, answer=["1", "2", "3"]) == [1.0, 1.0]
        assert math_verify_reward(completions, answer=["2"]) == [0.0, 0.0]
        assert math_verify_reward(5, answer=["1"]) == []
    advice = "unmatched completions score 0. Check that the dataset's answer column is named 'answer'."
    assert [record.getMessage() for record in caplog.records] == [
        f"math_verify_reward got 3 answers for 2 completions: {advice}",
        f"math_verify_reward got 1 answers for 2 completions: {advice}",
        "math_verify_reward: completions is not iterable; scoring nothing.",
    ]


def test_an_answer_column_that_cannot_be_read_scores_every_completion_0(caplog):
    import logging

    class UnreadableColumn(list):  # a list-like column whose rows fail to load
        def __iter__(self):
            raise OSError("the answer column could not be read")

    with caplog.at_level(logging.WARNING, logger="dhpo_trl.scoring.rewards"):
        rewards = math_verify_reward([r"\boxed{1}", r"\boxed{2}"], answer=UnreadableColumn(["1", "2"]))
    assert rewards == [0.0, 0.0]
    assert caplog.records == []  # as many (missing) answers as completions: no count warning


# ------------------------------------------------------------------ the worker process, with fake workers
FAKE_WORKER = r"""
import json, sys, time
log = open(sys.argv[0] + ".log", "a")
log.write("start\n"); log.flush()
mode = open(sys.argv[0] + ".mode").read()
if mode == "noisy":
    print("warning: noise on the worker's stderr", file=sys.stderr, flush=True)
if mode == "slow-start":
    time.sleep(30)
if mode == "stuck-and-slow-to-start":
    time.sleep(4.0)  # as a real worker importing sympy and math-verify on a loaded machine
print("hello" if mode == "wrong-greeting" else "ready", flush=True)
if mode == "exit-after-ready":
    sys.exit(0)
for line in sys.stdin:
    request = json.loads(line)
    log.write(line); log.flush()
    for index, (answer, gold) in enumerate(request["pairs"]):
        if mode == "slow-reply":
            time.sleep(request["timeout_s"] + 0.3)  # past its deadline, as a worker whose alarm fires at the end
        if mode == "slow-on-s" and answer.startswith("s"):
            time.sleep(0.4)  # a slow answer that still finishes within its deadline
        if mode in ("stuck-on-x", "stuck-and-slow-to-start") and answer == "x":
            time.sleep(600)  # C code that never returns to Python
        if mode == "stale":  # first a reply to an older request, and one to a wrong index
            print(f"{request['id'] - 1} {index} 1", flush=True)
            print(f"{request['id']} {index + 5} 1", flush=True)
        matched = {"padded": True, "ten": False}.get(mode, answer == gold)
        reply = f"{request['id']} {index} {'10' if mode == 'ten' else int(matched)}"
        print(f"  {reply}  " if mode == "padded" else reply, flush=True)
        if mode == "one-reply":
            sys.exit(0)
"""


@pytest.fixture
def fake_worker(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from dhpo_trl.scoring import _math_verify_core, rewards

    script = tmp_path / "fake_core.py"
    script.write_text(FAKE_WORKER)
    fake_core = SimpleNamespace(__file__=str(script), clean=_math_verify_core.clean, refusal=_math_verify_core.refusal)
    monkeypatch.setattr(rewards, "_math_verify_core", fake_core)
    workers = []

    def make(mode):
        (tmp_path / "fake_core.py.mode").write_text(mode)
        worker = rewards._VerifyWorker()
        workers.append(worker)
        return worker

    def log():
        path = tmp_path / "fake_core.py.log"
        return path.read_text().splitlines() if path.exists() else []

    yield make, log
    for worker in workers:
        worker.close()


def starts(log, expected: int) -> int:
    """How many worker processes have started, once `expected` have or 60 s have passed (a spare starts in the
    background: its line may come a little after the reply that needed it, long after on a loaded machine)."""
    deadline = time.monotonic() + 60.0
    while log().count("start") < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # and no more than expected
    return log().count("start")


def test_worker_protocol_and_reuse(fake_worker):
    import json

    make, log = fake_worker
    worker = make("compare")
    assert worker.answers_match("1", "1", 0.5) is True
    assert worker.match_many([("1", "2"), ("3", "3")], 0.25) == [False, True]
    pairs = [(str(i), str(i % 3)) for i in range(40)]  # more than one request's worth
    assert worker.match_many(pairs, 2.0) == [a == g for a, g in pairs]
    lines = log()
    assert lines[0] == "start" and starts(log, 2) == 2  # one process for every request, and its spare
    requests = [json.loads(line) for line in lines if line != "start"]
    assert requests[:2] == [
        {"id": 1, "timeout_s": 0.5, "pairs": [["1", "1"]]},
        {"id": 2, "timeout_s": 0.25, "pairs": [["1", "2"], ["3", "3"]]},
    ]
    assert [len(r["pairs"]) for r in requests[2:]] == [16, 16, 8] and [r["id"] for r in requests[2:]] == [3, 4, 5]
    process = worker._process
    worker.close()
    assert process.poll() is not None and worker._process is None
    worker.close()  # twice is fine


def test_the_workers_stderr_does_not_reach_the_trainers_output(fake_worker, capfd):
    """math-verify and sympy print warnings: in a training log they would repeat for every reward call."""
    make, _ = fake_worker
    capfd.readouterr()
    assert make("noisy").answers_match("3", "3", 1.0) is True
    assert capfd.readouterr() == ("", "")


@pytest.mark.parametrize(("mode", "matched"), [("padded", True), ("ten", False)])
def test_worker_reply_is_read_stripped(fake_worker, mode, matched):
    make, _ = fake_worker
    assert make(mode).answers_match("1", "2", 1.0) is matched


def test_replies_to_other_requests_are_never_read_as_the_answer(fake_worker):
    """A stale line (a reply to a request whose caller was interrupted) is skipped, not taken for the next answer."""
    make, _ = fake_worker
    worker = make("stale")
    assert worker.match_many([("1", "2"), ("3", "3"), ("4", "5")], 1.0) == [False, True, False]


def test_a_reply_just_after_the_deadline_is_still_read(fake_worker):
    """The worker's own alarm fires at timeout_s and its "0" arrives just after: the caller waits a little more
    before it kills the worker, instead of restarting it for every slow answer."""
    make, _ = fake_worker
    worker = make("slow-reply")
    assert worker.answers_match("1", "1", 0.1) is True
    assert worker._process is not None and worker._process.poll() is None  # kept for the next request


def test_a_stuck_comparison_is_killed_and_the_rest_of_the_list_goes_on(fake_worker):
    """A comparison stuck in C code ignores SIGALRM: the caller kills the worker at the deadline plus the margin;
    the stuck answer scores 0, the answers before and after it are compared (by a fresh worker)."""
    from dhpo_trl.scoring.rewards import _KILL_MARGIN_S

    make, log = fake_worker
    worker = make("stuck-on-x")
    worker.answers_match("0", "0", 1.0)
    first = worker._process
    start = time.perf_counter()
    assert worker.match_many([("1", "1"), ("x", "x"), ("2", "2"), ("3", "4")], 0.2) == [True, False, True, False]
    assert time.perf_counter() - start < 0.2 + _KILL_MARGIN_S + 5.0  # one deadline, one restart of a tiny script
    assert first.poll() is not None  # killed
    assert starts(log, 3) == 3  # the first worker, its spare (which took over), the next spare


def test_a_dead_worker_is_restarted(fake_worker):
    make, log = fake_worker
    worker = make("one-reply")
    assert worker.answers_match("1", "1", 1.0) is True
    worker._process.wait(10)  # it exits after its one reply
    assert worker.answers_match("2", "2", 1.0) is True  # a fresh one answers
    assert starts(log, 3) == 3  # the first worker, its spare (which took over), the next spare


def test_a_worker_that_dies_after_its_greeting_scores_no_match(fake_worker):
    make, _ = fake_worker
    worker = make("exit-after-ready")
    assert worker.match_many([("1", "1"), ("2", "2")], 1.0) == [False, False]
    assert worker._process is None


def test_a_worker_that_does_not_start_in_time_is_refused_loudly(fake_worker, monkeypatch):
    from dhpo_trl.scoring import rewards

    make, log = fake_worker
    monkeypatch.setattr(rewards, "_WORKER_START_TIMEOUT_S", 0.2)
    worker = make("slow-start")
    start = time.perf_counter()
    with pytest.raises(rewards.GraderUnavailableError, match="did not start within 0 s"):
        worker.answers_match("1", "1", 1.0)
    assert time.perf_counter() - start < 15.0  # the 0.2 s start deadline acted, not the worker's 30 s (loose for a loaded machine)
    assert worker._process is None
    pool = rewards._Pool()
    pool._workers = [worker]
    monkeypatch.setattr(rewards, "_POOL", pool)
    monkeypatch.setattr(rewards, "default_workers", lambda: 1)
    with pytest.raises(rewards.GraderUnavailableError):
        score_answer(r"\boxed{1}", "1")  # the scoring function raises it, it does not score 0 for ever
    assert log().count("start") == 2
    from pathlib import Path

    Path(rewards._math_verify_core.__file__ + ".mode").write_text("wrong-greeting")
    with pytest.raises(rewards.GraderUnavailableError):
        worker.answers_match("1", "1", 1.0)


def test_worker_read_stops_at_its_deadline_even_with_a_line_waiting(monkeypatch):
    """The reply deadline is a hard limit: at exactly the deadline nothing more is read, even a line already there."""
    import os
    import types

    from dhpo_trl.scoring import rewards

    read_end, write_end = os.pipe()
    os.write(write_end, b"late\n")
    process = types.SimpleNamespace(stdout=types.SimpleNamespace(fileno=lambda: read_end))
    worker = rewards._VerifyWorker()
    try:
        clock = iter([10.0, 12.0])  # the deadline is 10 + 2: the check runs at exactly 12
        monkeypatch.setattr(rewards.time, "monotonic", lambda: next(clock))
        assert worker._read_line(process, 2.0) is None
        clock = iter([10.0, 11.5])  # half a second left: the waiting line is read
        assert worker._read_line(process, 2.0) == "late"
        os.close(write_end)
        clock = iter([10.0, 11.5])
        assert worker._read_line(process, 2.0) is None  # end of file: the worker died
    finally:
        os.close(read_end)


def test_math_verify_timeout_warning_is_dropped_and_nothing_else():
    """math-verify warns "Timeout is disabled ..." on every call once its own alarm is off (we bound calls ourselves);
    that one line is filtered, any other warning of its logger passes."""
    import logging

    from dhpo_trl.scoring._math_verify_core import _DropTimeoutDisabledWarning

    def record(message):
        return logging.LogRecord("math_verify.grader", logging.WARNING, __file__, 1, message, None, None)

    drop = _DropTimeoutDisabledWarning()
    assert drop.filter(record("Timeout is disabled as timeout_seconds is None or <= 0, you must provide the logic")) is False
    assert drop.filter(record("Timeout is disabled as parsing_timeout is None or <= 0, you must provide the logic")) is False
    assert drop.filter(record("Error during comparison")) is True
    assert drop.filter(record("timeout is disabled")) is True  # another message, as math-verify never writes it


def test_extract_answer_by_default_takes_only_a_box():
    """The default is the paper's reward: no box, no answer, however clear the last number is."""
    assert extract_answer(r"so the answer is \boxed{42}.") == "42"
    assert extract_answer("so the answer is 42.") is None
    assert extract_answer("so the answer is 42.", "last_number") == "42"


def test_a_crashing_comparison_is_logged_at_debug_with_its_traceback(monkeypatch, caplog):
    """The reward swallows a verifier crash (scores 0); `--log_level debug` must still show what crashed."""
    import logging

    from dhpo_trl.scoring import rewards

    monkeypatch.setattr(rewards, "_POOL", FakePool(RuntimeError("parser crashed")))
    with caplog.at_level(logging.DEBUG, logger=rewards.logger.name):
        assert score_answer(r"\boxed{3}", "3") == 0.0
    (record,) = [r for r in caplog.records if r.name == rewards.logger.name]
    assert record.levelno == logging.DEBUG and record.getMessage() == "score_answer failed"
    assert record.exc_info is not None and str(record.exc_info[1]) == "parser crashed"


# ------------------------------------------------------------------ one call, one budget
def slow_answers(count: int, offset: int = 0) -> list[str]:
    """Distinct integrals the guards let through and sympy cannot settle within a deadline."""
    return [
        rf"\boxed{{\int_{{0}}^{{1}} x^{{{k}}} e^{{x}} \sin(3 x) \cos(5 x) \, dx}}"
        for k in range(1 + offset, count + 1 + offset)
    ]


def right_answers(count: int, offset: int = 0) -> list[str]:
    r"""Distinct right answers to 12 (`\frac{12k}{k}`): any score 0 among them is an answer the call did not decide."""
    return [rf"\frac{{{12 * k}}}{{{k}}}" for k in range(2 + offset, 2 + offset + count)]


def boxed(answers: list[str]) -> list[tuple[str, str]]:
    """(completion, gold) pairs: each answer boxed, against 12."""
    return [(rf"\boxed{{{answer}}}", "12") for answer in answers]


# One call of 15 right answers on a stand-in worker (tests/grader_stand_in.py) that takes 5 s to start: budget 10 s,
# full deadline 2 s. The answers get 9.5 s from the first comparison (the kill margin is kept back); first-pass
# deadline 0.3167 s (half of 9.5 s over 15 answers). First pass: answers 0 and 1 overrun it, answer 2 is stuck in C
# code (killed at 0.3167 + 0.5 s, then sent to the second pass), answers 3-9 and 11-13 overrun it, the quick
# answers 10 and 14 score: 12 x 0.3167 + 0.5 + 2 x 0.01 = 4.32 s. Second pass, 5.18 s left: answer 0 (1.5 s) scores
# at 5.82 s, answer 1 (5 s) overruns the full deadline at 7.82 s, answer 2 is stuck again and killed at 9.5 + 0.5 s:
# past the budget, so it is not tried again; answers 3-9 and 11-13 are never reached.
CALL_COSTS = {0: 1.5, 1: 5.0, **{k: 5.0 for k in (*range(3, 10), 11, 12, 13)}}
CALL_SCORES = [1.0] + [0.0] * 9 + [1.0] + [0.0] * 3 + [1.0]
CALL_COUNTS = {"answers": 15, "over_budget": 11, "over_deadline": 1, "cached": 0}


def test_a_call_of_slow_answers_keeps_its_budget_and_scores_the_quick_ones(monkeypatch):
    """Many slow answers cannot stretch a call past its budget: the quick answers behind them still score (first
    pass: every answer under a short deadline), an answer decided in the second pass scores, and the rest score 0,
    each counted once, as over the budget or over its deadline. The worker's start is not charged to the budget, and a
    call that ends with a stuck worker killed ends at its budget. Set by construction, whatever the machine's load."""
    from grader_stand_in import StandInClock, StandInWorker, installed

    from dhpo_trl.scoring import rewards

    answers = right_answers(15)
    costs = {answers[k]: cost for k, cost in CALL_COSTS.items()}
    clock = StandInClock()
    worker = StandInWorker(clock, costs, stuck=frozenset({answers[2]}), start_s=5.0)
    rewards.pop_grading_counts()
    with installed(monkeypatch, clock, worker):
        scores = rewards.score_many(boxed(answers), budget_s=10.0, timeout_s=2.0, workers=1)
    assert scores == CALL_SCORES
    assert rewards.pop_grading_counts() == CALL_COUNTS
    assert clock.now == pytest.approx(5.0 + 10.0)  # the start, then the whole budget: the last kill ends at it
    first_pass = [deadline for _, deadline in worker.asked[:15]]
    assert first_pass == pytest.approx([0.5 * 9.5 / 15] * 15)


@pytest.mark.parametrize("budget_s", [0.6, 1.0])
def test_a_budget_of_a_second_or_less_leaves_the_quick_answers_behind_slow_ones_time(budget_s, monkeypatch):
    """Under 1 s the kill margin takes half the budget: the first pass is planned on the answers' window, so the
    quick answer behind three slow ones is scored although every interrupted comparison replies 30 ms late (the
    alarm's latency, measured up to 29 ms on a busy 2-core machine) and the quick one takes 40 ms (a loaded parse).
    A first pass planned on the whole budget fills that window and leaves it none."""
    from grader_stand_in import StandInClock, StandInWorker, installed

    from dhpo_trl.scoring import rewards

    answers = right_answers(4, offset=100)
    clock = StandInClock()
    costs = {**{answer: 3.0 for answer in answers[:3]}, answers[3]: 0.04}
    worker = StandInWorker(clock, costs, overrun_s=0.03)
    rewards.pop_grading_counts()
    with installed(monkeypatch, clock, worker):
        scores = rewards.score_many(boxed(answers), budget_s=budget_s, workers=1)
    assert scores == [0.0, 0.0, 0.0, 1.0]
    assert rewards.pop_grading_counts() == {"answers": 4, "over_budget": 3, "over_deadline": 0, "cached": 0}
    assert clock.now <= budget_s / 2 + 0.03  # the window, and one late reply


def test_a_call_of_slow_answers_on_the_real_worker_keeps_its_budget():
    """The same call end to end, on the real worker with sympy's slow integrals: the quick answer behind seven slow
    ones scores and the call ends within its budget. The quick answer's first-pass deadline (0.22 s) is a hundred
    warm parses, and the time bound allows 3 s for process round trips: both hold on a loaded machine."""
    from dhpo_trl.scoring import rewards

    assert score_answer(r"\boxed{1}", "1") == 1.0  # the worker is up: its start is not part of the budget
    rewards.pop_grading_counts()
    completions = slow_answers(7, offset=1000) + [r"\boxed{\frac{24}{2}}"]
    start = time.perf_counter()
    scores = rewards.score_many([(c, "12") for c in completions], budget_s=4.0, timeout_s=2.0, workers=1)
    elapsed = time.perf_counter() - start
    assert scores == [0.0] * 7 + [1.0]
    assert elapsed < 4.0 + 3.0
    counts = rewards.pop_grading_counts()
    assert counts["answers"] == 8 and counts["over_budget"] + counts["over_deadline"] == 7
    assert counts["over_budget"] > 0  # 7 slow answers at a 2 s full deadline do not fit the 2 s the first pass left


def test_a_repeated_slow_answer_costs_once():
    from dhpo_trl.scoring import rewards

    assert score_answer(r"\boxed{1}", "1") == 1.0
    rewards.pop_grading_counts()
    (slow,) = slow_answers(1, offset=2000)
    start = time.perf_counter()
    assert rewards.score_many([(slow, "12")] * 40 + [(r"\boxed{73421}", "73421")], timeout_s=1.0) == [0.0] * 40 + [1.0]
    first = time.perf_counter() - start
    assert first < 40 * 0.5  # one comparison for the 40 copies (each alone would use at least its first deadline)
    assert rewards.pop_grading_counts() == {"answers": 2, "over_budget": 0, "over_deadline": 1, "cached": 0}
    assert rewards.score_many([(slow, "12")], timeout_s=1.0) == [0.0]  # and nothing in a later call
    assert rewards.pop_grading_counts() == {"answers": 1, "over_budget": 0, "over_deadline": 0, "cached": 1}
    assert rewards.score_many([(slow, "12")], timeout_s=1.2) == [0.0]  # a longer deadline tries it again
    assert rewards.pop_grading_counts() == {"answers": 1, "over_budget": 0, "over_deadline": 1, "cached": 0}


def test_an_answer_slower_than_the_first_pass_deadline_scores_in_the_second_pass():
    """A full call (`BUDGET_ANSWERS` answers, the default budget, one worker) gives every answer a first-pass deadline
    of about 58 ms. A correct answer written as an integral, which the grader settles in about a second, overruns it
    and is decided in the second pass, at the full deadline: it scores 1 with the quick answers around it."""
    from dhpo_trl.scoring import _math_verify_core as core
    from dhpo_trl.scoring import rewards

    slow, gold = r"\int_{0}^{\pi} \sin(x) \, dx", "2"
    window = rewards.DEFAULT_BUDGET_S - rewards._KILL_MARGIN_S  # the answers' time
    first = rewards.FIRST_PASS_SHARE * window / rewards.BUDGET_ANSWERS  # 57.6 ms
    assert core._compare(slow, gold, first) == "t"  # on this machine the answer cannot be decided in the first pass
    assert score_answer(r"\boxed{1}", "1") == 1.0  # the worker is up: its start is not part of the budget
    rewards.pop_grading_counts()
    quick = [(rf"\boxed{{{k}}}", str(k if k % 4 else k + 1)) for k in range(60_001, 60_000 + rewards.BUDGET_ANSWERS)]
    pairs = quick[:100] + [(rf"\boxed{{{slow}}}", gold)] + quick[100:]
    expected = [1.0 if int(answer[7:-1]) % 4 else 0.0 for answer, _ in quick]
    scores = rewards.score_many(pairs, timeout_s=20.0, workers=1)
    assert scores == expected[:100] + [1.0] + expected[100:]
    assert rewards.pop_grading_counts() == {"answers": 256, "over_budget": 0, "over_deadline": 0, "cached": 0}


def test_parallel_workers_give_the_same_scores():
    from dhpo_trl.scoring import rewards

    pairs = [(rf"\boxed{{{k}}}", str(k if k % 3 else k + 1)) for k in range(40)] + [(r"\boxed{0.5}", r"\frac{1}{2}")]
    expected = [1.0 if k % 3 else 0.0 for k in range(40)] + [1.0]
    rewards._POOL._cache.clear()
    try:
        assert rewards.score_many(pairs, workers=2) == expected
        assert len(rewards._POOL._workers) >= 2 and all(w._process is not None for w in rewards._POOL._workers[:2])
    finally:
        for worker in rewards._POOL._workers[1:]:  # the later tests' single worker stays
            worker.close()
        del rewards._POOL._workers[1:]
    assert rewards.default_workers() >= 1


def test_budget_and_worker_settings_are_checked_at_once():
    from dhpo_trl.scoring import rewards

    for name, bad in (("budget_s", 0), ("budget_s", float("inf")), ("workers", 0), ("workers", 1.5), ("timeout_s", -1)):
        with pytest.raises(ValueError, match=name):
            rewards.make_math_verify_reward(**{name: bad})
    reward = rewards.make_math_verify_reward(budget_s=60.0, workers=1)
    assert reward.__name__ == "math_verify_reward"  # TRL logs rewards under the function's name
    assert reward([r"\boxed{3}", r"\boxed{4}"], answer=["3", "3"]) == [1.0, 0.0]


def test_a_restart_costs_the_next_answer_nothing(fake_worker):
    """A worker killed on a stuck answer is replaced by its spare, started long before: the next answer does not
    wait for a worker to start (4 s here, as a real worker importing sympy on a loaded machine)."""
    make, log = fake_worker
    worker = make("stuck-and-slow-to-start")
    assert worker.answers_match("0", "0", 1.0) is True
    assert starts(log, 2) == 2
    time.sleep(4.5)  # the spare has started and said it is ready
    start = time.perf_counter()
    assert worker.match_many([("x", "x"), ("2", "2")], 0.2) == [False, True]
    from dhpo_trl.scoring.rewards import _KILL_MARGIN_S

    assert time.perf_counter() - start < 0.2 + _KILL_MARGIN_S + 2.5  # no 4 s start on the way


# A script's header that imports `dhpo_trl.scoring` without the package's `__init__`, which imports the trainer
# (torch, transformers, TRL: seconds of CPU in a fresh interpreter) that a script that only scores never uses.
SCORING_ONLY = (
    "import sys, types\n"
    "sys.modules['dhpo_trl'] = types.ModuleType('dhpo_trl')\n"
    f"sys.modules['dhpo_trl'].__path__ = [{os.path.dirname(dhpo_trl.__file__)!r}]\n"
)


def test_the_worker_ends_when_its_parent_dies(tmp_path):
    """A trainer killed mid-comparison leaves no worker computing on (the parent-death signal)."""
    import signal
    import subprocess
    import sys

    import psutil

    script = tmp_path / "parent.py"
    script.write_text(
        SCORING_ONLY +
        "from dhpo_trl.scoring import rewards\n"
        "rewards.score_answer(r'\\boxed{1}', '1')\n"
        "worker = rewards._POOL._workers[0]\n"
        "print(worker._process.pid, worker._spare.pid, flush=True)\n"
        f"rewards.score_answer({slow_answers(1, offset=3000)[0]!r}, '12', timeout_s=600.0)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, start_new_session=True)
    pids: list[int] = []
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(1.0)  # the comparison has started
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        def alive(pid: int) -> bool:
            return psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"

        # the comparing worker within 5 s, not at its deadline; the spare may still be importing on a loaded
        # machine (it ends once it is up and finds its parent gone)
        for pid, wait_s in zip(pids, (5.0, 60.0)):
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and alive(pid):
                time.sleep(0.05)
            assert not alive(pid), pid
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()
        for pid in pids:  # workers left alive by a failure
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie":
                os.kill(pid, signal.SIGKILL)


def test_forgetting_slow_answers_compares_them_again():
    from dhpo_trl.scoring import rewards

    assert score_answer(r"\boxed{1}", "1") == 1.0
    (slow,) = slow_answers(1, offset=4000)
    assert rewards.score_many([(slow, "12")], timeout_s=0.5) == [0.0]
    rewards.pop_grading_counts()
    rewards.forget_slow_answers()
    assert rewards.score_many([(slow, "12")], timeout_s=0.5) == [0.0]
    assert rewards.pop_grading_counts()["cached"] == 0


FIRST_COMPARISON_CALLS = SCORING_ONLY + r"""
import json
from dhpo_trl.scoring import _math_verify_core as core
assert "torch" not in sys.modules  # the header kept the trainer's imports out


def calls(answer, gold):  # Python function calls of one comparison: work done, whatever the machine's load
    count = [0]

    def profile(frame, event, arg):
        count[0] += event == "call"

    sys.setprofile(profile)
    try:
        assert core.answers_match(answer, gold)
    finally:
        sys.setprofile(None)
    return count[0]


if sys.argv[1] == "warm":
    core._warm_up()
print(json.dumps([calls(r"\frac{36}{3}", "12"), calls(r"\frac{36}{3}", "12")]))
"""


def first_and_next_comparison_calls(warm: bool) -> tuple[int, int]:
    import json
    import subprocess
    import sys

    argv = [sys.executable, "-c", FIRST_COMPARISON_CALLS, "warm" if warm else "cold"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
    return tuple(json.loads(out.stdout))


def test_the_warm_up_leaves_a_fresh_worker_only_a_warm_parse_to_do():
    """A fresh interpreter's first parse builds math-verify's parser tables (about 50 times a warm parse's work):
    after the worker's warm-up, a first comparison of an answer the warm-up did not see does about what the same
    comparison does again. Counted in Python calls, so the machine's load cannot move it."""
    cold_first, cold_next = first_and_next_comparison_calls(warm=False)
    assert cold_first > 20 * cold_next  # the cost the warm-up takes off the first call is there to be seen
    warm_first, warm_next = first_and_next_comparison_calls(warm=True)
    assert warm_first < 2 * warm_next, (warm_first, warm_next)


def test_a_worker_warms_up_before_it_says_it_is_ready(monkeypatch):
    """The pool's budget starts once the worker says it is ready: the warm-up must come before that line, so that
    its cost falls on the start, never on a call's first answers."""
    import io
    import sys

    from dhpo_trl.scoring import _math_verify_core as core

    events = []
    monkeypatch.setattr(sys, "argv", ["_math_verify_core.py"])  # no parent to follow
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # no requests: the loop ends at once
    monkeypatch.setattr(core, "_limit_memory", lambda: events.append("memory limit"))
    monkeypatch.setattr(core, "_warm_up", lambda: events.append("warm-up"))
    monkeypatch.setattr(core, "print", lambda line, **kwargs: events.append(line), raising=False)
    core._serve()
    assert events == ["memory limit", "warm-up", "ready"]


# ------------------------------------------------------------------ several threads at once
def test_a_pair_another_thread_is_grading_is_compared_once(fake_worker, monkeypatch):
    """TRL runs async reward functions in threads, and an evaluation callback may score beside training. Two calls
    asking for the same slow answers at once: the second waits for the first's results (served from the cache)
    instead of comparing every answer again, so a slow answer costs once however many threads ask for it."""
    import json

    from dhpo_trl.scoring import rewards

    make, log = fake_worker
    make("slow-on-s")
    monkeypatch.setattr(rewards, "_POOL", rewards._Pool())
    pairs = [(rf"\boxed{{s{i}}}", f"s{i}" if i % 4 else f"s{i}x") for i in range(8)]  # 8 x 0.4 s on one worker
    expected = [0.0 if i % 4 == 0 else 1.0 for i in range(8)]
    rewards.pop_grading_counts()
    results = {}
    first = threading.Thread(target=lambda: results.update(first=rewards.score_many(pairs, workers=1)))
    first.start()
    deadline = time.monotonic() + 20.0
    while not any(line.startswith("{") for line in log()) and time.monotonic() < deadline:
        time.sleep(0.02)  # the first call's request is with the worker: the second asks while it is being graded
    results["second"] = rewards.score_many(pairs, workers=1)
    first.join(60)
    assert not first.is_alive()
    assert results["first"] == results["second"] == expected
    compared = [pair for line in log() if line.startswith("{") for pair in json.loads(line)["pairs"]]
    assert len(compared) == len(pairs)  # each pair once, for both calls
    counts = rewards.pop_grading_counts()
    assert (counts["answers"], counts["cached"]) == (16, 8)
    rewards._POOL.close()


def test_many_threads_scoring_at_once_get_their_own_results():
    """Eight threads score different batches at once on two workers: every thread gets the scores of its own
    answers (checked against the values, computed here), and the call counts add up."""
    from concurrent.futures import ThreadPoolExecutor

    from dhpo_trl.scoring import rewards

    def batch(thread):
        pairs, expected = [], []
        for k in range(6):
            value = 10 * thread + k
            right = k % 3 != 1
            pairs.append((rf"\boxed{{\frac{{{2 * value}}}{{2}}}}", str(value if right else value + 1)))
            expected.append(1.0 if right else 0.0)
        return pairs, expected

    rewards.pop_grading_counts()
    batches = [batch(thread) for thread in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        scored = list(pool.map(lambda item: rewards.score_many(item[0], workers=2), batches))
    assert scored == [expected for _, expected in batches]
    assert rewards.pop_grading_counts()["answers"] == 8 * 6
