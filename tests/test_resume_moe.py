"""Exact resume of a Qwen3-MoE policy: `save_pretrained` writes the experts one by one (the Hub's layout,
`mlp.experts.<e>.gate_proj.weight`, ...) while the model holds them fused (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`); the checkpoint's weights are converted back on resume and for `load_best_model_at_end`
(`resume.load_policy_weights`), so the resumed run ends with the uninterrupted run's parameters.

The tiny Qwen3-MoE (4 experts, 2 per token), DHPO-E, a checkpoint every optimizer step, as in test_resume.py.
"""

import os
import types
import warnings

import pytest
from safetensors import safe_open
from test_resume import BASE, CPU, RecordingTrainer, digit_share, prompts, step_logs
from transformers import Qwen3MoeForCausalLM, TrainerCallback

from dhpo_trl.core.presets import config_for
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import resume

K2 = dict(steps_per_generation=2, max_steps=4)  # checkpoint-3 is mid generation batch
QUIET = ".*(on-policy|num_iterations|mask_truncated).*"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def moe(tok, seed=0):
    return build_tiny_qwen3(tok, hidden_size=32, seed=seed, moe=True)


def train(tok, output_dir, resume_from=None, callbacks=(), **settings):
    args = config_for("DHPO-E", output_dir=str(output_dir), **{**BASE, **settings}, **CPU)
    trainer = RecordingTrainer(model=moe(tok), reward_funcs=digit_share, args=args, train_dataset=prompts(),
                               processing_class=tok, callbacks=list(callbacks),
                               eval_dataset=prompts(4) if args.eval_strategy != "no" else None)  # fmt: skip
    trainer.seen = {}
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer


def relative_gap(model, reference) -> float:
    """max |model - reference| over max |reference|, over all parameters."""
    other = dict(reference.named_parameters())
    gap = max((param - other[name]).abs().max().item() for name, param in model.named_parameters())
    return gap / max(param.abs().max().item() for param in other.values())


def experts(model) -> dict:
    return {name: param for name, param in model.named_parameters() if ".experts." in name}


@pytest.fixture(scope="module")
def uninterrupted(tok, tmp_path_factory):
    return train(tok, tmp_path_factory.mktemp("moe-full"), **K2)


def test_a_moe_run_resumed_mid_generation_batch_equals_the_uninterrupted_run(uninterrupted, tok, tmp_path):
    """From checkpoint-3 (mid generation batch): the parameters (experts included) to a relative 1e-6, every
    logged metric and the data of step 4; the experts moved from their initial values meanwhile."""
    checkpoint = os.path.join(uninterrupted.args.output_dir, "checkpoint-3")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=QUIET)
        resumed = train(tok, tmp_path, resume_from=checkpoint, **K2)
    initial = moe(tok)
    assert relative_gap(uninterrupted.model, initial) > 1e-3
    assert set(experts(uninterrupted.model)) == set(experts(initial)) and experts(initial)
    assert relative_gap(resumed.model, uninterrupted.model) <= 1e-6
    assert resumed.state.global_step == 4 and sorted(resumed.seen) == [4]
    assert resumed.seen[4] == uninterrupted.seen[4]
    assert step_logs(resumed)[4] == pytest.approx(step_logs(uninterrupted)[4], abs=1e-6)


def test_the_checkpoint_keeps_the_hub_layout_of_the_experts(uninterrupted):
    """save_pretrained's format: one tensor per expert and projection, no fused expert tensor."""
    path = os.path.join(uninterrupted.args.output_dir, "checkpoint-3", resume.SAFE_WEIGHTS)
    with safe_open(path, "pt") as handle:
        names = set(handle.keys())
    per_expert = {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up", "down")}
    assert per_expert <= names
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in names)


class BestAt(TrainerCallback):
    """Gives the evaluation at `step` the best `eval_chosen` (1, every other one 0)."""

    def __init__(self, step):
        self.step = step

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_chosen"] = float(state.global_step == self.step)


def test_load_best_model_at_end_loads_the_best_checkpoints_experts(tok, tmp_path):
    """`load_best_model_at_end` with checkpoint-2 the best of 4: the model at the end is checkpoint-2's as
    `from_pretrained` reads it (transformers' own conversion), not the last step's."""
    settings = dict(K2, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4, load_best_model_at_end=True,
                    metric_for_best_model="chosen", greater_is_better=True)  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=QUIET)
        trainer = train(tok, tmp_path, callbacks=[BestAt(2)], **settings)
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    best = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "checkpoint-2")
    last = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "checkpoint-4")
    assert relative_gap(last, best) > 1e-3  # the last step moved on: loading the best one is visible
    assert relative_gap(trainer.model, best) <= 1e-6


