"""math-verify equivalence of one extracted answer with its ground truths, bounded in time.

Self-contained on purpose (imports nothing from `dhpo_trl`): `dhpo_trl.rewards` imports it in-process, and runs
this same file by path as a worker process (`python _math_verify_core.py`) when it is called outside the main
thread, where no signal-based timeout exists. Worker protocol: one JSON request per stdin line
(`{"answer": str, "truths": [str, ...], "timeout_s": float}`), one line `1` or `0` back.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify


class _DeadlineExceeded(BaseException):
    """BaseException so that math-verify's and sympy's `except Exception` blocks cannot swallow it."""


class _DropTimeoutDisabledWarning(logging.Filter):
    # We disable math-verify's own alarm (it cancels any outer one and refuses to run off the main thread) and
    # bound the whole comparison ourselves, so its "you must provide the logic for timeout" warning is noise.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def _normalise(text: str) -> str:
    return "".join(text.split()).strip("$").removeprefix("\\(").removesuffix("\\)")


def _parse_math(text: str) -> list:
    """Parse an answer, first as the content of a `\\boxed{}` (LaTeX), then as a plain expression."""
    as_latex = parse("\\boxed{" + text + "}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    if as_latex:
        return as_latex
    return parse(text, extraction_config=[ExprExtractionConfig()], parsing_timeout=None)


def answers_match(answer: str, truths: list[str]) -> bool:
    """True if `answer` equals one of `truths` (string-identical or math-verify equivalent). No time bound."""
    if any(_normalise(answer) == _normalise(truth) for truth in truths):
        return True  # covers answers sympy cannot evaluate quickly, e.g. 99^{99^{99}} given exactly
    predicted = _parse_math(answer)
    if not predicted:
        return False
    for truth in truths:
        gold = _parse_math(truth.strip().strip("$"))
        if gold and verify(gold, predicted, timeout_seconds=None):
            return True
    return False


def answers_match_with_deadline(answer: str, truths: list[str], timeout_s: float) -> bool:
    """`answers_match`, interrupted after `timeout_s` seconds (counts as no match). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("answers_match_with_deadline needs the main thread (it uses SIGALRM).")

    # The alarm repeats every 50 ms after the deadline: an exception raised where Python swallows it (a weakref
    # callback or __del__ running at that moment prints "Exception ignored") is raised again at the next tick.
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            raise _DeadlineExceeded

    started = time.monotonic()
    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s, 0.05)
    try:
        try:
            return answers_match(answer, truths)
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _DeadlineExceeded:
        return False
    finally:
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:  # someone else's timer was running: give it back (approximately)
            signal.setitimer(signal.ITIMER_REAL, max(previous_delay - (time.monotonic() - started), 1e-3))


def _serve() -> None:
    """Worker loop: answer requests from stdin until it closes."""
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            matched = answers_match_with_deadline(request["answer"], request["truths"], request["timeout_s"])
        except Exception:  # noqa: BLE001 - a bad request scores 0, the worker keeps serving
            matched = False
        print("1" if matched else "0", flush=True)


if __name__ == "__main__":
    _serve()
