"""The completeness marker's file record, an older marker's format and the finished-run check
(`dhpo_trl.training.resume`)."""

import json
import re
from types import SimpleNamespace

import pytest
from transformers import PretrainedConfig

from dhpo_trl.core.config import compiled_packing_reason
from dhpo_trl.training import resume


def test_file_sizes_leave_out_the_marker_and_temporaries(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"123")
    (tmp_path / resume.COMPLETE_MARKER).write_text("{}")  # an earlier marker of a folder being rewritten
    (tmp_path / "dhpo_generation_state_rank0.pt.tmp").write_bytes(b"12345")  # a write cut short
    (tmp_path / "optimizer.TMP").write_bytes(b"1")  # not a temporary: its name only looks like one
    assert resume.file_sizes(str(tmp_path)) == {"model.safetensors": 3, "optimizer.TMP": 1}


def test_a_marker_without_a_format_reads_as_the_first_and_skips_the_buffer_settings(tmp_path):
    """A first-format marker has no "format" key and recorded no BUFFER_SETTINGS: those are not compared."""
    path = tmp_path / "checkpoint-3"
    path.mkdir()
    (path / resume.COMPLETE_MARKER).write_text(json.dumps({"global_step": 3, "settings": {"world_size": 1}}))
    resume.check_resumable(str(path), {"world_size": 1, "beta": 0.04})  # beta is a buffer setting: not compared


def marked(tmp_path, record):
    path = tmp_path / "checkpoint-3"
    path.mkdir(exist_ok=True)
    (path / resume.COMPLETE_MARKER).write_text(json.dumps(record))
    return str(path)


def refusal(path, current):
    try:
        resume.check_resumable(path, current)
    except ValueError as error:
        return str(error)
    return None


def test_a_refused_update_path_says_it_compares_as_resolved(tmp_path):
    saved = {"world_size": 1, "padding_free": True, "dynamic_batching": True, "seed": 1}
    path = marked(tmp_path, {"format": 3, "global_step": 3, "settings": saved})
    one = refusal(path, {**saved, "padding_free": False})
    assert "padding_free=True in the checkpoint but False now (padding_free: the update path that ran" in one
    both = refusal(path, {**saved, "padding_free": False, "dynamic_batching": False, "seed": 2})
    assert "(dynamic_batching and padding_free: the update path that ran, as resolved)" in both
    assert ", seed=1 in the checkpoint but 2 now" in both
    other = refusal(path, {**saved, "seed": 2})
    assert other.startswith(f"--resume_from_checkpoint {path}: seed=1 in the checkpoint but 2 now. Resume")


def test_a_second_format_marker_resolves_the_padding_free_it_recorded(tmp_path):
    """A format-2 marker recorded padding_free as passed: True under TRL's batching ran unpacked."""
    saved = {"world_size": 1, "padding_free": True, "dynamic_batching": False}
    path = marked(tmp_path, {"format": 2, "global_step": 3, "settings": saved})
    assert refusal(path, {**saved, "padding_free": False}) is None
    assert "padding_free=False in the checkpoint but True now" in refusal(path, saved)


# ------------------------------------------------------------------------------ TRL loss settings (format 4)
def settings_of(tmp_path, **changes):
    from dhpo_trl import DHPOConfig

    args = DHPOConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none", steps_per_generation=2, **changes)
    return resume.run_settings(args, world_size=1)


