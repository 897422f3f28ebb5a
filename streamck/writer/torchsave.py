"""Writing a ``torch.save`` zip archive streamed, as torch itself lays it out, without torch.

The archive holds ``data.pkl`` (an OrderedDict of tensors rebuilt from storages),
the format markers, one stored record ``data/<i>`` per tensor, 64-byte aligned
through a padding extra field, and the central directory. Local headers carry
sizes 0 and flag 0x808 (a data descriptor follows the data), as torch writes
them, so each record's CRC-32 is computed while its bytes stream past. Zip64
fields appear where a size or offset needs them.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from streamck.dtypes import TORCH
from streamck.errors import OutputError, listing

ALIGN = 64
_FLAGS = 0x0808  # data descriptor follows; names are UTF-8
_U32 = 0xFFFFFFFF
# The small members torch.save writes before the data records and after them, in its order (torch 2.x).
FORMAT = {".format_version": b"1", ".storage_alignment": b"64", "byteorder": b"little"}
TRAILER = {"version": b"3\n", ".data/serialization_id": b"0" * 40}


def _pickle(tensors: list[tuple[str, str, tuple[int, ...]]]) -> bytes:
    """``data.pkl``: an OrderedDict of ``name -> _rebuild_tensor_v2/v3(storage i, 0, shape,
    contiguous strides, False, OrderedDict())``, in protocol 2 opcodes as torch emits them."""
    out = bytearray(b"\x80\x02")
    memo: dict[str, int] = {}

    def string(s: str) -> None:
        raw = s.encode("utf-8")
        out.extend(b"X" + struct.pack("<I", len(raw)) + raw)

    def global_(module: str, name: str) -> None:
        key = f"{module}\n{name}"
        if key in memo:
            out.extend(b"h" + bytes([memo[key]]) if memo[key] < 256 else b"j" + struct.pack("<I", memo[key]))
            return
        out.extend(b"c" + f"{module}\n{name}\n".encode())
        memo[key] = len(memo)
        out.extend(b"r" + struct.pack("<I", memo[key]))  # LONG_BINPUT

    def integer(n: int) -> None:
        if 0 <= n < 256:
            out.extend(b"K" + bytes([n]))
        elif 0 <= n < 65536:
            out.extend(b"M" + struct.pack("<H", n))
        elif -(2**31) <= n < 2**31:
            out.extend(b"J" + struct.pack("<i", n))
        else:
            raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
            out.extend(b"\x8a" + bytes([len(raw)]) + raw)  # LONG1

    def ints(values: Iterable[int]) -> None:
        out.extend(b"(")
        for v in values:
            integer(v)
        out.extend(b"t")

    global_("collections", "OrderedDict")
    out.extend(b")R(")  # OrderedDict(), then MARK for SETITEMS
    for i, (name, dtype, shape) in enumerate(tensors):
        torch_name, storage = TORCH[dtype]
        numel = 1
        for d in shape:
            numel *= d
        string(name)
        global_("torch._utils", "_rebuild_tensor_v2" if storage else "_rebuild_tensor_v3")
        out.extend(b"((")
        string("storage")
        global_("torch", storage) if storage else global_("torch.storage", "UntypedStorage")
        string(str(i))
        string("cpu")
        integer(numel if storage else numel * _itemsize(dtype))
        out.extend(b"tQ")  # the persistent id tuple, BINPERSID
        integer(0)
        ints(shape)
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        ints(reversed(strides))
        out.extend(b"\x89")  # False: requires_grad
        global_("collections", "OrderedDict")
        out.extend(b")R")
        if not storage:
            global_("torch", torch_name)
        out.extend(b"tR")
    out.extend(b"u.")
    return bytes(out)


def _itemsize(dtype: str) -> int:
    from streamck.dtypes import BITS

    return BITS[dtype] // 8


@dataclass(frozen=True)
class Record:
    """One archive member: its full name, size, and where its local header starts."""

    name: str
    size: int
    offset: int

    @property
    def zip64(self) -> bool:
        return self.size >= _U32 or self.offset >= _U32

    def local_header(self) -> bytes:
        name = self.name.encode()
        extra = struct.pack("<HHQQ", 1, 16, 0, 0) if self.zip64 else b""
        fixed = 30 + len(name) + len(extra) + 4  # + the padding field's own header
        pad = -(self.offset + fixed) % ALIGN
        extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad
        sizes = _U32 if self.zip64 else 0
        return (
            struct.pack(
                "<IHHHHHIIIHH",
                0x04034B50,
                45 if self.zip64 else 20,
                _FLAGS,
                0,
                0,
                0,
                0,
                sizes,
                sizes,
                len(name),
                len(extra),
            )
            + name
            + extra
        )

    def descriptor(self, crc: int) -> bytes:
        if self.zip64:
            return struct.pack("<IIQQ", 0x08074B50, crc, self.size, self.size)
        return struct.pack("<IIII", 0x08074B50, crc, self.size, self.size)

    @property
    def span(self) -> int:
        """Bytes from this record's local header to the end of its descriptor."""
        return len(self.local_header()) + self.size + (24 if self.zip64 else 16)

    def central(self, crc: int) -> bytes:
        name = self.name.encode()
        big = [v for v in (self.size, self.size) if v >= _U32] + ([self.offset] if self.offset >= _U32 else [])
        extra = struct.pack("<HH", 1, 8 * len(big)) + struct.pack(f"<{len(big)}Q", *big) if big else b""
        size = _U32 if self.size >= _U32 else self.size
        offset = _U32 if self.offset >= _U32 else self.offset
        return (
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                45 if big else 20,
                45 if big else 20,
                _FLAGS,
                0,
                0,
                0,
                crc,
                size,
                size,
                len(name),
                len(extra),
                0,
                0,
                0,
                0,
                offset,
            )
            + name
            + extra
        )


