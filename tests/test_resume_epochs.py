"""Exact resume in any epoch, with every stateful TRL setting, with the loss accumulators, from verified files.

The epoch runs train on 4 prompts, 2 per generation batch and 2 optimizer steps per generation batch: 4 steps per
epoch, so checkpoint-4 is the first step of epoch 2 (a generation boundary), checkpoint-5 is mid generation batch
in epoch 2, checkpoint-6 between generation batches in epoch 2, checkpoint-9 mid generation batch in epoch 3. They
log every 3 steps and run TRL's adaptive entropy controller, so the logged `loss` and metrics of a logging step mix
steps before and after the resume, and `train_loss` averages all of them.
"""

import json
import os
import re
import shutil
import warnings

import pytest
import torch
from datasets import Dataset
from test_resume import CPU, BASE, RecordingTrainer, digit_share, max_parameter_gap
from trl.trainer.utils import RepeatSampler

from dhpo_trl import DHPOConfig
from dhpo_trl.core.presets import config_for
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import resume, trl_mirror
from dhpo_trl.training.sampler import EpochRepeatSampler, epoch_permutation

EPOCHS = dict(steps_per_generation=2, max_steps=12, logging_steps=3, per_device_train_batch_size=4,
              use_adaptive_entropy=True, entropy_coef=0.05, entropy_coef_delta=0.05, entropy_target=10.0)  # fmt: skip
