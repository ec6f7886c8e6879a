"""The pure pieces of R3 (`dhpo_trl/training/rollout_routing.py`): vLLM's routing fields decoded in both wire forms,
a sample's routing assembled and checked against its tokens, a reply's choices matched to their prompts, and the
hooks on TRL's backend handing each process the routing of its own completions."""

import base64

import numpy as np
import pytest
import torch

from dhpo_trl.training import routing_replay as rr
from dhpo_trl.training.rollout_routing import (
    RolloutRouting,
    decode_experts,
    reply_samples,
    routing_of,
    sequence_rows,
)


def _experts(tokens, layers=2, offset=0):
    """Distinct, recognisable top-2 routing: token i, layer j -> (i + j + offset) % 7 and its successor."""
    return [[[(i + j + offset) % 7, (i + j + offset + 1) % 7] for j in range(layers)] for i in range(tokens)]


def test_decode_reads_nested_lists_and_base64_alike():
    value = np.array(_experts(5), dtype=np.int16)
    packed = {"data": base64.b64encode(value.tobytes()).decode(), "shape": list(value.shape)}
    assert np.array_equal(decode_experts(value.tolist(), "x"), value)
    assert np.array_equal(decode_experts(packed, "x"), value) and decode_experts(packed, "x").dtype == np.int16
    with pytest.raises(ValueError, match=r"choices\[3\].routed_experts is NoneType.*--enable-return-routed-experts"):
        decode_experts(None, "choices[3].routed_experts")
    with pytest.raises(ValueError, match=r"shape \(5, 2\)"):
        decode_experts([[1, 2]] * 5, "x")


def test_a_sample_is_its_prompts_then_its_completions_routing():
    prompt, completion = np.array(_experts(3), dtype=np.int16), np.array(_experts(4, offset=3), dtype=np.int16)
    rows = sequence_rows([5, 6, 7], [8, 9, 10, 11], prompt, completion, "choice 0")
    assert np.array_equal(rows, np.concatenate([prompt, completion]))
    # vLLM's capturer leaves the last sampled token without routing: its predecessor's stands in
    short = sequence_rows([5, 6, 7], [8, 9, 10, 11], prompt, completion[:3], "choice 0")
    assert np.array_equal(short[:6], rows[:6]) and np.array_equal(short[6], completion[2])


@pytest.mark.parametrize(("prompt_rows", "completion_rows", "field"), [
    (2, 4, r"prompt_routed_experts \(2, 2, 2\) for a prompt of 3 tokens"),
    (3, 2, r"routed_experts \(2, 2, 2\) for a completion of 4 tokens"),
    (3, 5, r"routed_experts \(5, 2, 2\) for a completion of 4 tokens"),
])  # fmt: skip
def test_routing_that_does_not_cover_the_tokens_names_the_shapes(prompt_rows, completion_rows, field):
    prompt, completion = np.array(_experts(prompt_rows), np.int16), np.array(_experts(completion_rows), np.int16)
    with pytest.raises(ValueError, match=field):
        sequence_rows([5, 6, 7], [8, 9, 10, 11], prompt, completion, "choice 1")


