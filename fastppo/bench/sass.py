"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU, and read its machine code.

Triton's wheel ships its NVIDIA backend, ptxas and cuobjdump, so Triton IR -> PTX -> cubin ->
SASS runs on a CPU (``launches.py`` compiles). This module turns a cubin into the numbers a kernel
engineer reads first: registers, local memory
(spills), shared memory, and per region of code the instruction mix: global load and store
widths, barriers, warp shuffles, special-function (MUFU) instructions.

Each instruction also carries the control bits ptxas encodes beside it (the top 23 bits of its
128-bit word, documented by Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via
Microbenchmarking", 2018, and unchanged through Hopper): the cycles to stall before the next
instruction, the scoreboard a variable-latency instruction (a load, a MUFU, a shuffle) sets when
its result is ready, and the scoreboards an instruction waits on. ``schedule.py`` replays them.

The *hot loop* is the first loop in address order that no other loop contains (a loop is the
region of a backward branch, SASS addresses ``[target, branch]``): each fastppo kernel's main loop,
over vocabulary or time blocks, comes first; a kernel that reads a row's ragged edges apart does
so after it, in a loop of its own that runs a trip or two, counted with the code that runs once per
program. A kernel with no loop has no hot loop; its whole body is the per-program cost.
"""

import re
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

HOPPER_ARCH = 90


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: this triton wheel does not ship {name}")
    return str(path)


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # e.g. "LDG.E.128", predicate stripped
    operands: str
    stall: int = 1  # cycles before the warp issues its next instruction
    sets: Optional[int] = None  # the scoreboard (0-5) released when the result is written
    frees: Optional[int] = None  # the scoreboard released when the sources have been read
    waits: tuple = ()  # the scoreboards that must be released before this issues


def control(high_word: int) -> dict:
    """The scheduling fields of an instruction's control bits (the high 64-bit word's top 23 bits)."""
    bits = high_word >> 41
    sets, frees = (bits >> 5) & 7, (bits >> 8) & 7  # 7: none
    return {
        "stall": bits & 15,
        "sets": None if sets == 7 else sets,
        "frees": None if frees == 7 else frees,
        "waits": tuple(b for b in range(6) if (bits >> (11 + b)) & 1),
    }


@dataclass(frozen=True)
class Resources:
    registers: int
    local_bytes: int  # per thread; nonzero means spills (fastppo kernels keep no local arrays)
    shared_bytes: int


@dataclass(frozen=True)
class Mix:
    """The instruction mix of a region of SASS (NOPs, the scheduler's padding, not counted)."""

    instructions: int
    barriers: int
    shuffles: int
    mufu: int
    load_bits: tuple  # the distinct widths of the global loads, sorted
    store_bits: tuple


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_HIGH_WORD = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")  # the line under an instruction
_WIDTH = {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}


def disassemble(cubin: bytes) -> tuple:
    """(the SASS instructions in address order, the kernel's resource usage) of a one-kernel cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(path)], capture_output=True, text=True, check=True)
        usage = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", str(path)], capture_output=True, text=True, check=True
        )
    return parse(sass.stdout), resources(usage.stdout)


def parse(sass: str) -> list:
    """The instructions of cuobjdump -sass output, with their control bits where it prints them."""
    instructions = []
    for line in sass.splitlines():
        found = _LINE.search(line)
        if found:
            address, opcode, operands = found.groups()
            instructions.append(Instruction(int(address, 16), opcode, operands.strip()))
        elif instructions and (high := _HIGH_WORD.match(line)):
            instructions[-1] = replace(instructions[-1], **control(int(high.group(1), 16)))
    return instructions


def resources(res_usage: str) -> Resources:
    fields = dict(re.findall(r"\b(REG|LOCAL|SHARED):(\d+)", res_usage))
    return Resources(int(fields["REG"]), int(fields["LOCAL"]), int(fields["SHARED"]))


def hot_loop(instructions: list) -> Optional[tuple]:
    """(first, last) index of the first loop (a backward branch's region) not inside another, or
    None without a loop."""
    index = {ins.address: i for i, ins in enumerate(instructions)}
    loops = []
    for i, ins in enumerate(instructions):
        target = re.match(r"(?:`\()?0x([0-9a-f]+)", ins.operands) if ins.opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < ins.address and int(target.group(1), 16) in index:
            loops.append((index[int(target.group(1), 16)], i))
    outermost = [r for r in loops if not any(o[0] <= r[0] and r[1] <= o[1] and o != r for o in loops)]
    return min(outermost, default=None)


def _width(opcode: str) -> int:
    parts = opcode.split(".")
    return next((_WIDTH[p] for p in parts[1:] if p in _WIDTH), 32)


def mix(instructions: list) -> Mix:
    ops = [ins.opcode for ins in instructions if ins.opcode != "NOP"]
    return Mix(
        instructions=len(ops),
        barriers=sum(op.startswith("BAR") for op in ops),
        shuffles=sum(op.startswith("SHFL") for op in ops),
        mufu=sum(op.startswith("MUFU") for op in ops),
        load_bits=tuple(sorted({_width(op) for op in ops if op.startswith("LDG")})),
        store_bits=tuple(sorted({_width(op) for op in ops if op.startswith("STG")})),
    )
