"""The completeness marker's file record and an older marker's format (`dhpo_trl.training.resume`)."""

import json

from dhpo_trl.training import resume


def test_file_sizes_leave_out_the_marker_and_temporaries(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"123")
    (tmp_path / resume.COMPLETE_MARKER).write_text("{}")  # an earlier marker of a folder being rewritten
    (tmp_path / "dhpo_generation_state_rank0.pt.tmp").write_bytes(b"12345")  # a write cut short
    (tmp_path / "optimizer.TMP").write_bytes(b"1")  # not a temporary: its name only looks like one
    assert resume.file_sizes(str(tmp_path)) == {"model.safetensors": 3, "optimizer.TMP": 1}


def test_a_marker_without_a_format_reads_as_the_first_and_skips_the_buffer_settings(tmp_path):
    """A first-format marker has no "format" key and recorded no BUFFER_SETTINGS: those are not compared."""
    path = tmp_path / "checkpoint-3"
    path.mkdir()
    (path / resume.COMPLETE_MARKER).write_text(json.dumps({"global_step": 3, "settings": {"world_size": 1}}))
    resume.check_resumable(str(path), {"world_size": 1, "beta": 0.04})  # beta is a buffer setting: not compared


def marked(tmp_path, record):
    path = tmp_path / "checkpoint-3"
    path.mkdir(exist_ok=True)
    (path / resume.COMPLETE_MARKER).write_text(json.dumps(record))
    return str(path)


def refusal(path, current):
    try:
        resume.check_resumable(path, current)
    except ValueError as error:
        return str(error)
    return None


def test_a_refused_update_path_says_it_compares_as_resolved(tmp_path):
    saved = {"world_size": 1, "padding_free": True, "dynamic_batching": True, "seed": 1}
    path = marked(tmp_path, {"format": 3, "global_step": 3, "settings": saved})
    one = refusal(path, {**saved, "padding_free": False})
    assert "padding_free=True in the checkpoint but False now (padding_free: the update path that ran" in one
    both = refusal(path, {**saved, "padding_free": False, "dynamic_batching": False, "seed": 2})
    assert "(dynamic_batching and padding_free: the update path that ran, as resolved)" in both
    assert ", seed=1 in the checkpoint but 2 now" in both
    other = refusal(path, {**saved, "seed": 2})
    assert other.startswith(f"--resume_from_checkpoint {path}: seed=1 in the checkpoint but 2 now. Resume")


def test_a_second_format_marker_resolves_the_padding_free_it_recorded(tmp_path):
    """A format-2 marker recorded padding_free as passed: True under TRL's batching ran unpacked."""
    saved = {"world_size": 1, "padding_free": True, "dynamic_batching": False}
    path = marked(tmp_path, {"format": 2, "global_step": 3, "settings": saved})
    assert refusal(path, {**saved, "padding_free": False}) is None
    assert "padding_free=False in the checkpoint but True now" in refusal(path, saved)
