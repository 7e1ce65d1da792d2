"""Dependent launches (fast/dependent_launch.py): a marked kernel waits for the kernels
before it before it touches memory, on every path, so launching it while the one before
runs changes no bit.

Without a GPU: the wait compiles to `griddepcontrol.wait` for sm_90 and to nothing for
sm_80; `dependent_order` reads a kernel's PTX and finds a load before the wait (here on
PTX text and on a kernel compiled to show it). test_ptx_sm90.py applies the same check
to every marked kernel the suite ran. On a GPU (STRATA_NB_GPU=1): decode steps launched
as dependent, one by one and replayed from a graph, give the bits of plain launches.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import ON_GPU
from strata_nb.fast.backend import FastCudaBackend
from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.fast.advance_step import advance_step_kernel
from strata_nb.fast.argmax import argmax_kernel
from strata_nb.fast.attention_step import STEP_KERNELS
from strata_nb.fast.block_scores import BLOCK_SCORES_KERNELS
from strata_nb.fast.embed import EMBED_KERNELS, embed_rows_kernel
from strata_nb.fast.expert_down import EXPERT_DOWN_KERNELS
from strata_nb.fast.expert_gate_up import EXPERT_GATE_UP_KERNELS
from strata_nb.fast.kv_append import key_sketch_kernel, kv_append_k8v4_kernel
from strata_nb.fast.map_ring import map_ring_kernel
from strata_nb.fast.matvec_fused import MATVEC_KERNELS
from strata_nb.fast.route import ROUTE_KERNELS
from strata_nb.fast.select_blocks import select_blocks_kernel
from strata_nb.fast.dependent_launch import dependent_launches, enabled, is_dependent
from strata_nb.fast.sm90 import dependent_order

# A decode step's kernels that wait for their inputs (a verify window runs the same), and
# the one it launches plain
STEP_S_KERNELS = [*MATVEC_KERNELS.values(), *STEP_KERNELS.values(), *EXPERT_DOWN_KERNELS.values(),
                  *EXPERT_GATE_UP_KERNELS.values(), *ROUTE_KERNELS.values(),
                  *BLOCK_SCORES_KERNELS.values(), key_sketch_kernel, kv_append_k8v4_kernel, argmax_kernel,
                  map_ring_kernel, *EMBED_KERNELS.values(), embed_rows_kernel, advance_step_kernel]
PLAIN_KERNELS = [select_blocks_kernel]

GOOD = """
.visible .entry k(.param .u64 k_param_0)
{
\tld.param.u64 \t%rd1, [k_param_0];
\tgriddepcontrol.wait;
\tgriddepcontrol.launch_dependents;
\tcvta.to.global.u64 \t%rd2, %rd1;
\tld.global.f32 \t%f1, [%rd2];
\tst.shared.f32 \t[%r1], %f1;
}
"""


def test_dependent_order_reads_the_ptx():
    assert dependent_order(GOOD) == ""
    # shared, local and parameter memory are the kernel's own: touching them first is fine
    assert dependent_order(GOOD.replace("\tgriddepcontrol.wait;", "\tst.shared.u32 \t[%r2], 0;\n"
                                        "\t@%p1 ld.local.f32 \t%f2, [%rd9];\n\tgriddepcontrol.wait;")) == ""
    early_load = GOOD.replace("\tgriddepcontrol.wait;", "\tld.global.nc.u32 \t%r3, [%rd1];\n\tgriddepcontrol.wait;")
    assert "touches memory before it waits: ld.global.nc.u32" in dependent_order(early_load)
    generic = GOOD.replace("\tgriddepcontrol.wait;", "\t@!%p2 st.u32 \t[%rd1], %r3;\n\tgriddepcontrol.wait;")
    assert "touches memory before it waits: @!%p2 st.u32" in dependent_order(generic)  # generic: maybe global
    atomic = GOOD.replace("\tgriddepcontrol.wait;", "\tatom.global.add.u32 \t%r4, [%rd1], 1;\n\tgriddepcontrol.wait;")
    assert "atom.global.add.u32" in dependent_order(atomic)
    assert "before it waits" in dependent_order(GOOD.replace("\tgriddepcontrol.wait;\n", "").replace(
        "\tgriddepcontrol.launch_dependents;", "\tgriddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;"))
    assert dependent_order(GOOD.replace("\tgriddepcontrol.wait;\n", "")) == "its PTX has no griddepcontrol.wait"
    # a kernel that reads early (expert_down) may load before it waits, never store
    assert dependent_order(early_load, reads_early=True) == ""
    assert "st.u32" in dependent_order(generic, reads_early=True)
    assert "atom.global.add.u32" in dependent_order(atomic, reads_early=True)


# Compiled in a process without the simulator: the instructions exist on sm_90 only, and
# the order check sees a kernel that loads before it waits.
_CHILD = textwrap.dedent('''
    import json
    from numba import cuda
    from strata_nb.fast.dependent_launch import let_next_start, wait_for_inputs
    from strata_nb.fast.sm90 import dependent_order

    def waits_first(x, y):
        wait_for_inputs()
        let_next_start()
        i = cuda.grid(1)
        if i < x.size:
            y[i] = x[i] * 2

    def reads_early(x, y):
        v = x[0]
        wait_for_inputs()
        let_next_start()
        y[0] = v

    sig = "void(float32[::1], float32[::1])"
    out = {}
    for name, fn in (("waits_first", waits_first), ("reads_early", reads_early)):
        for cc in ((8, 0), (9, 0)):
            ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
            out[f"{name} sm_{cc[0]}{cc[1]}"] = [ptx.count("griddepcontrol."), dependent_order(ptx)]
    print(json.dumps(out))
''')


def test_the_wait_is_an_instruction_on_hopper_only():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["waits_first sm_90"] == [2, ""]
    assert got["waits_first sm_80"] == [0, "its PTX has no griddepcontrol.wait"]
    count, problem = got["reads_early sm_90"]
    assert count == 2 and problem.startswith("it touches memory before it waits: ld.global"), problem


def test_the_step_s_kernels_are_marked_and_launch_plain_when_turned_off():
    """The step's kernels are marked but select_blocks; none is dependent while turned
    off, and under the simulator the backend says it cannot be on."""
    kernels = STEP_S_KERNELS
    assert all(getattr(k, "_strata_waits", False) for k in kernels)
    assert not any(is_dependent(k) for k in PLAIN_KERNELS)  # select_blocks: fast/dependent_launch.py
    with dependent_launches(False):
        assert not enabled() and not any(is_dependent(k) for k in kernels)
        assert FastCudaBackend().dependent_launches() == "off"
    with dependent_launches(True):
        assert all(is_dependent(k) for k in kernels)
        if not ON_GPU:
            assert FastCudaBackend().dependent_launches().startswith("unavailable: the simulator")
    assert NumpyBackend().dependent_launches() == "no GPU"


@pytest.mark.skipif(not ON_GPU, reason="dependent launches need a GPU (STRATA_NB_GPU=1)")
@pytest.mark.parametrize("kv,moe", [("fp16", False), ("k8v4", False), ("fp16", True)])
def test_dependent_launches_give_the_bits_of_plain_ones(tmp_path_factory, kv, moe):
    """On a GPU, random weights of the default model's shapes (its grids, not a tiny
    model's): prefill, then steps launched one by one and steps replayed from a graph,
    with dependent launches and without: the same logits, bit for bit, and the dependent
    engine's launches were dependent. moe: the same weights split into 8 experts, each
    token routed to 2 by a random router (the router, then the experts' kernels)."""
    from strata_nb.engine.engine import Engine
    from strata_nb.fast import fast_launch
    from strata_nb.model.gguf_file import GGUFModel
    from strata_nb.model.synthetic import write_default_shapes_gguf
    from strata_nb.settings import Settings

    default_model_path = str(write_default_shapes_gguf(tmp_path_factory.mktemp("shapes") / "shapes.gguf", 512))
    if moe:
        from strata_nb.model.moefy import moefy
        default_model_path = str(moefy(default_model_path, default_model_path.replace(".gguf", "-moe.gguf"), "split", 8,
                                       used=2, router="random", seed=1))

    prompt = [1, 504, 3458, 282, 1029, 30, 216, 12, 9224] * 5

    def decode(on: bool):
        with dependent_launches(on):
            eng = Engine(Settings(model=default_model_path, kv=kv, max_context=256, device="cuda"),
                         GGUFModel(default_model_path), FastCudaBackend())
            assert eng.be.dependent_launches() == ("on" if on else "off")
            logits = [np.array(eng.prefill(prompt))]  # copies: a backend may hand back its buffer
            token = int(np.argmax(logits[0]))
            for i in range(4):  # one by one
                logits.append(np.array(eng.decode_one_token(token, len(prompt) + i)))
                token = int(np.argmax(logits[-1]))
            step = eng.device_step()
            for i in range(4, 12):  # captured at the first, replayed after
                token = step.run(token, len(prompt) + i)
                logits.append(np.array(step.logits_on_host()))
            return logits

    plain = decode(False)  # first: it compiles, so the dependent run's launches take the fast path
    before = fast_launch.COUNTS["dependent"]
    dependent = decode(True)
    assert fast_launch.COUNTS["dependent"] > before
    for i, (a, b) in enumerate(zip(plain, dependent)):
        np.testing.assert_array_equal(a, b, err_msg=f"{kv}: logits {i}")
