"""Completions a policy could learn to write against the grader: each scores 0 within the deadline plus a margin,
from the main thread (where TRL calls synchronous reward functions) and from a thread, with bounded memory, no
code run, no process left behind, and correct answers still scoring 1 afterwards (issue 24).

The lexical guards (`_math_verify_core.refusal`) stop most of these before parsing; the worker process's deadline
and memory limit bound what gets past them (tests/test_rewards.py kills a worker stuck in C code).
"""

import ast
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from dhpo_trl.scoring import _math_verify_core, golds, rewards

TIMEOUT_S = 1.0
MARGIN_S = 1.0  # the bound: deadline + 1 s of wall time per completion
MARKER = "/tmp/dhpo_hostile_marker"

HOSTILE = {
    # huge numbers: sympy evaluates integer powers and factorials at parse time, in C code SIGALRM cannot stop
    "fraction-of-huge-powers": r"\boxed{\frac{2^{9999999}}{3^{9999999}}}",  # the 80 s answer
    "power-tower": r"\boxed{10^{10^{10^{10}}}}",
    "power-of-a-product": r"\boxed{(123456789 \cdot 987654321)^{123456789}}",
    "long-integer": r"\boxed{" + "9" * 900 + "}",
    "factorial": r"\boxed{100000!}",
    "factorial-of-factorial": r"\boxed{(10!)!}",
    "double-factorial": r"\boxed{99999!!}",
    "binomial": r"\boxed{\binom{1000000}{500000}}",
    "sum": r"\boxed{\sum_{k=1}^{10^{9}} k^{k}}",
    "product": r"\boxed{\prod_{k=1}^{10^{7}} k}",
    # matrix constructors whose size comes from the text (an identity of size 2*10^4 took 3 GB)
    "identity-matrix": r"\boxed{\mathbf{I}_{20000}}",
    "identity-squared": r"\boxed{(\mathbf{I}_{10000} + \mathbf{I}_{10000})^{2}}",
    "wide-pmatrix": r"\boxed{\begin{pmatrix}" + "&".join(["1"] * 400) + r"\end{pmatrix}}",
    "tall-bmatrix": r"\boxed{\begin{bmatrix}" + r"\\".join(["1"] * 400) + r"\end{bmatrix}}",
    # code-execution payloads: nothing may run
    "python-import": r"\boxed{__import__('os').system('touch " + MARKER + r"')}",
    "operatorname-import": r"\boxed{\operatorname{__import__}(\text{os}).system(\text{touch " + MARKER + "})}",
    "dunder-walk": r"\boxed{().__class__.__bases__[0].__subclasses__()}",
    "eval-call": r"\boxed{\operatorname{eval}(\text{open('" + MARKER + r"','w')})}",
    "lambda": r"\boxed{(lambda: open('" + MARKER + r"', 'w'))()}",
    # shapes: nesting, length, repetition, malformed LaTeX
    "nested-braces": r"\boxed{" + "{" * 400 + "1" + "}" * 400 + "}",
    "nested-fractions": r"\boxed{" + r"\frac{1}{" * 150 + "2" + "}" * 150 + "}",
    "nested-sqrt": r"\boxed{" + r"\sqrt{" * 200 + "2" + "}" * 200 + "}",
    "many-boxes": r"\boxed{1}" * 20000,
    "box-of-1000-chars": r"\boxed{" + "x+" * 499 + "1}",
    "e-notation-backtrack": r"\boxed{" + "1" * 495 + "e" + "1" * 495 + "}",
    "malformed": r"\boxed{\frac{1}{}^^__\sqrt[}",
    "unterminated-box": r"\boxed{" + "1" * 100_000,
    "control-characters": "\\boxed{1\x00\x07\x1b[2J}",
    "equation-chain-to-the-gold": r"\boxed{100 = 12}",
    "chain-with-the-gold-last": r"\boxed{1 = 2 = 12}",
    "decimal-near-an-integer-gold": r"\boxed{12.0001}",
    "plus-zero-near-an-integer-gold": r"\boxed{12.001 + 0.0}",
}


def tree_rss() -> int:
    """Resident memory of this process and all its descendants (the grading worker included), in bytes."""
    me = psutil.Process()
    total = 0
    for process in [me, *me.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def graders() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if any("_math_verify_core" in part for part in p.cmdline())]  # fmt: skip


def grader_ready() -> None:
    """Every worker of the pool started and ready (one killed before is replaced): the time of a call that follows
    is its answers' alone, not a start's, which takes tens of seconds on a loaded machine."""
    assert rewards.score_answer(r"\boxed{1}", "1") == 1.0
    for worker in rewards._POOL._workers:
        worker.ensure_ready()


