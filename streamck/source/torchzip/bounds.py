"""What a pickle may cost before it is unpickled: one pass over its opcodes, no object built.

CPython's C unpickler, fast as it is, trusts the stream in ways a crafted file turns against
the reader: a memo index is an array slot (``LONG_BINPUT 2**28`` allocates 4 GiB for a few
bytes), a tuple nested a million deep as a dict key crashes the process when the dict hashes
it (``tuplehash`` recurses in C with no guard), and an opcode is an object (30 million of them
fit a 28 KiB deflated record). None of that can be stopped from inside ``load()``, so every
pickle streamck reads is first walked here, opcode by opcode, tracking only what those three
need: the count of opcodes, the memo indices, and how deep each tuple on the stack nests.
"""

from __future__ import annotations

import pickle

# A state dict of 100,000 tensors is 3 million opcodes (torch 2.13's pickler). Each opcode
# builds at most one object (~60 to 100 bytes): this bounds what a data.pkl holds near 1.5 GiB.
MAX_OPCODES = 16 << 20
# A DCP .metadata is 67 opcodes a chunk (torch 2.13, protocol 4), and a real one may name a
# couple of million chunks (a 405B model's weights and Adam state over 512 ranks): 2**27.
MAX_METADATA_OPCODES = 1 << 27
# Tuples nest a few deep in a real pickle (torch.Size in a tuple of arguments); hashing one as
# a dict key recurses once per level in C, safe to well past this.
MAX_TUPLE_DEPTH = 100

# What each opcode does to the stack (_KIND), and the bytes of its fixed argument or of the
# length prefix of its data (_ARG).
# (The walk's loop spells the first twelve as literals, by how often a torch pickle holds them.)
PUT, GET, PUSH, TUPLE1, TUPLE, MARK, SIZED, REDUCE, POP1PUSH1, TO_MARK, POP, MEMOIZE = range(12)
POP2, MARK_PUSH, NEWOBJ_EX, POP_MARK, DUP, STOP, FRAME, LINES, NOOP, TEXT_PUT, TEXT_GET, UNKNOWN = range(12, 24)
_KIND = [UNKNOWN] * 256
_ARG = [0] * 256


def _table(kind: int, ops: bytes, arg: int = 0) -> None:
    for op in ops:
        _KIND[op], _ARG[op] = kind, arg


_table(PUSH, b"N\x88\x89]}\x8f\x97")  # NONE, NEWTRUE, NEWFALSE, EMPTY_LIST/DICT/SET, NEXT_BUFFER
_table(PUSH, b"K\x82", 1)  # BININT1, EXT1
_table(PUSH, b"M\x83", 2)  # BININT2, EXT2
_table(PUSH, b"J\x84", 4)  # BININT, EXT4
_table(PUSH, b"G", 8)  # BINFLOAT
_table(SIZED, b"U\x8cC\x8a", 1)  # SHORT_BINSTRING, SHORT_BINUNICODE, SHORT_BINBYTES, LONG1
_table(SIZED, b"TXB\x8b", 4)  # BINSTRING, BINUNICODE, BINBYTES, LONG4
_table(SIZED, b"\x8d\x8e\x96", 8)  # BINUNICODE8, BINBYTES8, BYTEARRAY8
_table(PUT, b"q", 1)  # BINPUT
_table(PUT, b"r", 4)  # LONG_BINPUT
_table(TEXT_PUT, b"p")  # PUT: a text line
_table(MEMOIZE, b"\x94")
_table(GET, b"h", 1)  # BINGET
_table(GET, b"j", 4)  # LONG_BINGET
_table(TEXT_GET, b"g")  # GET: a text line
_table(LINES, b"ILFSVPci")  # protocol 0's text arguments: pushes one object
_table(MARK, b"(")
_table(TUPLE, b")t\x86\x87")  # EMPTY_TUPLE, TUPLE, TUPLE2, TUPLE3
_table(TUPLE1, b"\x85")
_table(POP1PUSH1, b"Q\x98")  # BINPERSID, READONLY_BUFFER
_table(REDUCE, b"R\x81\x93")  # REDUCE, NEWOBJ, STACK_GLOBAL
_table(POP, b"0ab")  # POP; APPEND, BUILD (into the object below)
_table(POP2, b"s")  # SETITEM
_table(TO_MARK, b"eu\x90")  # APPENDS, SETITEMS, ADDITEMS
_table(MARK_PUSH, b"ld\x91o")  # LIST, DICT, FROZENSET, OBJ
_table(NEWOBJ_EX, b"\x92")
_table(POP_MARK, b"1")
_table(DUP, b"2")
_table(STOP, b".")
_table(FRAME, b"\x95", 8)  # its opcodes follow inline, read as any others
_table(NOOP, b"\x80", 1)  # PROTO
_STEP = [1 + n for n in _ARG]
_TUPLE_ITEMS = {0x29: 0, 0x85: 1, 0x86: 2, 0x87: 3}  # EMPTY_TUPLE, TUPLE1..3 (TUPLE: to the mark)


