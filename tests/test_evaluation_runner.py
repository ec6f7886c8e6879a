r"""dhpo_trl.evaluation.runner end to end with a scripted backend: completions of known correctness (answers equal to
the gold in value, not in form: `0.5` for `\frac{1}{2}`, `1,200` for 1200) give scores, averages, counts and records
asserted as hand-computed literals; prompt encoding with and without a chat template; result order; refused inputs."""

import pytest
from tokenizers import processors

from dhpo_trl.demo.tiny import build_char_tokenizer
from dhpo_trl.evaluation.backends import SamplingSettings
from dhpo_trl.evaluation.benchmarks import Problem
from dhpo_trl.evaluation.runner import encode_prompts, evaluate_problems

SYSTEM = "You are a helpful assistant."
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def bos_tokenizer(chat_template=None):
    """The character tokenizer, made to prepend <|endoftext|> (id 1) as a BOS, like Llama-style tokenizers do."""
    tokenizer = build_char_tokenizer()
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 1)]
    )
    tokenizer.chat_template = chat_template
    return tokenizer


# ------------------------------------------------------------------ encode_prompts
def test_plain_prompt_without_a_chat_template_keeps_the_tokenizer_specials():
    tokenizer = bos_tokenizer()
    ids = encode_prompts(tokenizer, ["What is 2+3? "])
    text = f"{SYSTEM}\n\nWhat is 2+3?\n{INSTRUCTION}\n\nAnswer:"
    assert ids == [[1, *tokenizer(text, add_special_tokens=False)["input_ids"]]]  # one BOS, then the text


def test_chat_prompt_is_rendered_with_the_generation_prompt_and_no_second_bos():
    tokenizer = bos_tokenizer(TEMPLATE)
    ids = encode_prompts(tokenizer, ["What is 2+3?", "Name a prime."])
    rendered = [
        f"[system]{SYSTEM}[user]What is 2+3?\n{INSTRUCTION}[assistant]",
        f"[system]{SYSTEM}[user]Name a prime.\n{INSTRUCTION}[assistant]",
    ]
    assert ids == [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]
    assert [row[0] for row in ids] == [87, 87]  # "[" (id 87) opens the template: no BOS (id 1) before it


class RecordingTokenizer:
    """Records every call encode_prompts makes; returns ids [n] for the n-th text it encodes."""

    def __init__(self, chat_template=None):
        self.chat_template = chat_template
        self.calls = []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append(("render", [m["role"] for m in messages], kwargs))
        return "rendered:" + messages[-1]["content"].split("\n")[0]

    def __call__(self, text, **kwargs):
        self.calls.append(("encode", text, kwargs))
        return {"input_ids": [sum(call[0] == "encode" for call in self.calls)]}


def test_encode_prompts_calls_with_a_chat_template():
    tokenizer = RecordingTokenizer(chat_template="any")
    assert encode_prompts(tokenizer, ["q1", "q2"]) == [[1], [2]]
    assert tokenizer.calls == [
        ("render", ["system", "user"], {"tokenize": False, "add_generation_prompt": True}),
        ("encode", "rendered:q1", {"add_special_tokens": False}),
        ("render", ["system", "user"], {"tokenize": False, "add_generation_prompt": True}),
        ("encode", "rendered:q2", {"add_special_tokens": False}),
    ]


def test_encode_prompts_calls_without_a_chat_template():
    tokenizer = RecordingTokenizer()
    assert encode_prompts(tokenizer, ["q1", "q2"]) == [[1], [2]]
    assert tokenizer.calls == [
        ("encode", f"{SYSTEM}\n\nq1\n{INSTRUCTION}\n\nAnswer:", {}),
        ("encode", f"{SYSTEM}\n\nq2\n{INSTRUCTION}\n\nAnswer:", {}),
    ]
    assert encode_prompts(tokenizer, []) == []


# ------------------------------------------------------------------ evaluate_problems
class ScriptedBackend:
    """Returns, for each generate() call, the next scripted list of per-problem completions; records the calls."""

    name = "scripted"

    def __init__(self, *per_call):
        self.per_call = list(per_call)
        self.calls = []

    def generate(self, prompt_ids, num_samples, settings):
        self.calls.append((prompt_ids, num_samples, settings))
        return self.per_call.pop(0)