SYNC = dict(steps_per_generation=2, max_steps=6, logging_steps=2, beta=0.1, sync_ref_model=True,
            ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)  # fmt: skip
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
QUIET = ".*(on-policy|num_iterations|mask_truncated).*"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def saved_model(tok, tmp_path_factory):
    """The tiny model in a folder: TRL builds the reference model (beta != 0) from the policy's path."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    build_tiny_qwen3(tok, hidden_size=32, seed=0).save_pretrained(path)
    return str(path)


def config(output_dir, **settings):
    return config_for("DHPO-E", output_dir=str(output_dir), **{**BASE, **CPU, **settings})


def train(tok, output_dir, prompts=4, resume_from=None, callbacks=(), model=None, **settings):
    args = config(output_dir, **settings)
    dataset = Dataset.from_dict({"prompt": [f"{'x' * (a % 3)}{a}+{2 * a + 1}=" for a in range(prompts)]})
    model = model or build_tiny_qwen3(tok, hidden_size=32, seed=0)
    trainer = RecordingTrainer(model=model, reward_funcs=digit_share, args=args, train_dataset=dataset,
                               processing_class=tok, callbacks=list(callbacks))  # fmt: skip
    trainer.seen = {}
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer


def logs(trainer) -> dict:
    """Every logged entry by step (the step logs and the final summary), timings left out."""
    entries = {}
    for entry in trainer.state.log_history:
        key = "summary" if "train_loss" in entry else entry["step"]
        entries[key] = {k: v for k, v in entry.items() if k not in TIMINGS}
    return entries


def assert_resumed_exactly(full, resumed, start):
    """Parameters, every logged value after `start` (loss, train_loss and metrics included) to a relative 1e-6, and
    the data of every step after `start`."""
    assert resumed.state.global_step == full.state.global_step
    scale = max(p.abs().max().item() for p in full.model.parameters())
    assert max_parameter_gap(full.model, resumed.model) <= 1e-6 * scale
    full_logs, resumed_logs = logs(full), logs(resumed)
    later = [key for key in full_logs if key == "summary" or key > start]
    assert "summary" in later  # train_loss: every step's loss, before and after the resume
    for key in later:
        assert resumed_logs[key] == pytest.approx(full_logs[key], rel=1e-6, abs=1e-12), key
    steps = [step for step in full.seen if step > start]
    assert sorted(resumed.seen) == steps and all(resumed.seen[step] == full.seen[step] for step in steps)


def resumed_run(tok, tmp_path, full, start, checkpoint=None, **settings):
    checkpoint = checkpoint or os.path.join(full.args.output_dir, f"checkpoint-{start}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to warn about: the state is all there
        warnings.filterwarnings("ignore", message=QUIET)
        return train(tok, tmp_path, resume_from=checkpoint, **settings)


# ------------------------------------------------------------------------------------------- later epochs
@pytest.fixture(scope="module")
def epochs_full(tok, tmp_path_factory):
    return train(tok, tmp_path_factory.mktemp("epochs"), **EPOCHS)


def test_each_epoch_trains_on_its_own_order(epochs_full):
    """The check below can fail: epochs 1, 2 and 3 see their prompts in different orders (a resume that replays
    epoch 1's order trains on other data)."""
    def batch(first):  # the prompts of the generation batch trained at steps first and first + 1
        return {prompt for step in (first, first + 1) for prompt, _ in epochs_full.seen[step]}

    assert len(batch(1)) == 2 and batch(1) | batch(3) == batch(5) | batch(7)  # each epoch: all 4 prompts ...
    assert batch(1) != batch(5) and batch(5) != batch(9) and batch(7) != batch(11)  # ... grouped otherwise in each
    # ... as TRL's own sampler groups them in its first three passes (GRPOTrainer trains on the same data)
    texts = epochs_full.train_dataset["prompt"]
    trl = RepeatSampler(texts, mini_repeat_count=4, batch_size=2, repeat_count=2, seed=0)
    groups = [set(indexes[k : k + 16]) for indexes in (list(trl) for _ in range(3)) for k in (0, 16)]
    ids = [tuple(epochs_full.processing_class(text, add_special_tokens=False)["input_ids"]) for text in texts]
    expected = [{ids[index] for index in group} for group in groups]
    assert [batch(first) for first in range(1, 12, 2)] == expected


@pytest.mark.parametrize("start", [4, 5, 6, 9])
def test_a_resume_in_a_later_epoch_equals_the_uninterrupted_run(start, epochs_full, tok, tmp_path):
    resumed = resumed_run(tok, tmp_path, epochs_full, start, **EPOCHS)
    assert_resumed_exactly(epochs_full, resumed, start)


def test_checkpoints_hold_no_second_copy_of_the_entropy_state(epochs_full):
    """The adaptive entropy state is saved once, in the generation state (TRL's own file is not written)."""
    checkpoint = os.path.join(epochs_full.args.output_dir, "checkpoint-5")
    assert "entropy_ctrl_state.json" not in os.listdir(checkpoint)
    state = torch.load(os.path.join(checkpoint, "dhpo_generation_state_rank0.pt"), weights_only=True)
    assert resume.decode(state["entropy_coef"]) == pytest.approx(0.05 + 5 * 0.05)  # below target: +delta per step


def test_the_marker_records_the_entropy_coefficient_passed_not_the_one_the_controller_moved(epochs_full):
    """The command that started the run resumes it: the marker compares entropy_coef as passed, while the
    coefficient the controller moved to is restored from the generation state."""
    checkpoint = os.path.join(epochs_full.args.output_dir, "checkpoint-5")
    state = torch.load(os.path.join(checkpoint, "dhpo_generation_state_rank0.pt"), weights_only=True)
    assert resume.decode(state["entropy_coef"]) != pytest.approx(EPOCHS["entropy_coef"])
    assert resume.read_marker(checkpoint)["settings"]["entropy_coef"] == EPOCHS["entropy_coef"]
    resume.check_resumable(checkpoint, resume.run_settings(epochs_full.args, 1, epochs_full._update.padding_free))


def test_the_loss_accumulators_are_in_the_checkpoint(epochs_full):
    """At step 5 the last log was step 3: the accumulated loss holds steps 4 and 5, the total the loss logged at 3."""
    state = torch.load(os.path.join(epochs_full.args.output_dir, "checkpoint-5", "dhpo_generation_state_rank0.pt"),
                       weights_only=True)  # fmt: skip
    logged_at_3 = next(e["loss"] for e in epochs_full.state.log_history if e.get("step") == 3 and "loss" in e)
    assert resume.decode(state["_globalstep_last_logged"]) == 3
    assert resume.decode(state["_total_loss_scalar"]) == pytest.approx(3 * logged_at_3, rel=1e-6)
    assert resume.decode(state["_tr_loss"]).item() != 0.0


# ------------------------------------------------------------------------------------------------ sampler
@pytest.mark.parametrize("shuffle", [True, False])
def test_the_epoch_sampler_draws_trls_sequence_of_permutations(shuffle):
    """Pass `e` of EpochRepeatSampler, told its epoch or not, is pass `e` of TRL's RepeatSampler (an independent
    computation: TRL's own sampler iterated), and pure in (seed, epoch)."""
    data = list(range(11))
    settings = dict(mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=shuffle, seed=7)
    trl = RepeatSampler(data, **settings)
    trl_passes = [list(trl) for _ in range(4)]
    ours = EpochRepeatSampler(data, **settings)
    assert [list(ours) for _ in range(4)] == trl_passes  # no set_epoch: each pass the next epoch
    for epoch in (3, 0, 2):
        fresh = EpochRepeatSampler.like(RepeatSampler(data, **settings))
        fresh.set_epoch(epoch)
        assert list(fresh) == trl_passes[epoch]
    if shuffle:
        assert trl_passes[0] != trl_passes[1]
        assert epoch_permutation(11, 7, 2) != epoch_permutation(11, 7, 1)


# ------------------------------------------------------------------------------------------ sync_ref_model
@pytest.fixture(scope="module")
def sync_full(tok, tmp_path_factory, saved_model):
    return train(tok, tmp_path_factory.mktemp("sync"), prompts=16, model=saved_model, **SYNC)


@pytest.mark.parametrize("start", [3, 4])
def test_sync_ref_model_resumes_with_the_synced_reference_model(start, sync_full, tok, tmp_path, saved_model):
    """The reference model TRL mixes into the policy every step is saved and restored: the resumed run's KL values,
    reference model and parameters are the uninterrupted run's."""
    initial = build_tiny_qwen3(tok, hidden_size=32, seed=0)
    assert max_parameter_gap(sync_full.ref_model, initial) > 1e-3  # the reference model moved: the check can fail
    assert resume.REFERENCE_MODEL in os.listdir(os.path.join(sync_full.args.output_dir, f"checkpoint-{start}"))
    resumed = resumed_run(tok, tmp_path, sync_full, start, prompts=16, model=saved_model, **SYNC)
    assert_resumed_exactly(sync_full, resumed, start)
    assert max_parameter_gap(sync_full.ref_model, resumed.ref_model) <= 1e-6


def test_a_sync_ref_model_checkpoint_without_the_reference_model_warns_once(sync_full, tok, tmp_path, saved_model):
    """A checkpoint written before the reference model was saved still resumes: one warning says the reference
    model restarts from the initial one, and the run then differs (the KL is against another model)."""
    old = tmp_path / "checkpoint-3"
    shutil.copytree(os.path.join(sync_full.args.output_dir, "checkpoint-3"), old)
    (old / resume.REFERENCE_MODEL).unlink()
    _rewrite_marker(old, lambda record: {**record, "files": {}})
    with pytest.warns(UserWarning) as caught:
        resumed = train(tok, tmp_path / "out", prompts=16, resume_from=str(old), model=saved_model, **SYNC)
    named = [w for w in caught if resume.REFERENCE_MODEL in str(w.message)]
    assert len(named) == 1
    assert max_parameter_gap(sync_full.ref_model, resumed.ref_model) > 1e-4


# ----------------------------------------------------------------------------------------- refused settings
def _rewrite_marker(folder, change):
    marker = folder / resume.COMPLETE_MARKER
    marker.write_text(json.dumps(change(json.loads(marker.read_text()))))


@pytest.mark.parametrize(("changed", "setting"), [
    (dict(beta=0.1), "beta"), (dict(scale_rewards="none"), "scale_rewards"), (dict(seed=1), "seed"),
    (dict(temperature=0.7), "temperature"),
    (dict(padding_free=False), "padding_free"), (dict(dynamic_batching=False), "dynamic_batching"),
    (dict(vllm_importance_sampling_correction=False), "vllm_importance_sampling_correction"),
])  # fmt: skip
def test_a_setting_that_changes_the_buffer_is_refused_before_any_model_loads(changed, setting, epochs_full, tmp_path):
    """`resolve_for_run` is what the command calls before loading anything (and `train()` before restoring)."""
    checkpoint = os.path.join(epochs_full.args.output_dir, "checkpoint-5")
    args = config(tmp_path, **{**EPOCHS, **changed})
    with pytest.raises(ValueError) as error:
        resume.resolve_for_run(checkpoint, args, world_size=1)
    saved = resume.read_marker(checkpoint)["settings"][setting]
    assert f"{setting}={saved!r} in the checkpoint" in str(error.value)
    same = config(tmp_path, **EPOCHS)
    assert resume.resolve_for_run(checkpoint, same, world_size=1) == checkpoint


def test_a_beta_change_is_refused_by_train_before_the_checkpoint_loads(tok, tmp_path, saved_model):
    """Through the Python API: a beta=0 checkpoint resumed with beta=0.1 stops at train() with the setting named,
    before the checkpoint's weights are loaded (no KeyError at the first step)."""
    train(tok, tmp_path, prompts=16, steps_per_generation=2, max_steps=1)
    args = config(tmp_path, steps_per_generation=2, max_steps=3, beta=0.1)
    trainer = RecordingTrainer(model=saved_model, reward_funcs=digit_share,
                               args=args, train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 16}),
                               processing_class=tok)  # fmt: skip
    with pytest.raises(ValueError, match=r"beta=0\.0 in the checkpoint but 0\.1 now"):
        trainer.train(resume_from_checkpoint="latest")
    assert max_parameter_gap(trainer.model, build_tiny_qwen3(tok, hidden_size=32, seed=0)) == 0.0


