"""torch.distributed.checkpoint (DCP) and the trainers that save through it, without torch.

sharded: DCP's sharded-safetensors form (and what both forms share); native: ``dcp.save``'s
``.distcp`` files, located by metadata; fsdp: HF Trainer + FSDP's folders; olmo: OLMo-core's."""
