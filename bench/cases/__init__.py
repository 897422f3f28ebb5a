"""The bench's cases, a module per case or per family of them; each registers its cases with
harness.case when imported. MODULES' order is the order ``python bench/run.py`` runs them in."""

from __future__ import annotations

import importlib

MODULES = ("rewrite", "headers", "dcp", "trainers", "jobs", "merges", "clone", "lora", "quant", "gguf", "mlx",
           "gptoss", "remote", "megatron_import")  # fmt: skip

for _name in MODULES:
    importlib.import_module(f"{__name__}.{_name}")