def test_an_older_marker_stays_resumable_without_the_buffer_settings(epochs_full, tmp_path):
    """A marker of format 1 recorded no buffer settings and no file sizes: those are not compared."""
    old = tmp_path / "checkpoint-5"
    shutil.copytree(os.path.join(epochs_full.args.output_dir, "checkpoint-5"), old)
    _rewrite_marker(old, lambda record: {**record, "format": 1, "files": None, "settings": {
        k: v for k, v in record["settings"].items() if k not in resume.BUFFER_SETTINGS}})  # fmt: skip
    args = config(tmp_path, **{**EPOCHS, "seed": 3})
    assert resume.resolve_for_run(str(old), args, world_size=1) == str(old)
    changed = config(tmp_path, **{**EPOCHS, "steps_per_generation": 4})
    with pytest.raises(ValueError, match="steps_per_generation=2 in the checkpoint"):
        resume.resolve_for_run(str(old), changed, world_size=1)


# ------------------------------------------------------------------------------------- the update path that ran
def test_the_marker_records_the_update_path_that_ran(epochs_full):
    """The epoch runs leave padding_free automatic (None), which packs on the CPU: the marker records True."""
    assert epochs_full.args.padding_free is None and epochs_full._update.padding_free is True
    settings = resume.read_marker(os.path.join(epochs_full.args.output_dir, "checkpoint-5"))["settings"]
    assert settings["padding_free"] is True and settings["dynamic_batching"] is True


