"""`torch_compile=True` (transformers' TrainingArguments field: accelerate wraps the model the update trains in
`torch.compile`) on every update path: the same update as without compile, and the compiled model is not
specialised on each forward's layout.

Packed rows change length every forward, dynamic batching's micro-batches change width and rows, shared-prompt rows
change their segments. Dynamo compiles a frame again when an input's shape changes, once: after that it treats the
dimension as dynamic. A frame that kept recompiling (one graph per row layout) would pass dynamo's recompile limit
and silently run eagerly; here the limit is lowered to what one dynamic dimension per changing input needs and a hit
fails the run (`fail_on_recompile_limit_hit`).

The backend is `aot_eager`: dynamo's graphs, guards and AOTAutograd's forward and backward graphs, without
inductor's C++ build (minutes per graph on a 2-core machine). Inductor's update on every path, 4 off-policy steps,
is the eager one to 5e-7 relative (docs/update_paths.md#torchcompile). TRL's batching (`dynamic_batching=False`)
runs TRL's own forward, untrimmed: it is compiled as dynamic batching is, with one dynamic dimension fewer.
"""

import contextlib

import pytest
import torch
import torch._dynamo
from long_tail import OFF_POLICY_RUN, dataset, length_reward, long_tailed_rollout
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from dhpo_trl import DHPOTrainer
from dhpo_trl.core.config import DHPOConfig, compiled_packing_reason
from dhpo_trl.core.presets import config_for
from dhpo_trl.training import batching, input_grad_hooks, update_path
from dhpo_trl.demo.tiny import build_char_tokenizer, build_tiny_qwen3

CPU = dict(use_cpu=True, bf16=False, report_to="none", seed=0, data_seed=0, save_strategy="no", logging_steps=1)
RUN = OFF_POLICY_RUN  # long_tail.py: steps 2 and 4 off-policy
# Packed rows are compiled without gradient checkpointing only (`compiled_packing_reason`: with it they are refused).
PATHS = {
    "dynamic": dict(padding_free=False),
    "packed": dict(padding_free=True, gradient_checkpointing=False),
    "shared": dict(padding_free=True, share_prompts=True, gradient_checkpointing=False),
}
# Compilations a frame may have in these runs: static shapes, then every dimension that changes dynamic. Each path's
# rollout (every n-th completion truncated) is one whose second forward already changes every dimension that later
# changes: dynamic batching's micro-batches their width and rows, packed and shared rows their length (and so their
# sequences' and segments' count). A rollout whose second forward changed the width only would need a third
# compilation, for the rows. A micro-batch of one row would add one (dynamo compiles a dimension of size 1 apart);
# these 4 steps have none.
COMPILATIONS_PER_FRAME = 2
TRUNCATED_EVERY = {"dynamic": 3, "packed": 5, "shared": 5}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing, and leaves no compiled frame to the tests after it."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def parameter_change(tok, tmp_path, path: str, trainer_cls=DHPOTrainer, **settings):
    config = config_for("GRPO", output_dir=str(tmp_path), **PATHS[path], **RUN, **CPU, **settings)
    trainer = trainer_cls(model=build_tiny_qwen3(tok, seed=0, num_layers=1, hidden_size=32), args=config,
                          reward_funcs=length_reward, train_dataset=dataset(), processing_class=tok,
                          rollout_func=long_tailed_rollout(tok, TRUNCATED_EVERY[path]))  # fmt: skip
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in trained]
    trainer.eager_update_forwards = 0  # a layer's Python forward run with grad on, outside a compiled graph

    def count(module, args, output):
        trainer.eager_update_forwards += torch.is_grad_enabled() and not torch.compiler.is_compiling()

    trainer.model.get_decoder().layers[0].mlp.register_forward_hook(count)
    trainer.train()
    return torch.cat([(p.detach() - s).flatten() for p, s in zip(trained, start, strict=True)]), trainer


# About 50 s of CPU for the three paths on the 2-core machine (load average 4-6): 15-20 s a path, eager run included,
# each frame compiled twice.
@pytest.mark.parametrize("path", list(PATHS))
def test_compiled_update_equals_the_eager_one_without_recompiling_per_layout(tok, tmp_path, path):
    eager, uncompiled = parameter_change(tok, tmp_path, path)
    with torch._dynamo.config.patch(recompile_limit=COMPILATIONS_PER_FRAME, fail_on_recompile_limit_hit=True):
        compiled, trainer = parameter_change(tok, tmp_path, path, torch_compile=True,
                                             torch_compile_backend="aot_eager")  # fmt: skip
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    # every forward of the update ran the compiled model (the no-grad passes run it uncompiled, as TRL's do)
    assert uncompiled.eager_update_forwards > 0 and trainer.eager_update_forwards == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    assert eager.norm() > 1e-3 and ((compiled - eager).norm() / eager.norm()).item() < 1e-5


