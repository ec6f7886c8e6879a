"""Exact resume from any checkpoint (dhpo_trl/training/resume.py): a run resumed mid-generation-batch ends with the
uninterrupted run's parameters, logged metrics and data; half-written checkpoints are skipped; settings mismatches
are refused; the pure pieces (state encoding, discovery, settings, signal handlers, the stop callback) directly.

Runs are DHPO-E on the tiny Qwen3 (seed 0), a checkpoint every optimizer step, real sampling (the RNG states must be
restored too). Each takes about a second.
"""

import dataclasses
import json
import os
import shutil
import signal
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from dhpo_trl import DHPOTrainer
from dhpo_trl.core import aggregation
from dhpo_trl.core.presets import config_for
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import batching, resume

CPU = dict(use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0)
BASE = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, logging_steps=1,
            learning_rate=3e-2, save_strategy="steps", save_steps=1, gradient_accumulation_steps=1)  # fmt: skip
# Logged values that are wall-clock timings, not results.
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def prompts(n=16):
    return Dataset.from_dict({"prompt": [f"{'x' * (a % 3)}{a}+{2 * a + 1}=" for a in range(n)]})


def digit_share(completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


class RecordingTrainer(DHPOTrainer):
    """Records, per optimizer step, the prompt and completion ids of every micro-batch it trains on."""

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training:
            parts = inputs if isinstance(inputs, list) else [inputs]
            rows = [(tuple(p["prompt_ids"][i][p["prompt_mask"][i].bool()].tolist()),
                     tuple(p["completion_ids"][i][p["completion_mask"][i].bool()].tolist()))
                    for p in parts for i in range(p["prompt_ids"].size(0))]  # fmt: skip
            self.seen.setdefault(self.state.global_step + 1, []).extend(rows)
        return inputs


def train(tok, output_dir, resume_from=None, trainer_cls=RecordingTrainer, **settings):
    args = config_for("DHPO-E", output_dir=str(output_dir), **{**BASE, **settings}, **CPU)
    trainer = trainer_cls(model=build_tiny_qwen3(tok, hidden_size=32, seed=0), reward_funcs=digit_share, args=args,
                          train_dataset=prompts(), processing_class=tok)  # fmt: skip
    trainer.seen = {}
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer


def step_logs(trainer) -> dict:
    return {entry["step"]: {k: v for k, v in entry.items() if k not in TIMINGS}
            for entry in trainer.state.log_history if "loss" in entry}  # fmt: skip


def max_parameter_gap(a, b) -> float:
    other = dict(b.named_parameters())
    return max((param - other[name]).abs().max().item() for name, param in a.named_parameters())


def assert_resumed_exactly(full, resumed, start):
    """Parameters to 1e-6, every logged metric of every later step, and the data of every later step."""
    assert resumed.state.global_step == full.state.global_step
    assert max_parameter_gap(full.model, resumed.model) <= 1e-6
    full_logs, resumed_logs = step_logs(full), step_logs(resumed)
    later = [step for step in full_logs if step > start]
    assert later and all(resumed_logs[step] == pytest.approx(full_logs[step], abs=1e-6) for step in later), later
    assert sorted(resumed.seen) == later
    assert all(resumed.seen[step] == full.seen[step] for step in later)


# name: (settings, checkpoint to resume from). Every checkpoint is mid-generation-batch.
MID_BATCH = {
    "k2": (dict(steps_per_generation=2, max_steps=6), 3),
    "k4": (dict(steps_per_generation=4, max_steps=8), 3),
    "k4-trl-batching": (dict(steps_per_generation=4, max_steps=6, dynamic_batching=False), 2),
    "k2-accumulation-windows": (dict(gradient_accumulation_steps=2, steps_per_generation=4, max_steps=4), 1),
    "k4-token-budget": (dict(gradient_accumulation_steps=2, steps_per_generation=8, max_steps=4,
                             max_tokens_per_micro_batch=24), 1),  # fmt: skip
    "iterations": (dict(steps_per_generation=2, num_iterations=2, max_steps=6), 3),
    "k4-padding-free-budget": (dict(gradient_accumulation_steps=2, steps_per_generation=8, max_steps=4,
                                    padding_free=True, max_tokens_per_micro_batch=24), 1),  # fmt: skip
}


@pytest.fixture(scope="module")
def uninterrupted(tok, tmp_path_factory):
    runs = {}
    for name, (settings, _) in MID_BATCH.items():
        runs[name] = train(tok, tmp_path_factory.mktemp(name), **settings)
    return runs


@pytest.mark.parametrize("name", list(MID_BATCH))
def test_mid_generation_batch_resume_equals_the_uninterrupted_run(name, uninterrupted, tok, tmp_path):
    settings, start = MID_BATCH[name]
    full = uninterrupted[name]
    checkpoint = os.path.join(full.args.output_dir, f"checkpoint-{start}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to warn about: the state is all there
        warnings.filterwarnings("ignore", message=".*(on-policy|num_iterations|mask_truncated).*")
        resumed = train(tok, tmp_path, resume_from=checkpoint, **settings)
    assert_resumed_exactly(full, resumed, start)


def test_token_budget_checkpoint_holds_passes_and_window_tensors(uninterrupted):
    """The saved buffer is the planned one: `Passes` lists and each pass's accumulation `Window`, on the CPU."""
    full = uninterrupted["k4-token-budget"]
    path = os.path.join(full.args.output_dir, "checkpoint-1", "dhpo_generation_state_rank0.pt")
    state = torch.load(path, weights_only=True)
    buffered = resume.decode(state["_buffered_inputs"])
    assert resume.decode(state["_step"]) == 2  # one optimizer step of 2 micro-steps done
    assert len(buffered) == 8 and any(isinstance(micro, batching.Passes) for micro in buffered)
    part = next(micro for micro in buffered if isinstance(micro, batching.Passes))[0]
    window = part[batching.WINDOW]
    assert isinstance(window, aggregation.Window) and float(window.passes) > 2 and float(window.tokens) > 0


def test_without_the_generation_state_the_resume_differs(uninterrupted, tok, tmp_path):
    """The state matters (the check above can fail): a checkpoint of an older version (no generation state) resumes
    with one warning, regenerates at its step and trains on other data, so its parameters differ; the generation
    batches after the next boundary start at the uninterrupted run's prompts."""
    full = uninterrupted["k4"]
    legacy = tmp_path / "checkpoint-3"
    shutil.copytree(os.path.join(full.args.output_dir, "checkpoint-3"), legacy)
    for name in ("dhpo_generation_state_rank0.pt", resume.COMPLETE_MARKER):
        (legacy / name).unlink()
    with pytest.warns(UserWarning) as caught:
        resumed = train(tok, tmp_path / "out", resume_from=str(legacy), steps_per_generation=4, max_steps=8)
    regenerate = [w for w in caught if "no generation state" in str(w.message)]
    assert len(regenerate) == 1 and "step 3" in str(regenerate[0].message)
    assert max_parameter_gap(full.model, resumed.model) > 1e-3
    assert resumed.seen[4] != full.seen[4]  # regenerated: other completions
    # Steps 5-8 are one generation batch in both runs (the shuffle inside it differs: the RNG did more work).
    prompts_of = lambda run: sorted(prompt for step in (5, 6, 7, 8) for prompt, _ in run.seen[step])  # noqa: E731
    assert prompts_of(resumed) == prompts_of(full)


def test_an_older_checkpoint_regenerates_on_the_uninterrupted_runs_boundaries_under_accumulation(
        uninterrupted, tok, tmp_path):  # fmt: skip
    """With 2 micro-steps per optimizer step, an older checkpoint at step 1 has done 2 micro-steps: the resume must
    count them (not 1), or its generation batches start mid-step and steps 3-4 train on other prompts."""
    full = uninterrupted["k2-accumulation-windows"]
    legacy = tmp_path / "checkpoint-1"
    shutil.copytree(os.path.join(full.args.output_dir, "checkpoint-1"), legacy)
    for name in ("dhpo_generation_state_rank0.pt", resume.COMPLETE_MARKER):
        (legacy / name).unlink()
    settings, _ = MID_BATCH["k2-accumulation-windows"]
    with pytest.warns(UserWarning, match="no generation state"):
        resumed = train(tok, tmp_path / "out", resume_from=str(legacy), **settings)
    prompts_of = lambda run: sorted(prompt for step in (3, 4) for prompt, _ in run.seen[step])  # noqa: E731
    assert sorted(resumed.seen) == [2, 3, 4] and prompts_of(resumed) == prompts_of(full)


def test_latest_skips_a_half_written_checkpoint(uninterrupted, tok, tmp_path):
    full = uninterrupted["k2"]
    output_dir = tmp_path / "out"
    for step in (4, 5):
        shutil.copytree(os.path.join(full.args.output_dir, f"checkpoint-{step}"), output_dir / f"checkpoint-{step}")
    (output_dir / "checkpoint-5" / resume.COMPLETE_MARKER).unlink()  # the save of step 5 never finished
    (output_dir / "checkpoint-5" / "model.safetensors").unlink()
    with pytest.warns(UserWarning, match="checkpoint-5"):
        resumed = train(tok, output_dir, resume_from="latest", steps_per_generation=2, max_steps=6)
    assert sorted(resumed.seen) == [5, 6]  # resumed from step 4
    assert max_parameter_gap(full.model, resumed.model) <= 1e-6


def test_a_save_that_fails_midway_leaves_a_folder_latest_skips(tok, tmp_path, monkeypatch):
    """The model is written, then the save dies (disk full) before transformers' trainer_state.json: the folder holds
    our generation state but no marker, so it is never resumed; the signal handlers are restored."""
    from transformers import Trainer

    save_model = Trainer.save_model

    def full_disk_at_step_2(self, output_dir=None, _internal_call=False):
        save_model(self, output_dir, _internal_call)
        if self.state.global_step == 2:
            raise OSError("No space left on device")

    monkeypatch.setattr(Trainer, "save_model", full_disk_at_step_2)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(OSError, match="No space left"):
        train(tok, tmp_path, steps_per_generation=2, max_steps=3)
    assert signal.getsignal(signal.SIGTERM) == before
    assert (tmp_path / "checkpoint-2" / "model.safetensors").exists()
    assert resume.COMPLETE_MARKER in resume.incomplete_reason(str(tmp_path / "checkpoint-2"))
    skipped = []
    assert resume.resolve_checkpoint("latest", str(tmp_path), skipped.append) == str(tmp_path / "checkpoint-1")
    assert len(skipped) == 1 and "checkpoint-2" in skipped[0]


def test_latest_without_checkpoints_starts_from_scratch_and_true_refuses(tok, tmp_path):
    trainer = train(tok, tmp_path, resume_from="latest", steps_per_generation=2, max_steps=1)
    assert trainer.state.global_step == 1 and sorted(trainer.seen) == [1]
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resume.resolve_checkpoint(True, str(tmp_path / "empty"))


def test_settings_mismatch_is_refused_naming_the_setting(uninterrupted, tok, tmp_path):
    checkpoint = os.path.join(uninterrupted["k2"].args.output_dir, "checkpoint-2")
    with pytest.raises(ValueError, match="steps_per_generation=2 in the checkpoint but 4 now"):
        train(tok, tmp_path, resume_from=checkpoint, steps_per_generation=4, max_steps=6)


def test_save_total_limit_keeps_the_newest_complete_checkpoint(tok, tmp_path):
    train(tok, tmp_path, steps_per_generation=2, max_steps=3, save_total_limit=1)
    assert [name for name in os.listdir(tmp_path) if name.startswith("checkpoint-")] == ["checkpoint-3"]
    assert resume.incomplete_reason(str(tmp_path / "checkpoint-3")) is None
    marker = json.loads((tmp_path / "checkpoint-3" / resume.COMPLETE_MARKER).read_text())
    assert marker["global_step"] == 3 and marker["settings"]["steps_per_generation"] == 2


class SignalSelfAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.mark.parametrize("signal_at", [1, 3])
def test_sigusr1_stops_after_the_step_with_a_checkpoint_unless_the_run_had_finished(tok, tmp_path, signal_at):
    caught = []  # ours replaces this handler inside train() only; if it did not, this one catches the signal
    fallback = lambda signum, frame: caught.append(signum)  # noqa: E731
    previous = signal.signal(signal.SIGUSR1, fallback)
    try:
        args = config_for("DHPO-E", output_dir=str(tmp_path), **{**BASE, "steps_per_generation": 2, "max_steps": 3},
                          **CPU)  # fmt: skip
        trainer = RecordingTrainer(model=build_tiny_qwen3(tok, hidden_size=32, seed=0), reward_funcs=digit_share,
                                   args=args, train_dataset=prompts(), processing_class=tok,
                                   callbacks=[SignalSelfAt(signal_at)])  # fmt: skip
        trainer.seen = {}
        trainer.train()
        assert caught == [] and signal.getsignal(signal.SIGUSR1) is fallback  # restored after train()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert trainer.state.global_step == signal_at
    stopped = [name for name in os.listdir(tmp_path) if name.startswith("checkpoint-")]
    if signal_at == 1:
        assert trainer.graceful_stop == {"signal": "SIGUSR1", "step": 1, "checkpoint": str(tmp_path / "checkpoint-1")}
        assert stopped == ["checkpoint-1"] and resume.incomplete_reason(str(tmp_path / "checkpoint-1")) is None
    else:
        assert trainer.graceful_stop is None  # it had reached max_steps: a finished run, not a stopped one


def test_a_stop_checkpoint_is_full_under_save_only_model_and_resumes_exactly(uninterrupted, tok, tmp_path):
    """The periodic checkpoints of a save_only_model run hold the weights only; the one a signal writes is full, so
    the requeued job resumes from it (`latest` skips the weights-only ones) and ends as the uninterrupted run."""
    settings, _ = MID_BATCH["k2"]
    stopped = tmp_path / "stopped"
    args = config_for("DHPO-E", output_dir=str(stopped), **{**BASE, **settings, "save_only_model": True}, **CPU)
    trainer = RecordingTrainer(model=build_tiny_qwen3(tok, hidden_size=32, seed=0), reward_funcs=digit_share,
                               args=args, train_dataset=prompts(), processing_class=tok,
                               callbacks=[SignalSelfAt(3)])  # fmt: skip
    trainer.seen = {}
    trainer.train()
    assert trainer.graceful_stop["step"] == 3 and trainer.args.save_only_model is True  # the setting is restored
    assert "save_only_model" in resume.incomplete_reason(str(stopped / "checkpoint-2"))  # a periodic one
    assert resume.incomplete_reason(str(stopped / "checkpoint-3")) is None
    assert any(name.startswith("optimizer") for name in os.listdir(stopped / "checkpoint-3"))
    resumed = train(tok, stopped, resume_from="latest", **settings, save_only_model=True)
    assert_resumed_exactly(uninterrupted["k2"], resumed, 3)


# ------------------------------------------------------------------------------------------------ pure parts
def test_encode_decode_round_trip_keeps_types_devices_and_order():
    window = torch.tensor(3.0)
    value = [
        {"b": torch.arange(6).reshape(2, 3), "a": window, "n": 7, "x": None},
        batching.Passes([{"ids": torch.ones(1, 2)}, {"ids": torch.zeros(2, 2)}]),
        (1.5, "s", True),
    ]
    back = resume.decode(resume.encode(value))
    assert isinstance(back, list) and isinstance(back[1], batching.Passes) and not isinstance(back[0], batching.Passes)
    assert list(back[0]) == ["b", "a", "n", "x"] and back[0]["n"] == 7 and back[0]["x"] is None
    assert torch.equal(back[0]["b"], value[0]["b"]) and back[0]["a"].dim() == 0 and back[0]["a"].item() == 3.0
    assert torch.equal(back[1][1]["ids"], torch.zeros(2, 2)) and back[2] == (1.5, "s", True)
    back[0]["b"][0, 0] = 100  # a copy, not a view of the live buffer
    assert value[0]["b"][0, 0] == 0


def test_decode_moves_accelerator_tensors_to_the_device_at_every_depth():
    """A tensor saved from an accelerator goes to the resuming process's device, wherever it sits (inside passes,
    dicts, lists, tuples, a window); a CPU one stays on the CPU. The meta device stands in for an accelerator."""
    def on_device(value):
        return ("tensor", torch.tensor(value), True)

    def on_cpu(value):
        return ("tensor", torch.tensor(value), False)

    window = resume.encode(aggregation.fixed_slice_window(4, 2, torch.tensor(30.0)))
    assert [node[0] for _, node in window[1]].count("tensor") == 1  # dapo_tokens
    window = ("window", [(name, on_device(1.0) if node[0] == "tensor" else node) for name, node in window[1]])
    node = ("list", [
        ("passes", [("dict", [("ids", on_device(1.0)), ("cpu", on_cpu(2.0))])]),
        ("tuple", [on_device(3.0), ("list", [on_device(4.0)])]),
        window,
    ])  # fmt: skip
    back = resume.decode(node, device="meta")
    assert isinstance(back[0], batching.Passes) and back[0][0]["ids"].device.type == "meta"
    assert back[0][0]["cpu"].device.type == "cpu" and back[0][0]["cpu"].item() == 2.0
    assert [t.device.type for t in (back[1][0], back[1][1][0])] == ["meta", "meta"]
    window_tensors = [getattr(back[2], f.name) for f in dataclasses.fields(back[2])
                      if torch.is_tensor(getattr(back[2], f.name))]  # fmt: skip
    assert window_tensors and all(t.device.type == "meta" for t in window_tensors)
    assert resume.decode(on_device(5.0)).device.type == "cpu"  # the default device


def test_a_cpu_tensor_stays_on_the_cpu_whatever_the_resuming_device():
    """The window normalisers stay on the CPU on purpose: encode marks a CPU tensor as such."""
    back = resume.decode(resume.encode({"window": torch.tensor(3.0)}), device="meta")
    assert back["window"].device.type == "cpu" and back["window"].item() == 3.0


@pytest.mark.parametrize(("value", "path"), [
    ([batching.Passes([{"ids": torch.ones(1), "odd": {1}}])], "state[0][0]['odd']"),
    ((1, {2}), "state[1]"),
    ({"w": aggregation.fixed_slice_window(2, 1, {3})}, "state['w'].dapo_tokens"),
])  # fmt: skip
def test_encode_names_the_path_through_passes_tuples_and_windows(value, path):
    with pytest.raises(TypeError) as error:
        resume.encode(value)
    assert str(error.value).split(" is a ")[0] == path


def test_resume_values_as_a_shell_passes_them(tmp_path):
    """`--resume_from_checkpoint` arrives as text: "no" in any case starts afresh, and the surrounding whitespace of
    a value (a requeue script's trailing newline) is ignored, for `latest` and for a path alike."""
    path = _checkpoint(tmp_path, 4, ["trainer_state.json", "optimizer.pt"])
    for value in ("no", " No ", "NO\n"):
        assert resume.resolve_checkpoint(value, str(tmp_path)) is None
    assert resume.resolve_checkpoint(" latest\n", str(tmp_path)) == path
    assert resume.resolve_checkpoint("Yes", str(tmp_path)) == path  # like True
    assert resume.resolve_checkpoint(f"{path}\n", str(tmp_path)) == path


def test_marking_and_unmarking_a_checkpoint(tmp_path):
    """A marker written with the defaults makes a resumable checkpoint of format MARKER_FORMAT recording every
    file's size; unmark removes it, so the folder is incomplete until marked again."""
    path = _checkpoint(tmp_path, 3, ["trainer_state.json", "optimizer.pt", "dhpo_generation_state_rank0.pt"])
    os.makedirs(os.path.join(path, "global_step3"))
    with open(os.path.join(path, "global_step3", "states.pt"), "wb") as handle:
        handle.write(b"0123456789")
    resume.mark_complete(path, {"world_size": 1}, 3)
    assert resume.incomplete_reason(path) is None
    files = {"dhpo_generation_state_rank0.pt": 2, "global_step3/states.pt": 10, "optimizer.pt": 2,
             "trainer_state.json": 2}  # fmt: skip
    assert resume.read_marker(path) == {"format": resume.MARKER_FORMAT, "global_step": 3, "save_only_model": False,
                                        "settings": {"world_size": 1}, "files": files}  # fmt: skip
    resume.unmark(path)
    assert resume.read_marker(path) is None and resume.COMPLETE_MARKER in resume.incomplete_reason(path)
    resume.unmark(path)  # already unmarked: nothing to do


def test_decode_refuses_an_unknown_node_naming_its_kind():
    with pytest.raises(ValueError, match="'bitmap'"):
        resume.decode(("bitmap", b"\x00"))


def test_a_marker_without_settings_refuses_every_current_setting(tmp_path):
    path = _checkpoint(tmp_path, 1, ["trainer_state.json", "optimizer.pt"])
    (tmp_path / "checkpoint-1" / resume.COMPLETE_MARKER).write_text(json.dumps({"format": 1, "global_step": 1}))
    with pytest.raises(ValueError) as error:
        resume.check_resumable(path, {"world_size": 2, "algorithm": "dhpo"})
    assert "world_size=None" in str(error.value) and "algorithm=None" in str(error.value)


def test_encode_names_the_path_of_an_unsupported_value():
    with pytest.raises(TypeError, match=r"state\[0\]\['images'\] is a set"):
        resume.encode([{"images": {1, 2}}])


def test_an_unsaveable_buffer_degrades_to_a_regenerating_resume_with_a_warning():
    """A value the encoding does not know (e.g. a new batch type) must not kill the run at a save: the state is saved
    without the buffer, and the step counter points at the micro-steps done, so the resume regenerates there."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(
        _step=5, _buffered_inputs=[{"ids": torch.ones(2)}, {"odd": {1, 2}}], entropy_coef=0.1,
        _last_world_entropy=2.0, _entropy_window_stats=None, _metrics={"train": {"loss": [0.5]}},
        state=SimpleNamespace(global_step=3), args=SimpleNamespace(gradient_accumulation_steps=2),
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"step 3 resumes inexactly.*_buffered_inputs\[1\]\['odd'\] is a set"):
        state = resume.capture(trainer)
    assert resume.decode(state["_buffered_inputs"]) is None and resume.decode(state["_step"]) == 6
    assert resume.decode(state["entropy_coef"]) == 0.1 and resume.decode(state["_metrics_train"]) == {"loss": [0.5]}


def test_settings_difference_and_run_settings(tmp_path):
    args = config_for("DHPO-E", output_dir=str(tmp_path), **{**BASE, "steps_per_generation": 2}, **CPU)
    settings = resume.run_settings(args, world_size=2)
    assert settings["world_size"] == 2 and settings["steps_per_generation"] == 2 and settings["algorithm"] == "dhpo"
    assert "epsilon_low_token" in settings  # the objective's own settings
    assert resume.settings_difference(settings, {**settings, "world_size": 4}) == ["world_size"]
    assert resume.settings_difference(settings, dict(settings)) == []
    assert resume.settings_difference({"a": 1}, {"b": 1}) == ["a", "b"]


def _checkpoint(root, step, files):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_text("{}")
    return str(path)


def test_discovery_and_completeness(tmp_path):
    legacy = _checkpoint(tmp_path, 2, ["trainer_state.json", "model.safetensors", "optimizer.pt"])
    complete = _checkpoint(tmp_path, 10, ["trainer_state.json", "dhpo_generation_state_rank0.pt", resume.COMPLETE_MARKER])
    half = _checkpoint(tmp_path, 11, ["dhpo_generation_state_rank0.pt", "trainer_state.json"])
    crashed = _checkpoint(tmp_path, 12, ["model.safetensors"])
    (tmp_path / "checkpoint-13").write_text("a file, not a folder")
    assert resume.incomplete_reason(legacy) is None and resume.incomplete_reason(complete) is None
    assert resume.COMPLETE_MARKER in resume.incomplete_reason(half)
    assert "trainer_state.json" in resume.incomplete_reason(crashed)
    skipped = []
    assert resume.newest_complete_checkpoint(str(tmp_path), skipped.append) == complete  # 10 > 2 numerically
    assert [message.split(":")[0] for message in skipped] == [f"Skipping {crashed}", f"Skipping {half}"]
    assert resume.resolve_checkpoint("latest", str(tmp_path), skipped.append) == complete
    assert resume.resolve_checkpoint("True", str(tmp_path), skipped.append) == complete
    assert resume.resolve_checkpoint(legacy, str(tmp_path)) == legacy
    for value in (None, False, "false", ""):
        assert resume.resolve_checkpoint(value, str(tmp_path)) is None
    with pytest.raises(ValueError, match="checkpoint-11 cannot be resumed"):
        resume.resolve_checkpoint(half, str(tmp_path))
    with pytest.raises(ValueError, match="is not a folder"):
        resume.resolve_checkpoint(str(tmp_path / "checkpoint-99"), str(tmp_path))
    assert resume.resolve_checkpoint("latest", str(tmp_path / "nothing-here")) is None


def test_skipped_checkpoints_are_warned_about_by_default(tmp_path):
    """Without a `warn` callback, each skipped folder is a UserWarning that names it (a silent skip would hide a
    half-written save)."""
    complete = _checkpoint(tmp_path, 1, ["trainer_state.json", "optimizer.pt"])
    half = _checkpoint(tmp_path, 2, ["dhpo_generation_state_rank0.pt"])
    with pytest.warns(UserWarning) as caught:
        assert resume.newest_complete_checkpoint(str(tmp_path)) == complete
    assert [half in str(w.message) for w in caught] == [True]


def test_an_older_deepspeed_checkpoint_is_resumable(tmp_path):
    """DeepSpeed keeps the optimizer states in a `global_step<N>` folder, with no `optimizer.pt`: not weights only."""
    deepspeed = _checkpoint(tmp_path, 6, ["trainer_state.json", "latest", "zero_to_fp32.py"])
    (tmp_path / "checkpoint-6" / "global_step6").mkdir()
    assert resume.incomplete_reason(deepspeed) is None
    assert resume.resolve_checkpoint("latest", str(tmp_path)) == deepspeed


def test_weights_only_and_unresumable_output_dirs_are_refused(tmp_path):
    weights_only = _checkpoint(tmp_path, 3, ["trainer_state.json", "model.safetensors"])  # older, save_only_model
    assert "save_only_model" in resume.incomplete_reason(weights_only)
    marked = _checkpoint(tmp_path, 4, ["trainer_state.json", "model.safetensors", "optimizer.pt"])
    resume.mark_complete(marked, {}, 4, save_only_model=True)  # the marker decides for our checkpoints
    assert "save_only_model" in resume.incomplete_reason(marked)
    _checkpoint(tmp_path, 5, ["dhpo_generation_state_rank0.pt"])
    skipped = []
    # checkpoints, none resumable: starting from step 0 would overwrite them
    with pytest.raises(ValueError, match="none can be resumed.*checkpoint-5"):
        resume.resolve_checkpoint("latest", str(tmp_path), skipped.append)
    assert len(skipped) == 3


def test_a_weights_only_run_is_marked_so(tok, tmp_path):
    train(tok, tmp_path, steps_per_generation=2, max_steps=1, save_only_model=True)
    assert json.loads((tmp_path / "checkpoint-1" / resume.COMPLETE_MARKER).read_text())["save_only_model"] is True
    with pytest.raises(ValueError, match="save_only_model"):
        resume.resolve_checkpoint("latest", str(tmp_path), lambda message: None)


def test_check_resumable_names_every_differing_setting(tmp_path):
    path = _checkpoint(tmp_path, 1, ["trainer_state.json"])
    resume.mark_complete(path, {"steps_per_generation": 2, "world_size": 1, "algorithm": "dhpo"}, 1)
    resume.check_resumable(path, {"steps_per_generation": 2, "world_size": 1, "algorithm": "dhpo"})
    with pytest.raises(ValueError) as error:
        resume.check_resumable(path, {"steps_per_generation": 2, "world_size": 8, "algorithm": "gspo"})
    assert "world_size=1" in str(error.value) and "algorithm='dhpo'" in str(error.value)
    assert "steps_per_generation" not in str(error.value)
    resume.check_resumable(_checkpoint(tmp_path, 2, ["trainer_state.json"]), {"world_size": 8})  # older: unchecked


def test_stop_handlers_live_only_inside_the_block_and_a_second_signal_stops_at_once():
    calls = []
    before = {signum: signal.getsignal(signum) for signum in resume.STOP_SIGNALS}
    signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        with resume.stop_on_signals() as request:
            assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
            assert not request.requested
            os.kill(os.getpid(), signal.SIGUSR1)
            assert request.requested and request.name == "SIGUSR1" and calls == []  # only the flag
            os.kill(os.getpid(), signal.SIGUSR1)  # second: the previous handler runs, ours are gone
            assert calls == [signal.SIGUSR1]
            assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    finally:
        signal.signal(signal.SIGUSR1, before[signal.SIGUSR1])


def test_stop_handlers_are_restored_after_an_error():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError), resume.stop_on_signals():
        raise RuntimeError("training failed")
    assert signal.getsignal(signal.SIGTERM) == before


def test_stop_callback_asks_every_step_and_stops_when_any_process_was_signalled():
    from transformers import TrainerControl, TrainerState

    asked = []
    request = resume.StopRequest()
    other_rank_signalled = [False]
    callback = resume.GracefulStopCallback(request, lambda flag: asked.append(flag) or flag or other_rank_signalled[0])
    state, control = TrainerState(), TrainerControl()
    state.global_step = 1
    callback.on_step_end(None, state, control)
    assert asked == [False] and not control.should_training_stop and callback.stopped_at is None
    other_rank_signalled[0] = True  # this process got nothing; the agreement says stop
    state.global_step = 2
    callback.on_step_end(None, state, control)
    assert control.should_save and control.should_training_stop and callback.stopped_at == 2 and asked == [False, False]
