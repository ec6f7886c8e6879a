"""Every refusal of DHPOConfig, DHPOTrainer and the pure modules, in one table keyed by the setting it concerns.

A refusal must name the setting that is wrong (and, where one exists, the setting that would make it act). The
checks assert those names, never the wording around them, so a message can be reworded without touching a test,
and no test asserts another library's wording. Values are checked only where the message's job is to echo the
offending value (`<setting>=<value>`).

Sources (grep `raise ValueError`, `raise TypeError`, `warnings.warn`): dhpo_trl/core/config.py (every branch of
`_validate_dhpo_fields`, `_refuse_settings_without_effect`, `_validate_batching`, `_warn_if_on_policy`),
dhpo_trl/training/trainer.py (`args` type; the multimodal dynamic-batching notice is covered by test_trainer_paths.py;
the explicit planned batching refused with a vision-language processor: dhpo_trl/training/update_path.py;
`_aggregate`'s loss_type branch is unreachable past the config), dhpo_trl/core/objectives.py, dhpo_trl/core/losses.py and
dhpo_trl/user_errors.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.core import losses
from dhpo_trl.core.objectives import get_objective
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import update_path
from dhpo_trl.user_errors import check_model_path, make_folder

CPU = dict(use_cpu=True, bf16=False, report_to="none")
OFF_POLICY = dict(gradient_accumulation_steps=1, steps_per_generation=2)


def config(tmp_path, **kwargs):
    return DHPOConfig(output_dir=str(tmp_path), **CPU, **{**OFF_POLICY, **kwargs})


def ones(rows=2, width=3):
    return torch.ones(rows, width)


# setting -> cases; a case is (how to trigger it, what the message must also name besides the setting)
# triggers: ("config", kwargs) DHPOConfig(...) raises ValueError; ("validate", kwargs) a valid config mutated by
# kwargs, then DHPOConfig.validate() raises; ("warn", kwargs) DHPOConfig(...) warns; ("call", fn) fn() raises.
CONTRACTS = {
    "algorithm": [(("config", dict(algorithm="ppo")), ["ppo"]), (("call", lambda: get_objective("ppo")), ["ppo"])],
    "mixing": [(("config", dict(mixing="geometric")), ["geometric"]),
               (("call", lambda: losses.dhpo_per_token_loss(ones(), ones(), ones(2, 1), ones(), mixing="x")), [])],
    "clipping": [(("config", dict(clipping="none")), ["none"]),
                 (("call", lambda: losses.dhpo_per_token_loss(ones(), ones(), ones(2, 1), ones(), mixing="averaged",
                                                              clipping="x")), [])],
    "entropy_norm_scope": [
        (("config", dict(entropy_norm_scope="token")), ["token"]),
        (("config", dict(mixing="averaged", entropy_norm_scope="global")), ["mixing='entropy'"]),
        (("call", lambda: losses.entropy_mixing_weight(ones(), ones(), scope="token")), []),
    ],
    "importance_sampling_level": [
        (("config", dict(importance_sampling_level="tokens")), ["tokens"]),
        (("config", dict(algorithm="gmpo", importance_sampling_level="sequence")), ["algorithm='gspo'"]),
        (("config", dict(algorithm="vespo", importance_sampling_level="sequence")), ["beta"]),
    ],
    "token_weight": [
        (("config", dict(token_weight="0.5")), ["'0.5'"]),
        (("config", dict(token_weight=None)), ["None"]),
        (("config", dict(mixing="averaged", token_weight=1.5)), ["1.5"]),
        (("config", dict(mixing="averaged", token_weight=-1e-9)), ["-1e-09"]),
        (("config", dict(mixing="averaged", token_weight=1.000001)), ["1.000001"]),
        (("config", dict(algorithm="grpo", token_weight=0.7)), ["mixing='averaged'"]),
        (("call", lambda: losses.dhpo_per_token_loss(ones(), ones(), ones(2, 1), ones(), mixing="averaged",
                                                     token_weight=2.0)), []),
    ],
    "epsilon_low_token": [(("config", dict(epsilon_low_token=1.0)), ["1.0"]),
                          (("config", dict(epsilon_low_token=-1e-9)), ["-1e-09"]),
                          (("config", dict(algorithm="grpo", epsilon_low_token=0.1)), ["algorithm='dhpo'"])],
    "epsilon_high_token": [
        (("config", dict(epsilon_high_token=-0.1)), ["-0.1"]),
        (("call", lambda: losses.dhpo_per_token_loss(ones(), ones(), ones(2, 1), ones(), mixing="averaged",
                                                     epsilon_high_token=-1)), []),
    ],
    "epsilon_low_seq": [(("config", dict(epsilon_low_seq=float("inf"))), ["inf"]),
                        (("config", dict(epsilon_low_seq=1.0)), ["1.0"]),
                        (("config", dict(clipping="unified", epsilon_low_seq=0.1)), ["clipping='branch'"])],
    "epsilon_high_seq": [(("config", dict(epsilon_high_seq="0.28")), ["'0.28'"]),
                         (("config", dict(algorithm="gspo", epsilon_high_seq=0.3)), ["clipping='branch'"])],
    "gmpo_epsilon_low": [(("config", dict(algorithm="gmpo", gmpo_epsilon_low=-1)), ["-1"]),
                         (("config", dict(algorithm="dhpo", gmpo_epsilon_low=0.3)), ["algorithm='gmpo'"])],
    "gmpo_epsilon_high": [(("config", dict(algorithm="gmpo", gmpo_epsilon_high=False)), ["False"])],
    "epsilon": [(("config", dict(algorithm="gspo", epsilon=2)), ["2"]),
                (("config", dict(algorithm="grpo", epsilon=1.0)), ["1.0"]),
                (("config", dict(algorithm="dhpo", epsilon=0.3)), ["algorithm='grpo'"])],
    "epsilon_high": [(("config", dict(algorithm="grpo", epsilon_high=True)), ["True"]),
                     (("config", dict(algorithm="grpo", epsilon_high=-0.1)), ["-0.1"]),
                     (("config", dict(algorithm="cispo", epsilon_high=0.0)), ["algorithm='cispo'"]),
                     (("config", dict(algorithm="dhpo", epsilon_high=0.28)), ["'cispo'"])],
    "cap": [(("call", lambda: losses.cispo_per_token_loss(ones(), ones(), ones(2, 1), ones(), cap=0)), [])],
    "delta": [(("config", dict(delta="3")), ["'3'"]), (("config", dict(delta=1.0)), ["1.0"]),
              (("config", dict(algorithm="grpo", delta=1)), ["1"]),
              (("config", dict(algorithm="cispo", delta=3.0)), ["'dhpo'"]),
              (("call", lambda: losses.dhpo_per_token_loss(ones(), ones(), ones(2, 1), ones(), mixing="averaged",
                                                           delta=1.0)), [])],
    "loss_type": [(("config", dict(algorithm="grpo", loss_type="sapo")), ["sapo", "algorithm='sapo'"]),
                  (("config", dict(algorithm="gmpo", loss_type="cispo")), ["algorithm='cispo'"]),
                  (("config", dict(loss_type="sapo2")), ["sapo2"]),
                  (("config", dict(algorithm="gmpo", loss_type="dapo")), ["gmpo"]),
                  (("validate", dict(loss_type="luspo", algorithm="gspo")), ["luspo", "algorithm='luspo'"])],
    "sapo_temperature_pos": [(("config", dict(algorithm="sapo", sapo_temperature_pos=0)), ["0"]),
                             (("config", dict(sapo_temperature_pos=2.0)), ["algorithm='sapo'"])],
    "vespo_lambda_neg": [(("config", dict(algorithm="vespo", vespo_lambda_neg=1e-5)), ["1e-05", "0.0001"])],
    "vllm_importance_sampling_correction": [
        (("config", dict(algorithm="vespo", use_vllm=True)), ["vllm_importance_sampling_correction=False"])],
    "dynamic_batching": [(("config", dict(dynamic_batching=1)), ["1"]),
                         (("config", dict(dynamic_batching="yes")), ["yes"]),
                         # an explicit request that the TRL settings rule out (automatic falls back instead)
                         (("config", dict(dynamic_batching=True, loss_type="bnpo")), ["loss_type", "dapo"]),
                         (("validate", dict(dynamic_batching=True, loss_type="bnpo")), ["loss_type"]),
                         (("config", dict(dynamic_batching=True, gradient_accumulation_steps=2,
                                          steps_per_generation=3)), ["steps_per_generation"]),
                         (("call", lambda: _with_a_vision_processor(dynamic_batching=True)), ["ImageOnlyProcessor"])],
    "padding_free": [(("config", dict(padding_free=True, loss_type="bnpo")), ["loss_type"]),
                     (("call", lambda: _with_a_vision_processor(padding_free=True)), ["dynamic_batching=False"])],
    "share_prompts": [(("config", dict(share_prompts=True, gradient_accumulation_steps=2, steps_per_generation=3)),
                       ["steps_per_generation"]),
                      (("call", lambda: _with_a_vision_processor(padding_free=True, share_prompts=True)),
                       ["dynamic_batching=False"])],
    "max_tokens_per_micro_batch": [
        (("config", dict(max_tokens_per_micro_batch=0)), ["0"]),
        (("config", dict(max_tokens_per_micro_batch=True)), ["True"]),
        (("config", dict(max_tokens_per_micro_batch=1.5)), ["1.5"]),
        (("config", dict(max_tokens_per_micro_batch=512.0)), ["512.0"]),
        (("config", dict(max_tokens_per_micro_batch=-5)), ["-5"]),
        (("config", dict(dynamic_batching=False, max_tokens_per_micro_batch=5)), ["dynamic_batching"]),
        (("config", dict(max_tokens_per_micro_batch=64, loss_type="bnpo")), ["loss_type"]),
        (("validate", dict(max_tokens_per_micro_batch=0)), ["0"]),
        (("call", lambda: _with_a_vision_processor(max_tokens_per_micro_batch=512)), ["dynamic_batching=False"]),
    ],
    "steps_per_generation": [
        (("warn", dict(gradient_accumulation_steps=2, steps_per_generation=2)),
         ["gradient_accumulation_steps", "num_iterations", "algorithm='dhpo'"]),
        (("warn", dict(algorithm="gmpo", gradient_accumulation_steps=1, steps_per_generation=1)),
         ["gradient_accumulation_steps", "num_iterations", "algorithm='gmpo'"]),
    ],
    "args": [(("call", lambda: _grpo_config_trainer()), ["DHPOConfig", "GRPOConfig"])],
    "advantages": [(("call", lambda: losses.gmpo_per_token_loss(ones(), ones(), ones(), ones())), ["GMPO"])],
    "model path": [(("call", lambda: check_model_path("./no/such/model", label="model path")), ["./no/such/model"])],
    "--output_dir": [(("call", lambda: make_folder("/proc/no-such-folder/x", "--output_dir")),
                      ["/proc/no-such-folder/x"])],
}  # fmt: skip


def _grpo_config_trainer():
    from transformers import TrainingArguments

    tokenizer = build_char_tokenizer()
    DHPOTrainer(build_tiny_qwen3(tokenizer, hidden_size=16, num_layers=1),
                lambda completions, **kw: [0.0] * len(completions),
                args=TrainingArguments("/tmp/unused", **CPU), processing_class=tokenizer)  # fmt: skip


def _with_a_vision_processor(**settings):
    """The planned batching asked for with a vision-language processing class, whose batches keep TRL's."""
    from vlm_stand_in import build_processor, image_dataset

    args = DHPOConfig("/tmp/unused", **CPU, **OFF_POLICY, **settings)
    update_path.refuse_multimodal_planning(args, build_processor(), image_dataset(2))