# The unpickler numbers MEMOIZE's entries by how many it holds: beside explicit indices that count
# is its own, and no pickler writes both (protocols 0-3 put by index, 4 on memoize).
MIXED = "memo entries both put by index and memoized in order"


class PickleBoundsError(pickle.UnpicklingError):
    """A pickle refused for what it would cost to unpickle."""


def check(data: bytes, max_opcodes: int = MAX_OPCODES) -> None:
    """Walk the pickle ``data`` and raise PickleBoundsError if unpickling it would build more
    than ``max_opcodes`` objects, put a memo entry at an index well past the count of opcodes
    before it (pickle's own pickler numbers its memo in order, so a larger one can only be
    there to allocate), or make a tuple nested deeper than MAX_TUPLE_DEPTH (a REDUCE or NEWOBJ
    result counts as deep as its arguments: a reducer may return them). A malformed stream is
    left to the unpickler to refuse in its own words, once what comes before it is judged."""
    ops, deepest, mixed = _walk(bytes(data), max_opcodes)
    if ops > max_opcodes:
        raise PickleBoundsError(f"more than {max_opcodes} opcodes (objects) to build")
    if deepest > MAX_TUPLE_DEPTH:
        raise PickleBoundsError(f"tuples nested more than {MAX_TUPLE_DEPTH} deep")
    if mixed:
        raise PickleBoundsError(MIXED)


_SEGMENT = 1 << 20  # bytes of opcodes between two looks at the count and depth (stopping early)


def _walk(data: bytes, max_opcodes: int) -> tuple[int, int, bool]:
    """(opcodes, the deepest tuple, whether the memo is both put and memoized) up to the
    pickle's STOP, or to where it is malformed (the unpickler stops there too)."""
    stack: list[int] = []  # per item: how deep it nests tuples (0: not a tuple)
    marks: list[int] = []
    # Memo indices may not pass the pickle's length (by a 64 KiB slack): each entry follows an
    # opcode. The memoized tuples' depths, by index, 0 for anything else.
    memo = bytearray(len(data) + 0x10000)
    big = len(data) >> 16  # a LONG_BINPUT's third byte past this (or a fourth byte at all): look closer
    pos, end, ops, kinds, steps, push, pop = 0, len(data), 0, _KIND, _STEP, stack.append, stack.pop
    puts, memoized, deepest = False, 0, 0
    try:
        while 0 <= pos < end and ops <= max_opcodes and deepest <= MAX_TUPLE_DEPTH:  # a segment at a time
            limit = min(end, pos + _SEGMENT)
            while 0 <= pos < limit:  # the kinds by how often a torch pickle holds them; literals: no lookups
                op = data[pos]
                kind = kinds[op]
                pos += steps[op]
                ops += 1
                if kind == 0:  # PUT: BINPUT, LONG_BINPUT
                    puts = True
                    top = stack[-1]
                    if op == 0x71:
                        if top:  # a tuple: its depth kept for the GETs of it
                            memo[data[pos - 1]] = top
                    elif top or data[pos - 1] or data[pos - 2] > big:
                        _put(memo, int.from_bytes(data[pos - 4 : pos], "little"), top)
                elif kind == 1:  # GET: BINGET, LONG_BINGET
                    push(memo[data[pos - 1] if op == 0x68 else int.from_bytes(data[pos - 4 : pos], "little")])
                elif kind == 2:  # PUSH
                    push(0)
                elif kind == 3:  # TUPLE1
                    depth = stack[-1] = stack[-1] + 1
                    if depth > deepest:
                        deepest = depth
                elif kind == 4:  # TUPLE, TUPLE2, TUPLE3, EMPTY_TUPLE
                    at = marks.pop() if op == 0x74 else len(stack) - _TUPLE_ITEMS[op]
                    depth = 1 + max(stack[at:], default=0)
                    del stack[at:]
                    push(depth)
                    if depth > deepest:
                        deepest = depth
                elif kind == 5:  # MARK
                    marks.append(len(stack))
                elif kind == 6:  # SIZED: a length, then the data
                    n = steps[op] - 1
                    pos += int.from_bytes(data[pos - n : pos], "little")
                    push(0)
                elif kind == 7:  # REDUCE, NEWOBJ (as deep as the arguments), STACK_GLOBAL
                    top = pop()
                    stack[-1] = 0 if op == 0x93 else top
                elif kind == 8:  # BINPERSID, READONLY_BUFFER
                    stack[-1] = 0
                elif kind == 9:  # APPENDS, SETITEMS, ADDITEMS
                    del stack[marks.pop() :]
                elif kind == 10:  # POP, APPEND, BUILD
                    pop()
                elif kind == 11:  # MEMOIZE: the memo's next index (protocol 4 on), as the unpickler counts them
                    memo[memoized] = stack[-1]
                    memoized += 1
                else:  # the rest; pos < 0 at STOP
                    puts = puts or kind == TEXT_PUT
                    pos = _rare(data, kind, pos, stack, marks, memo)
                    if stack and stack[-1] > deepest:  # OBJ, INST: a call that may return its arguments
                        deepest = stack[-1]
    except (IndexError, ValueError):  # malformed (a stack underflow, a truncated argument…)
        pass
    return ops, deepest, puts and memoized > 0


