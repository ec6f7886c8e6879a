r"""The paper's verifiable reward: 1.0 if the last `\boxed{}` answer is equivalent to the gold answer.

`score_answer` is the one scoring function: the reward (`math_verify_reward`, TRL's reward-function signature with
`answer` the dataset column) and the benchmark evaluation (`dhpo_trl.evaluation.runner`) both call it. The gold is
normalised by `dhpo_trl.scoring.golds.normalise_gold` (a no-op for golds the loaders already normalised) and compared by
`dhpo_trl.scoring._math_verify_core` (math-verify as the engine; docs/grading.md lists how it differs from SimpleRL-Zoo's
grader). A list or tuple gold is one answer with several components, never a list of alternatives.

It never raises (except `GraderUnavailableError` when no grading process can start) and bounds the time and
memory spent on each completion:

- the answer is located with `str.rfind`, so a megabyte of text costs microseconds, and an answer longer than
  `MAX_ANSWER_CHARS` (or an unterminated `\boxed{`) scores 0 without being parsed;
- an answer with a number, power, factorial, sum or matrix larger than any answer needs
  (`dhpo_trl.scoring._math_verify_core.refusal`, a linear scan) scores 0 without being parsed;
- every comparison, from the main thread or any other, runs in a long-lived worker process (`_VerifyWorker`)
  under a deadline (`timeout_s`, default `DEFAULT_TIMEOUT_S`) and a memory limit; an overrun scores 0 and a worker
  stuck in C code is killed and replaced by its spare;
- one call (`score_many`, `math_verify_reward`) runs under one budget (`DEFAULT_BUDGET_S` per `BUDGET_ANSWERS`
  answers) shared by all its answers (`_Pool`): quick answers are scored first, results are cached, and the answers
  left at the end of the budget score 0 and are counted (`pop_grading_counts`).
"""

from __future__ import annotations

import atexit
import collections
import functools
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time

from . import _math_verify_core
from .golds import normalise_gold

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
MAX_ANSWER_CHARS = 1_000  # a final answer, not a derivation: longer boxes score 0 unparsed
_BOX_COMMANDS = ("\\boxed", "\\fbox")
FALLBACKS = ("none", "last_number")  # what `score_answer` reads when a completion has no box
_LAST_NUMBER = re.compile(r"-?\d*\.?\d+")  # SimpleRL-Zoo's (Qwen2.5-Math's) no-box fallback pattern
_WORKER_START_TIMEOUT_S = 60.0


