"""The update's forwards, decided once from the settings, the models and the device (`update_path.choose`)."""

import pytest
import torch
from datasets import Dataset
from test_padding_free import sliding_qwen3
from trl.trainer.utils import add_fused_lm_head
from vlm_stand_in import build_processor, image_dataset

from dhpo_trl import DHPOConfig
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from dhpo_trl.training import batching, packing, shared_prompts, update_path


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def sdpa(tok):
    model = build_tiny_qwen3(tok, hidden_size=16)
    model.config._attn_implementation = "sdpa"
    return model


@pytest.fixture(scope="module")
def flash(tok):
    model = build_tiny_qwen3(tok, hidden_size=16)
    model.config._attn_implementation = "flash_attention_2"
    return model


def choose(padding_free=None, share_prompts=False, dynamic_batching=None, model=None, ref_model=None, device="cpu",
           trl_only=None):  # fmt: skip
    return update_path.choose(padding_free, share_prompts, dynamic_batching, {"model": model, "ref_model": ref_model},
                              device, trl_only)  # fmt: skip


@pytest.mark.parametrize(("device", "attention", "packed"), [("cpu", "sdpa", True), ("cuda", "flash", True),
                                                              ("cuda", "sdpa", False), ("xpu", "sdpa", False)])
def test_automatic_packs_where_measured_or_varlen(device, attention, packed, request):
    path = choose(model=request.getfixturevalue(attention), device=device)
    assert path.padding_free is packed
    assert path.path is (packing.PACKED if packed else batching.DYNAMIC)
    assert (path.note is None) is packed  # dynamic batching by the automatic choice is said, naming the opt-in
    assert packed or "padding_free=True" in path.note


def test_explicit_settings_are_obeyed(sdpa):
    assert choose(padding_free=True, model=sdpa, device="cuda").padding_free is True  # opt-in where unmeasured
    assert choose(padding_free=False, model=sdpa).padding_free is False
    off = choose(dynamic_batching=False, model=sdpa)  # TRL's batching: nothing packs, nothing to say
    assert (off.path, off.note) == (batching.PADDED, None)


def test_shared_prompts_forward_and_plan(sdpa):
    path = choose(share_prompts=True, model=sdpa, ref_model=sdpa)
    assert (path.padding_free, path.path) == (True, shared_prompts.SHARED)


def test_refusals_name_the_setting_that_would_act(tok, sdpa, flash):
    sliding = sliding_qwen3(tok)
    with pytest.raises(ValueError, match=r"padding_free=True cannot run on this ref_model: .*sliding"):
        choose(padding_free=True, model=sdpa, ref_model=sliding)
    automatic_off = choose(model=sliding)  # automatic: dynamic batching, the reason said
    assert automatic_off.padding_free is False and "sliding" in automatic_off.note
    reference_off = choose(model=sdpa, ref_model=sliding)  # the reference pass runs packed too: it decides as well
    assert reference_off.padding_free is False and "sliding" in reference_off.note
    with pytest.raises(ValueError, match=r"share_prompts=True needs padding-free .*padding_free=True"):
        choose(share_prompts=True, model=sdpa, device="cuda")
    with pytest.raises(ValueError, match=r"share_prompts=True cannot run on this model: .*flash_attention_2"):
        choose(share_prompts=True, padding_free=True, model=flash, device="cuda")


def test_automatic_keeps_trl_batching_where_dynamic_batching_cannot_serve(sdpa):
    automatic = choose(model=sdpa, trl_only="loss_type='bnpo' normalises per micro-batch")
    assert automatic.path is batching.PADDED and "dynamic_batching=None" in automatic.note and "bnpo" in automatic.note
    explicit_off = choose(dynamic_batching=False, model=sdpa, trl_only="bnpo")  # nothing to say: asked for
    assert (explicit_off.path, explicit_off.note) == (batching.PADDED, None)