def test_an_explicit_padding_free_resumes_a_checkpoint_the_automatic_choice_packed(epochs_full, tok, tmp_path):
    resumed = resumed_run(tok, tmp_path, epochs_full, 5, **{**EPOCHS, "padding_free": True})
    assert_resumed_exactly(epochs_full, resumed, 5)


def test_an_automatic_choice_that_no_longer_packs_is_refused_before_the_checkpoint_loads(epochs_full, tok, tmp_path,
                                                                                          monkeypatch):  # fmt: skip
    """A CPU checkpoint resumed where the automatic choice keeps dynamic batching (a device without the packed
    kernel, stood in for by `automatic_reason`): undecided before the models load, refused by train() naming
    padding_free before the checkpoint's weights load."""
    from dhpo_trl.training import packing

    monkeypatch.setattr(packing, "automatic_reason", lambda models, device_type: "no varlen kernel here")
    checkpoint = os.path.join(epochs_full.args.output_dir, "checkpoint-5")
    assert resume.resolve_for_run(checkpoint, config(tmp_path, **EPOCHS), world_size=1) == checkpoint
    model = build_tiny_qwen3(tok, hidden_size=32, seed=0)
    trainer = RecordingTrainer(model=model, reward_funcs=digit_share, args=config(tmp_path, **EPOCHS),
                               train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 4}), processing_class=tok)
    assert trainer._update.padding_free is False
    with pytest.raises(ValueError, match="padding_free=True in the checkpoint but False now"):
        trainer.train(resume_from_checkpoint=checkpoint)
    assert max_parameter_gap(trainer.model, build_tiny_qwen3(tok, hidden_size=32, seed=0)) == 0.0