def _reply(prompts, completions, n, shared=True):
    choices = [{"prompt_token_ids": prompts[i // n], "token_ids": c, "routed_experts": _experts(len(c), offset=i)}
               for i, c in enumerate(completions)]  # fmt: skip
    reply = {"choices": choices}
    if shared:
        reply["prompt_routed_experts"] = [_experts(len(p), offset=10 + j) for j, p in enumerate(prompts)]
    else:
        for i, choice in enumerate(choices):
            choice["prompt_routed_experts"] = _experts(len(prompts[i // n]), offset=10 + i // n)
    return reply


@pytest.mark.parametrize("shared", [True, False])
def test_each_choice_gets_its_own_prompts_routing(shared):
    prompts, completions = [[1, 2], [3, 4, 5]], [[6], [7, 8], [9, 10, 11], [12]]
    samples = reply_samples(_reply(prompts, completions, 2, shared), prompts, 2)
    assert [ids for ids, _ in samples] == [[1, 2, 6], [1, 2, 7, 8], [3, 4, 5, 9, 10, 11], [3, 4, 5, 12]]
    for index, (ids, rows) in enumerate(samples):
        prompt = prompts[index // 2]
        expected = _experts(len(prompt), offset=10 + index // 2) + _experts(len(completions[index]), offset=index)
        assert rows.tolist() == expected


def test_one_prompts_routing_may_stand_alone_on_the_reply():
    reply = _reply([[1, 2]], [[6], [7, 8]], 2)
    reply["prompt_routed_experts"] = reply["prompt_routed_experts"][0]  # (tokens, layers, top_k), not a list of them
    samples = reply_samples(reply, [[1, 2]], 2)
    assert samples[1][1].tolist() == _experts(2, offset=10) + _experts(2, offset=1)


def test_a_reply_without_routing_names_the_server_flag():
    reply = _reply([[1, 2]], [[6]], 1)
    del reply["choices"][0]["routed_experts"]
    with pytest.raises(ValueError, match="choice 0.*--enable-return-routed-experts"):
        reply_samples(reply, [[1, 2]], 1)


def test_routing_of_is_found_by_the_keys_of_the_trainers_padded_rows():
    samples = [([1, 2, 6], np.array(_experts(3), np.int16)), ([3, 4, 5, 9, 10], np.array(_experts(5, offset=4), np.int16))]
    routing = routing_of(samples)
    ids = torch.tensor([[0, 1, 2, 6, 0, 0], [3, 4, 5, 9, 10, 0]])  # left-padded prompt, right-padded completion
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])
    rows = rr.to_rows(routing, ids, mask)
    assert rows[0, 1:4].tolist() == _experts(3) and rows[1, :5].tolist() == _experts(5, offset=4)
    assert bool((rows[~mask.bool()] == -1).all())


class _Accelerator:
    def __init__(self, process_index, num_processes):
        self.process_index, self.num_processes, self.is_main_process = process_index, num_processes, True


class _Client:
    def __init__(self, reply):
        self.reply = reply

    def _post(self, url, **kwargs):
        return self.reply


class _Generation:
    """TRL's server-mode `VLLMGeneration.generate` as far as routing goes: one request, unique prompts, n each."""

    mode = "server"

    def __init__(self, reply, prompts, n):
        self.vllm_client, self.unique, self.n = _Client(reply), prompts, n

    def generate(self, prompts, images, num_generations, profiler=None):
        self.vllm_client._post("http://server/v1/completions", json={"prompt": self.unique, "n": self.n})
        return prompts


@pytest.mark.parametrize("process_index", [0, 1])
def test_each_process_keeps_the_routing_of_its_own_completions(monkeypatch, process_index):
    """Two processes of 4 completions each (2 prompts x n = 4 on the server): process 1 keeps choices 4-7."""
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", lambda held, from_process=0: held)
    prompts = [[1, 2], [3, 4, 5]]
    completions = [[6 + i, 7] for i in range(8)]
    generation = _Generation(_reply(prompts, completions, 4), prompts, 4)
    source = RolloutRouting()
    source.install(generation, _Accelerator(process_index, 2))
    local = [prompts[process_index]] * 4
    generation.generate(local, None, 4)
    kept = source._local
    assert [ids for ids, _ in kept] == [prompts[process_index] + completions[4 * process_index + j] for j in range(4)]
    assert kept[0][1][-2:].tolist() == _experts(2, offset=4 * process_index)
    source.take()
    assert source._local == []


@pytest.mark.parametrize(("experts", "message"), [
    (torch.zeros(3, 5, 2, dtype=torch.int16), r"holds 3 MoE layers .*\(3, 5, 2\).*the model 2 \(model.layers.0"),
    (torch.zeros(2, 5, 3, dtype=torch.int16), r"layer 0 \(model.layers.0.mlp.gate\) picks top-2, the routing holds top-3"),
    (torch.full((2, 5, 2), 4, dtype=torch.int16), r"layer 0 \(model.layers.0.mlp.gate\) has 4 experts.*4..4"),
])  # fmt: skip
def test_routing_from_another_model_names_the_layer(tiny_moe_model, experts, message):
    routing = rr.Routing(torch.arange(5), torch.arange(5), experts)
    with pytest.raises(ValueError, match=message):
        rr.check_fits(routing, rr.routers(tiny_moe_model))
    rr.check_fits(rr.Routing(torch.arange(5), torch.arange(5), experts[:2, :, :2] % 4), rr.routers(tiny_moe_model))


def test_an_engine_output_without_routing_names_the_engine_setting():
    from types import SimpleNamespace

    from dhpo_trl.training.rollout_routing import output_samples

    request = SimpleNamespace(prompt_token_ids=[1, 2], prompt_routed_experts=np.array(_experts(2), np.int16),
                              outputs=[SimpleNamespace(token_ids=[3], routed_experts=torch.tensor(_experts(1)))])
    assert output_samples([request])[0][1].tolist() == _experts(2) + _experts(1)  # numpy and torch alike
    request.outputs[0].routed_experts = None
    with pytest.raises(ValueError, match="request 0 .*enable_return_routed_experts=True"):
        output_samples([request])
