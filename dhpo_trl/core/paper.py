"""The paper's numbers (Min et al., 2026, appendix D), in one place: `DHPOConfig`'s defaults, the keyword defaults
of `dhpo_trl.core.losses` and the rows of `dhpo_trl.core.presets` all read them from here."""

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