def test_every_path_implements_the_interface():
    for path in (batching.PADDED, batching.DYNAMIC, packing.PACKED, shared_prompts.SHARED):
        for method in ("plan", "forward", "sums", "logged"):
            assert callable(getattr(path, method)), (path.name, method)
    names = [path.name for path in (batching.PADDED, batching.DYNAMIC, packing.PACKED, shared_prompts.SHARED)]
    assert len(set(names)) == 4


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_model_that_already_ran_packed_decides_as_a_fresh_one(tok, implementation):
    """A packed forward switches the model to its dispatching attention (`dhpo_packed_<original>`); a second trainer
    on that model (an evaluation run, a resumed run in the same process) must decide as on the model it was given."""
    fresh = build_tiny_qwen3(tok, hidden_size=16)
    fresh.config._attn_implementation = implementation
    used = build_tiny_qwen3(tok, hidden_size=16)
    used.config._attn_implementation = implementation
    add_fused_lm_head(used, outputs=("log_probs",))
    ids = torch.tensor([[5, 6, 7, 8], [0, 5, 9, 3]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    packing.forward_packed(used, packing.pack(ids, mask, 2, [[0, 1]]), (2, 2), False, False, torch.no_grad)
    assert used.config._attn_implementation == f"dhpo_packed_{implementation}"  # the switch happened
    for device in ("cpu", "cuda"):
        for padding_free in (None, True, False):
            for share_prompts in (False, True) if padding_free is not False else (False,):
                decide = dict(padding_free=padding_free, share_prompts=share_prompts, device=device)
                try:
                    expected = choose(model=fresh, ref_model=fresh, **decide)
                except ValueError as error:
                    with pytest.raises(ValueError) as raised:
                        choose(model=used, ref_model=used, **decide)
                    assert str(raised.value) == str(error)
                    continue
                decided = choose(model=used, ref_model=used, **decide)
                assert (decided.path, decided.note) == (expected.path, expected.note), decide
    assert packing.attention_implementation(used) == implementation
    assert packing.unsupported_model_reason(used) is None and shared_prompts.unsupported_model_reason(used) is None


def test_planned_batching_with_a_vision_language_processor_is_refused_only_when_asked_for(tok, tmp_path):
    """The automatic default keeps TRL's micro-batches for image batches (with one warning, test_trainer_paths.py);
    an explicit request is refused, naming each setting, where the dataset may hold images (an `image` or `images`
    column, or unknown columns); a tokenizer is no vision-language processor, and text-only rows are planned."""
    def args(**settings):
        return DHPOConfig(str(tmp_path), use_cpu=True, report_to="none", gradient_accumulation_steps=1,
                          steps_per_generation=2, **settings)  # fmt: skip

    processor, images = build_processor(), image_dataset(2)
    update_path.refuse_multimodal_planning(args(), processor, images)  # automatic: accepted
    update_path.refuse_multimodal_planning(args(dynamic_batching=False), processor, images)
    update_path.refuse_multimodal_planning(args(padding_free=True, max_tokens_per_micro_batch=64), tok, images)
    texts = Dataset.from_dict({"prompt": ["a", "b"]})
    update_path.refuse_multimodal_planning(args(padding_free=True), processor, texts)
    update_path.refuse_multimodal_planning(args(padding_free=True), processor, None)
    several = Dataset.from_dict({"prompt": ["a", "b"], "images": [[], []]})
    unknown = (images.to_iterable_dataset().map(lambda row: row), [{"prompt": "a"}])  # columns unknown, or none named
    for dataset in (images, several, *unknown):
        with pytest.raises(ValueError) as error:
            update_path.refuse_multimodal_planning(args(padding_free=True, max_tokens_per_micro_batch=64), processor,
                                                   dataset)  # fmt: skip
        assert "padding_free=True" in str(error.value) and "max_tokens_per_micro_batch=64" in str(error.value)
        assert "dynamic_batching=True" not in str(error.value)  # not asked for: left at its default
