"""Running at scale: `dhpo-train`, the command that `accelerate launch` (DeepSpeed ZeRO-3, vLLM server mode, many
nodes, SLURM requeue) runs with the paper's recipes."""
