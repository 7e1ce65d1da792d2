"""Every kernel the simulator ran in this session compiles to PTX for sm_90 (Hopper), and
none spills registers.

The simulator executes kernels as Python, so it accepts things the GPU compiler rejects
(a NumPy call inside a kernel, a type that does not unify). conftest.py records each
simulated launch's kernel and argument types; this file is marked `last`, so it runs
after every other test (under pytest-xdist, after every other worker's: conftest's
launches_so_far), and a child process without the simulator compiles each kernel
with `cuda.compile_ptx(..., cc=(9, 0))`, then asks ptxas what it uses (fast/sm90.py). A
kernel whose registers spill to local memory fails: that is a slowdown the simulator cannot
show. So does a kernel marked for dependent launches (fast/dependent_launch.py) whose PTX
touches global memory before its griddepcontrol.wait. No GPU needed, only NVRTC/libNVVM and ptxas (the nvidia-cuda-nvrtc-cu12 and
nvidia-cuda-nvcc-cu12 wheels)."""
import os

import pytest

from conftest import ON_GPU, launches_so_far
from strata_nb.fast.gguf_fetch import WHOLE
from strata_nb.fast.sm90 import (compile_recorded, load_runs, nvdisasm, parse_ptxas, ptxas, variant,
                                warps_by_registers, wide_divides)

pytestmark = pytest.mark.last  # after every other test: it compiles what they ran (conftest.py)
# The checks that compile every kernel the session ran take minutes of CPU: the full tier
# (STRATA_NB_TESTS=all, as CI runs) has them, the default tier the rest of this file.
COMPILES_ALL = pytest.mark.slow

# ptxas -v's report of a kernel that spills, as ptxas 12 words it
SPILLING = """ptxas info    : Compiling entry function 'k' for 'sm_90'
ptxas info    : Function properties for k
    40 bytes stack frame, 36 bytes spill stores, 44 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 45508 bytes smem, 472 bytes cmem[0]"""


def test_the_ptxas_report_is_read():
    assert parse_ptxas(SPILLING) == {"registers": 255, "shared": 45508, "spill_stores": 36, "spill_loads": 44,
                                     "stack": 40}


# nvdisasm's listing, cut down: two loads, their addresses worked out between them, then
# the arithmetic that uses them; a branch; one more load, a conversion, a last load
LISTING = """
        /*0100*/                   LDG.E R4, desc[UR4][R2.64] ;
        /*0110*/                   IMAD.WIDE R6, R0, 0x4, R8 ;
        /*0120*/               @!P0 LDG.E.U16 R5, desc[UR4][R6.64+0x2] ;
        /*0130*/                   FFMA R10, R4, R5, R10 ;
        /*0140*/               @P1 BRA `(.L_x_1) ;
        /*0150*/                   LD.E R11, desc[UR4][R12.64] ;
        /*0160*/                   I2F R11, R11 ;
        /*0170*/                   LDG.E.128 R16, desc[UR4][R14.64] ;
"""


def test_the_runs_of_loads_are_read_from_the_sass():
    """Integer address arithmetic does not end a run of loads; arithmetic on a loaded
    value, a branch or a conversion does."""
    assert load_runs(LISTING) == [2, 1, 1]


def test_warps_the_register_file_holds():
    """65,536 registers an SM, given to a warp 256 at a time."""
    assert warps_by_registers(32) == 64
    assert warps_by_registers(96) == 21  # 3,072 a warp
    assert warps_by_registers(100) == 19  # 3,200 rounds up to 3,328
    assert warps_by_registers(255) == 8


def test_a_factory_kernel_is_named_by_what_it_was_made_from():
    """Kernels made by one factory share a name and a line: the arguments they were made
    from tell them apart, the same under the simulator as in the compiling process."""
    import strata_nb.fast.matvec_fused as mv

    normed = mv.MATVEC_KERNELS["Q8_0", "normed", "store", 1]
    gated = mv.MATVEC_KERNELS["Q4_1", "gated", "add", mv.ROW_GROUP]
    appending = mv.MATVEC_KERNELS["Q4_1", "normed", "rope_append", 1]
    assert variant(normed.py_func) == ("part=part_q8_0,nibbles=False,fetch_x=fetch_normed,make_x=x_normed,"
                                       f"store_y=y_store,normed=True,x_rows=1,rows={mv.ROWS},rope=False,"
                                       "append_pair=no_append")
    assert variant(gated.py_func) != variant(normed.py_func)
    assert ",rope=True,append_pair=make_append_pair.<locals>.append_pair(" in variant(appending.py_func)
    # a device function a factory made is named by what it was made from in turn
    from strata_nb.kernels.dense.matvec import MATVEC_KERNELS

    assert variant(MATVEC_KERNELS["Q4_1"].py_func) == \
        "row_sums=make_row_sums.<locals>.row_sums(part=part_q4_1,nibbles=True)"