REFUSED = [  # (the checkpoint's run, the change on resume, the setting named)
    (dict(beta=0.04), dict(use_bias_correction_kl=False), "use_bias_correction_kl"),
    ({}, dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
    (dict(off_policy_mask_threshold=0.5), dict(off_policy_mask_threshold=0.25), "off_policy_mask_threshold"),
    ({}, dict(top_entropy_quantile=0.2), "top_entropy_quantile"),
    ({}, dict(entropy_coef=0.01), "entropy_coef"),
    (dict(use_adaptive_entropy=True, entropy_coef=0.01), dict(entropy_coef=0.02), "entropy_coef"),
    ({}, dict(use_adaptive_entropy=True), "use_adaptive_entropy"),
    (dict(router_aux_loss_coef=0.0), dict(router_aux_loss_coef=0.001), "router_aux_loss_coef"),
    (dict(loss_type="dr_grpo"), dict(max_completion_length=256), "max_completion_length"),
]


@pytest.mark.parametrize(("base", "change", "setting"), REFUSED)
def test_a_changed_loss_setting_is_refused_naming_it_and_the_same_value_resumes(tmp_path, base, change, setting):
    saved, current = settings_of(tmp_path, **base), settings_of(tmp_path, **{**base, **change})
    assert setting in saved and saved[setting] != current[setting] == {**base, **change}[setting]
    (tmp_path / "checkpoint-3").mkdir()
    resume.mark_complete(str(tmp_path / "checkpoint-3"), saved, 3)
    assert resume.read_marker(str(tmp_path / "checkpoint-3"))["format"] == resume.MARKER_FORMAT == 4
    with pytest.raises(ValueError) as error:
        resume.check_resumable(str(tmp_path / "checkpoint-3"), current)
    assert resume.settings_difference(saved, current) == [setting]
    assert f" {setting}={saved[setting]!r} in the checkpoint" in str(error.value)
    resume.check_resumable(str(tmp_path / "checkpoint-3"), settings_of(tmp_path, **base))


@pytest.mark.parametrize(("base", "change"), [
    ({}, dict(use_bias_correction_kl=False)),  # beta = 0: no KL term to weigh
    ({}, dict(max_completion_length=256)),  # a normaliser only under dr_grpo; here it bounds what is generated next
    (dict(use_adaptive_entropy=True), dict(entropy_target=1.5, entropy_coef_delta=0.01, entropy_coef_min=0.001,
                                           entropy_coef_max=0.5)),  # the controller's schedule
])  # fmt: skip
def test_a_loss_setting_that_does_not_act_or_steers_a_schedule_may_change(tmp_path, base, change):
    saved = settings_of(tmp_path, **base)
    (tmp_path / "checkpoint-3").mkdir()
    resume.mark_complete(str(tmp_path / "checkpoint-3"), saved, 3)
    resume.check_resumable(str(tmp_path / "checkpoint-3"), settings_of(tmp_path, **{**base, **change}))


def named(message):
    """The settings a refusal lists, in its order."""
    return re.findall(r"(\w+)=\S+ in the checkpoint", message)


@pytest.mark.parametrize(("base", "change", "setting"), [
    (dict(beta=0.0), dict(beta=0.04), "beta"),  # the KL weight's switch is read now only
    (dict(beta=0.04, use_bias_correction_kl=False), dict(beta=0.0), "beta"),  # ... in the checkpoint only
    (dict(loss_type="dr_grpo"), dict(loss_type="dapo", max_completion_length=64), "loss_type"),  # the normaliser
    (dict(loss_type="dapo"), dict(loss_type="dr_grpo"), "loss_type"),
])  # fmt: skip
def test_a_loss_setting_read_on_one_side_only_is_not_listed_beside_the_setting_deciding_it(tmp_path, base, change,
                                                                                          setting):
    """A change of beta or loss_type adds or removes a loss setting: the refusal names that change, not the loss
    setting as None on the side that does not read it."""
    saved, current = settings_of(tmp_path, **base), settings_of(tmp_path, **{**base, **change})
    assert set(saved) ^ set(current) <= set(resume.LOSS_SETTINGS) and set(saved) != set(current)
    path = marked(tmp_path, {"format": resume.MARKER_FORMAT, "global_step": 3, "settings": saved})
    assert named(refusal(path, current)) == [setting]


def test_loss_settings_name_those_that_act():
    from types import SimpleNamespace

    def acting(beta, loss_type):
        return set(resume.loss_settings(SimpleNamespace(beta=beta, loss_type=loss_type)))

    always = {"off_policy_mask_threshold", "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy",
              "router_aux_loss_coef"}  # fmt: skip
    assert acting(0.0, "grpo") == always
    assert acting(0.04, "dapo") == always | {"use_bias_correction_kl"}
    assert acting(0, "dr_grpo") == always | {"max_completion_length"}
    assert always | {"use_bias_correction_kl", "max_completion_length"} == set(resume.LOSS_SETTINGS)


@pytest.mark.parametrize("marker_format", [2, 3])
def test_an_older_marker_without_the_loss_settings_resumes_under_any(tmp_path, marker_format):
    """Markers before format 4 did not record LOSS_SETTINGS: those are compared on neither side; the rest are."""
    current = settings_of(tmp_path, beta=0.04, use_bias_correction_kl=False, off_policy_mask_threshold=0.5,
                          top_entropy_quantile=0.2, entropy_coef=0.01, use_adaptive_entropy=True,
                          router_aux_loss_coef=0.01)  # fmt: skip
    older = {name: value for name, value in settings_of(tmp_path, beta=0.04).items()
             if name not in resume.LOSS_SETTINGS}  # fmt: skip
    path = marked(tmp_path, {"format": marker_format, "global_step": 3, "settings": older})
    assert refusal(path, current) is None
    assert "beta=0.04 in the checkpoint but 0.1 now" in refusal(path, {**current, "beta": 0.1})
    # a value such a marker holds for one (none writes it) is not compared either
    stale = marked(tmp_path, {"format": marker_format, "global_step": 3, "settings": {**older, "entropy_coef": 0.5}})
    assert refusal(stale, current) is None
    # the same settings recorded by a format-4 marker are compared: missing there, they differ
    newer = marked(tmp_path, {"format": 4, "global_step": 3, "settings": older})
    assert "use_bias_correction_kl=None in the checkpoint but False now" in refusal(newer, current)


def test_vespo_reads_the_level_as_the_recorded_kl_switch_says(tmp_path):
    """A marker before format 4 holds no use_bias_correction_kl: VESPO's reading is unknown (nothing is dropped as
    unread); a format-4 marker holds it, so a level it recorded unread by its own run is known to be unread."""
    saved = settings_of(tmp_path, algorithm="vespo", beta=0.04)
    assert saved["use_bias_correction_kl"] is True and saved["importance_sampling_level"] == "token"
    older = {name: value for name, value in saved.items() if name not in resume.LOSS_SETTINGS}
    assert resume.unread_by_recorded_objective(older) == set()
    assert resume.unread_by_recorded_objective(saved) == set()
    off = {**saved, "use_bias_correction_kl": False}
    assert resume.unread_by_recorded_objective(off) == {"importance_sampling_level"}
    path = marked(tmp_path, {"format": 4, "global_step": 3, "settings": saved})
    current = settings_of(tmp_path, algorithm="vespo", beta=0.04, use_bias_correction_kl=False)
    assert "use_bias_correction_kl=True in the checkpoint but False now" in refusal(path, current)


# ----------------------------------------------------------- router_aux_loss_coef as it acts (None: the model's)
def aux_settings(tmp_path, coef, default):
    """`run_settings` with `router_aux_loss_coef=coef` where None stands for `default` (None: before the models
    load)."""
    from dhpo_trl import DHPOConfig

    args = DHPOConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none", steps_per_generation=2,
                      router_aux_loss_coef=coef)  # fmt: skip
    return resume.run_settings(args, world_size=1, aux_default=default)