def _put(memo: bytearray, index: int, depth: int) -> None:
    """Keep a memo entry's tuple depth; an index no pickler numbers its memo to is refused
    before the unpickler allocates a slot for every index below it."""
    if index >= len(memo):
        raise PickleBoundsError(f"memo index {index} in a pickle of {len(memo) - 0x10000} bytes")
    memo[index] = depth


def _rare(data: bytes, kind: int, pos: int, stack: list[int], marks: list[int], memo: bytearray) -> int:
    """The opcodes a torch pickle holds few of: where the next one starts (-1: stop here)."""
    if kind == POP2:
        del stack[-2:]
    elif kind == MARK_PUSH:  # OBJ calls a class on the items, which may return them: as deep as a tuple of them
        at = marks.pop()
        depth = 1 + max(stack[at:], default=0) if data[pos - 1] == 0x6F else 0
        del stack[at:]
        stack.append(depth)
    elif kind == LINES:
        op = data[pos - 1]
        for _ in range(2 if op in b"ci" else 1):
            pos = data.index(b"\n", pos) + 1
        if op == 0x69:  # INST: OBJ's protocol-0 form, the class named in its lines
            at = marks.pop()
            depth = 1 + max(stack[at:], default=0)
            del stack[at:]
            stack.append(depth)
        else:
            stack.append(0)
    elif kind == TEXT_PUT:  # protocol 0, never beside MEMOIZE (a text PUT of a protocol-4 pickle: refused)
        index, pos = _line_int(data, pos)
        _put(memo, index, stack[-1])
    elif kind == TEXT_GET:
        index, pos = _line_int(data, pos)
        stack.append(memo[index])
    elif kind == NEWOBJ_EX:
        stack[-3:] = [max(stack[-2:])]
    elif kind == POP_MARK:
        del stack[marks.pop() :]
    elif kind == DUP:
        stack.append(stack[-1])
    elif kind in (STOP, UNKNOWN):
        return -1  # the end, or an opcode pickle does not know (the unpickler refuses it)
    return pos  # FRAME, PROTO


def _line_int(data: bytes, pos: int) -> tuple[int, int]:
    """A protocol-0 decimal argument line at ``pos``: its value, and where the next opcode starts."""
    end = data.index(b"\n", pos)
    return int(data[pos:end]), end + 1


def one_line(e: BaseException) -> str:
    """An unpickling error as one short line: Python's messages may quote a value whole
    (a deep persistent id), or run over lines."""
    text = str(e).strip().splitlines()
    line = text[0] if text and text[0] else type(e).__name__
    return line if len(line) <= 300 else line[:300] + "…"
