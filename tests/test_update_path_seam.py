"""`update_path.UpdatePath`, the seam the trainer calls: a batch with image inputs goes to TRL's own forward, any
other to the chosen path's, with every argument as given; TRL's own batching (`dynamic_batching=False`) has no
fallback to announce; a refusal names the setting that fixes it."""

import pytest
import torch
from test_padding_free import sliding_qwen3
from test_trainer_paths import micro_batch, plan, planning_host

from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import batching, update_path

ARGUMENTS = ("ids", "mask", 7, 3, True, False)  # input_ids, attention_mask, logits_to_keep, batch_size, entropy, aux


class RecordingPath:
    name, fallback = "recording", "recording keeps"

    def __init__(self):
        self.calls = []

    def forward(self, *args):
        self.calls.append(args)
        return "path's output"


def test_trls_batching_takes_an_unplannable_batch_without_a_warning():
    host = planning_host(dynamic_batching=False)
    buffered = [micro_batch(extra={"pixel_values": torch.zeros(2, 1)})]
    planned, messages = plan(host, buffered)
    assert planned is buffered and messages == []
    assert host._metrics["train"]["batching/padding_fraction"] == [pytest.approx(0.2)]  # 8 real of 10 tokens


def test_a_forward_with_image_inputs_is_trls_own_with_every_argument():
    path, trl_calls = RecordingPath(), []

    def trl(*args, **kwargs):
        trl_calls.append((args, kwargs))
        return "trl's output"

    multimodal = {"pixel_values": "pixels", "image_grid_thw": None}
    run = object()
    assert update_path.UpdatePath(path).forward("model", trl, *ARGUMENTS, multimodal, run) == "trl's output"
    assert trl_calls == [(ARGUMENTS, multimodal)] and path.calls == []


def test_a_forward_without_image_inputs_is_the_paths_with_every_argument():
    path, run = RecordingPath(), object()

    def trl(*args, **kwargs):
        raise AssertionError("TRL's forward is the path's to call")

    multimodal = {"pixel_values": None, "image_grid_thw": None}
    assert update_path.UpdatePath(path).forward("model", trl, *ARGUMENTS, multimodal, run) == "path's output"
    assert path.calls == [("model", trl, *ARGUMENTS, run)]


def test_a_refusal_names_the_setting_that_fixes_it():
    tokenizer = build_char_tokenizer()
    flash = build_tiny_qwen3(tokenizer, hidden_size=16)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"Set share_prompts=False or change the model"):
        update_path.choose(True, True, None, {"model": flash}, "cuda")
    with pytest.raises(ValueError, match=r"Set padding_free=False \(dynamic batching\) or change the model"):
        update_path.choose(True, False, None, {"model": sliding_qwen3(tokenizer)}, "cpu")


def test_the_chosen_path_plans_with_the_runs_settings():
    """Dynamic batching through the seam cuts the window into the run's micro-steps, as the plan does called alone."""
    host = planning_host(steps=2)
    buffered = [micro_batch(), micro_batch()]
    planned, messages = plan(host, buffered)
    alone = batching.plan_generation_batch([micro_batch(), micro_batch()], micro_steps=2)
    assert messages == [] and len(planned) == len(alone) == 2
    assert [p["completion_ids"].shape for p in planned] == [p["completion_ids"].shape for p in alone]