@pytest.mark.parametrize(("saved", "now", "default", "refused"), [
    (None, 0.0, 0.0, False),  # a dense model: TRL adds no auxiliary loss either way
    (0.0, None, 0.0, False),
    (0.0, 0.001, 0.0, True),  # a real change (an MoE model's)
    (None, 0.01, 0.01, False),  # an MoE model declaring 0.01: None is that coefficient
    (0.01, None, 0.01, False),
    (None, 0.0, 0.01, True),  # ... and 0.0 turns its auxiliary loss off
    (0.0, None, 0.01, True),
    (None, 0.0, None, False),  # before the models load: undecided, the trainer compares again
    (0.01, None, None, False),  # ... on either side: an MoE run resumed with the default, before its model loads
    (0.0, 0.001, None, True),
])  # fmt: skip
def test_router_aux_loss_coef_compares_as_it_acts(tmp_path, saved, now, default, refused):
    """Recorded as it acts (None is the model's own coefficient, `aux_default`), and compared so on both sides, also
    against a marker that recorded it as passed (None) before: a real change is refused naming it, in either
    direction."""
    recorded = aux_settings(tmp_path, saved, default)
    assert recorded["router_aux_loss_coef"] == (default if saved is None else saved)
    path = marked(tmp_path, {"format": 4, "global_step": 3, "settings": recorded})
    (tmp_path / "older").mkdir()
    as_passed = marked(tmp_path / "older", {"format": 4, "global_step": 3,
                                            "settings": {**recorded, "router_aux_loss_coef": saved}})  # fmt: skip
    for checkpoint in (path, as_passed):
        try:
            resume.check_resumable(checkpoint, aux_settings(tmp_path, now, default), None, default)
            message = None
        except ValueError as error:
            message = str(error)
        assert (named(message) if refused else message) == (["router_aux_loss_coef"] if refused else None), message