AMC = [  # AMC23: Avg@4 by default
    Problem("amc23", 10, "Half of one?", "\\frac{1}{2}"),
    Problem("amc23", 11, "Two squared?", "4"),
]
AMC_COMPLETIONS = [
    ["\\boxed{0.5}", "so \\boxed{1/2}", "\\boxed{0.25}", "no box, 0.5"],  # 2/4 (3/4 with the last-number fallback)
    ["\\boxed{4.0}", "\\boxed{4}", "\\boxed{\\frac{8}{2}}", "\\boxed{-4}"],  # 3/4
]
GSM = [  # GSM8K: Pass@1 by default
    Problem("gsm8k", 0, "Pens?", "1200"),
    Problem("gsm8k", 1, "Pages?", "7"),
    Problem("gsm8k", 2, "Cats?", "3"),
]
GSM_COMPLETIONS = [["\\boxed{1,200}"], ["\\boxed{8}"], ["the answer is 3"]]  # 1/3 (2/3 with the fallback)


def test_scores_counts_and_records_from_known_answers(tokenizer):
    backend = ScriptedBackend(GSM_COMPLETIONS, AMC_COMPLETIONS)
    settings = SamplingSettings(max_new_tokens=9, seed=3)
    messages = []
    result = evaluate_problems(backend, tokenizer, {"gsm8k": GSM, "amc23": AMC}, settings, log=messages.append)

    assert list(result) == ["benchmarks", "average", "average_over"]
    assert result["average_over"] == ["gsm8k", "amc23"]  # the caller's order, not Table 1's
    assert list(result["benchmarks"]) == ["gsm8k", "amc23"]
    # AVG = (100 * 1/3 + 100 * (2/4 + 3/4) / 2) / 2 = (33.33 + 62.5) / 2
    assert result["average"] == pytest.approx(47.9166667)

    gsm, amc = result["benchmarks"]["gsm8k"], result["benchmarks"]["amc23"]
    assert gsm["score"] == pytest.approx(33.3333333)
    assert {k: v for k, v in gsm.items() if k not in ("score", "problems")} == {
        "metric": "Pass@1",
        "header": "GSM8K",
        "num_problems": 3,
        "samples_per_problem": 1,
        "num_samples": 3,
    }
    assert amc["score"] == 62.5
    assert {k: v for k, v in amc.items() if k not in ("score", "problems")} == {
        "metric": "Avg@4",
        "header": "AMC23 (Avg@4)",
        "num_problems": 2,
        "samples_per_problem": 4,
        "num_samples": 8,
    }
    assert amc["problems"] == [
        {
            "index": 10,
            "question": "Half of one?",
            "answer": "\\frac{1}{2}",
            "completions": ["\\boxed{0.5}", "so \\boxed{1/2}", "\\boxed{0.25}", "no box, 0.5"],
            "predictions": ["0.5", "1/2", "0.25", None],
            "correct": [1.0, 1.0, 0.0, 0.0],
            "score": 0.5,
        },
        {
            "index": 11,
            "question": "Two squared?",
            "answer": "4",
            "completions": ["\\boxed{4.0}", "\\boxed{4}", "\\boxed{\\frac{8}{2}}", "\\boxed{-4}"],
            "predictions": ["4.0", "4", "\\frac{8}{2}", "-4"],
            "correct": [1.0, 1.0, 1.0, 0.0],
            "score": 0.75,
        },
    ]
    assert [p["correct"] for p in gsm["problems"]] == [[1.0], [0.0], [0.0]]
    assert [p["predictions"] for p in gsm["problems"]] == [["1,200"], ["8"], [None]]
    assert [p["index"] for p in gsm["problems"]] == [0, 1, 2]

    # the backend got the SimpleRL prompts, the problems' sample counts and the settings object, one call per benchmark
    (gsm_ids, gsm_n, gsm_settings), (amc_ids, amc_n, amc_settings) = backend.calls

    def prompt(question):
        return tokenizer(f"{SYSTEM}\n\n{question}\n{INSTRUCTION}\n\nAnswer:")["input_ids"]

    assert gsm_ids == [prompt("Pens?"), prompt("Pages?"), prompt("Cats?")]
    assert amc_ids == [prompt("Half of one?"), prompt("Two squared?")]
    assert (gsm_n, amc_n) == (1, 4)
    assert gsm_settings is settings and amc_settings is settings
    assert messages == [
        "[gsm8k] sampling 3 problems x 1 ...",
        "[gsm8k] Pass@1 = 33.3",
        "[amc23] sampling 2 problems x 4 ...",
        "[amc23] Avg@4 = 62.5",
    ]


def test_last_number_fallback_reaches_scoring_and_predictions(tokenizer):
    backend = ScriptedBackend(AMC_COMPLETIONS, GSM_COMPLETIONS)
    result = evaluate_problems(
        backend, tokenizer, {"amc23": AMC, "gsm8k": GSM}, SamplingSettings(), fallback="last_number"
    )
    amc, gsm = result["benchmarks"]["amc23"], result["benchmarks"]["gsm8k"]
    assert amc["problems"][0]["predictions"] == ["0.5", "1/2", "0.25", "0.5"]
    assert amc["problems"][0]["correct"] == [1.0, 1.0, 0.0, 1.0]
    assert amc["score"] == 75.0  # (3/4 + 3/4) / 2
    assert [p["predictions"] for p in gsm["problems"]] == [["1,200"], ["8"], ["3"]]
    assert gsm["score"] == pytest.approx(66.6666667)
    assert result["average"] == pytest.approx(70.8333333)
    assert result["average_over"] == ["amc23", "gsm8k"]