# ------------------------------------------------------------------ extraction
def extract_boxed_answer(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` (or `\fbox{...}`, or `\boxed 5`) in `text`; None if there is none.

    Nested and escaped braces are handled. An unterminated last box (a response cut off by the length limit)
    gives None rather than an earlier box: the final answer is the last one written.
    """
    if not isinstance(text, str):
        return None
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    after = start + len(command)
    position = after
    while position < len(text) and position - after < 8 and text[position] in " \t":
        position += 1
    if text.startswith("{", position):
        return _balanced_content(text, position)
    if position > after:  # "\boxed 5$": the answer runs to the next "$" or whitespace
        token = text[position : position + MAX_ANSWER_CHARS + 1].split(maxsplit=1)
        answer = token[0].split("$")[0] if token else ""
        return answer if 0 < len(answer) <= MAX_ANSWER_CHARS else None
    return None


def _balanced_content(text: str, open_brace: int) -> str | None:
    depth, index, end = 0, open_brace, min(len(text), open_brace + MAX_ANSWER_CHARS + 2)
    while index < end:
        char = text[index]
        if char == "\\":
            index += 2  # skip \{ and \} (and any escaped character)
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1 : index]
        index += 1
    return None  # unterminated, or longer than MAX_ANSWER_CHARS


def completion_text(completion) -> str | None:
    """The text of a TRL completion: a string, or a conversation (list of messages) whose assistant turns count."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if not isinstance(completion, (list, tuple)):
        return None
    parts = []
    for message in completion:
        if not isinstance(message, dict) or message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # multimodal content: [{"type": "text", "text": ...}, ...]
            parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)


def extract_answer(text: str, fallback: str = "none") -> str | None:
    r"""The final answer of a completion: the last `\boxed{}`; without a box, the last number if `fallback` is
    "last_number" (as SimpleRL-Zoo's evaluation does, thousands commas removed), else None."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}.")
    boxed = extract_boxed_answer(text)
    if boxed is not None or fallback == "none" or not isinstance(text, str):
        return boxed
    if any(command in text for command in _BOX_COMMANDS):
        return None  # a box was written but cut off: no guess from the text around it
    numbers = _LAST_NUMBER.findall(text[-MAX_ANSWER_CHARS * 10 :].replace(",", ""))
    return numbers[-1] if numbers else None


def gold_text(answer) -> str | None:
    """The gold as the grader reads it: a string, a number, or a list/tuple of components; None if unusable."""
    if isinstance(answer, list):
        answer = tuple(answer)  # hashable, for the cache
    try:
        return _gold_text(answer)
    except TypeError:  # unhashable content: normalise without the cache
        return normalise_gold(answer)


@functools.lru_cache(maxsize=65536)
def _gold_text(answer) -> str | None:
    if isinstance(answer, str) and any(command in answer for command in _BOX_COMMANDS):
        answer = extract_boxed_answer(answer) or answer  # a gold written as a boxed answer
    gold = normalise_gold(answer)
    return gold if gold and len(gold) <= MAX_ANSWER_CHARS else None


# ------------------------------------------------------------------ scoring
class GraderUnavailableError(RuntimeError):
    """The grading worker process cannot start: grading refuses to run without its time and memory bounds."""


DEFAULT_BUDGET_S = 30.0  # seconds for one call of up to BUDGET_ANSWERS answers; a larger call gets more in proportion
BUDGET_ANSWERS = 256
FIRST_PASS_SHARE = 0.5  # the first pass (every answer, a short deadline) may use at most this share of the answers'
# time (the budget less the kill margin, at least half the budget)
CACHE_SIZE = 16_384  # (answer, gold) results kept: an answer and a gold are at most MAX_ANSWER_CHARS each

_COUNTS_LOCK = threading.Lock()
_COUNTS = {"answers": 0, "over_budget": 0, "over_deadline": 0, "cached": 0}


def pop_grading_counts() -> dict[str, int]:
    """Counts since the last call, then reset: `answers` compared, `over_budget` (scored 0 because the call's budget
    ran out before their comparison ended), `over_deadline` (scored 0 at their own deadline) and `cached` (answered
    from the cache). `DHPOTrainer` logs `over_budget` once per generation batch; it is 0 unless answers were slow."""
    with _COUNTS_LOCK:
        counts = dict(_COUNTS)
        for key in _COUNTS:
            _COUNTS[key] = 0
    return counts


def forget_slow_answers() -> None:
    """Forget which answers overran a deadline, so that the next call compares them again (an audit that tells a busy
    machine from a slow grader by scoring a slow answer twice)."""
    with _POOL._lock:
        _POOL._slow.clear()


def _count(**increments: int) -> None:
    with _COUNTS_LOCK:
        for key, value in increments.items():
            _COUNTS[key] += value


def _pair(completion, ground_truth, fallback: str) -> tuple[str, str] | None:
    """(answer, gold) to compare, or None when the completion scores 0 without a comparison."""
    try:
        text = completion_text(completion)
        answer = extract_answer(text, fallback) if text else None
        gold = gold_text(ground_truth)
        if not answer or not answer.strip() or not gold:
            return None
        if _math_verify_core.refusal(_math_verify_core.clean(answer)):
            return None  # a number or matrix too large to be an answer: refused before any parsing
        return answer, gold
    except Exception:  # the reward must never take a training step down
        logger.debug("score_answer failed", exc_info=True)
        return None


def _check_numbers(timeout_s, budget_s, workers) -> None:
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
    if budget_s is not None and not (isinstance(budget_s, (int, float)) and 0 < budget_s < float("inf")):
        raise ValueError(f"budget_s must be a positive number of seconds (or None for the default), got {budget_s!r}.")
    if workers is not None and not (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1):
        raise ValueError(f"workers must be a positive integer (or None for one per spare core), got {workers!r}.")


def score_many(
    pairs,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    fallback: str = "none",
    budget_s: float | None = None,
    workers: int | None = None,
) -> list[float]:
    r"""`score_answer` for each (completion, ground_truth) of `pairs`, within one budget for the whole call.

    `budget_s` (default `DEFAULT_BUDGET_S` per `BUDGET_ANSWERS` answers, never less) bounds the call whatever the
    answers hold; answers still uncompared when it runs out score 0 and are counted (`pop_grading_counts`).
    `workers` worker processes compare in parallel (default: one per core this process can spare).
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}.")
    _check_numbers(timeout_s, budget_s, workers)
    prepared = [_pair(completion, truth, fallback) for completion, truth in pairs]
    asked = list(dict.fromkeys(pair for pair in prepared if pair is not None))  # each distinct pair compared once
    if budget_s is None:
        budget_s = DEFAULT_BUDGET_S * max(1.0, len(asked) / BUDGET_ANSWERS)
    try:
        matched = _POOL.grade(asked, timeout_s, budget_s, workers) if asked else {}
    except GraderUnavailableError:
        raise
    except Exception:  # noqa: BLE001 - the reward must never take a training step down
        logger.debug("score_answer failed", exc_info=True)
        matched = {}
    return [1.0 if pair is not None and matched.get(pair) else 0.0 for pair in prepared]


def score_answer(completion, ground_truth, *, timeout_s: float = DEFAULT_TIMEOUT_S, fallback: str = "none") -> float:
    r"""1.0 if the final answer of `completion` (its last `\boxed{}`, see `extract_answer` for `fallback`) is
    equivalent to `ground_truth`, else 0.0. Never raises, except for an unknown `fallback` or `timeout_s`, and
    `GraderUnavailableError` when no worker process can start (grading without bounds is refused)."""
    return score_many([(completion, ground_truth)], timeout_s=timeout_s, fallback=fallback)[0]


def make_math_verify_reward(
    *, budget_s: float | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, workers: int | None = None
):
    """`math_verify_reward` with another call budget, per-answer deadline or worker count (checked here, at once)."""
    _check_numbers(timeout_s, budget_s, workers)

    def math_verify_reward(completions, answer=None, **kwargs) -> list[float]:
        return _reward(completions, answer, timeout_s=timeout_s, budget_s=budget_s, workers=workers)

    return math_verify_reward


def math_verify_reward(completions, answer=None, **kwargs) -> list[float]:
    r"""TRL reward function: 1.0 per completion whose last `\boxed{}` matches its `answer`, 0.0 otherwise. One call
    takes at most `DEFAULT_BUDGET_S` per `BUDGET_ANSWERS` completions (`make_math_verify_reward` to change it)."""
    return _reward(completions, answer)


def _reward(completions, answer, **options) -> list[float]:
    try:
        completions = list(completions)
    except Exception:  # noqa: BLE001
        logger.warning("math_verify_reward: completions is not iterable; scoring nothing.")
        return []
    try:
        answers = list(answer) if isinstance(answer, (list, tuple)) else [answer] * len(completions)
    except Exception:  # noqa: BLE001
        answers = [None] * len(completions)
    if len(answers) != len(completions):
        logger.warning(
            "math_verify_reward got %d answers for %d completions: unmatched completions score 0. Check that the "
            "dataset's answer column is named 'answer'.",
            len(answers),
            len(completions),
        )
        answers = (answers + [None] * len(completions))[: len(completions)]
    return score_many(list(zip(completions, answers)), **options)


# ------------------------------------------------------------------ the pool of worker processes
def default_workers() -> int:
    """Worker processes per trainer process: the cores this process may use, shared by the processes of this node
    (`LOCAL_WORLD_SIZE`), less one for the trainer itself; at least 1, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(8, cores // local - 1))


_OVERRAN, _OVER_BUDGET = "t", "b"  # reply codes besides "1" and "0": past the answer's deadline, past the call's budget


class _Pool:
    """Grades a list of distinct (answer, gold) pairs within a budget, with a cache and parallel workers.

    Two passes: every answer first gets a short deadline (the first pass takes at most `FIRST_PASS_SHARE` of the
    budget), so that the answers the grader decides quickly are all scored even behind many slow ones; the answers
    that overran it get the full deadline in the time left. A final result (a match, a no, or an overrun of the full
    deadline) is cached by (answer, gold), so a slow answer repeated in this call or a later one costs once.
    """

    def __init__(self):
        self._workers: list[_VerifyWorker] = []
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], bool] = collections.OrderedDict()
        # pairs that overran a deadline and were not decided since -> the longest deadline they overran: the next
        # call scores 0 at once a pair that overran its full deadline, and gives one that overran only a first-pass
        # deadline the full deadline at once, so that a repeated slow answer costs once
        self._slow: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()

    def grade(self, pairs: list[tuple[str, str]], timeout_s: float, budget_s: float, workers: int | None):
        with self._lock:
            results: dict[tuple[str, str], bool] = {}
            for pair in pairs:
                if pair in self._cache:
                    self._cache.move_to_end(pair)
                    results[pair] = self._cache[pair]
                elif self._slow.get(pair, 0.0) >= timeout_s:
                    results[pair] = False  # it overran this deadline before: a longer one would try it again
            todo = [pair for pair in pairs if pair not in results]
            overran: set[tuple[str, str]] = set()
            self._grade(todo, timeout_s, budget_s, workers or default_workers(), results, overran)
            for pair in todo:
                if pair in results and pair not in overran:
                    self._remember(pair, results[pair])
            over_deadline = len(overran)
            over_budget = len(todo) - sum(pair in results for pair in todo)
            _count(answers=len(pairs), cached=len(pairs) - len(todo), over_budget=over_budget, over_deadline=over_deadline)
            if over_budget:
                logger.warning(
                    "math_verify_reward: %d of %d answers scored 0 because the call's budget (%.1f s) ran out; "
                    "pass budget_s to make_math_verify_reward to allow more.",
                    over_budget,
                    len(pairs),
                    budget_s,
                )
            return results

    def _remember(self, pair, matched: bool) -> None:
        """A decided pair: its result for any later call."""
        self._slow.pop(pair, None)
        self._cache[pair] = matched
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)

    def _remember_slow(self, pair, deadline: float) -> None:
        self._slow[pair] = max(deadline, self._slow.get(pair, 0.0))
        self._slow.move_to_end(pair)
        if len(self._slow) > CACHE_SIZE:
            self._slow.popitem(last=False)

    def _grade(self, pairs, timeout_s, budget_s, count, results, overran) -> None:
        """Fills `results` with the pairs decided within the budget, and `overran` with those that overran the full
        deadline (scored 0, and remembered as slow)."""
        if not pairs:
            return
        while len(self._workers) < count:
            self._workers.append(_VerifyWorker())
        workers = self._workers[:count]
        for worker in workers:
            worker.ensure_ready()  # from the calling thread, before the budget starts: a start is not an answer's cost
        # The budget counts from the first comparison (a worker's start is no answer's cost), less the margin a stuck
        # worker is given before it is killed, so that the call returns within `budget_s` in every case. The first
        # pass is a share of that window, not of the budget: at 1 s or less the margin takes half the budget, and a
        # first pass planned on the budget would fill the window, leaving a quick answer behind slow ones no time.
        window = max(budget_s - _KILL_MARGIN_S, budget_s / 2)
        end = time.monotonic() + window
        first = min(timeout_s, max(_MIN_FIRST_DEADLINE_S, FIRST_PASS_SHARE * window * len(workers) / len(pairs)))
        known_slow = [self._slow.get(pair, 0.0) >= first for pair in pairs]
        queue = collections.deque((index, first) for index in range(len(pairs)) if not known_slow[index])
        queue.extend((index, timeout_s) for index in range(len(pairs)) if known_slow[index])
        queue_lock = threading.Lock()

        def give_up(index: int) -> None:  # overran the full deadline: 0, and remembered
            results[pairs[index]] = False
            overran.add(pairs[index])
            self._remember_slow(pairs[index], timeout_s)

        def serve(worker: _VerifyWorker) -> None:
            while True:
                with queue_lock:
                    left = end - time.monotonic()
                    if not queue or left <= 0:
                        return
                    deadline = queue[0][1]
                    chunk = []
                    while queue and queue[0][1] == deadline and len(chunk) < _PAIRS_PER_REQUEST:
                        chunk.append(queue.popleft()[0])
                codes = worker.request([pairs[i] for i in chunk], deadline, end)
                with queue_lock:
                    for index, code in zip(chunk, codes):
                        if code in ("1", "0"):
                            results[pairs[index]] = code == "1"
                        elif code == _OVERRAN and deadline < timeout_s:
                            queue.append((index, timeout_s))  # the second pass, with the full deadline
                            self._remember_slow(pairs[index], deadline)
                        elif code == _OVERRAN:
                            give_up(index)
                    if len(codes) < len(chunk):  # the worker was killed on (or died at) chunk[len(codes)]
                        index = chunk[len(codes)]
                        if time.monotonic() < end:  # stuck past its deadline, not cut by the budget
                            if deadline < timeout_s:
                                queue.append((index, timeout_s))
                                self._remember_slow(pairs[index], deadline)
                            else:
                                give_up(index)
                        queue.extendleft(reversed([(i, deadline) for i in chunk[len(codes) + 1 :]]))

        if len(workers) == 1:
            serve(workers[0])
            return
        errors: list[BaseException] = []

        def serve_or_keep_error(worker: _VerifyWorker) -> None:
            try:
                serve(worker)
            except BaseException as error:  # noqa: BLE001 - raised in the calling thread below
                errors.append(error)

        threads = [threading.Thread(target=serve_or_keep_error, args=(worker,), daemon=True) for worker in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def close(self) -> None:
        for worker in self._workers:
            worker.close()

    def forget(self) -> None:
        """In a forked child: the parent's workers and cache lock are the parent's."""
        for worker in self._workers:
            worker._forget()
        self._workers, self._lock = [], threading.Lock()


# ------------------------------------------------------------------ one worker process
class _VerifyWorker:
    """One long-lived `python _math_verify_core.py` process, and a spare started beside it.

    Every comparison runs there, from the main thread or any other, so that one bound holds on every path: the
    worker's SIGALRM at the answer's deadline (or the call's budget, whichever comes first) for Python code, its
    RLIMIT_AS (`WORKER_MEMORY_HEADROOM_BYTES` above its size at start-up) and RLIMIT_CPU for everything, and a kill by
    this process at the deadline plus `_KILL_MARGIN_S` of wall time for C code that never returns to Python (sympy's
    big-integer gcd). A killed or dead worker is replaced by the spare, already started, and a new spare is started
    in the background: a restart costs the next answer nothing. The worker ends when this process dies (a
    parent-death signal, and a watchdog on its parent's id). A worker that cannot start raises
    `GraderUnavailableError`. Requests carry an id, so a reply to a request this process gave up on (an interrupted
    call) is never read as the answer to the next one. A forked child (a DataLoader worker) starts its own worker
    rather than share its parent's pipes.
    """

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._spare: subprocess.Popen | None = None
        self._buffer = b""
        self._next_id, self._pid = 0, os.getpid()
        self._lock = threading.Lock()
        atexit.register(self.close)

    def answers_match(self, answer: str, gold: str, timeout_s: float) -> bool:
        return self.match_many([(answer, gold)], timeout_s)[0]

    def match_many(self, pairs: list[tuple[str, str]], timeout_s: float) -> list[bool]:
        """Whether each (answer, gold) matches, each under `timeout_s` and no overall budget; False for one whose
        comparison overran (a worker stuck past the deadline is killed and the rest go on)."""
        results = [False] * len(pairs)
        done = 0
        while done < len(pairs):
            chunk = pairs[done : done + _PAIRS_PER_REQUEST]
            codes = self.request(chunk, timeout_s, float("inf"))
            results[done : done + len(codes)] = [code == "1" for code in codes]
            done += len(codes) + (len(codes) < len(chunk))  # the comparison that overran (or the worker died on)
        return results

    def request(self, chunk: list[tuple[str, str]], timeout_s: float, end: float) -> list[str]:
        """The reply codes to `chunk`, in order ("1", "0", `_OVERRAN`, `_OVER_BUDGET`), each compared under
        `timeout_s` and none past the monotonic time `end`; shorter when a reply did not come in time (the worker is
        then killed) or the worker died."""
        with self._lock:
            process = self._ensure_started()
            self._next_id += 1
            request_id = self._next_id
            message = {"id": request_id, "timeout_s": timeout_s, "pairs": chunk}
            if end != float("inf"):
                message["budget_s"] = max(end - time.monotonic(), 0.0)
            line = json.dumps(message) + "\n"
            codes: list[str] = []
            if self._write(process, line.encode(), timeout_s + _KILL_MARGIN_S):
                while len(codes) < len(chunk):
                    wait = min(timeout_s, max(end - time.monotonic(), 0.0)) + _KILL_MARGIN_S
                    reply = self._read_line(process, wait)
                    if reply is None:
                        break
                    fields = reply.split()
                    if len(fields) == 3 and fields[0] == str(request_id) and fields[1] == str(len(codes)):
                        code = fields[2]
                        codes.append(code if code in ("1", _OVERRAN, _OVER_BUDGET) else "0")
                    # else: a reply to an earlier request (its caller was interrupted), skipped
            if len(codes) < len(chunk):
                self._kill()
            return codes

    def ensure_ready(self) -> None:
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> subprocess.Popen:
        if self._pid != os.getpid():
            self._forget()  # forked without the at-fork hook: the pipes are the parent's
        if self._process is not None and self._process.poll() is None:
            return self._process
        self._kill()
        process, self._spare = self._spare, None
        if process is None or process.poll() is not None:
            _end(process)
            process = self._start()
        self._process, self._buffer, self._pid = process, b"", os.getpid()
        if self._read_line(process, _WORKER_START_TIMEOUT_S) != "ready":
            self._kill()
            raise GraderUnavailableError(
                f"the grading worker process ({sys.executable} {_math_verify_core.__file__}) did not start within "
                f"{_WORKER_START_TIMEOUT_S:.0f} s; grading needs it to bound time and memory: check that "
                "`python -c 'import math_verify, sympy'` works in this environment."
            )
        self._spare = self._start()  # not waited for: it is ready long before it is needed
        return process

    def _start(self) -> subprocess.Popen:
        # The parent-death signal is tied to the thread that starts the process: set only from the main thread, so
        # that a worker started from a short-lived thread does not die with it (the watchdog covers that case).
        death_signal = "1" if threading.current_thread() is threading.main_thread() else "0"
        try:
            return subprocess.Popen(
                [sys.executable, os.path.abspath(_math_verify_core.__file__), str(os.getpid()), death_signal],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                bufsize=0,
                start_new_session=True,  # a Ctrl-C meant for the trainer does not kill it mid-reply
            )
        except OSError as error:
            raise GraderUnavailableError(f"cannot start the grading worker process ({error})") from error

    def _write(self, process: subprocess.Popen, data: bytes, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        fd = process.stdin.fileno()
        while data:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            _, writable, _ = select.select([], [fd], [], remaining)
            if writable:
                try:
                    written = os.write(fd, data[:_PIPE_CHUNK])
                except OSError:  # the worker died
                    return False
                data = data[written:]
        return True

    def _read_line(self, process: subprocess.Popen, timeout_s: float) -> str | None:
        """The next line from the worker, without its newline; None at the deadline or when the worker died."""
        deadline = time.monotonic() + timeout_s
        fd = process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None  # the worker died
                self._buffer += chunk
                if len(self._buffer) > 1 << 20:  # no line is this long: not our worker
                    return None
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode("utf-8", "replace").strip()

    def _kill(self) -> None:
        process, self._process = self._process, None
        self._buffer = b""
        _end(process)

    def _forget(self) -> None:
        """In a forked child: drop the parent's workers without touching them (the parent still uses them)."""
        for process in (self._process, self._spare):
            if process is not None:
                for stream in (process.stdin, process.stdout):
                    try:
                        stream.close()  # this process's copies of the pipes only
                    except OSError:
                        pass
                process.returncode = 0  # never waited for or killed from here
        self._process = self._spare = None
        self._buffer, self._lock, self._pid = b"", threading.Lock(), os.getpid()

    def close(self) -> None:
        if self._pid != os.getpid():
            self._forget()
        self._kill()
        spare, self._spare = self._spare, None
        _end(spare)


def _end(process: subprocess.Popen | None) -> None:
    if process is None:
        return
    if process.poll() is None:
        process.kill()
    process.wait()
    for stream in (process.stdin, process.stdout):
        try:
            stream.close()
        except OSError:
            pass


_KILL_MARGIN_S = 0.5  # the worker's alarm fires at its deadline; past this much more, it is stuck in C code: killed
_MIN_FIRST_DEADLINE_S = 0.05  # the first pass's deadline is never shorter (a usual answer takes 2-4 ms, p99 70 ms)
_PAIRS_PER_REQUEST = 16  # answers and golds are at most MAX_ANSWER_CHARS each: a request is at most ~64 KB
_PIPE_CHUNK = 1 << 16
_POOL = _Pool()
atexit.register(_POOL.close)
os.register_at_fork(after_in_child=_POOL.forget)
