"""The graceful stop's per-step agreement (`resume.GracefulStopCallback`): this process's own signal is what it hands
to the agreement, and the agreed answer stops the run with a checkpoint."""

import os
import signal

from transformers import TrainerControl, TrainerState

from dhpo_trl.training import resume


def test_this_processs_signal_is_what_it_hands_to_the_agreement():
    asked = []
    request = resume.StopRequest()
    callback = resume.GracefulStopCallback(request, lambda flag: asked.append(flag) or flag)
    state, control = TrainerState(), TrainerControl()
    state.global_step = 4
    callback.on_step_end(None, state, control)
    assert asked == [False] and not control.should_save and callback.stopped_at is None
    request.signum = signal.SIGTERM  # what the handler records on the first signal
    state.global_step = 5
    callback.on_step_end(None, state, control)
    assert asked == [False, True] and control.should_save and control.should_training_stop
    assert callback.stopped_at == 5


def test_without_signal_handlers_the_process_asks_with_no_request():
    """`stop_on_signals` yields None where handlers cannot be installed (not the main thread): the process still takes
    part in every agreement, with nothing to ask for."""
    asked = []
    callback = resume.GracefulStopCallback(None, lambda flag: asked.append(flag) or flag)
    callback.on_step_end(None, TrainerState(), TrainerControl())
    assert asked == [False] and callback.stopped_at is None


def test_the_record_names_the_signal_step_and_checkpoint_of_a_stop_before_the_last_step():
    """`DHPOTrainer.graceful_stop`: None without a stop or for a stop at the last step (the run had finished); this
    process's signal by name, another process's as such."""
    request = resume.StopRequest()
    callback = resume.GracefulStopCallback(request, lambda flag: flag)
    assert callback.record(10, "out") is None
    callback.stopped_at = 10
    assert callback.record(10, "out") is None
    callback.stopped_at = 4
    assert callback.record(10, "out") == {"signal": "a signal to another process", "step": 4,
                                          "checkpoint": os.path.join("out", "checkpoint-4")}  # fmt: skip
    request.signum = signal.SIGUSR1
    assert callback.record(10, "out")["signal"] == "SIGUSR1"
    assert resume.GracefulStopCallback(None, lambda flag: flag).record(10, "out") is None