@pytest.fixture(autouse=True)
def no_marker():
    if os.path.exists(MARKER):
        os.remove(MARKER)
    yield
    assert not os.path.exists(MARKER), "a completion ran code"


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_completion_scores_0_in_time_from_the_main_thread(name):
    assert threading.current_thread() is threading.main_thread()
    grader_ready()
    start = time.perf_counter()
    assert rewards.score_answer(HOSTILE[name], "12", timeout_s=TIMEOUT_S) == 0.0
    assert time.perf_counter() - start < TIMEOUT_S + MARGIN_S


def test_hostile_completions_from_a_thread_in_time_and_memory_and_correct_answers_still_score_1():
    before = tree_rss()
    names = list(HOSTILE)

    def timed(name):
        grader_ready()
        start = time.perf_counter()
        value = rewards.score_answer(HOSTILE[name], "12", timeout_s=TIMEOUT_S)
        return value, time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=1) as pool:  # not the main thread: no SIGALRM there
        results = dict(zip(names, pool.map(timed, names)))
        correct = list(pool.map(lambda answer: rewards.score_answer(answer, "12"), [r"\boxed{12}", r"\boxed{12.0}"]))
    assert {name: value for name, (value, _) in results.items() if value != 0.0} == {}
    assert {name: round(t, 2) for name, (_, t) in results.items() if t >= TIMEOUT_S + MARGIN_S} == {}
    assert correct == [1.0, 1.0]
    assert tree_rss() - before < 1 << 30  # the process tree grew by less than 1 GiB
    assert len(graders()) <= 2 * len(rewards._POOL._workers)  # reused workers and their spares, none left by a kill


def test_a_batch_with_hostile_completions_scores_the_rest_as_usual():
    completions = [HOSTILE["fraction-of-huge-powers"], r"\boxed{12}", HOSTILE["identity-matrix"], r"\boxed{13}",
                   HOSTILE["dunder-walk"], r"The answer is \boxed{\frac{24}{2}}."]  # fmt: skip
    grader_ready()
    start = time.perf_counter()
    assert rewards.math_verify_reward(completions, answer=["12"] * len(completions)) == [0, 1, 0, 0, 0, 1]
    assert time.perf_counter() - start < len(completions) * (rewards.DEFAULT_TIMEOUT_S + MARGIN_S)


@pytest.mark.parametrize("answer", [
    "12", "12.0", "12.00", "1.2 \\times 10^{1}", "\\frac{24}{2}", "2^{2} \\cdot 3", "3! \\cdot 2", "\\binom{12}{1}",
    "\\sqrt{144}", "12 = 12",
])  # fmt: skip
def test_ordinary_forms_of_the_gold_pass_the_guards(answer):
    assert _math_verify_core.refusal(_math_verify_core.clean(answer)) is None
    assert rewards.score_answer(f"\\boxed{{{answer}}}", "12") == 1.0


# ------------------------------------------------------------------------------------ every regex, linear time
def _patterns():
    """Every regular expression the reward, the golds and the grader use: each literal pattern given to a `re`
    function in their source (module-level compiled ones and inline `re.sub(r"...")` calls alike), with its flags."""
    for module in (rewards, golds, _math_verify_core):
        tree = ast.parse(Path(module.__file__).read_text())
        # Under mutation testing (scripts/mutation.sh) the module also holds mutmut's mutated copies of each
        # function, `name__mutmut_<n>`, whose patterns may not even compile: only the original code is ours.
        mutated = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                   and re.search(r"__mutmut_\d+$", f.name) for n in ast.walk(f)}  # fmt: skip
        for node in ast.walk(tree):
            if id(node) in mutated:
                continue
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                continue  # fmt: skip
            flags = 0
            for keyword in node.keywords:
                if keyword.arg == "flags":
                    flags |= eval(compile(ast.Expression(keyword.value), "flags", "eval"), {"re": re})  # noqa: S307
            call = node.func.attr if node.func.attr != "compile" else "search"  # a compiled one: its worst use
            yield f"{Path(module.__file__).name}:{node.lineno}", re.compile(node.args[0].value, flags), call


ADVERSARIAL = [  # runs that make nested quantifiers backtrack, each cut to the length asked
    "1" * 4000 + "e" + "1" * 4000, "1." * 4000, "\\frac{" * 2000, "{" * 4000 + "}" * 10, "_{" * 3000,
    " " * 8000 + "x", "a" * 8000 + "!", "\\text{" + "a " * 4000, "(" * 4000, "1,2" * 2700, "d" * 8000 + "/", "$" * 8000,
]  # fmt: skip