def test_torch_compile_turned_on_is_refused_naming_it_before_the_checkpoint_loads(epochs_full, tok, tmp_path):
    """The epoch runs pack automatically with TRL's default gradient checkpointing; torch_compile=True there keeps
    dynamic batching (`compiled_packing_reason`) whatever the model, so the resume is refused, naming torch_compile
    and its checkpoint value to resume with, not only the resolved padding_free (which was None both times): by
    `dhpo-train`'s check before any model loads, and by train()."""
    checkpoint = os.path.join(epochs_full.args.output_dir, "checkpoint-5")
    settings = resume.read_marker(checkpoint)["settings"]
    assert (settings["torch_compile"], settings["gradient_checkpointing"]) == (False, True)
    compiled = config(tmp_path, **EPOCHS, torch_compile=True)
    with pytest.raises(ValueError) as early:
        resume.resolve_for_run(checkpoint, compiled, world_size=1)  # no model: decided by the settings alone
    assert re.search(r"Resume with (\w+)=(\w+),", str(early.value)).groups() == ("torch_compile", "False")
    trainer = RecordingTrainer(model=build_tiny_qwen3(tok, hidden_size=32, seed=0), reward_funcs=digit_share,
                               args=compiled, train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 4}),
                               processing_class=tok)  # fmt: skip
    assert trainer._update.padding_free is False
    with pytest.raises(ValueError) as refused:
        trainer.train(resume_from_checkpoint=checkpoint)
    message = str(refused.value)
    assert re.findall(r"(\w+)=\S+ in the checkpoint", message) == ["padding_free", "torch_compile"], message
    assert re.search(r"Resume with (\w+)=(\w+),", message).groups() == ("torch_compile", "False"), message
    assert max_parameter_gap(trainer.model, build_tiny_qwen3(tok, hidden_size=32, seed=0)) == 0.0


def test_router_aux_loss_coef_0_resumes_a_dense_run_that_left_it_none(epochs_full, tok, tmp_path):
    """A dense model adds no auxiliary loss whether router_aux_loss_coef is None (the model's own: none) or 0.0:
    the marker records the coefficient that acted (0.0), and a resume passing 0.0 continues exactly."""
    checkpoint = os.path.join(epochs_full.args.output_dir, "checkpoint-9")
    assert epochs_full.args.router_aux_loss_coef is None and not epochs_full.aux_loss_enabled
    assert resume.read_marker(checkpoint)["settings"]["router_aux_loss_coef"] == 0.0
    resumed = resumed_run(tok, tmp_path, epochs_full, 9, **{**EPOCHS, "router_aux_loss_coef": 0.0})
    assert_resumed_exactly(epochs_full, resumed, 9)


