"""`dhpo-train` that sends SIGTERM to its own process at the end of optimizer step N (a deterministic preemption).

Usage: python tests/dist_scripts/signal_at_step.py N [dhpo-train flags...]
"""

import os
import signal
import sys

from transformers import TrainerCallback

from dhpo_trl.scale_out import cli


class SignalAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    step, argv = int(sys.argv[1]), sys.argv[2:]
    build = cli.build_trainer

    def build_with_signal(*args, **kwargs):
        trainer = build(*args, **kwargs)
        trainer.add_callback(SignalAt(step))
        return trainer

    cli.build_trainer = build_with_signal
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