USES = {
    "search": lambda pattern, text: (pattern.search(text), list(pattern.finditer(text))),
    "finditer": lambda pattern, text: list(pattern.finditer(text)),
    "findall": lambda pattern, text: pattern.findall(text),
    "sub": lambda pattern, text: pattern.sub("", text),
    "split": lambda pattern, text: pattern.split(text),
    "match": lambda pattern, text: pattern.match(text),
    "fullmatch": lambda pattern, text: pattern.fullmatch(text),
}


@pytest.mark.parametrize(("name", "pattern", "call"), list(_patterns()), ids=[name for name, _, _ in _patterns()])
def test_every_pattern_is_fast_on_adversarial_strings(name, pattern, call):
    """No pattern of the reward, the golds or the grader may take superlinear time, used as the code uses it:
    8,000 characters of any backtracking bait take well under 0.5 s (a cubic pattern takes minutes there; 1,000
    characters of the old e-notation pattern took the whole 2 s deadline)."""
    slowest = 0.0
    for text in ADVERSARIAL:
        text = text[:8000]
        start = time.thread_time()  # CPU time of this thread: other jobs on a shared machine do not count
        USES[call](pattern, text)
        slowest = max(slowest, time.thread_time() - start)
    assert slowest < 0.5, f"{name} ({call}) took {slowest:.2f} s of CPU"


# ------------------------------------------------------------------------------- the worker's own bounds
@pytest.mark.parametrize("answer", [r"\frac{2^{9999999}}{3^{9999999}}", r"\mathbf{I}_{20000} + \mathbf{I}_{20000}"])
def test_the_worker_refuses_on_its_own(answer):
    """The guards also run inside the worker: a caller that reaches it directly (`match_many`) cannot skip them."""
    worker = rewards._VerifyWorker()
    try:
        worker.ensure_ready()
        start = time.perf_counter()
        assert worker.match_many([(answer, "12"), ("12", "12")], TIMEOUT_S) == [False, True]
        assert time.perf_counter() - start < TIMEOUT_S + MARGIN_S
    finally:
        worker.close()


def test_the_worker_runs_under_a_memory_and_a_cpu_limit():
    """What gets past the guards is bounded by the worker's address-space and CPU limits (a kill past the deadline
    is tested in tests/test_rewards.py with a worker stuck in C code)."""
    assert rewards.score_answer(r"\boxed{12}", "12") == 1.0  # the worker is up
    worker = psutil.Process(rewards._POOL._workers[0]._process.pid)
    rows = Path(f"/proc/{worker.pid}/limits").read_text().splitlines()[1:]
    limits = {row[:26].strip(): row[26:].split() for row in rows}
    address_space, cpu = limits["Max address space"][0], limits["Max cpu time"][0]
    assert address_space != "unlimited" and int(address_space) < worker.memory_info().vms + (1 << 30)
    assert cpu != "unlimited" and int(cpu) <= 60