def test_the_aux_loss_default_is_the_moe_models_own_coefficient():
    """`aux_loss_default`, what TRL's trainer makes of `router_aux_loss_coef=None`: the MoE config's coefficient, 0.0
    for a dense model."""
    from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3

    tok = build_char_tokenizer()
    assert resume.aux_loss_default(build_tiny_qwen3(tok, hidden_size=16, num_layers=1)) == 0.0
    moe = build_tiny_qwen3(tok, hidden_size=16, num_layers=1, moe=True)
    assert moe.config.router_aux_loss_coef == 0.01 and resume.aux_loss_default(moe) == 0.01
    moe.config.router_aux_loss_coef = 0.003
    assert resume.aux_loss_default(moe) == 0.003
    # No auxiliary loss where the MoE config declares 0.0, or no coefficient at all (TRL's `getattr` default).
    moe.config.router_aux_loss_coef = 0.0
    assert resume.aux_loss_default(moe) == 0.0
    undeclared = SimpleNamespace(config=PretrainedConfig(output_router_logits=True))
    assert not hasattr(undeclared.config, "router_aux_loss_coef") and resume.aux_loss_default(undeclared) == 0.0


# --------------------------------------------------------------- the settings that decide the automatic padding_free
def path_settings(tmp_path, packed, **values):
    from dhpo_trl import DHPOConfig

    args = DHPOConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none", steps_per_generation=2, **values)
    return resume.run_settings(args, world_size=1, packed=packed)


def advised(message):
    """The settings a refusal advises resuming with, and their values."""
    found = re.search(r"Resume with ((?:\w+=\S+?(?:, |,? as))+)", message)
    return dict(re.findall(r"(\w+)=(\w+)", found[1])) if found else {}


