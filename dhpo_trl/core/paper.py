"""The paper (Min et al., 2026) in one place: its citation and the model card's DHPO section, and its numbers
(appendix D): `DHPOConfig`'s defaults, the keyword defaults of `dhpo_trl.core.losses` and the rows of
`dhpo_trl.core.presets` all read them from here."""

import os
import textwrap

CITATION = textwrap.dedent("""\
    @inproceedings{min-etal-2026-orchestrating,
        title     = {Orchestrating Tokens and Sequences: Dynamic Hybrid Policy Optimization for {RLVR}},
        author    = {Min, Zijun and Liu, Bingshuai and Wang, Ante and Zhang, Long and Zeng, Anxiang and Zhang, Haibo and Su, Jinsong},
        booktitle = {Findings of the Association for Computational Linguistics: ACL 2026},
        year      = {2026},
    }""")

# Settings recorded in the model card of every checkpoint, after `algorithm` and the objective's own settings.
CARD_FIELDS = (
    "loss_type", "beta", "num_generations", "steps_per_generation", "gradient_accumulation_steps", "num_iterations",
    "learning_rate", "temperature", "max_completion_length",
)  # fmt: skip


def card_section(args, objective_settings) -> str:
    """The model card's DHPO section: the objective and its settings, then `CARD_FIELDS`, as a table."""
    names = ("algorithm", *objective_settings, *CARD_FIELDS)
    rows = "\n".join(f"| `{name}` | `{getattr(args, name)}` |" for name in names)
    return (
        "\n\n## DHPO settings\n\n"
        f"Trained with `dhpo_trl.DHPOTrainer` (Dynamic Hybrid Policy Optimization), objective "
        f"`algorithm={args.algorithm}` (the DHPO citation is above).\n\n"
        f"| setting | value |\n|---|---|\n{rows}\n"
    )


def append_card_section(args, objective_settings) -> None:
    """Append `card_section` to the model card TRL wrote in `args.output_dir`."""
    with open(os.path.join(args.output_dir, "README.md"), "a", encoding="utf-8") as handle:
        handle.write(card_section(args, objective_settings))


# DHPO's trust regions: [1 - 0.2, 1 + 0.28] on the token and on the sequence branch.
EPSILON_LOW = 0.2
EPSILON_HIGH = 0.28
# DHPO-A's fixed mixing weight w.
AVERAGED_TOKEN_WEIGHT = 0.5
# GMPO: the token log-ratio clipped to [-0.4, 0.4].
GMPO_EPSILON = 0.4
# GRPO: symmetric clip 0.2 and VERL's vanilla dual clip clip_ratio_c = 3 (TRL's delta).
GRPO_EPSILON = 0.2
GRPO_DELTA = 3.0
# GSPO: the sequence ratio clipped to [1 - 3e-4, 1 + 4e-4].
GSPO_EPSILON_LOW = 3e-4
GSPO_EPSILON_HIGH = 4e-4
# CISPO: eps_high = 0.2 caps the weight at 1.2 (TRL's epsilon_high is the cap itself).
CISPO_CAP = 1.2
