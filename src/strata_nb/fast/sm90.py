"""The kernels as the H200 would build them, without a GPU: sm_90 PTX from Numba, then
ptxas's account of what each kernel holds per thread and per thread block.

The simulator runs a kernel as Python, so it can neither reject code the GPU compiler
refuses nor say what the kernel costs the SM. Three numbers from ptxas do:

    registers      per thread. An SM has 65,536, so a kernel of 96 registers keeps at
                   most 21 of the SM's 64 warps resident (matvec's, for example): fewer
                   loads in flight to hide the memory's latency.
    shared bytes   static shared memory per thread block. An SM has 228 KiB, less 1 KiB
                   per block: a 45 KiB block (the step attention's tiles) fits 5 times.
    spill bytes    registers ptxas could not keep, stored to local memory (DRAM behind
                   the L1) and loaded back: a kernel that spills is a performance bug.

A fourth check needs no ptxas: a kernel marked for dependent launches
(fast/dependent_launch.py) must wait before it touches memory another kernel writes, and
its PTX says whether it does (`dependent_order`).

The launches are recorded under the simulator (`record_launches`: kernel and argument
types), and a process without the simulator compiles each (`compile_recorded`), so the
module constants take their GPU values. The test suite's sm_90 check does this for every
kernel the suite ran; `ptx_usage` reads each kernel's registers, shared memory and spills.
ptxas comes with the nvidia-cuda-nvcc-cu12 wheel (the dev extra), or a CUDA toolkit.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REGISTERS_PER_SM = 65536
WARPS_PER_SM = 64
REGISTER_UNIT = 256  # registers are given to a warp in units of 256


def type_name(a) -> str:
    """A kernel argument's Numba type, as a signature spells it."""
    import numpy as np

    a = getattr(a, "_ary", a)  # a simulator device array wraps a NumPy array
    if isinstance(a, np.ndarray):
        dims = [":"] * a.ndim
        if a.flags.c_contiguous and a.ndim:
            dims[-1] = "::1"
        return f"{a.dtype.name}[{', '.join(dims)}]"
    if isinstance(a, (bool, np.bool_)):
        return "boolean"
    if isinstance(a, np.generic):
        return a.dtype.name
    return {int: "int64", float: "float64"}[type(a)]


def closure_cells(fn) -> dict:
    """fn's closure by name, with the closures of the device functions it calls that a
    factory made, this one or another (a factory argument used only inside one of them,
    or passed on to another factory under the same name, still counts)."""
    cells = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        cells.setdefault(name, cell)
        inner = getattr(cell.cell_contents, "py_func", None)
        if inner is not None and ".<locals>." in inner.__qualname__:
            for name_, cell_ in closure_cells(inner).items():
                cells.setdefault(name_, cell_)
    return cells


def variant(fn) -> str:
    """Which of a factory's kernels fn is: the factory's arguments it was made from
    (device functions by name, constants by value), read from its closure. Values the
    factory derives may differ under the simulator (a split's lanes, a tile's rows); its
    arguments do not, so the compiling process finds the very kernel that was launched.
    A kernel made on demand (not at its module's import) names its variant itself, in
    `made_from`, and its module remakes it from that (`remake`)."""
    if isinstance(getattr(fn, "made_from", None), str):
        return fn.made_from
    factory_name = fn.__qualname__.split(".<locals>")[0] if ".<locals>" in fn.__qualname__ else None
    factory = getattr(sys.modules[fn.__module__], factory_name, None) if factory_name else None
    if factory is None:
        return ""
    params = factory.__code__.co_varnames[:factory.__code__.co_argcount]
    cells = closure_cells(fn)

    def describe(obj):
        inner = getattr(obj, "py_func", None) or getattr(obj, "fn", None) or obj
        if callable(inner) and hasattr(inner, "__qualname__"):  # a device function a factory made: what from
            made = variant(inner) if ".<locals>." in inner.__qualname__ else ""
            return f"{inner.__qualname__}({made})" if made else inner.__qualname__
        if isinstance(obj, (bool, int, float, str)):
            return repr(obj)
        return type(obj).__name__

    return ",".join(f"{name}={describe(cells[name].cell_contents)}" for name in params if name in cells)


