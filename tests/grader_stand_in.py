"""A grading worker whose answers take the time the test gives them, on a clock of its own.

`rewards._Pool` runs unchanged (its two passes, its budget, its counts); only the worker process and the clock the
pool reads are replaced, so whether an answer fits the budget is decided by construction, not by the machine's load.
The stand-in replies as the worker's loop does (`dhpo_trl.scoring._math_verify_core._serve`): each answer runs under
the request's deadline or the budget left, whichever is shorter; "t" past the deadline, "b" past the budget, and a
verdict from math-verify itself (in this process, untimed) for an answer that ends in time.

    clock = StandInClock()
    worker = StandInWorker(clock, costs={slow_answer: 3.0})
    with installed(monkeypatch, clock, worker): ...  # every math reward call grades through `worker`
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

QUICK_S = 0.01  # an answer the test gives no cost takes this long


class StandInClock:
    """The pool's `time.monotonic`: it moves only when the stand-in compares an answer."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class StandInWorker:
    """`rewards._VerifyWorker` with `costs[answer]` seconds per comparison (`QUICK_S` otherwise), and `late[answer]`
    seconds lost once, before that answer first starts (a worker that gets no CPU on a loaded machine)."""

    def __init__(self, clock: StandInClock, costs: dict[str, float], late: dict[str, float] | None = None):
        self.clock, self.costs, self.late = clock, costs, dict(late or {})

    def request(self, chunk: list[tuple[str, str]], timeout_s: float, end: float) -> list[str]:
        return [self._compare(answer, gold, timeout_s, end) for answer, gold in chunk]

    def _compare(self, answer: str, gold: str, timeout_s: float, end: float) -> str:
        from dhpo_trl.scoring import _math_verify_core

        self.clock.now += self.late.pop(answer, 0.0)
        left = end - self.clock.now
        if left <= 0:
            return "b"  # not started: the budget ran out before it
        deadline = min(timeout_s, left)
        cost = self.costs.get(answer, QUICK_S)
        if cost > deadline:
            self.clock.now += deadline
            return "t" if deadline == timeout_s else "b"
        self.clock.now += cost
        return "1" if _math_verify_core.answers_match(answer, gold) else "0"

    def ensure_ready(self) -> None:
        pass

    def close(self) -> None:
        pass


@contextlib.contextmanager
def installed(monkeypatch, clock: StandInClock, worker: StandInWorker):
    """Every call of the math reward in this block grades through `worker` on `clock`, in a pool of its own (no
    answer cached or remembered as slow by an earlier test)."""
    from dhpo_trl.scoring import rewards

    with monkeypatch.context() as patch:
        patch.setattr(rewards, "time", SimpleNamespace(monotonic=clock.monotonic))
        patch.setattr(rewards, "_VerifyWorker", lambda: worker)
        patch.setattr(rewards, "_POOL", rewards._Pool())
        yield
