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
- every comparison, from the main thread or any other, runs in one long-lived worker process (`_VerifyWorker`)
  under a deadline (`timeout_s`, default `DEFAULT_TIMEOUT_S`) and a memory limit; an overrun scores 0 and the
  worker is killed and replaced.
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
class GraderUnavailableError(RuntimeError):
    """The grading worker process cannot start: grading refuses to run without its time and memory bounds."""


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


def score_many(pairs, *, timeout_s: float = DEFAULT_TIMEOUT_S, fallback: str = "none") -> list[float]:
    r"""`score_answer` for each (completion, ground_truth) of `pairs`, in one round trip to the worker process."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}.")
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
    prepared = [_pair(completion, truth, fallback) for completion, truth in pairs]
    asked = [pair for pair in prepared if pair is not None]
    try:
        matched = iter(_WORKER.match_many(asked, timeout_s) if asked else [])
    except GraderUnavailableError:
        raise
    except Exception:  # noqa: BLE001 - the reward must never take a training step down
        logger.debug("score_answer failed", exc_info=True)
        matched = iter([False] * len(asked))
    return [0.0 if pair is None else (1.0 if next(matched) else 0.0) for pair in prepared]


def score_answer(completion, ground_truth, *, timeout_s: float = DEFAULT_TIMEOUT_S, fallback: str = "none") -> float:
    r"""1.0 if the final answer of `completion` (its last `\boxed{}`, see `extract_answer` for `fallback`) is
    equivalent to `ground_truth`, else 0.0. Never raises, except for an unknown `fallback` or `timeout_s`, and
    `GraderUnavailableError` when no worker process can start (grading without bounds is refused)."""
    return score_many([(completion, ground_truth)], timeout_s=timeout_s, fallback=fallback)[0]


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
    return score_many(list(zip(completions, answers)))


# ------------------------------------------------------------------ the worker process
class _VerifyWorker:
    """One long-lived `python _math_verify_core.py` process per Python process (each trainer rank has its own).

    Every comparison runs there, from the main thread or any other, so that one bound holds on every path: the
    worker's SIGALRM at `timeout_s` for Python code, its RLIMIT_AS (`WORKER_MEMORY_HEADROOM_BYTES` above its size at
    start-up) and RLIMIT_CPU for everything, and a kill by this process at `timeout_s + _KILL_MARGIN_S` of wall time
    per answer for C code that never returns to Python (sympy's big-integer gcd). A killed or dead worker is replaced
    at once; a worker that cannot start raises `GraderUnavailableError`. Requests carry an id, so a reply to a
    request this process gave up on (an interrupted call) is never read as the answer to the next one. A forked
    child (a DataLoader worker) starts its own worker rather than share its parent's pipes.
    """

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._buffer = b""
        self._next_id, self._pid = 0, os.getpid()
        self._lock = threading.Lock()
        atexit.register(self.close)

    def answers_match(self, answer: str, gold: str, timeout_s: float) -> bool:
        return self.match_many([(answer, gold)], timeout_s)[0]

    def match_many(self, pairs: list[tuple[str, str]], timeout_s: float) -> list[bool]:
        """Whether each (answer, gold) matches; False for one whose comparison overran (the worker is then killed)."""
        results = [False] * len(pairs)
        with self._lock:
            done = 0
            while done < len(pairs):
                chunk = pairs[done : done + _PAIRS_PER_REQUEST]
                replies = self._request(chunk, timeout_s)
                results[done : done + len(replies)] = replies
                done += len(replies)
                if len(replies) < len(chunk):
                    done += 1  # the comparison that overran (or the worker died on) scores 0; the rest go on
                    self._kill()
        return results

    def _request(self, chunk: list[tuple[str, str]], timeout_s: float) -> list[bool]:
        """The replies to `chunk`, in order, until the first one that does not come in time (then shorter)."""
        process = self._ensure_started()
        self._next_id += 1
        request_id = self._next_id
        line = json.dumps({"id": request_id, "timeout_s": timeout_s, "pairs": chunk}) + "\n"
        if not self._write(process, line.encode(), timeout_s + _KILL_MARGIN_S):
            return []
        replies: list[bool] = []
        while len(replies) < len(chunk):
            reply = self._read_line(process, timeout_s + _KILL_MARGIN_S)
            if reply is None:
                break
            fields = reply.split()
            if len(fields) == 3 and fields[0] == str(request_id) and fields[1] == str(len(replies)):
                replies.append(fields[2] == "1")
            # else: a reply to an earlier request (its caller was interrupted), skipped
        return replies

    def _ensure_started(self) -> subprocess.Popen:
        if self._process is not None and self._pid != os.getpid():
            self._forget()  # forked without the at-fork hook: the pipes are the parent's
        if self._process is not None and self._process.poll() is None:
            return self._process
        self._kill()
        try:
            self._process = subprocess.Popen(
                [sys.executable, os.path.abspath(_math_verify_core.__file__)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                bufsize=0,
                start_new_session=True,  # a Ctrl-C meant for the trainer does not kill it mid-reply
            )
        except OSError as error:
            raise GraderUnavailableError(f"cannot start the grading worker process ({error})") from error
        self._buffer, self._pid = b"", os.getpid()
        if self._read_line(self._process, _WORKER_START_TIMEOUT_S) != "ready":
            self._kill()
            raise GraderUnavailableError(
                f"the grading worker process ({sys.executable} {_math_verify_core.__file__}) did not start within "
                f"{_WORKER_START_TIMEOUT_S:.0f} s; grading needs it to bound time and memory: check that "
                "`python -c 'import math_verify, sympy'` works in this environment."
            )
        return self._process

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
        if process is not None:
            if process.poll() is None:
                process.kill()
            process.wait()
            for stream in (process.stdin, process.stdout):
                try:
                    stream.close()
                except OSError:
                    pass

    def _forget(self) -> None:
        """In a forked child: drop the parent's worker without touching it (the parent still uses it)."""
        process, self._process = self._process, None
        self._buffer, self._lock = b"", threading.Lock()
        if process is not None:
            for stream in (process.stdin, process.stdout):
                try:
                    stream.close()  # this process's copies of the pipes only
                except OSError:
                    pass
            process.returncode = 0  # never waited for or killed from here

    def close(self) -> None:
        if self._process is not None and self._pid != os.getpid():
            self._forget()
        self._kill()


_KILL_MARGIN_S = 0.5  # the worker's alarm fires at timeout_s; past this much more, it is stuck in C code: killed
_PAIRS_PER_REQUEST = 16  # answers and golds are at most MAX_ANSWER_CHARS each: a request is at most ~64 KB
_PIPE_CHUNK = 1 << 16
_WORKER = _VerifyWorker()
os.register_at_fork(after_in_child=lambda: _WORKER._forget())