def test_a_marker_recording_padding_free_as_passed_stays_resumable(epochs_full, tok, tmp_path):
    """A marker of format 2 recorded padding_free as passed (None: automatic, its choice unrecorded): it resumes
    exactly under None again; an explicit value cannot be checked against it and is refused."""
    old = tmp_path / "checkpoint-5"
    shutil.copytree(os.path.join(epochs_full.args.output_dir, "checkpoint-5"), old)
    _rewrite_marker(old, lambda record: {**record, "format": 2,
                                         "settings": {**record["settings"], "padding_free": None}})  # fmt: skip
    with pytest.raises(ValueError, match="padding_free=None in the checkpoint but True now"):
        resume.resolve_for_run(str(old), config(tmp_path, **{**EPOCHS, "padding_free": True}), world_size=1)
    resumed = resumed_run(tok, tmp_path / "out", epochs_full, 5, checkpoint=str(old), **EPOCHS)
    assert_resumed_exactly(epochs_full, resumed, 5)


@pytest.mark.parametrize(("marker_format", "saved", "requested", "resolved", "refused"), [
    (3, dict(padding_free=True, dynamic_batching=True), None, None, False),  # before the models load: undecided
    (3, dict(padding_free=True, dynamic_batching=True), True, True, False),
    (3, dict(padding_free=True, dynamic_batching=True), None, False, True),  # the automatic choice changed
    (3, dict(padding_free=False, dynamic_batching=True), True, True, True),
    (2, dict(padding_free=None, dynamic_batching=True), None, None, False),
    (2, dict(padding_free=None, dynamic_batching=True), None, True, False),
    (2, dict(padding_free=None, dynamic_batching=True), False, False, True),
    (2, dict(padding_free=None, dynamic_batching=False), False, False, False),  # TRL's batching never packs
    (2, dict(padding_free=True, dynamic_batching=True), None, True, False),
    (2, dict(padding_free=True, dynamic_batching=True), None, False, True),
])  # fmt: skip
def test_padding_free_compares_as_resolved(marker_format, saved, requested, resolved, refused, tmp_path):
    """`check_resumable` on the update-path settings alone: `resolved` is what `run_settings` records for this run
    (None: automatic, before the models load)."""
    (tmp_path / "checkpoint-1").mkdir()
    path = str(tmp_path / "checkpoint-1")
    (tmp_path / "checkpoint-1" / resume.COMPLETE_MARKER).write_text(json.dumps(
        {"format": marker_format, "global_step": 1, "settings": {**saved, "world_size": 1}}))  # fmt: skip
    current = {"padding_free": resolved, "dynamic_batching": saved["dynamic_batching"], "world_size": 1}
    if not refused:
        resume.check_resumable(path, current, requested)
        return
    with pytest.raises(ValueError, match="padding_free="):
        resume.check_resumable(path, current, requested)


def test_run_settings_resolve_the_update_path(tmp_path):
    def settings(packed=None, **values):
        args = DHPOConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none", **values)
        chosen = resume.run_settings(args, world_size=1, packed=packed)
        return chosen["dynamic_batching"], chosen["padding_free"]

    assert settings() == (True, None) and settings(packed=True) == (True, True) and settings(packed=False) == (True, False)
    assert settings(padding_free=True) == (True, True) and settings(padding_free=False, packed=False) == (True, False)
    assert settings(dynamic_batching=False) == (False, False) and settings(loss_type="bnpo") == (False, False)


