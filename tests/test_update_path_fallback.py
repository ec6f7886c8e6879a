"""TRL's own batching (`dynamic_batching=False`) has no fallback to announce: a batch the other paths cannot plan
(an image input) goes through it unchanged and without a warning, its padding logged as any batch's."""

import pytest
import torch
from test_trainer_paths import micro_batch, plan, planning_host


def test_trls_batching_takes_an_unplannable_batch_without_a_warning():
    host = planning_host(dynamic_batching=False)
    buffered = [micro_batch(extra={"pixel_values": torch.zeros(2, 1)})]
    planned, messages = plan(host, buffered)
    assert planned is buffered and messages == []
    assert host._metrics["train"]["batching/padding_fraction"] == [pytest.approx(0.2)]  # 8 real of 10 tokens
