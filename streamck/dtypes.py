"""The safetensors dtype table, as data.

Order matters: it is the reference's ``Dtype`` enum order, which its writer
uses (descending) to lay tensors out in a file. Sub-byte types are sized in
bits; a tensor's byte length is ``numel * bits / 8`` and must be whole.
"""

from __future__ import annotations

# name -> bits per element, in the reference enum's order.
BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

RANK: dict[str, int] = {name: i for i, name in enumerate(BITS)}

# Casts are offered between these; the rest are carried unchanged.
CASTABLE = ("F64", "F32", "F16", "BF16")

# name -> (torch dtype name, the typed storage class torch.save pickles it with, or None
# where torch pickles an UntypedStorage and passes the dtype to _rebuild_tensor_v3).
TORCH: dict[str, tuple[str, str | None]] = {
    "F64": ("float64", "DoubleStorage"),
    "F32": ("float32", "FloatStorage"),
    "F16": ("float16", "HalfStorage"),
    "BF16": ("bfloat16", "BFloat16Storage"),
    "I64": ("int64", "LongStorage"),
    "I32": ("int32", "IntStorage"),
    "I16": ("int16", "ShortStorage"),
    "I8": ("int8", "CharStorage"),
    "U8": ("uint8", "ByteStorage"),
    "BOOL": ("bool", "BoolStorage"),
    "C64": ("complex64", "ComplexFloatStorage"),
    "U16": ("uint16", None),
    "U32": ("uint32", None),
    "U64": ("uint64", None),
    "F8_E4M3": ("float8_e4m3fn", None),
    "F8_E5M2": ("float8_e5m2", None),
    "F8_E8M0": ("float8_e8m0fnu", None),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", None),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", None),
}

# What a config.json's ``torch_dtype`` calls the castable ones.
TORCH_NAMES: dict[str, str] = {name: TORCH[name][0] for name in CASTABLE}

ALIASES: dict[str, str] = {
    "float64": "F64",
    "fp64": "F64",
    "double": "F64",
    "float32": "F32",
    "fp32": "F32",
    "float": "F32",
    "float16": "F16",
    "fp16": "F16",
    "half": "F16",
    "bfloat16": "BF16",
    "bf16": "BF16",
}


def nbytes(dtype: str, numel: int) -> int | None:
    """Byte length of ``numel`` elements, or None if it is not a whole number of bytes."""
    bits = numel * BITS[dtype]
    return None if bits % 8 else bits // 8


def castable_dtype(spelling: str) -> str:
    """Resolve a user's dtype spelling (``bf16``, ``F32``, ``half``) to a castable safetensors name.

    Raises ValueError naming the accepted spellings.
    """
    name = ALIASES.get(spelling.lower(), spelling.upper())
    if name not in CASTABLE:
        accepted = ", ".join([*CASTABLE, *ALIASES])
        raise ValueError(f"unknown or uncastable dtype {spelling!r} (accepted: {accepted})")
    return name
