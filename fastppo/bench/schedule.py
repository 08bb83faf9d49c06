"""How long a region of SASS keeps an SM busy: its issue time per pipe, and one warp's latency.

Two lower bounds on a trip through a kernel's hot loop, both read from the machine code:

* **Pipes.** Every warp instruction is dispatched by its scheduler (4 per SM per clock) and runs
  on one pipe, whose rate is in warp instructions per SM per clock. Hopper, like GA10x, has two
  fp32 pipes per scheduler of 16 lanes each: FMA-heavy, which also runs the integer multiply
  (IMAD, IDP), and FMA-lite, fp32 only (NVIDIA's description of the sm_86 and sm_90 pipes; half2
  arithmetic issues to both at once). So fp32 and IMAD together share a rate of 4 (``fma``), and
  IMAD alone is bounded by FMA-heavy's 2 (``fmaheavy``). The integer/compare/select ALU runs at 2,
  shuffles and loads/stores at 1, special functions and conversions (MUFU, I2F, F2F) at 0.5 (16
  lanes). A program's trip occupies each pipe for ``warps x slots / rate`` clocks; the busiest
  pipe (or dispatch) bounds it. Uniform-datapath, branch and barrier instructions cost dispatch
  only.
* **One warp's latency.** :func:`warp_cycles` replays the instructions in order as ptxas scheduled
  them (``sass.Instruction``'s control bits): each waits for the scoreboards it names, stalls the
  cycles encoded after it, and a variable-latency instruction releases its scoreboard after the
  latency of its kind (a global load: the DRAM latency; a shuffle, a MUFU, a shared-memory access:
  a few tens of cycles). A loop that loads a tile and then reduces it waits the whole DRAM latency
  every trip unless another resident program's trip fills the gap; ``roofline.py`` counts the
  resident programs. A warp's replay stands for its program's: warps of one program run the same
  code, so they reach each barrier together, where they pay ``BARRIER_CYCLES``.

Every predicated or branched-around instruction of the region is replayed as if it ran: for the
straight-line loops here that is exact, elsewhere an overestimate. The latencies of the variable
kinds are assumptions (from published Volta-to-Hopper microbenchmarks, rounded), named in
``LATENCY``; the control bits are ptxas's own.
"""

import re

PIPE_RATES = {"dispatch": 4.0, "fma": 4.0, "fmaheavy": 2.0, "alu": 2.0, "shfl": 1.0, "lsu": 1.0, "mufu": 0.5}

_FMA = ("FFMA", "FADD", "FMUL", "FSWZADD")  # FMA-heavy or FMA-lite
_FMA_HEAVY = ("IMAD", "IDP")  # FMA-heavy only
_HALF2 = ("HFMA2", "HADD2", "HMUL2")  # FMA-heavy and FMA-lite at once
_LSU = ("LDG", "STG", "LDS", "STS", "LD", "ST", "ATOM", "ATOMS", "ATOMG", "RED", "LDSM", "LDGSTS")
_MUFU = ("MUFU", "I2F", "F2I", "F2F", "FRND", "I2FP", "F2IP")
_ALU = (
    "ISETP", "FSETP", "IADD3", "IADD", "VIADD", "LOP3", "LOP", "SHF", "SHL", "SHR", "LEA", "SEL",
    "FSEL", "FMNMX", "IMNMX", "VIMNMX", "PRMT", "IABS", "MOV", "P2R", "R2P", "PLOP3", "F2FP",
    "FCHK", "BMSK", "SGXT", "FLO", "POPC", "BREV", "HSETP2", "HMNMX2", "CS2R",
)  # fmt: skip

# Cycles from issue to a variable-latency result, by opcode family; the DRAM latency is the
# GPU's figure. Sources of a store are read within ``SOURCE_READ_CYCLES``.
LATENCY = {"SHFL": 24, "MUFU": 18, "LDS": 30, "LDSM": 30, "S2R": 24, "LDC": 12, "I2F": 16, "F2I": 16, "F2F": 16}
DEFAULT_LATENCY = 20
SOURCE_READ_CYCLES = 12
BARRIER_CYCLES = 20


