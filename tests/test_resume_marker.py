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
