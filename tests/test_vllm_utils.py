"""dhpo_trl.training.vllm_utils without a server: the URL TRL's client will use, what counts as a healthy server, the retry
schedule (on a fake clock), and when the checks run at all."""

import urllib.error
from types import SimpleNamespace

import pytest

import dhpo_trl.training.vllm_utils as vllm_utils


def args(**overrides):
    fields = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=None, vllm_server_host="10.0.0.7",
                  vllm_server_port=8123, vllm_server_timeout=5.0)  # fmt: skip
    return SimpleNamespace(**{**fields, **overrides})


def test_server_url():
    assert vllm_utils.vllm_server_url(args()) == "http://10.0.0.7:8123"
    assert vllm_utils.vllm_server_url(args(vllm_server_base_url="http://gpu-7:9000/")) == "http://gpu-7:9000"
    assert vllm_utils.vllm_server_url(args(vllm_server_base_url="https://h/v1//")) == "https://h/v1"
    assert vllm_utils.vllm_server_url(args(vllm_server_base_url="http://GPU-BOX/")) == "http://GPU-BOX"  # only "/"


class FakeResponse:
    def __init__(self, status):
        self.status = status

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize(
    ("answer", "up"),
    [
        (FakeResponse(200), True),
        (FakeResponse(503), False),
        (FakeResponse(204), False),
        (urllib.error.URLError("refused"), False),
        (ConnectionResetError(), False),
        (ValueError("unknown url type"), False),
    ],
)
def test_only_a_200_on_health_is_up(monkeypatch, answer, up):
    calls = []

    def urlopen(url, timeout):
        calls.append((url, timeout))
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(vllm_utils.urllib.request, "urlopen", urlopen)
    assert vllm_utils._server_is_up("http://h:1", 0.7) is up
    assert calls == [("http://h:1/health", 0.7)]


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(vllm_utils.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(vllm_utils.time, "sleep", fake.sleep)
    return fake


def probes(monkeypatch, clock, up_from=None):
    seen = []

    def server_is_up(url, timeout):
        seen.append((clock.now - 100.0, url, timeout))
        return up_from is not None and clock.now - 100.0 >= up_from

    monkeypatch.setattr(vllm_utils, "_server_is_up", server_is_up)
    return seen


def test_waits_until_the_server_answers(monkeypatch, clock):
    seen = probes(monkeypatch, clock, up_from=4.0)
    vllm_utils.wait_for_vllm_server(args(vllm_server_timeout=30), "m")
    assert [t for t, _, _ in seen] == [0.0, 2.0, 4.0]  # every retry_interval_s, stops at the first answer
    assert {(url, timeout) for _, url, timeout in seen} == {("http://10.0.0.7:8123", vllm_utils.PROBE_TIMEOUT_S)}


def test_gives_up_at_the_timeout_without_sleeping_past_it(monkeypatch, clock):
    seen = probes(monkeypatch, clock)
    with pytest.raises(ConnectionError) as error:
        vllm_utils.wait_for_vllm_server(args(vllm_server_timeout=5.0), "org/model", retry_interval_s=2.0)
    assert [t for t, _, _ in seen] == [0.0, 2.0, 4.0] and clock.sleeps == [2.0, 2.0]  # 4 + 2 > 5: no third wait
    message = str(error.value)
    assert "No vLLM server answered at http://10.0.0.7:8123/health (host '10.0.0.7', port 8123)" in message
    assert "within vllm_server_timeout=5.0s" in message
    assert "trl vllm-serve --model org/model --port 8123\n" in message


def test_exactly_reaching_the_deadline_still_probes(monkeypatch, clock):
    seen = probes(monkeypatch, clock)
    with pytest.raises(ConnectionError):
        vllm_utils.wait_for_vllm_server(args(vllm_server_timeout=4.0), "m", retry_interval_s=2.0)
    assert [t for t, _, _ in seen] == [0.0, 2.0, 4.0]


@pytest.mark.parametrize(("timeout", "probe"), [(0, 0.1), (0.5, 0.5), (60, 2.0)])
def test_probe_timeout_is_bounded(monkeypatch, clock, timeout, probe):
    seen = probes(monkeypatch, clock)
    with pytest.raises(ConnectionError):
        vllm_utils.wait_for_vllm_server(args(vllm_server_timeout=timeout), "m", retry_interval_s=100.0)
    assert [p for _, _, p in seen] == [probe]


def test_base_url_port_is_the_one_in_the_command(monkeypatch, clock):
    probes(monkeypatch, clock)
    with pytest.raises(ConnectionError) as error:
        vllm_utils.wait_for_vllm_server(args(vllm_server_base_url="http://gpu-3:9001/", vllm_server_timeout=0), "m")
    message = str(error.value)
    assert "http://gpu-3:9001/health (vllm_server_base_url='http://gpu-3:9001/')" in message
    assert "--port 9001" in message
    with pytest.raises(ConnectionError) as error:  # no port in the URL: the configured one
        vllm_utils.wait_for_vllm_server(args(vllm_server_base_url="http://gpu-3", vllm_server_timeout=0), "m")
    assert "--port 8123" in str(error.value)


def test_when_the_checks_run(monkeypatch):
    waited = []
    monkeypatch.setattr(vllm_utils, "wait_for_vllm_server", lambda a, name: waited.append(name))

    def unavailable():
        raise AssertionError("vllm availability checked although use_vllm=False")

    monkeypatch.setattr(vllm_utils, "is_vllm_available", unavailable)
    vllm_utils.check_vllm_setup(args(use_vllm=False), "m")
    monkeypatch.setattr(vllm_utils, "is_vllm_available", lambda: True)
    vllm_utils.check_vllm_setup(args(vllm_mode="colocate"), "m")  # no server to wait for
    vllm_utils.check_vllm_setup(args(), "m", is_main_process=False)  # only the main process talks to the server
    assert waited == []
    vllm_utils.check_vllm_setup(args(), "main-model")
    assert waited == ["main-model"]
    monkeypatch.setattr(vllm_utils, "is_vllm_available", lambda: False)
    with pytest.raises(ImportError, match=r"use_vllm=True but vllm is not installed.*or set use_vllm=False"):
        vllm_utils.check_vllm_setup(args(vllm_mode="colocate"), "m")


def test_the_whole_connection_error_message(monkeypatch, clock):
    probes(monkeypatch, clock)
    with pytest.raises(ConnectionError) as error:
        vllm_utils.wait_for_vllm_server(args(vllm_server_timeout=240), "Qwen/Qwen3-1.7B-Base")
    assert str(error.value) == (
        "No vLLM server answered at http://10.0.0.7:8123/health (host '10.0.0.7', port 8123) within "
        "vllm_server_timeout=240s. Start it first, on the GPUs not used for training, with:\n"
        "    trl vllm-serve --model Qwen/Qwen3-1.7B-Base --port 8123\n"
        "or point vllm_server_host/vllm_server_port (or vllm_server_base_url) at the running server."
    )
    assert clock.sleeps == [2.0] * 120 and clock.now - 100.0 == 240.0  # the last probe at the deadline itself


def test_an_empty_base_url_means_host_and_port():
    assert vllm_utils.vllm_server_url(args(vllm_server_base_url="")) == "http://10.0.0.7:8123"
    assert vllm_utils.vllm_server_url(args(vllm_server_host="localhost", vllm_server_port=8000)) == (
        "http://localhost:8000"
    )


def test_the_missing_vllm_message_names_the_install_command(monkeypatch):
    monkeypatch.setattr(vllm_utils, "is_vllm_available", lambda: False)
    with pytest.raises(ImportError) as error:
        vllm_utils.check_vllm_setup(args(), "m")
    assert str(error.value) == (
        'DHPOConfig.use_vllm=True but vllm is not installed. Install it with `pip install -e ".[vllm]"` in a clone '
        "of the dhpo-trl repository (needs a CUDA GPU), or set use_vllm=False to generate with transformers."
    )


def test_a_server_that_comes_up_at_the_last_probe_is_used(monkeypatch, clock):
    seen = probes(monkeypatch, clock, up_from=4.0)
    vllm_utils.wait_for_vllm_server(args(vllm_server_timeout=4.0), "m", retry_interval_s=2.0)  # no error
    assert [t for t, _, _ in seen] == [0.0, 2.0, 4.0] and clock.sleeps == [2.0, 2.0]


def test_a_server_that_is_up_is_probed_once_without_waiting(monkeypatch, clock):
    seen = probes(monkeypatch, clock, up_from=0.0)
    vllm_utils.wait_for_vllm_server(args(vllm_server_timeout=0), "m")
    assert len(seen) == 1 and clock.sleeps == []
