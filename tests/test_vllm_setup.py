"""vLLM wiring on CPU: server settings reach TRL unchanged; missing vllm / unreachable server fail early and clearly."""

import http.server
import threading
import time
from types import SimpleNamespace

import pytest
from datasets import Dataset

import processes

import dhpo_trl.training.vllm_utils as vllm_utils
from dhpo_trl import DHPOConfig, DHPOTrainer

MISSING_MODEL = "no-such-org/no-such-model"  # loading it would fail: an error naming vLLM proves the check ran first


def _config(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=4, use_vllm=True, vllm_mode="server",
    )  # fmt: skip
    kwargs.update(overrides)
    return DHPOConfig(**kwargs)


def _dataset():
    return Dataset.from_dict({"prompt": ["1+1=", "2+2=", "3+3=", "4+4="]})


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_missing_vllm_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_utils, "is_vllm_available", lambda *a, **k: False)
    with pytest.raises(ImportError, match=r'`pip install -e "\.\[vllm\]"` in a clone of the dhpo-trl repository'):
        DHPOTrainer(MISSING_MODEL, _reward, args=_config(tmp_path), train_dataset=_dataset())


@pytest.mark.parametrize("use_base_url", [False, True])
def test_unreachable_server_names_host_port_and_command(tmp_path, monkeypatch, use_base_url):
    monkeypatch.setattr(vllm_utils, "is_vllm_available", lambda *a, **k: True)
    port = processes.free_port()
    overrides = dict(vllm_server_host="127.0.0.1", vllm_server_port=port, vllm_server_timeout=1.0)
    if use_base_url:  # TRL ignores host/port when a base URL is given; so must the check
        overrides.update(vllm_server_base_url=f"http://127.0.0.1:{port}/", vllm_server_port=1)
    start = time.monotonic()
    with pytest.raises(ConnectionError) as caught:
        DHPOTrainer(MISSING_MODEL, _reward, args=_config(tmp_path, **overrides), train_dataset=_dataset())
    elapsed = time.monotonic() - start
    message = str(caught.value)
    assert f"http://127.0.0.1:{port}/health" in message
    assert f"trl vllm-serve --model {MISSING_MODEL}" in message
    assert ("(vllm_server_base_url=" in message) == use_base_url
    assert f"--port {port}" in message  # the port the trainer expects, also when it comes from the base URL
    if not use_base_url:
        assert f"port {port}" in message and "'127.0.0.1'" in message
    assert elapsed < 10.0, f"the check took {elapsed:.1f}s with vllm_server_timeout=1"


class _HealthHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_server_settings_reach_trl_unchanged(tmp_path, monkeypatch, tiny_model, tokenizer):
    server = http.server.HTTPServer(("127.0.0.1", 0), _HealthHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    received = {}

    class RecordingVLLMGeneration:  # stands in for TRL's backend, which needs vllm and a GPU
        def __init__(self, **kwargs):
            received.update(kwargs)
            info = {"model_config": {"logprobs_mode": "processed_logprobs"}}
            self.vllm_client = SimpleNamespace(get_server_info=lambda: info)

    monkeypatch.setattr(vllm_utils, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr("trl.trainer.grpo_trainer.VLLMGeneration", RecordingVLLMGeneration)
    args = _config(
        tmp_path, vllm_server_host="127.0.0.1", vllm_server_port=port, vllm_server_timeout=7.5, vllm_group_port=51299
    )
    try:
        trainer = DHPOTrainer(tiny_model, _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    finally:
        server.shutdown()
    assert trainer.use_vllm and trainer.vllm_mode == "server"
    assert received["mode"] == "server"
    assert received["server_host"] == "127.0.0.1"
    assert received["server_port"] == port
    assert received["server_timeout"] == 7.5
    assert received["server_base_url"] is None
    assert received["group_port"] == 51299
