"""verl's actor checkpoints (0.9.1): FSDP rank files consolidated on the fly (fsdp, with
the DTensors of ranks), and where a Megatron actor's model lies (megatron)."""
