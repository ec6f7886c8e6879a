"""A grading worker whose answers take the time the test gives them, on a clock of its own.

`rewards._Pool` runs unchanged (its two passes, its budget, its counts); only the worker process and the clock the
pool reads are replaced, so whether an answer fits the budget is decided by construction, not by the machine's load.
The stand-in replies as the worker's loop does (`dhpo_trl.scoring._math_verify_core._serve`): each answer runs under
the request's deadline or the budget left, whichever is shorter; "t" past the deadline, "b" past the budget, and a
verdict from math-verify itself (in this process, untimed; "0" if it raises) for an answer that ends in time. As
`rewards._VerifyWorker.request` does, it returns fewer codes than answers when one never returns (C code the alarm
cannot stop): the caller waited the deadline plus `rewards._KILL_MARGIN_S` for it, then killed the worker.

    clock = StandInClock()
    worker = StandInWorker(clock, costs={slow_answer: 3.0})
    with installed(monkeypatch, clock, worker): ...  # every math reward call grades through `worker`, workers=1
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

QUICK_S = 0.01  # an answer the test gives no cost takes this long


class StandInClock:
    """The pool's `time.monotonic`: it moves only when the stand-in starts or compares."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class StandInWorker:
    """`rewards._VerifyWorker` with `costs[answer]` seconds per comparison (`QUICK_S` otherwise); `late[answer]`
    seconds lost once, before that answer first starts (a worker that gets no CPU on a loaded machine); `overrun_s`
    seconds an interrupted comparison goes on past its deadline before it replies (the alarm's latency); the answers
    in `stuck` never return; `start_s` seconds for the worker's start (its first `ensure_ready`). `asked` lists
    (answer, deadline) for every comparison started, in order."""

    def __init__(self, clock: StandInClock, costs: dict[str, float], late: dict[str, float] | None = None, *,
                 overrun_s: float = 0.0, stuck: frozenset[str] = frozenset(), start_s: float = 0.0):  # fmt: skip
        self.clock, self.costs, self.late = clock, costs, dict(late or {})
        self.overrun_s, self.stuck, self.start_s = overrun_s, stuck, start_s
        self.started, self.asked = False, []

    def request(self, chunk: list[tuple[str, str]], timeout_s: float, end: float) -> list[str]:
        from dhpo_trl.scoring.rewards import _KILL_MARGIN_S

        assert self.started, "the pool asked a worker it had not made ready"
        codes = []
        for answer, gold in chunk:
            if answer in self.stuck:  # the caller waits for the reply as `_VerifyWorker.request` does, then kills
                deadline = min(timeout_s, max(end - self.clock.now, 0.0))
                self.asked.append((answer, deadline))
                self.clock.now += deadline + _KILL_MARGIN_S
                return codes
            codes.append(self._compare(answer, gold, timeout_s, end))
        return codes

    def _compare(self, answer: str, gold: str, timeout_s: float, end: float) -> str:
        from dhpo_trl.scoring import _math_verify_core

        self.clock.now += self.late.pop(answer, 0.0)
        left = end - self.clock.now
        if left <= 0:
            return "b"  # not started: the budget ran out before it
        deadline = min(timeout_s, left)
        self.asked.append((answer, deadline))
        cost = self.costs.get(answer, QUICK_S)
        if cost > deadline:
            self.clock.now += deadline + self.overrun_s
            return "t" if deadline == timeout_s else "b"
        self.clock.now += cost
        try:
            return "1" if _math_verify_core.answers_match(answer, gold) else "0"
        except Exception:  # noqa: BLE001 - as the worker: a comparison that raises scores 0
            return "0"

    def ensure_ready(self) -> None:
        if not self.started:
            self.clock.now += self.start_s
            self.started = True

    def close(self) -> None:
        pass


@contextlib.contextmanager
def installed(monkeypatch, clock: StandInClock, worker: StandInWorker):
    """Every call of the math reward in this block grades through `worker` on `clock`, in a pool of its own (no
    answer cached or remembered as slow by an earlier test). The stand-in is one worker: a call that asks for more
    fails."""
    from dhpo_trl.scoring import rewards

    made = []

    def make_worker():
        assert not made, "the stand-in is one worker: pass workers=1"
        made.append(worker)
        return worker

    with monkeypatch.context() as patch:
        patch.setattr(rewards, "time", SimpleNamespace(monotonic=clock.monotonic))
        patch.setattr(rewards, "_VerifyWorker", make_worker)
        patch.setattr(rewards, "_POOL", rewards._Pool())
        yield
