"""GGUF output (llama.cpp): the family table, the plan pass, the keys and the format.

Imported only when a GGUF file is written: it needs gguf-py and tokenizers (``.[gguf]``).
"""