# ------------------------------------------------------------------------------------------- damaged files
@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_latest_skips_a_checkpoint_whose_files_differ_from_the_marker(damage, epochs_full, tok, tmp_path):
    """A truncated (or missing) weights file under an intact marker: `latest` skips that checkpoint with one warning
    naming the file and resumes the previous one exactly; naming the folder itself is refused naming the file."""
    out = tmp_path / "out"
    for step in (5, 6):
        shutil.copytree(os.path.join(epochs_full.args.output_dir, f"checkpoint-{step}"), out / f"checkpoint-{step}")
    weights = out / "checkpoint-6" / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        weights.unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        resume.resolve_checkpoint(str(out / "checkpoint-6"), str(out))
    with pytest.warns(UserWarning) as caught:
        resumed = train(tok, out, resume_from="latest", **EPOCHS)
    skipped = [str(w.message) for w in caught if "Skipping" in str(w.message)]
    assert len(skipped) == 1 and "checkpoint-6" in skipped[0] and "model.safetensors" in skipped[0]
    assert_resumed_exactly(epochs_full, resumed, 5)


def test_file_mismatch_names_the_first_differing_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"12345")
    (tmp_path / "sub" / "b.bin").write_bytes(b"1")
    sizes = resume.file_sizes(str(tmp_path))
    assert sizes == {"a.bin": 5, "sub/b.bin": 1}
    assert resume.file_mismatch(str(tmp_path), sizes) is None
    (tmp_path / "sub" / "b.bin").write_bytes(b"12")
    assert "sub/b.bin has 2 bytes" in resume.file_mismatch(str(tmp_path), sizes)
    (tmp_path / "a.bin").unlink()
    assert "a.bin is missing" in resume.file_mismatch(str(tmp_path), sizes)


# ------------------------------------------------------------------------------------------------ writing
def test_writing_a_checkpoint_leaves_args_alone_and_rotates_after_the_marker(tok, tmp_path, monkeypatch):
    """While each checkpoint is written, `args` keeps the user's values; with save_total_limit=1 the older
    checkpoint is removed only once the new one is marked complete."""
    from transformers import Trainer

    seen, save_model = [], Trainer.save_model

    def recording_save_model(self, output_dir=None, _internal_call=False):
        folders = sorted(name for name in os.listdir(self.args.output_dir) if name.startswith("checkpoint-"))
        seen.append((self.args.save_total_limit, self.args.save_only_model, folders))
        return save_model(self, output_dir, _internal_call)

    monkeypatch.setattr(Trainer, "save_model", recording_save_model)
    train(tok, tmp_path, prompts=16, steps_per_generation=2, max_steps=2, save_total_limit=1)
    assert [(limit, only) for limit, only, _ in seen] == [(1, False), (1, False)]
    assert seen[1][2] == ["checkpoint-1", "checkpoint-2"]  # the complete one stays while the new one is written
    assert "checkpoint-1" not in os.listdir(tmp_path) and resume.incomplete_reason(str(tmp_path / "checkpoint-2")) is None


def test_the_resume_surface_of_transformers_and_trl_is_in_the_mirror():
    """Every private name the resume relies on is listed in `trl_mirror.PRIVATE` (whose test checks that each still
    exists where it says)."""
    listed = {(private.owner.split(":")[-1], private.name) for private in trl_mirror.PRIVATE}
    for owner, name in [("Trainer", "_save_optimizer_and_scheduler"), ("Trainer", "_save_rng_state"),
                        ("Trainer", "_run_epoch"), ("GRPOTrainer", "_get_train_sampler"),
                        ("Trainer", "_save_checkpoint"), ("GRPOTrainer", "_save_checkpoint")]:  # fmt: skip
        assert (owner, name) in listed