# ------------------------------------------------------------ no reward for a learnable tolerance or chain
@pytest.mark.parametrize(("answer", "gold", "score"), [
    ("12346.0", "12345", 0.0),  # the relative 1e-4 tolerance never applies against an integer gold
    ("12345.0", "12345", 1.0), ("12345 + 0.0", "12345", 1.0), ("1.2345 \\times 10^{4}", "12345", 1.0),
    ("0.33333", "\\frac{1}{3}", 1.0),  # a decimal answer to a non-integer gold keeps the tolerance
    ("3.14159", "\\pi", 1.0), ("3.15", "\\pi", 0.0),
    ("100 = 3", "3", 0.0), ("1 = 2 = 3", "3", 0.0), ("3 = 3", "3", 1.0),  # every side of a chain must hold
    ("x = 2 + 3 = 5", "5", 1.0), ("x = 5", "5", 1.0), ("y = 4 = 5", "5", 0.0),
    # an integer-valued gold is compared exactly whatever its form
    ("12346", "12345.0", 0.0), ("12345", "12345.0", 1.0), ("12345.00", "12345.0", 1.0),
    ("1499850", "1.5 \\times 10^{6}", 0.0), ("1500150", "1.5 \\times 10^{6}", 0.0), ("1500001", "1.5 \\times 10^{6}", 0.0),
    ("1500000", "1.5 \\times 10^{6}", 1.0), ("15 \\times 10^{5}", "1.5 \\times 10^{6}", 1.0), ("1.5e6", "1.5 \\times 10^{6}", 1.0),
    ("12345.0000000000000000001", "12345", 0.0),
    # an integer never matches a non-integer gold
    ("12345", "12345.5", 0.0), ("12346", "12345.5", 0.0), ("1414214", "1000000\\sqrt{2}", 0.0),
    # a decimal gold: never wider than half a unit of its last written digit
    ("18.001", "18.0", 0.0), ("18", "18.0", 1.0), ("12.3457", "12.3456", 0.0), ("12.34561", "12.3456", 1.0),
    ("1234.51", "1234.50", 0.0), ("1234.504", "1234.50", 1.0), ("2.89 \\times 10^{-19}", "2.88 \\times 10^{-19}", 0.0),
    ("0.6251", "62.5\\%", 0.0), ("0.625", "62.5\\%", 1.0),
    # only names may stand on the left of a chain
    ("\\pi = 3", "3", 0.0), ("\\infty = 3", "3", 0.0), ("e = 3", "3", 0.0), ("\\sin(100) = 3", "3", 0.0),
    ("f(2) = 3", "3", 0.0), ("\\theta = 3", "3", 1.0), ("f(x) = 3", "3", 1.0), ("a_{n} = 3", "3", 1.0),
    ("AB = 3", "3", 1.0), ("x = 3, \\pi = 3", "3, 3", 0.0),
    # the scalar rules element by element
    ("(2.89 \\times 10^{-19}, 1)", "(2.88 \\times 10^{-19}, 1)", 0.0),
    ("(2.88 \\times 10^{-19}, 1)", "(2.88 \\times 10^{-19}, 1)", 1.0),
    ("\\{2.89 \\times 10^{-19}, 1\\}", "\\{2.88 \\times 10^{-19}, 1\\}", 0.0),
    ("[2.89 \\times 10^{-19}, 1)", "[2.88 \\times 10^{-19}, 1)", 0.0),
    ("\\begin{pmatrix} 2.89 \\times 10^{-19} \\\\ 1 \\end{pmatrix}", "\\begin{pmatrix} 2.88 \\times 10^{-19} \\\\ 1 \\end{pmatrix}", 0.0),
    ("\\begin{pmatrix} \\frac{3}{2} \\\\ 1 \\end{pmatrix}", "\\begin{pmatrix} 1.5 \\\\ 1 \\end{pmatrix}", 1.0),
    ("(12346, 1)", "(12345.0, 1)", 0.0), ("(1.0000001, 2)", "(1, 2)", 0.0), ("(12.3457, 1)", "(12.3456, 1)", 0.0),
    ("(12345, 1)", "(12345.5, 1)", 0.0), ("(0.33333, 1)", "(\\frac{1}{3}, 1)", 1.0),
    ("x = 2.89 \\times 10^{-19}", "x = 2.88 \\times 10^{-19}", 0.0), ("y = 0.5 x", "y = \\frac{x}{2}", 1.0),
])  # fmt: skip
def test_training_reward_has_no_exploitable_tolerance_or_chain(answer, gold, score):
    assert rewards.score_answer(f"\\boxed{{{answer}}}", gold) == score


# ------------------------------------------------------------------ the guards are linear in the answer
GROWING = {  # shapes whose guard cost grew with the square of their length
    "primes": lambda n: "x" + "'" * n,  # each prime becomes a power ^{\prime}: a chain of n powers
    "powers": lambda n: "x^2" * n,
    "chain": lambda n: "x" + "^{a}" * n,
    "sums": lambda n: "\\sum_{i=1}^{2}" * n,
    "chain-and-factorials": lambda n: "x" + "^{a}" * n + "!" * n,
}


def _guard_cpu(text: str) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        _math_verify_core.refusal(_math_verify_core.clean(text))
        best = min(best, time.thread_time() - start)
    return best


@pytest.mark.parametrize("shape", list(GROWING))
def test_the_guards_take_linear_time(shape):
    """Four times the text costs about four times the CPU (a quadratic guard: sixteen), measured where the cost is
    well above the timer's resolution; the best of three runs, in this thread's CPU time."""
    small, large = _guard_cpu(GROWING[shape](1000)), _guard_cpu(GROWING[shape](4000))
    assert large < 8 * small + 2e-3, f"{shape}: {small * 1e3:.2f} ms, then {large * 1e3:.2f} ms for 4x the text"


def test_998_primes_in_a_box_cost_the_trainer_little():
    completion = "\\boxed{x" + "'" * 998 + "}"
    start = time.thread_time()
    for _ in range(10):
        rewards._pair(completion, "3", "none")
    assert (time.thread_time() - start) / 10 < 0.02  # a quadratic guard took 38-80 ms