def archive_name(filename: str) -> str:
    """The folder torch puts records in: the file name without its suffix."""
    return filename.rsplit("/", 1)[-1].rsplit(".", 1)[0] or "archive"


def layout(filename: str, tensors: list[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, list[Record]]:
    """``data.pkl`` and every record of the archive for ``(name, dtype, shape, nbytes)``
    tensors, with offsets: small records first, then ``data/<i>``, then the trailer."""
    prefix = archive_name(filename) + "/"
    pkl = _pickle([(n, d, s) for n, d, s, _ in tensors])
    sizes = [("data.pkl", len(pkl)), *((k, len(v)) for k, v in FORMAT.items())]
    sizes += [(f"data/{i}", t[3]) for i, t in enumerate(tensors)]
    sizes += [(k, len(v)) for k, v in TRAILER.items()]
    records, offset = [], 0
    for name, size in sizes:
        record = Record(prefix + name, size, offset)
        records.append(record)
        offset += record.span
    return pkl, records


def end_of_archive(records: list[Record], crcs: list[int]) -> bytes:
    """The central directory and end records (zip64 ones where needed)."""
    start = records[-1].offset + records[-1].span
    central = b"".join(r.central(c) for r, c in zip(records, crcs, strict=True))
    n, end = len(records), start + len(central)
    if n < 0xFFFF and start < _U32 and len(central) < _U32:
        return central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(central), start, 0)
    zip64_end = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, len(central), start)
    locator = struct.pack("<IIQI", 0x07064B50, 0, end, 1)
    small = min(n, 0xFFFF)
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, small, small, min(len(central), _U32), min(start, _U32), 0)
    return central + zip64_end + locator + eocd


def stream_archive(
    filename: str, tensors: list[tuple[str, str, tuple[int, ...], int]], data: Iterator[Iterator[memoryview]]
) -> Iterator[bytes | memoryview]:
    """The archive's bytes in order; ``data`` yields, per tensor, its bytes in pieces."""
    pkl, records = layout(filename, tensors)
    crcs = []
    small = {"data.pkl": pkl, **FORMAT, **TRAILER}
    prefix = archive_name(filename) + "/"
    for record in records:
        yield record.local_header()
        key = record.name[len(prefix) :]
        if key in small:
            crc = zlib.crc32(small[key])
            yield small[key]
        else:
            crc, n = 0, 0
            for piece in next(data):
                crc = zlib.crc32(piece, crc)
                n += len(piece)
                yield piece
            if n != record.size:
                raise OutputError(f"{record.name}: {n} bytes streamed where the layout has {record.size}", filename)
        crcs.append(crc)
        yield record.descriptor(crc)
    yield end_of_archive(records, crcs)


def archive_size(filename: str, tensors: list[tuple[str, str, tuple[int, ...], int]]) -> int:
    _, records = layout(filename, tensors)
    return len(end_of_archive(records, [0] * len(records))) + records[-1].offset + records[-1].span


def refuse_unsaveable(tensors: Iterable) -> None:
    """Refuse, before anything is written, tensors (``.name``, ``.dtype``) whose dtype torch
    cannot hold (F4 and F6 pack elements in bits: torch has no such dtype)."""
    odd = [t for t in tensors if t.dtype not in TORCH]
    if odd:
        names = listing([f"{t.name} ({t.dtype})" for t in odd], 3)
        raise OutputError(f"torch.save output cannot hold {names}: torch has no such dtype; write safetensors")
