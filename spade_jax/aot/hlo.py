"""What a compiled program's HLO says about its collectives: bytes per chip of every
all-gather, all-reduce, all-to-all, reduce-scatter and collective-permute, by kind.

Read from ``compiled.as_text()`` (the optimized per-device HLO), each instruction's result
shape (for an async ``*-start`` its last tuple element, the result). A loop body (the layer
scan, the decode loop) is counted once, as in XLA's cost analysis: a check of *which*
collectives a program issues (e.g. that the decode layout gathers no weights per token),
not a replacement for the analytic ICI count.
"""

from __future__ import annotations

import re

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>.+?)\s+(?P<kind>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def _bytes(dtype: str, dims: str) -> int:
    count = 1
    for d in filter(None, dims.split(",")):
        count *= int(d)
    return count * _ITEMSIZE.get(dtype, 4)


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Result bytes per chip of the program's collectives, summed by kind (every kind of
    :data:`COLLECTIVES` present, 0 when absent)."""
    totals = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.search(line)
        if match is None:
            continue
        arrays = _ARRAY.findall(match["shape"])
        if not arrays:
            continue
        if match["start"]:  # (operands..., result[, scratch]): the result is the second half
            arrays = arrays[len(arrays) // 2:][:1] if len(arrays) > 1 else arrays
        totals[match["kind"]] += sum(_bytes(t, d) for t, d in arrays)
    return totals