def family(opcode: str) -> str:
    return opcode.split(".")[0]


def pipe_slots(opcode: str) -> dict:
    """The pipe slots one warp instruction takes besides dispatch: ``{pipe: slots}``."""
    name = family(opcode)
    if name in _FMA:
        return {"fma": 1}
    if name in _FMA_HEAVY:
        return {"fma": 1, "fmaheavy": 1}
    if name in _HALF2:
        return {"fma": 2, "fmaheavy": 1}
    for pipe_name, names in (("lsu", _LSU), ("mufu", _MUFU), ("alu", _ALU)):
        if name in names:
            return {pipe_name: 1}
    return {"shfl": 1} if name == "SHFL" else {}


def pipe_cycles(instructions: list, warps: int) -> dict:
    """Clocks each pipe of one SM is busy for ``warps`` warps running ``instructions`` once."""
    counts = dict.fromkeys(PIPE_RATES, 0)
    for ins in instructions:
        if ins.opcode == "NOP":
            continue
        counts["dispatch"] += 1
        for unit, slots in pipe_slots(ins.opcode).items():
            counts[unit] += slots
    return {name: warps * count / PIPE_RATES[name] for name, count in counts.items()}


def _is_global_load(opcode: str) -> bool:
    return family(opcode) in ("LDG", "LD")


_DEPBAR = re.compile(r"SB(\d), (0x[0-9a-f]+|\d+)")


def warp_cycles(instructions: list, dram_cycles: float) -> float:
    """Cycles one warp takes through ``instructions`` in order, as ptxas scheduled them, until its
    last result is in. A loop is replayed as its trips in a row (``program``): a scoreboard set in
    one trip and waited on in the next is then carried across, as on the hardware.

    A scoreboard counts the results pending on it: waiting on it waits for all of them, and
    ``DEPBAR.LE SBn, k`` for all but the ``k`` latest. Asynchronous copies to shared memory
    (``LDGSTS``, what ``tl.range(..., num_stages=)`` pipelines loads into) land as one group per
    ``LDGDEPBAR``, which is what such a ``DEPBAR`` counts.
    """
    pending = [[] for _ in range(6)]  # completion times on each scoreboard, oldest first
    copies = 0.0  # when the asynchronous copies issued since the last LDGDEPBAR have landed
    clock = 0.0
    for ins in instructions:
        if ins.opcode == "NOP":
            continue
        name = family(ins.opcode)
        issue = max([clock] + [max(pending[b], default=0.0) for b in ins.waits])
        for b in ins.waits:
            pending[b] = []
        if name == "DEPBAR":
            board, keep = _DEPBAR.search(ins.operands).groups()
            keep = int(keep, 0)
            older = pending[int(board)][: max(0, len(pending[int(board)]) - keep)]
            issue = max([issue] + older)
            del pending[int(board)][: len(older)]
        if name == "LDGSTS":
            copies = max(copies, issue + dram_cycles)
        if ins.sets is not None:
            if name == "LDGDEPBAR":
                done, copies = max(copies, issue), 0.0
            else:
                latency = dram_cycles if _is_global_load(ins.opcode) else LATENCY.get(name)
                done = issue + (latency or DEFAULT_LATENCY)
            pending[ins.sets].append(done)
        if ins.frees is not None:
            pending[ins.frees].append(issue + SOURCE_READ_CYCLES)
        clock = issue + max(1, ins.stall) + (BARRIER_CYCLES if name == "BAR" else 0)
    return max([clock, copies] + [t for board in pending for t in board])


def program(instructions: list, loop, trips: int) -> list:
    """The instructions one program runs in order: the loop ``(first, last)`` ``trips`` times."""
    if loop is None:
        return list(instructions)
    first, last = loop
    return instructions[:first] + instructions[first : last + 1] * trips + instructions[last + 1 :]


def global_loads(instructions: list) -> int:
    """Global load instructions a warp issues in ``instructions``."""
    return sum(_is_global_load(ins.opcode) or family(ins.opcode) == "LDGSTS" for ins in instructions)
