"""The embedded CPU default (`python -m dhpo_trl`): arithmetic problems, a tiny Qwen3 built locally, its warm start."""
