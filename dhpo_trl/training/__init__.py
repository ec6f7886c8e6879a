"""`DHPOTrainer` (TRL's `GRPOTrainer` with our loss, logging and batching) and the update engine it wires: dynamic
batching and padding-free packing plans, exact resume, the TRL lines it mirrors, and the set-up checks of rewards,
vLLM and ZeRO-3 MoE models."""
