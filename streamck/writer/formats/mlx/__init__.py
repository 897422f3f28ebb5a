"""MLX output (mlx-lm): the family table, the plan pass and the format.

Imported only when an MLX folder is written; it needs nothing beyond streamck's own packages
(the quantization is numpy's: streamck.transforms.mlx_quant).
"""
