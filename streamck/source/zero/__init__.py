"""DeepSpeed ZeRO checkpoints (stages 1–3), consolidated on the fly without torch or deepspeed.

find: which folder holds a save; files: one rank file unpickled as inert data; ranks: the
rank files of one save, checked against each other; read: the tensors they make up."""
