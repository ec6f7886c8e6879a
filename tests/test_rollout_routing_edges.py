"""R3's routing read from malformed replies and engine outputs (`dhpo_trl/training/rollout_routing.py`): each is a
ValueError that names the field, the choice or request, and the setting that fixes it."""

from types import SimpleNamespace

import numpy as np
import pytest

from dhpo_trl.training.rollout_routing import SERVER_FLAG, output_samples, reply_samples


def experts(tokens, layers=2, offset=0):
    return [[[(i + j + offset) % 7, (i + j + offset + 1) % 7] for j in range(layers)] for i in range(tokens)]


def request(prompt_routing, routing, prompt=(1, 2), completion=(3,)):
    return SimpleNamespace(prompt_token_ids=list(prompt), prompt_routed_experts=prompt_routing,
                           outputs=[SimpleNamespace(token_ids=list(completion), routed_experts=routing)])  # fmt: skip


@pytest.mark.parametrize("missing", ["prompt_routed_experts", "routed_experts"])
def test_an_engine_output_without_the_routing_attribute_names_the_engine_setting(missing):
    """An engine built without the option returns outputs without the attributes at all (not set to None)."""
    output = request(np.array(experts(2), np.int16), np.array(experts(1), np.int16))
    if missing == "prompt_routed_experts":
        del output.prompt_routed_experts
    else:
        del output.outputs[0].routed_experts
    with pytest.raises(ValueError, match=r"request 0 .*enable_return_routed_experts=True"):
        output_samples([output])


def test_a_malformed_engine_routing_names_its_field_and_request():
    good = request(np.array(experts(2), np.int16), np.array(experts(1), np.int16))
    flat_prompt = request(np.zeros((2, 2), np.int16), np.array(experts(1), np.int16))
    with pytest.raises(ValueError, match=r"^rollout routing: prompt_routed_experts has shape \(2, 2\)"):
        output_samples([good, flat_prompt])
    flat_completion = request(np.array(experts(2), np.int16), np.zeros((1, 2), np.int16))
    with pytest.raises(ValueError, match=r"^rollout routing: routed_experts has shape \(1, 2\)"):
        output_samples([good, flat_completion])
    short = request(np.array(experts(2), np.int16), np.array(experts(1), np.int16), completion=(3, 4, 5))
    with pytest.raises(ValueError, match=r"^rollout routing of request 1: routed_experts \(1, 2, 2\) for a completion "
                                         r"of 3 tokens"):  # fmt: skip
        output_samples([good, short])


def test_a_reply_with_another_number_of_choices_names_both_counts():
    choices = [{"token_ids": [6], "routed_experts": experts(1), "prompt_routed_experts": experts(2)}] * 3
    with pytest.raises(ValueError, match=r"3 choices for 2 prompts x n=2"):
        reply_samples({"choices": choices}, [[1, 2], [3, 4]], 2)


def test_one_prompt_with_an_empty_prompt_routing_names_the_server_flag():
    reply = {"choices": [{"token_ids": [6], "routed_experts": experts(1)}], "prompt_routed_experts": []}
    with pytest.raises(ValueError, match=f"no prompt_routed_experts for prompt 0.*{SERVER_FLAG}"):
        reply_samples(reply, [[1, 2]], 1)


def test_a_malformed_reply_routing_names_its_field_with_the_prompt_or_choice():
    prompts = [[1, 2], [3, 4]]
    choices = [{"token_ids": [6], "routed_experts": experts(1)} for _ in range(4)]
    reply = {"choices": choices, "prompt_routed_experts": [experts(2), [[1, 2], [3, 4]]]}
    with pytest.raises(ValueError, match=r"^rollout routing: prompt_routed_experts\[1\] has shape \(2, 2\)"):
        reply_samples(reply, prompts, 2)
    reply["prompt_routed_experts"][1] = experts(2)
    choices[2]["routed_experts"] = [[1, 2]]
    with pytest.raises(ValueError, match=r"^rollout routing: choices\[2\]\.routed_experts has shape \(1, 2\)"):
        reply_samples(reply, prompts, 2)


def test_the_choices_prompt_token_ids_stand_for_a_prompt_sent_as_text():
    """A request whose prompts are text: the token ids come from the choice (the server's tokenisation)."""
    choices = [{"prompt_token_ids": [1, 2], "token_ids": [6], "routed_experts": experts(1),
                "prompt_routed_experts": experts(2)}]  # fmt: skip
    samples = reply_samples({"choices": choices}, ["2+2="], 1)
    assert samples[0][0] == [1, 2, 6] and samples[0][1].tolist() == experts(2) + experts(1)


def test_decode_reads_the_wire_dtype_empty_lists_and_tensors_and_refuses_experts_outside_int16():
    import base64

    import torch

    from dhpo_trl.training.rollout_routing import decode_experts, sequence_rows

    value = np.array(experts(3), dtype=np.int32)
    wire = {"data": base64.b64encode(value.tobytes()).decode(), "shape": list(value.shape), "dtype": "int32"}
    assert decode_experts(wire, "x").tolist() == experts(3)
    empty = decode_experts([], "x")  # a completion of one sampled token: no step went through the model
    assert empty.shape == (0, 0, 0) and empty.dtype == np.int16
    prompt = np.asarray(experts(3), dtype=np.int16)
    rows = sequence_rows([1, 2, 3], [7], prompt, empty, "sample 0")
    assert rows.tolist() == experts(3) + experts(3)[-1:]
    assert decode_experts(torch.tensor(experts(2)), "x").tolist() == experts(2)
    with pytest.raises(ValueError, match=r"^rollout routing: x is str, not a \(tokens, layers, top_k\) array"):
        decode_experts("routing", "x")
    with pytest.raises(ValueError, match=r"^rollout routing: x holds expert -1\.\.3, outside int16"):
        decode_experts([[[-1, 3]]], "x")
    with pytest.raises(ValueError, match=r"^rollout routing: x holds expert 0\.\.32768, outside int16"):
        decode_experts([[[0, 32768]]], "x")
    assert decode_experts([[[0, 32767]]], "x").tolist() == [[[0, 32767]]]  # the largest int16 is an expert


def test_a_one_token_completion_without_routing_takes_the_prompts_last_row():
    from dhpo_trl.training.rollout_routing import sequence_rows

    prompt = np.array(experts(3), np.int16)
    rows = sequence_rows([5, 6, 7], [8], prompt, np.zeros((0, 2, 2), np.int16), "choice 0")
    assert rows.tolist() == experts(3) + experts(3)[-1:]
    with pytest.raises(ValueError, match=r"^rollout routing of choice 0: prompt_routed_experts \(3, 2, 2\) and "
                                         r"routed_experts \(1, 3, 2\) differ in \(layers, top_k\)"):  # fmt: skip
        sequence_rows([5, 6, 7], [8], prompt, np.array(experts(1, layers=3), np.int16), "choice 0")
    assert sequence_rows([5, 6, 7], [], prompt, np.zeros((0, 2, 2), np.int16), "choice 0").tolist() == experts(3)


def test_no_sample_to_replay_is_said():
    from dhpo_trl.training.rollout_routing import routing_of

    with pytest.raises(ValueError, match=r"^rollout routing: no routed sample to replay"):
        routing_of([])