CASES = [(setting, trigger, names) for setting, cases in CONTRACTS.items() for trigger, names in cases]


def _message(tmp_path, trigger):
    kind, payload = trigger
    if kind == "config":
        with pytest.raises(ValueError) as error:
            config(tmp_path, **payload)
        return str(error.value)
    if kind == "validate":
        built = config(tmp_path)
        for name, value in payload.items():
            setattr(built, name, value)
        with pytest.raises(ValueError) as error:
            built.validate()
        return str(error.value)
    if kind == "warn":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DHPOConfig(output_dir=str(tmp_path), **CPU, **payload)
        (warning,) = [w for w in caught if issubclass(w.category, UserWarning) and "DHPOConfig" in str(w.message)]
        return str(warning.message)
    with pytest.raises((ValueError, TypeError)) as error:
        payload()
    return str(error.value)


@pytest.mark.parametrize(("setting", "trigger", "names"), CASES,
                         ids=[f"{setting}-{i}" for i, (setting, _, _) in enumerate(CASES)])  # fmt: skip
def test_refusal_names_the_setting(tmp_path, setting, trigger, names):
    message = _message(tmp_path, trigger)
    assert setting in message
    echoes_value = setting not in ("loss_type", "steps_per_generation")  # these explain, not echo
    if trigger[0] == "config" and trigger[1].get(setting) is not None and echoes_value:
        value = trigger[1][setting]
        assert f"{setting}={value!r}" in message or f"{setting}={value}" in message  # the offending value echoed
    for name in names:
        assert name in message
    assert "\n" not in message.strip()  # one line: the CLI prints it as `prog: error: <message>`


ACCEPTED = [  # the boundary values next to the refusals above act, so they are accepted
    dict(max_tokens_per_micro_batch=1),
    dict(loss_type="bnpo", dynamic_batching=False),
    dict(loss_type="bnpo"),  # dynamic_batching=None: TRL's batching for this run, said by the trainer
    dict(gradient_accumulation_steps=2, steps_per_generation=3),
    dict(gradient_accumulation_steps=2, steps_per_generation=2),
    dict(gradient_accumulation_steps=2, steps_per_generation=4),
    dict(mixing="averaged", token_weight=0.0),
    dict(delta=1.000001),
    dict(algorithm="cispo", epsilon_high=1e-9),
]


@pytest.mark.parametrize("settings", ACCEPTED, ids=[f"accepted{i}" for i in range(len(ACCEPTED))])
def test_the_boundary_values_are_accepted(tmp_path, settings):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the on-policy notice
        built = config(tmp_path, **settings)
    assert {name: getattr(built, name) for name in settings} == settings