def make_probe_kernel(read, n):
    """A factory whose `read` only an inner device function uses: without looking into
    that function's closure, two of its kernels would look alike and the compile could
    take one for the other."""
    from numba import cuda

    @cuda.jit(device=True)
    def helper(x):
        return read(x) + n

    @cuda.jit
    def kernel(x):
        x[0] = helper(x[0])
    return kernel


def test_a_factory_argument_used_only_by_an_inner_device_function_still_names_the_kernel():
    a, b = make_probe_kernel(abs, 1).py_func, make_probe_kernel(round, 1).py_func
    assert variant(a) == "read=abs,n=1" and variant(b) == "read=round,n=1"


def test_wide_divides_are_counted_in_ptx():
    ptx = """
    div.s64 %rd5, %rd3, %rd4;
    rem.u64 %rd6, %rd3, %rd4;
    div.rn.f32 %f1, %f2, %f3;
    div.s32 %r1, %r2, %r3;
    """
    assert wide_divides(ptx) == 2  # the float and the 32-bit divisions are single instructions


@pytest.fixture(scope="module")
def compiled():
    """(failures, rows): every kernel the simulator ran in this session, compiled for sm_90
    once for the checks below, with ptxas's numbers and the longest run of loads in its
    SASS (nvdisasm). Under pytest-xdist the other workers' kernels are compiled as they
    come, one process at a time while they still run tests, all cores at the end."""
    if ON_GPU:
        pytest.skip("on a GPU the kernels are compiled for real")
    try:
        import nvidia.cuda_nvrtc  # noqa: F401  (the wheel that carries NVRTC)
    except ImportError:
        pytest.fail("NVRTC is missing: pip install -e '.[dev]' brings nvidia-cuda-nvrtc-cu12")
    binary, disassembler = ptxas(), nvdisasm()
    assert binary, "ptxas is missing: pip install -e '.[dev]' brings nvidia-cuda-nvcc-cu12"
    assert disassembler, "nvdisasm is missing: pip install -e '.[dev]' brings nvidia-cuda-nvdisasm"
    failures, rows, done = [], [], set()
    for launches, final in launches_so_far():
        new = {key: fresh for key, sigs in launches.items() if (fresh := {s for s in sigs if (key, s) not in done})}
        if new:
            done |= {(key, sig) for key, sigs in new.items() for sig in sigs}
            batch = compile_recorded(new, binary, workers=(os.cpu_count() or 2) if final else 1,
                                     disassembler=disassembler)
            failures += batch[0]
            rows += batch[1]
    if not done:
        pytest.skip("no kernel ran under the simulator in this session (run it with the kernel tests)")
    return failures, rows


@COMPILES_ALL
def test_every_simulated_kernel_compiles_for_sm90_without_spills(compiled):
    failures, rows = compiled
    assert not failures, "\n".join(failures)
    assert rows, "ptxas measured no kernel"
    spills = [f"{r['module']}.{r['kernel']}{r['sig']}: {r['spill_stores']} bytes spilled, {r['spill_loads']} reloaded"
              for r in rows if r["spill_stores"] or r["spill_loads"]]
    assert not spills, "\n".join(spills)
    # The decode step's two hot kernels divide only by constants: every index they work
    # out, and every loop's trip count, is a multiply and shifts (sm90.wide_divides).
    hot = [f"{r['kernel']}({r['made_from']}): {r['divides']} 64-bit divisions" for r in rows
           if r["kernel"] in ("attention_step_kernel", "matvec_kernel") and r["divides"]]
    assert not hot, "\n".join(hot)
    # A decode step's matvec (one row of x) has no row groups: its r0 is the constant 0,
    # not blockIdx.y * 1, so its indexing folds.
    grouped = [f"matvec_kernel({r['made_from']})" for r in rows
               if r["kernel"] == "matvec_kernel" and ",x_rows=1," in r["made_from"] and r["grid_y"]]
    assert not grouped, "a 1-row matvec reads blockIdx.y:\n" + "\n".join(grouped)
    assert any(r["grid_y"] for r in rows if r["kernel"] == "matvec_kernel"), "no row-group matvec was compiled"