def made_by_the_product(fn) -> bool:
    """Is every device function fn was made from the package's? A kernel a test makes from
    a fault of its own (a store that drops the host copy) is the test's, not compiled here."""
    for cell in closure_cells(fn).values():
        inner = getattr(cell.cell_contents, "py_func", None) or getattr(cell.cell_contents, "fn", None)
        if callable(inner) and not getattr(inner, "__module__", "").startswith("strata_nb."):
            return False
    return True


def record_launches(launches: dict) -> None:
    """Under the simulator: from now on every launch of a strata_nb kernel adds its
    signature to launches[(module, qualname, first line, variant)]."""
    from numba.cuda.simulator import kernel as sim

    call = sim.FakeCUDAKernel.__call__

    def recording_call(self, *args):
        fn = self.fn
        # the product's kernels only: importing a test module in the compiling process would
        # import the tests' conftest, whose simulator hooks would then replace later kernels
        if not self._device and not sim._kernel_context and fn.__module__.startswith("strata_nb.") \
                and made_by_the_product(fn):
            key = (fn.__module__, fn.__qualname__, fn.__code__.co_firstlineno, variant(fn))
            try:
                launches.setdefault(key, set()).add(f"void({', '.join(type_name(a) for a in args)})")
            except KeyError:
                pass  # an argument type we do not map: that launch is not compiled
        return call(self, *args)

    sim.FakeCUDAKernel.__call__ = recording_call


def ptxas() -> str | None:
    """The ptxas binary: the nvidia-cuda-nvcc wheel's (the same release as the libNVVM
    Numba compiles with), else one on PATH."""
    try:
        import nvidia.cuda_nvcc

        for root in nvidia.cuda_nvcc.__path__:
            path = Path(root) / "bin" / "ptxas"
            if path.is_file():
                return str(path)
    except ImportError:
        pass
    return shutil.which("ptxas")


def nvdisasm() -> str | None:
    """The nvdisasm binary: the nvidia-cuda-nvdisasm wheel's, else one on PATH."""
    try:
        import nvidia

        for root in nvidia.__path__:
            for path in sorted(Path(root).glob("*/bin/nvdisasm")):
                return str(path)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


def ptx_usage(ptx: str, binary: str, disassembler: str | None = None) -> dict:
    """{registers, shared, spill_stores, spill_loads, stack} of the one kernel in `ptx`;
    with `disassembler` (nvdisasm) also `load_run`, the longest run of loads in its SASS."""
    with tempfile.TemporaryDirectory() as tmp:
        path, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        path.write_text(ptx)
        run = subprocess.run([binary, "-arch=sm_90", "-v", str(path), "-o", str(cubin) if disassembler else os.devnull],
                             capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise RuntimeError(f"ptxas failed: {run.stderr[-500:]}")
        usage = {**parse_ptxas(run.stderr), "divides": wide_divides(ptx), "grid_y": "%ctaid.y" in ptx}
        if disassembler:
            sass = subprocess.run([disassembler, "-c", str(cubin)], capture_output=True, text=True, timeout=300)
            usage["load_run"] = max(load_runs(sass.stdout), default=0)
    return usage


# --8<-- [start:load_runs]
# An instruction of nvdisasm's listing: its address comment, a predicate maybe, the opcode
_SASS_OP = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
# After these a run of loads is over: arithmetic that may use a loaded value (floats,
# halves, conversions, the special-function unit), shared memory, a barrier, a branch, a
# shuffle, a store or atomic. Integer address arithmetic may come between two loads.
_ENDS_A_RUN = re.compile(r"^(F[A-Z0-9]*|H[A-Z0-9]+|I2F|MUFU|LDS|STS|BAR|BRA|BSSY|SHFL|STG|ST|ATOM\w*|RED|MEMBAR|EXIT)$")


def load_runs(sass: str) -> list[int]:
    """The runs of global loads (LDG, and LD, a load from a pointer that may be global) in
    a kernel's SASS, in program order. A thread waits on memory only where an instruction
    uses a load's result, so the loads of one run are in flight together: a kernel whose
    round of loads is one run waits once a round, where one whose loads sit between the
    arithmetic that uses them waits once a load. A listing holds both sides of every
    branch, so this is an account of the code, not of one thread's path."""
    runs, n = [], 0
    for m in _SASS_OP.finditer(sass):
        op = m.group(1)
        if op in ("LDG", "LD"):
            n += 1
        elif n and _ENDS_A_RUN.match(op):
            runs.append(n)
            n = 0
    return runs + [n] if n else runs
# --8<-- [end:load_runs]


def wide_divides(ptx: str) -> int:
    """64-bit integer divisions and remainders in a kernel's PTX. Numba computes indices
    in 64 bits, so `e // n` or `e % n` by a value known only at run time (and the trip
    count of `range(a, b, step)` with a runtime step) becomes one of these, which the GPU
    has no instruction for: ptxas expands each into a routine of dozens of instructions.
    A division by a constant compiles to a multiply and shifts, and leaves none."""
    return len(re.findall(r"\b(?:div|rem)\.[su]64\b", ptx))


# A memory instruction of a kernel's PTX, and its state space when it names one
_MEMORY_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld|st|atom|red|prefetch|prefetchu|cp\.async)((?:\.\w+)*)", re.M)
_OWN_SPACES = {"param", "shared", "local", "const"}  # the kernel's own: no other kernel writes them