def test_one_input_embedding_hook_however_often_trl_toggles_gradient_checkpointing(tok, tmp_path):
    """TRL turns gradient checkpointing off and on around every generation batch's no-grad passes, and transformers
    adds an input-embedding hook each time it turns it on (dhpo_trl/training/input_grad_hooks.py): TRL's trainer
    gains one per generation batch, which a compiled model guards on (one compilation each, then eager)."""
    counts = {}
    for name, trainer_cls in (("dhpo", DHPOTrainer), ("trl", GRPOTrainer)):
        hooks = []

        class Count(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kwargs):
                hooks.append(len(model.model.embed_tokens._forward_hooks))

        def counted(*args, **kwargs):
            return trainer_cls(*args, callbacks=[Count()], **kwargs)

        parameter_change(tok, tmp_path, "dynamic", trainer_cls=counted, gradient_checkpointing=True)
        counts[name] = hooks
    assert len(counts["dhpo"]) == 4 and set(counts["dhpo"]) == {1}  # 2 generation batches
    assert counts["trl"] == [2, 2, 3, 3]  # one more each generation batch


def test_packed_rows_are_refused_compiled_under_gradient_checkpointing_and_not_chosen(tok, tmp_path):
    """Packed rows' per-sequence attention breaks the compiled graph inside each checkpointed layer, which dynamo then
    runs eagerly (docs/update_paths.md#torchcompile): an explicit request is refused naming it, the automatic
    default keeps dynamic batching, which compiles, and says why."""
    base = dict(output_dir=str(tmp_path), **RUN, **CPU)
    for name, settings in (("padding_free", dict(padding_free=True)),
                           ("share_prompts", dict(padding_free=None, share_prompts=True)),
                           ("padding_free", dict(padding_free=True, share_prompts=True))):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^DHPOConfig\.{name}=True: torch_compile=True") as refused:
            DHPOConfig(**settings, torch_compile=True, gradient_checkpointing=True, **base)
        # the dynamic-batching fix it names is accepted as named (share_prompts=True refuses padding_free=False)
        named = {key: False for key in ("padding_free", "share_prompts") if f"{key}=False" in str(refused.value)}
        assert named.keys() == {"padding_free", *(("share_prompts",) if "share_prompts" in settings else ())}
        DHPOConfig(**{**settings, **named}, torch_compile=True, gradient_checkpointing=True, **base)
        DHPOConfig(**settings, torch_compile=True, gradient_checkpointing=False, **base)
        DHPOConfig(**settings, torch_compile=False, gradient_checkpointing=True, **base)
    model = build_tiny_qwen3(tok, num_layers=1, hidden_size=32)
    for compiled, checkpointed, path in ((True, True, batching.DYNAMIC), (True, False, None), (False, True, None)):
        config = DHPOConfig(torch_compile=compiled, gradient_checkpointing=checkpointed, **base)
        chosen = update_path.choose(config.padding_free, False, True, {"model": model}, "cpu", None,
                                    compiled_packing_reason(config))  # fmt: skip
        if path is None:
            assert chosen.padding_free and chosen.note is None
        else:
            assert chosen.path is path and "torch_compile" in chosen.note and "padding_free=None" in chosen.note


def test_lora_under_reentrant_gradient_checkpointing_trains_as_trl_over_generation_batches(tok, tmp_path):
    """Reentrant checkpointing (TRL forces it for PEFT under ZeRO-3) passes gradients to the adapters inside a
    checkpointed layer only if the embeddings' output requires grad: the hook kept across TRL's checkpointing toggles
    must be a live one. Three generation batches, compared with `trl.GRPOTrainer`."""
    from peft import LoraConfig

    changes, hooks = {}, {}
    for name, trainer_cls in (("dhpo", DHPOTrainer), ("trl", GRPOTrainer)):
        settings = dict(RUN, max_steps=6)
        config = config_for("GRPO", output_dir=str(tmp_path / name), dynamic_batching=False, **settings, **CPU,
                            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})  # fmt: skip
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        trainer = trainer_cls(model=build_tiny_qwen3(tok, seed=0, num_layers=1, hidden_size=32), args=config,
                              reward_funcs=length_reward, train_dataset=dataset(), processing_class=tok,
                              rollout_func=long_tailed_rollout(tok, 5), peft_config=lora)  # fmt: skip
        adapters = {n: p for n, p in trainer.model.named_parameters() if "lora_A" in n}
        start = {n: p.detach().clone() for n, p in adapters.items()}
        trainer.train()
        changes[name] = torch.cat([(adapters[n].detach() - start[n]).flatten() for n in sorted(adapters)])
        embeddings = trainer.model.get_input_embeddings()
        hooks[name] = len(embeddings._forward_hooks)
    # Before training TRL's enable_input_require_grads (PEFT with checkpointing) and the Trainer's checkpointing each
    # register one; `trl.GRPOTrainer` adds one per generation batch, DHPOTrainer keeps the count.
    assert hooks == {"dhpo": 2, "trl": 5}
    # the adapters sit inside the checkpointed layer: they move only through the gradient the checkpoint passes
    assert changes["trl"].norm() > 1e-3
    assert ((changes["dhpo"] - changes["trl"]).norm() / changes["trl"].norm()).item() < 1e-5


def test_replaced_hooks_are_removed_when_the_generation_batch_raises(tok):
    """A generation batch that raises after TRL turned checkpointing back on (its `finally`) and is caught (a
    callback, an interactive session) leaves one hook, as one that returns does."""
    model = build_tiny_qwen3(tok, num_layers=1, hidden_size=32)
    model.gradient_checkpointing_enable()
    for fails in (False, True):
        with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
            with input_grad_hooks.replaced_hooks_removed(model):
                with disable_gradient_checkpointing(model):
                    if fails:
                        raise RuntimeError("reward function failed")
        assert len(model.get_input_embeddings()._forward_hooks) == 1