def test_a_setting_the_checkpoint_did_not_record_compares_as_its_default(tmp_path):
    """A marker written before an objective read a setting (CISPO and `importance_sampling_level`) resumes where this
    run keeps the default, and is refused naming the setting where it does not."""
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    args = DHPOConfig(str(tmp_path), algorithm="cispo", use_cpu=True, bf16=False, report_to="none",
                      steps_per_generation=2)  # fmt: skip
    current = resume.run_settings(args, world_size=1)
    assert current["importance_sampling_level"] == "token"
    old = {name: value for name, value in current.items() if name != "importance_sampling_level"}
    resume.mark_complete(str(checkpoint), old, global_step=2)
    resume.check_resumable(str(checkpoint), current)  # the default: resumable
    sequence = resume.run_settings(DHPOConfig(str(tmp_path), algorithm="cispo", importance_sampling_level="sequence",
                                              use_cpu=True, bf16=False, report_to="none", steps_per_generation=2), 1)
    with pytest.raises(ValueError, match="importance_sampling_level='token' in the checkpoint but 'sequence' now"):
        resume.check_resumable(str(checkpoint), sequence)


def test_a_setting_neither_objective_reads_is_not_compared(tmp_path):
    """DHPO-A at token_weight=1 does not read the sequence epsilons, and the config refuses them away from their
    default: a marker that recorded them, at any value, resumes (they had no effect in the run that wrote it), and
    a marker whose objective did read them (token_weight=0.5) is refused for the weight."""
    args = DHPOConfig(str(tmp_path), mixing="averaged", token_weight=1.0, use_cpu=True, bf16=False, report_to="none",
                      steps_per_generation=2)  # fmt: skip
    current = resume.run_settings(args, world_size=1)
    assert "epsilon_low_seq" not in current and current["epsilon_low_token"] == 0.2
    markers = {2: {"epsilon_low_seq": 0.2}, 4: {"epsilon_low_seq": 0.1},
               6: {"epsilon_low_seq": 0.1, "token_weight": 0.5}}  # fmt: skip
    for step, recorded in markers.items():
        checkpoint = tmp_path / f"checkpoint-{step}"
        checkpoint.mkdir()
        resume.mark_complete(str(checkpoint), {**current, "epsilon_high_seq": 0.28, **recorded}, step)
    resume.check_resumable(str(tmp_path / "checkpoint-2"), current)
    resume.check_resumable(str(tmp_path / "checkpoint-4"), current)
    with pytest.raises(ValueError, match="token_weight=0.5 in the checkpoint but 1.0 now") as error:
        resume.check_resumable(str(tmp_path / "checkpoint-6"), current)
    assert "epsilon_low_seq" in str(error.value)  # read there at 0.1, not read here: compared as its default


def test_a_setting_read_by_the_checkpoints_objective_compares_as_its_default(tmp_path):
    """VESPO reads importance_sampling_level only with the bias-corrected KL, whose switch a marker before format 4
    does not hold: a checkpoint that recorded the level at 'sequence' (TRL's default use_bias_correction_kl=True) is
    refused by a run that turns the correction off and so does not read it."""
    args = DHPOConfig(str(tmp_path), algorithm="vespo", beta=0.04, use_bias_correction_kl=False, use_cpu=True,
                      bf16=False, report_to="none", steps_per_generation=2)  # fmt: skip
    current = resume.run_settings(args, world_size=1)
    assert "importance_sampling_level" not in current
    older = {name: value for name, value in current.items() if name not in resume.LOSS_SETTINGS}
    for step, level in ((2, "token"), (4, "sequence")):
        checkpoint = tmp_path / f"checkpoint-{step}"
        checkpoint.mkdir()
        resume.mark_complete(str(checkpoint), {**older, "importance_sampling_level": level}, step)
        _rewrite_marker(checkpoint, lambda record: {**record, "format": 3})
    resume.check_resumable(str(tmp_path / "checkpoint-2"), current)
    with pytest.raises(ValueError, match="importance_sampling_level='sequence' in the checkpoint but 'token' now"):
        resume.check_resumable(str(tmp_path / "checkpoint-4"), current)