# The kernels a decode step waits on most, and the fewest loads their longest run must
# hold (gpu/sm90.load_runs): a trip's or a round's loads go out together, with no branch or
# arithmetic between them. Before they did, the same
# kernels' longest runs were 11 (normed matvec), 4 (gated), 8 (plain), 8 (experts) and
# 16 (the step attention's unpack).
# Each bound lies between the two: now 28, 20, 12, 12, 18 and 32 (ptxas 12.9). The experts'
# kernels are checked as built for a cache that never misses. expert_down reads before it
# waits (fast/dependent_launch.py): its four rows' 12 weight loads go out before the wait,
# and h's 8 values after it, two runs where the kernel that waited first had one of 20.
# expert_gate_up's bound is between its warp-a-row kernel's 14 (now the plain
# expert_gate_up_kernel, kernels/experts/) and the fast kernel's 18, which fetches its four
# rows' parts before it decodes any (with the fetches and decodes alternating, as `part`
# does row by row, its longest run was 9). The plain kernels are not held to these bounds,
# nor are the fast kernels of the types gguf_fetch.py reads through the plain part whole
# (WHOLE: Q5_0, Q5_1, the K-quants), whose loads and arithmetic still alternate (a Q4_K
# matvec's longest run is 8 where x_plain wants 10): not split yet, as the load page says.
WHOLE_PARTS = tuple(f"part=part_{qtype.lower()}," for qtype in WHOLE)
GROUPED_LOADS = [("matvec_kernel", "x_normed", 20), ("matvec_kernel", "x_gated", 12),
                 ("matvec_kernel", "x_plain", 10), ("expert_down_kernel", "stages=False", 12),
                 ("expert_gate_up_kernel", "stages=False", 16), ("attention_step_kernel", "read_float_column", 24)]


@COMPILES_ALL
def test_a_round_s_loads_go_out_together(compiled):
    failures, rows = compiled
    rows = [r for r in rows if not any(part in r["made_from"] for part in WHOLE_PARTS)]
    checked = [r for r in rows for name, needle, _ in GROUPED_LOADS if r["kernel"] == name and needle in r["made_from"]]
    if not checked:
        pytest.skip("none of the kernels checked here ran in this session")
    short = [f"{r['kernel']}({r['made_from']}){r['sig']}: its longest run of loads is {r['load_run']}, want {least}"
             for r in rows for name, needle, least in GROUPED_LOADS
             if r["kernel"] == name and needle in r["made_from"] and r["load_run"] < least]
    assert not short, "\n".join(short)


@COMPILES_ALL
def test_the_step_attention_lets_the_next_kernel_start_late(compiled):
    """The step attention lets the next kernel launch once a split's record is written,
    not at its start (docs: "When the next kernel may start"): in its PTX, launch_dependents
    comes after a store to global memory."""
    failures, rows = compiled
    steps = [r for r in rows if r["kernel"] == "attention_step_kernel"]
    if not steps:
        pytest.skip("the step attention did not run in this session")
    early = [f"attention_step_kernel({r['made_from']}){r['sig']}" for r in steps if not r["late_start"]]
    assert not early, "lets the next kernel start before its first store:\n" + "\n".join(early)


@COMPILES_ALL
def test_the_kernels_that_end_in_one_block_let_nothing_start_early(compiled):
    """The fast router (fast/route.py, one thread block a token) waits for the o matvec but
    lets the experts' kernel launch only at its end; select_blocks, whose last thread block
    writes the list, is launched plain (fast/dependent_launch.py): neither has
    launch_dependents in its PTX."""
    failures, rows = compiled
    found = {name: [r for r in rows if r["kernel"] == name and r["module"] != "strata_nb.kernels.experts.route"]
             for name in ("route_kernel", "select_blocks_kernel")}
    if not any(found.values()):
        pytest.skip("neither ran in this session")
    assert all(r["waits"] and not r["lets_next"] for r in found["route_kernel"]), found["route_kernel"]
    assert all(not r["waits"] and not r["lets_next"] for r in found["select_blocks_kernel"])


@COMPILES_ALL
def test_each_step_attention_build_fits_its_blocks_an_sm(compiled):
    """The step attention's two builds (attention_step.py): the one for three thread blocks
    an SM keeps to registers that three blocks of 256 threads can have (the compiler does it
    by itself, with no launch bounds to make it), the one for two uses more than that, as
    its launch bounds let it. Shared memory holds three of either."""
    failures, rows = compiled
    steps = [r for r in rows if r["kernel"] == "attention_step_kernel"]
    builds = {r["made_from"].rsplit("per_sm=", 1)[-1] for r in steps}
    if builds != {"2", "3"}:
        pytest.skip(f"both builds did not run in this session (ran: {sorted(builds)})")
    warps = 256 // 32
    wrong = [f"attention_step_kernel({r['made_from']}){r['sig']}: {r['registers']} registers"
             for r in steps for per_sm in [int(r["made_from"].rsplit("per_sm=", 1)[-1])]
             if warps_by_registers(r["registers"]) // warps != per_sm or 3 * r["shared"] > 227 * 1024]
    assert not wrong, "\n".join(wrong)