def dependent_order(ptx: str, reads_early: bool = False) -> str:
    """'' when a dependent kernel's PTX waits before it touches memory another kernel may
    write (fast/dependent_launch.py): griddepcontrol.wait before the first load, store or
    atomic of global or generic memory, and launch_dependents, if any, after the wait.
    reads_early: loads may come first ("Reading before the wait"), stores and atomics not.
    Else what is wrong. The check reads the PTX in order up to the first wait; it holds for
    kernels whose wait is their first statement, as the rule asks, where no branch comes
    before it (a kernel that reads early may wait in two branches: the first is checked)."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return "its PTX has no griddepcontrol.wait"
    start = ptx.find("griddepcontrol.launch_dependents")
    if 0 <= start < wait:
        return "it lets the next kernel start before it waits"
    for m in _MEMORY_OP.finditer(ptx, 0, wait):
        spaces = set(m.group(2).split(".")[1:])
        if reads_early and m.group(1) in ("ld", "prefetch", "prefetchu"):
            continue
        if not spaces & _OWN_SPACES:
            return f"it touches memory before it waits: {m.group(0).strip()}"
    return ""


def lets_next_start_late(ptx: str) -> bool:
    """Whether a kernel's PTX lets the next kernel launch (launch_dependents) only after its
    first store to global memory: the step attention's rule, which lets it launch once a
    split's record is written (fast/dependent_launch.py), not at its start."""
    start = ptx.find("griddepcontrol.launch_dependents")
    store = re.search(r"\bst\.global", ptx)
    return start >= 0 and store is not None and store.start() < start


# --8<-- [start:ptxas_report]
def parse_ptxas(report: str) -> dict:
    """ptxas -v's lines for one kernel -> {registers, shared, spill_stores, spill_loads, stack}."""
    def number(pattern):
        m = re.search(pattern, report)
        return int(m.group(1)) if m else 0

    return {"registers": number(r"Used (\d+) registers"), "shared": number(r"(\d+) bytes smem"),
            "spill_stores": number(r"(\d+) bytes spill stores"), "spill_loads": number(r"(\d+) bytes spill loads"),
            "stack": number(r"(\d+) bytes stack frame")}


