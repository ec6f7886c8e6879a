r"""The paper's verifiable reward: 1.0 if the last `\boxed{}` answer is equivalent to the gold answer.

`score_answer` is the one scoring function: the reward (`math_verify_reward`, TRL's reward-function signature with
`answer` the dataset column) and the benchmark evaluation (`dhpo_trl.evaluation.runner`) both call it. The gold is
normalised by `dhpo_trl.golds.normalise_gold` (a no-op for golds the loaders already normalised) and compared by
`dhpo_trl._math_verify_core` (math-verify as the engine; docs/grading.md lists how it differs from SimpleRL-Zoo's
grader). A list or tuple gold is one answer with several components, never a list of alternatives.

It never raises and bounds the time spent on each completion:

- the answer is located with `str.rfind`, so a megabyte of text costs microseconds, and an answer longer than
  `MAX_ANSWER_CHARS` (or an unterminated `\boxed{`) scores 0 without being parsed;
- parsing and comparison run under one deadline (`timeout_s`, default `DEFAULT_TIMEOUT_S`): SIGALRM in the main
  thread (where TRL calls synchronous reward functions), and outside it a worker process that is killed and
  restarted if it overruns (a thread cannot be interrupted, and math-verify's own timeout refuses to run there).
"""

from __future__ import annotations

import atexit
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
def score_answer(completion, ground_truth, *, timeout_s: float = DEFAULT_TIMEOUT_S, fallback: str = "none") -> float:
    r"""1.0 if the final answer of `completion` (its last `\boxed{}`, see `extract_answer` for `fallback`) is
    equivalent to `ground_truth`, else 0.0. Never raises, except for an unknown `fallback`."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}.")
    try:
        text = completion_text(completion)
        answer = extract_answer(text, fallback) if text else None
        gold = gold_text(ground_truth)
        if not answer or not answer.strip() or not gold:
            return 0.0
        if threading.current_thread() is threading.main_thread() and hasattr(_math_verify_core.signal, "setitimer"):
            matched = _math_verify_core.answers_match_with_deadline(answer, gold, timeout_s)
        else:
            matched = _WORKER.answers_match(answer, gold, timeout_s)
        return 1.0 if matched else 0.0
    except Exception:  # the reward must never take a training step down
        logger.debug("score_answer failed", exc_info=True)
        return 0.0


def math_verify_reward(completions, answer=None, **kwargs) -> list[float]:
    r"""TRL reward function: 1.0 per completion whose last `\boxed{}` matches its `answer`, 0.0 otherwise."""
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
    return [score_answer(completion, truth) for completion, truth in zip(completions, answers)]


# ------------------------------------------------------------------ worker process (off the main thread)
class _VerifyWorker:
    """One long-lived `python _math_verify_core.py` process, used one request at a time, killed on overrun."""

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def answers_match(self, answer: str, gold: str, timeout_s: float) -> bool:
        with self._lock:
            try:
                process = self._ensure_started()
                request = json.dumps({"answer": answer, "gold": gold, "timeout_s": timeout_s})
                process.stdin.write(request + "\n")
                process.stdin.flush()
                # the worker's own alarm fires at timeout_s; past this, it is stuck in C code: kill it
                reply = self._read_line(process, timeout_s + 1.0)
            except (OSError, ValueError):
                reply = None
            if reply is None:
                self.close()
                return False
            return reply.strip() == "1"

    def _ensure_started(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        self._process = subprocess.Popen(
            [sys.executable, os.path.abspath(_math_verify_core.__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        if self._read_line(self._process, _WORKER_START_TIMEOUT_S) != "ready\n":
            self.close()
            raise OSError("math-verify worker process did not start")
        return self._process

    @staticmethod
    def _read_line(process: subprocess.Popen, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([process.stdout], [], [], remaining)
            if readable:
                line = process.stdout.readline()
                return line or None  # "" = the worker died

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()


_WORKER = _VerifyWorker()
