"""`TrainingStopped`, the stop of an embedded run, in a module of the standard library only: `cell_pool` raises it,
and a pool's workers import `cell_pool` as they start, before any cell needs torch."""

from __future__ import annotations

import signal
import sys


class TrainingStopped(RuntimeError):
    """A stop signal (SIGTERM, SIGUSR1) ended `run_embedded`'s training before its last step. Raised before the final
    evaluation and before anything that marks a finished run (the summary, the final checkpoint), so a study never
    saves a stopped cell as done and reruns it on resume. `args`: the message, then the trainer's `graceful_stop`."""

    def __str__(self) -> str:
        return self.args[0]

    @property
    def exit_status(self) -> int:
        """128 + the signal's number, as a shell reports a process that the signal ended."""
        name = self.args[1]["signal"]
        return 128 + (signal.Signals[name].value if name in signal.Signals.__members__ else signal.SIGTERM.value)

    def report(self, prefix: str, then: str = "") -> int:
        """Print the stop on one line of stderr, as `<prefix> <message><then>`; return `exit_status` for `sys.exit`."""
        print(f"{prefix} {self}{then}", file=sys.stderr, flush=True)
        return self.exit_status
