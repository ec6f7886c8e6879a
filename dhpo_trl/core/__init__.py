"""The method, as pure functions: the paper's constants, the losses (eq. 1-7), the objective registry, the
aggregation and entropy bonus, the metrics, `DHPOConfig` and the paper's recipes. Imports nothing of the trainer."""