@pytest.mark.parametrize(("saved", "now", "changed"), [  # (torch_compile, gradient_checkpointing) on each side
    ((False, True), (True, True), ["torch_compile"]),  # TRL's default checkpointing: torch_compile alone changes it
    ((True, True), (False, True), ["torch_compile"]),
    ((True, False), (True, True), ["gradient_checkpointing"]),
    ((True, True), (False, False), ["torch_compile", "gradient_checkpointing"]),
])  # fmt: skip
def test_a_path_changed_by_torch_compile_is_refused_naming_the_setting_that_changed_it(tmp_path, saved, now, changed):
    """The automatic padding_free resolves otherwise when torch_compile (with gradient checkpointing) changes: the
    refusal names the setting that changed the path, with the checkpoint's value to resume with, not only the
    resolved padding_free (alone where padding_free is passed now, or the marker did not record them);
    torch_compile and gradient_checkpointing themselves are not compared."""
    def settings(side):  # the trainer's automatic choice on the CPU packs unless both are on
        return path_settings(tmp_path, not all(side), torch_compile=side[0], gradient_checkpointing=side[1])

    recorded, current = settings(saved), settings(now)
    assert recorded["padding_free"] != current["padding_free"]
    path = marked(tmp_path, {"format": 4, "global_step": 3, "settings": recorded})
    message = refusal(path, current)
    # Each changed setting with its checkpoint value: the one to resume with.
    assert named(message) == ["padding_free", *changed], message
    assert advised(message) == {name: str(recorded[name]) for name in changed}, message
    # How they decide the path: the reason of the side where both are on (the checkpoint's or this run's).
    assert compiled_packing_reason(SimpleNamespace(torch_compile=True, gradient_checkpointing=True)) in message
    # padding_free passed explicitly now: the value passed decided the path, named alone.
    with pytest.raises(ValueError) as refused:
        resume.check_resumable(path, current, current["padding_free"])
    assert named(str(refused.value)) == ["padding_free"] and advised(str(refused.value)) == {}, str(refused.value)
    # Before the models load, a side with both on is decided already (dynamic batching): refused as early.
    early = path_settings(tmp_path, None, torch_compile=now[0], gradient_checkpointing=now[1])
    assert early["padding_free"] == (False if all(now) else None), early
    if all(now):
        assert named(refusal(path, early)) == ["padding_free", *changed], refusal(path, early)
    # The same settings, with padding_free chosen as before: they resume (not compared themselves).
    assert refusal(path, {**current, "padding_free": recorded["padding_free"]}) is None
    # A marker without them: the resolved path named, as before.
    older = {name: value for name, value in recorded.items() if name not in resume.PATH_CAUSES}
    (tmp_path / "older").mkdir()
    message = refusal(marked(tmp_path / "older", {"format": 4, "global_step": 3, "settings": older}), current)
    assert named(message) == ["padding_free"] and advised(message) == {}, message


@pytest.mark.parametrize("compiled", [(False, True), (True, False)])  # (checkpoint, now), neither checkpointing
def test_a_path_that_torch_compile_did_not_decide_is_not_blamed_on_it(tmp_path, compiled):
    """torch_compile changed, but without gradient checkpointing on either side it decides no path; the automatic
    padding_free resolved otherwise for another reason (the machine's kernels): the refusal names padding_free
    alone and advises no torch_compile value."""
    recorded = path_settings(tmp_path, True, torch_compile=compiled[0], gradient_checkpointing=False)
    current = path_settings(tmp_path, False, torch_compile=compiled[1], gradient_checkpointing=False)
    message = refusal(marked(tmp_path, {"format": 4, "global_step": 3, "settings": recorded}), current)
    assert named(message) == ["padding_free"] and advised(message) == {}, message


# ------------------------------------------------------------------------------------------------- a finished run
def saved_at(tmp_path, global_step):
    """A checkpoint whose trainer state says `global_step`, in a folder whose name says another (a renamed folder)."""
    path = tmp_path / "checkpoint-9"
    path.mkdir()
    (path / resume.TRAINER_STATE).write_text(json.dumps({"global_step": global_step, "max_steps": 9}))
    return str(path)


def raised_setting(error):
    """The setting a finished-run refusal says to raise."""
    return re.search(r"raise (\S+)", str(error))[1]


@pytest.mark.parametrize("step", [1, 4])
def test_a_checkpoint_at_or_past_the_last_step_its_trainer_state_records_is_finished(tmp_path, step):
    """`check_unfinished`: the step is the trainer state's `global_step`, not the folder's name; a `max_steps` at or
    below it is refused, naming max_steps, or the setting given that set the steps; one above it, or `max_steps <= 0`
    (the epochs decide, checked once the data loader exists), resumes."""
    checkpoint = saved_at(tmp_path, step)
    assert resume.saved_global_step(checkpoint) == step
    for max_steps in range(1, step + 1):
        with pytest.raises(ValueError) as refused:
            resume.check_unfinished(checkpoint, max_steps)
        assert raised_setting(refused.value) == "max_steps" and f"max_steps={max_steps} " in str(refused.value)
        with pytest.raises(ValueError) as refused:
            resume.check_unfinished(checkpoint, max_steps, "num_train_epochs=0.5")
        assert raised_setting(refused.value) == "num_train_epochs" and "num_train_epochs=0.5 " in str(refused.value)
    for max_steps in (step + 1, 0, -1):
        resume.check_unfinished(checkpoint, max_steps)
