"""The policy update leaves cuDNN attention out of SDPA on CUDA (dhpo_trl/training/cuda_attention.py): the decision,
and the trainer running every gradient forward, recomputed ones included, inside it and nothing else."""

from __future__ import annotations

import re

import pytest
import torch
from datasets import Dataset
from torch.nn.attention import SDPBackend

from dhpo_trl import DHPOConfig, DHPOTrainer
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import cuda_attention


ALL = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@pytest.mark.parametrize(
    ("device", "version", "cudnn", "left_out"),
    [("cuda", "2.11.0+cu130", True, True), ("cuda", "2.13.0", True, True), ("cuda", "2.14.0.dev20261101", True, True),
     ("cuda", "2.14.0a0+git1a2b3c", True, True), ("cuda", "2.10.1+cu128", True, False),
     ("cuda", "2.9.1+cu126", True, False), ("cuda", "2.13.0", False, False), ("cpu", "2.13.0+cpu", True, False),
     ("mps", "2.13.0", True, False)],
)  # fmt: skip
def test_cudnn_is_left_out_on_cuda_from_torch_2_11_unless_already_off(device, version, cudnn, left_out):
    enabled = ALL if cudnn else ALL[1:]
    backends = cuda_attention.update_backends(device, version, enabled)
    if not left_out:
        assert backends is None
    else:  # every other backend stays: flash without a mask, memory-efficient with one, math for what neither takes
        assert set(backends) == {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH}


def test_a_backend_the_user_turned_off_stays_off_and_cudnn_alone_is_refused():
    kept = cuda_attention.update_backends("cuda", "2.12.0", [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH])
    assert kept == [SDPBackend.MATH]
    with pytest.raises(ValueError, match=re.escape("torch.backends.cuda.enable_mem_efficient_sdp(True)")):
        cuda_attention.update_backends("cuda", "2.12.0", [SDPBackend.CUDNN_ATTENTION])


def test_the_context_turns_off_cudnn_only_and_restores_it_on_error():
    """Inside: cuDNN off, a flag the user turned off (flash) still off, the others on; after, even after an error
    raised inside, every flag as before."""
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        with pytest.raises(RuntimeError, match="inside"), cuda_attention.without_cudnn():
            assert cuda_attention.enabled_backends() == [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
            raise RuntimeError("inside")
        assert cuda_attention.enabled_backends() == [SDPBackend.CUDNN_ATTENTION, *ALL[2:]]
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    assert cuda_attention.enabled_backends() == ALL


def test_on_cpu_nothing_is_left_out_and_nothing_said():
    context, note = cuda_attention.for_update("cpu")
    assert note is None
    with context():
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_on_cuda_the_guard_is_the_context_and_the_note_names_torch_and_the_doc():
    """SDPA's flags are on by default on a CPU build too, so the decision for "cuda" is the one a GPU run takes."""
    context, note = cuda_attention.for_update("cuda")
    assert context is cuda_attention.without_cudnn
    assert torch.__version__ in note and "docs/cuda_attention.md" in note and "pytorch/pytorch#196678" in note


def sdpa_flags():
    return torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()


def trainer_forwards(tmp_path, gradient_checkpointing: bool, **dynamic):
    """Train 2 off-policy steps; return the (grad enabled, cuDNN allowed) of every forward of the first layer."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer, hidden_size=32, num_layers=2, seed=0)
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: seen.append((torch.is_grad_enabled(), sdpa_flags()[0])))
    args = DHPOConfig(
        str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no", max_steps=2, logging_steps=1,
        per_device_train_batch_size=2, num_generations=2, gradient_accumulation_steps=2, steps_per_generation=4,
        max_completion_length=6, gradient_checkpointing=gradient_checkpointing, algorithm="dhpo", **dynamic,
    )  # fmt: skip
    trainer = DHPOTrainer(model, lambda completions, **kw: [float(len(c) % 3) for c in completions], args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["1+1=", "2+3=", "4+4=", "9+1="] * 2}),
                          processing_class=tokenizer)  # fmt: skip
    trainer.train()
    return seen


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
@pytest.mark.parametrize(("dynamic_batching", "padding_free"), [(False, False), (True, False), (True, True)])
def test_every_forward_of_a_training_step_runs_without_cudnn(tmp_path, monkeypatch, capsys, gradient_checkpointing,
                                                             dynamic_batching, padding_free):  # fmt: skip
    """With the guard on (as on CUDA with torch >= 2.11; forced here on CPU), on every update path: every forward
    that takes gradients - the policy passes and, under gradient checkpointing, their recomputation in backward -
    runs with cuDNN attention off, and so do the step's no-gradient passes (generation, old log-probs); the flags are
    back on after training, and the note names the setting that acts."""
    monkeypatch.setattr(cuda_attention, "update_backends", lambda *a: [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
    seen = trainer_forwards(tmp_path, gradient_checkpointing, dynamic_batching=dynamic_batching,
                            padding_free=padding_free)  # fmt: skip
    gradient = [cudnn for grad, cudnn in seen if grad]
    assert len(gradient) >= 4 * (2 if gradient_checkpointing else 1)  # 2 steps x 2 micro-steps, recomputed or not
    assert len(seen) > len(gradient) and not any(cudnn for _, cudnn in seen)
    assert sdpa_flags() == (True, True)
    assert "cuDNN" in capsys.readouterr().out


def test_without_the_guard_the_flags_are_untouched(tmp_path, capsys):
    seen = trainer_forwards(tmp_path, False, dynamic_batching=True, padding_free=False)
    assert seen and all(cudnn for _, cudnn in seen)
    assert "cuDNN" not in capsys.readouterr().out


def test_the_path_note_and_the_attention_note_are_kept_apart_and_printed_together():
    """On CUDA the attention's line comes beside the path's own note (which says why the automatic choice did not
    pack), never in it; the trainer prints both."""
    from dhpo_trl.training import update_path

    tokenizer = build_char_tokenizer()
    chosen = update_path.choose(False, False, True, {"model": build_tiny_qwen3(tokenizer, hidden_size=32)}, "cuda")
    assert chosen.note is None and "cuDNN" in chosen.attention_note
    assert chosen.notes == chosen.attention_note
    chosen.note = "DHPOConfig.padding_free=None (automatic): dynamic batching"
    assert chosen.notes.split("\n") == [chosen.note, chosen.attention_note]
    assert update_path.choose(False, False, True, {"model": None}, "cpu").notes is None
