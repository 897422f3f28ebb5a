"""``torch.save`` zip archives read without torch: the archive by ranges (archive), its pickle
as inert data (unpickle, with the stand-ins of inert), and which dict of it is the model (keys).

Every other torch-format family reads its files through this package: DCP's ``.distcp``
blobs, DeepSpeed's and verl's rank files, Megatron's args."""