def test_sample_overrides(tokenizer):
    # GSM8K at 2 samples (Avg@2); AMC23 overridden down to Pass@1; an override for a benchmark not run is ignored
    backend = ScriptedBackend(
        [["\\boxed{4}"], ["\\boxed{0.5}"]],
        [["\\boxed{1200}", "\\boxed{12}"], ["\\boxed{7}", "\\boxed{7.0}"], ["\\boxed{3}", "x"]],
    )
    samples = {"gsm8k": 2, "amc23": 1, "aime24": 0}
    messages = []
    result = evaluate_problems(
        backend, tokenizer, {"amc23": AMC, "gsm8k": GSM}, SamplingSettings(), samples, log=messages.append
    )
    assert messages == [  # the log names the metric of the overridden counts, not of the benchmarks' defaults
        "[amc23] sampling 2 problems x 1 ...",
        "[amc23] Pass@1 = 0.0",
        "[gsm8k] sampling 3 problems x 2 ...",
        "[gsm8k] Avg@2 = 66.7",
    ]
    assert [call[1] for call in backend.calls] == [1, 2]
    amc, gsm = result["benchmarks"]["amc23"], result["benchmarks"]["gsm8k"]
    assert (amc["metric"], amc["header"], amc["num_samples"], amc["score"]) == ("Pass@1", "AMC23", 2, 0.0)
    assert (gsm["metric"], gsm["header"], gsm["samples_per_problem"], gsm["num_samples"]) == (
        "Avg@2",
        "GSM8K (Avg@2)",
        2,
        6,
    )
    assert gsm["score"] == pytest.approx(66.6666667)  # (1/2 + 2/2 + 1/2) / 3
    assert result["average"] == pytest.approx(33.3333333)
    assert samples == {"gsm8k": 2, "amc23": 1, "aime24": 0}  # the caller's mapping is not modified


@pytest.mark.parametrize("count", [0, -1])
def test_a_sample_count_below_one_is_refused(tokenizer, count):
    backend = ScriptedBackend()
    with pytest.raises(ValueError, match=rf"^samples for 'gsm8k' must be >= 1, got {count}\.$"):
        evaluate_problems(backend, tokenizer, {"gsm8k": GSM}, SamplingSettings(), {"gsm8k": count})
    assert backend.calls == []


def test_an_unknown_fallback_is_refused_before_sampling(tokenizer):
    backend = ScriptedBackend()
    with pytest.raises(ValueError, match=r"^fallback must be one of \('none', 'last_number'\), got 'last'\.$"):
        evaluate_problems(backend, tokenizer, {"gsm8k": GSM}, SamplingSettings(), fallback="last")
    assert backend.calls == []


@pytest.mark.parametrize(
    ("completions", "message"),
    [
        (AMC_COMPLETIONS[:1], r"^\[amc23\] the backend returned samples for 1 problems, expected 2\.$"),
        (
            AMC_COMPLETIONS + [["\\boxed{1}"] * 4],
            r"^\[amc23\] the backend returned samples for 3 problems, expected 2\.$",
        ),
        (
            [AMC_COMPLETIONS[0], AMC_COMPLETIONS[1][:3]],
            r"^\[amc23\] the backend returned 3 samples for problem 11, expected 4\.$",
        ),
        (
            [AMC_COMPLETIONS[0] + ["\\boxed{0.5}"], AMC_COMPLETIONS[1]],
            r"^\[amc23\] the backend returned 5 samples for problem 10, expected 4\.$",
        ),
    ],
)
def test_a_backend_returning_the_wrong_counts_is_an_error(tokenizer, completions, message):
    with pytest.raises(ValueError, match=message):
        evaluate_problems(ScriptedBackend(completions), tokenizer, {"amc23": AMC}, SamplingSettings())


def test_empty_inputs_are_refused(tokenizer):
    with pytest.raises(ValueError, match=r"^No benchmark scores to average\.$"):
        evaluate_problems(ScriptedBackend(), tokenizer, {}, SamplingSettings())
    with pytest.raises(ValueError, match=r"^A benchmark needs at least one problem to score\.$"):
        evaluate_problems(ScriptedBackend([]), tokenizer, {"gsm8k": []}, SamplingSettings())