def _no_transformers_warnings_trainer(loaded: list):
    return types.SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=False,
                                 _issue_warnings_after_load=loaded.append)  # fmt: skip


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_load_policy_weights_restores_a_saved_moe_from_one_file_or_shards(shard, tok, tmp_path):
    """A model another seed built gets every parameter of the saved one, from one file or from shards; no key is
    missing but the tied output head."""
    saved = moe(tok, seed=0)
    saved.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert os.path.isfile(tmp_path / (resume.SAFE_WEIGHTS_INDEX if shard else resume.SAFE_WEIGHTS))
    target, loaded = moe(tok, seed=1), []
    assert relative_gap(target, saved) > 1e-2
    assert resume.load_policy_weights(_no_transformers_warnings_trainer(loaded), target, str(tmp_path))
    assert relative_gap(target, saved) == 0.0
    (result,) = loaded
    assert set(result.missing_keys) <= {"lm_head.weight"}


def test_load_policy_weights_leaves_what_transformers_loads_right_to_it(tok, tmp_path):
    """A dense model (written in its own layout), DeepSpeed and FSDP (their own states), a folder without
    safetensors weights: nothing is loaded, False (transformers' own load runs)."""
    build_tiny_qwen3(tok, hidden_size=32, seed=0).save_pretrained(tmp_path / "dense")
    moe(tok).save_pretrained(tmp_path / "moe")
    loaded = []
    plain = _no_transformers_warnings_trainer(loaded)
    dense = build_tiny_qwen3(tok, hidden_size=32, seed=1)
    assert not resume.load_policy_weights(plain, dense, str(tmp_path / "dense"))
    assert not resume.load_policy_weights(plain, moe(tok, seed=1), str(tmp_path))  # no weights in the folder
    for engine in ("is_deepspeed_enabled", "is_fsdp_enabled"):
        target = moe(tok, seed=1)
        trainer = types.SimpleNamespace(**{**vars(plain), engine: True})
        assert not resume.load_policy_weights(trainer, target, str(tmp_path / "moe"))
        assert relative_gap(target, moe(tok, seed=1)) == 0.0
    assert loaded == []


@pytest.mark.parametrize("targets", [
    dict(target_modules=["q_proj", "v_proj"]),
    dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
], ids=["attention", "fused-experts"])  # fmt: skip
def test_a_lora_moe_run_resumes_exactly(targets, tok, tmp_path):
    """LoRA on a Qwen3-MoE, on the attention or on the fused experts too (PEFT's `target_parameters`): the adapters
    are PEFT's to save and load, in its own layout; resumed mid generation batch, the run ends with the
    uninterrupted run's parameters."""
    from peft import LoraConfig

    def lora_run(output_dir, resume_from=None):
        args = config_for("DHPO-E", output_dir=str(output_dir), **{**BASE, **K2}, **CPU)
        lora = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **targets)
        trainer = RecordingTrainer(model=moe(tok), reward_funcs=digit_share, args=args, train_dataset=prompts(),
                                   processing_class=tok, peft_config=lora)  # fmt: skip
        trainer.seen = {}
        trainer.train(resume_from_checkpoint=resume_from)
        return trainer

    full = lora_run(tmp_path / "full")
    resumed = lora_run(tmp_path / "resumed", resume_from=str(tmp_path / "full" / "checkpoint-3"))
    trained = {name: p for name, p in full.model.named_parameters() if "lora_B" in name}
    assert max(p.abs().max().item() for p in trained.values()) > 0
    assert any(".experts." in name for name in trained) == ("target_parameters" in targets)
    assert relative_gap(resumed.model, full.model) <= 1e-6
    assert resumed.seen[4] == full.seen[4]


def test_the_models_own_aux_loss_coefficient_resumes_a_run_that_left_it_none_and_0_is_refused(uninterrupted, tok,
                                                                                              tmp_path):  # fmt: skip
    """router_aux_loss_coef=None on this MoE model is its config's coefficient (0.01, as TRL reads it): the marker
    records 0.01, a resume passing 0.01 continues exactly, and one passing 0.0 (the auxiliary loss off) is refused
    by train() naming router_aux_loss_coef."""
    checkpoint = os.path.join(uninterrupted.args.output_dir, "checkpoint-3")
    assert uninterrupted.args.router_aux_loss_coef is None and uninterrupted.model.config.router_aux_loss_coef == 0.01
    assert resume.read_marker(checkpoint)["settings"]["router_aux_loss_coef"] == 0.01
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=QUIET)
        resumed = train(tok, tmp_path / "same", resume_from=checkpoint, router_aux_loss_coef=0.01, **K2)
        assert relative_gap(resumed.model, uninterrupted.model) <= 1e-6 and resumed.seen[4] == uninterrupted.seen[4]
        with pytest.raises(ValueError, match=r"router_aux_loss_coef=0\.01 in the checkpoint but 0\.0 now"):
            train(tok, tmp_path / "off", resume_from=checkpoint, router_aux_loss_coef=0.0, **K2)