def warps_by_registers(registers: int) -> int:
    """Warps an SM can keep resident at `registers` per thread (the register file alone)."""
    per_warp = -(-max(registers, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    return min(WARPS_PER_SM, REGISTERS_PER_SM // per_warp)
# --8<-- [end:ptxas_report]


# Runs in a process without the simulator: finds each recorded kernel among the dispatchers
# its module holds (kernels made by a factory share a qualname and line: their closures
# tell them apart), compiles it for sm_90 and, with ptxas, measures it.
_CHILD = textwrap.dedent('''
    import importlib, json, sys, types
    from numba import cuda
    import numba.cuda.dispatcher
    from numba.cuda.dispatcher import CUDADispatcher
    from strata_nb.fast.sm90 import dependent_order, lets_next_start_late, ptx_usage, variant
    # compiling a kernel that calls device functions asks for the current device; there is
    # none here, so answer for the target we compile for
    numba.cuda.dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    todo, binary, disassembler = json.load(sys.stdin)
    def dispatchers(obj, depth=0):
        if isinstance(obj, CUDADispatcher):
            yield obj
        elif isinstance(obj, dict) and depth < 3:
            for v in obj.values():
                yield from dispatchers(v, depth + 1)
    failures, rows = [], []
    for module, qualname, line, made_from, sigs in todo:
        mod = importlib.import_module(module)
        found = [d for v in vars(mod).values() for d in dispatchers(v)
                 if d.py_func.__qualname__ == qualname and d.py_func.__code__.co_firstlineno == line
                 and variant(d.py_func) == made_from]
        if not found and hasattr(mod, "remake"):  # made on demand: remade from its variant
            found = [d for d in [mod.remake(made_from)] if d.py_func.__qualname__ == qualname]
        if not found:
            failures.append(f"{module}.{qualname} (line {line}): kernel not found at import")
            continue
        kernel = found[0]  # the same factory arguments: the same kernel, however often it was made
        for sig in sigs:
            try:
                # launch bounds, where a kernel sets them, cap its registers as on the GPU
                ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0),
                                          launch_bounds=kernel.targetoptions.get("launch_bounds"))
            except Exception as err:
                failures.append(f"{module}.{qualname}{sig}: {type(err).__name__}: {str(err)[:300]}")
                continue
            wrong = dependent_order(ptx, getattr(kernel, "_strata_reads_early", False))
            if getattr(kernel, "_strata_waits", False) and wrong:  # fast/dependent_launch.py
                failures.append(f"{module}.{qualname}{sig}: marked waits_for_inputs, but {wrong}")
            if binary:
                rows.append(dict(kernel=qualname.split(".")[-1], module=module, made_from=made_from, sig=sig,
                                 late_start=lets_next_start_late(ptx), waits="griddepcontrol.wait" in ptx,
                                 lets_next="griddepcontrol.launch_dependents" in ptx,
                                 **ptx_usage(ptx, binary, disassembler)))
    print(json.dumps([failures, rows]))
''')


def compile_recorded(launches: dict, binary: str | None, workers: int = 2,
                     disassembler: str | None = None) -> tuple[list[str], list[dict]]:
    """(failures, rows): each recorded kernel compiled for sm_90 in a process without the
    simulator; a row per (kernel, signature) with ptxas's numbers when `binary` is set,
    and the longest run of loads in its SASS (`load_run`) when `disassembler` is too.
    Compiling is CPU-bound and a process compiles one kernel at a time, so `workers`
    processes take a share each."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    todo = [[m, q, line, made_from, sorted(sigs)] for (m, q, line, made_from), sigs in launches.items()]
    shares = [share for share in (todo[i::workers] for i in range(workers)) if share]

    def compile_share(share):
        return subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps([share, binary, disassembler]),
                              capture_output=True, text=True, env=env, timeout=1500)

    with ThreadPoolExecutor(max(1, len(shares))) as pool:
        runs = list(pool.map(compile_share, shares))
    failures, rows = [], []
    for run in runs:
        if run.returncode != 0:
            raise RuntimeError(run.stderr[-3000:])
        share_failures, share_rows = json.loads(run.stdout.strip().splitlines()[-1])
        failures += share_failures
        rows += share_rows
    return failures, rows
