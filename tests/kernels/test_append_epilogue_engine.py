"""The KV append in the q|k|v matvec's epilogue, through the engine: a streamed cache's
replayed decode steps against a resident cache's, bit for bit, with the fused append the
only writer of the steps' cells (the separate fp16 append kernel never runs in them).

A 1-layer random-weight model, fp16 KV, a ring of 1 block and a slot pool of 4: the step at
15 writes its cell into block 0, the step at 16 moves the ring to block 1 and reads block 0
in place from the host copy. The prompt's cells come from the numpy backend (a snapshot
restored into each cuda engine; a simulated prefill takes most of a minute). Negative
control: the epilogue's writer body drops V's host write; the step at 16 must differ.
"""
import numpy as np
import pytest

from strata_nb.fast.backend import FastCudaBackend
from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.engine.engine import Engine
from strata_nb.kernels.kv import kv_append_fp16 as append_module
from strata_nb.fast import matvec_fused
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.model.synthetic import write_synthetic_gguf
from strata_nb.settings import Settings
from test_append_epilogue import store_cell_v_host_dropped

pytestmark = pytest.mark.sim_engine  # engines stepping under the simulator: minutes on a CPU

PROMPT = [3 + (7 * i) % 90 for i in range(15)]  # positions 0..14: block 0
STEPS = ((5, 15), (6, 16))  # (token, position): 15 is written into block 0 by the epilogue;
# at 16 the ring leaves block 0, which is then read in place from the host copy


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """One layer of 64 wide, one head: each simulated step takes seconds, not tens."""
    return str(write_synthetic_gguf(tmp_path_factory.mktemp("one_layer") / "m.gguf", n_layers=1, d_model=64,
                                    d_ff=64, n_heads=1, n_kv_heads=1))


def fp16_engine(model, be, kv_resident):
    settings = Settings(model=model, kv="fp16", max_context=128, kv_window=16, kv_resident=kv_resident,
                        device="cuda" if be.name == "cuda" else "cpu")
    return Engine(settings, GGUFModel(model), be)


@pytest.fixture(scope="module")
def prompt_cells(model):
    engine = fp16_engine(model, NumpyBackend(), 0)
    engine.prefill(PROMPT)
    return engine.kv.snapshot(len(PROMPT))


def replayed_logits(model, prompt_cells, kv_resident):
    """Each replayed step's logits, and how often the separate fp16 append kernel ran."""
    engine = fp16_engine(model, FastCudaBackend(), kv_resident)
    engine.kv.restore(prompt_cells)
    launches, kernel = [], append_module.kv_append_fp16

    def counted(*args):
        launches.append(1)
        return kernel(*args)

    step, logits = engine.device_step(), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(append_module, "kv_append_fp16", counted)
        for token, pos in STEPS:
            step.run(token, pos)
            logits.append(step.logits_on_host())
    if kv_resident:
        assert engine.kv.streamed and engine.kv.counters.in_place > 0  # block 0 was read from the host copy
    assert not launches  # the epilogue wrote the steps' cells
    return logits


@pytest.fixture(scope="module")
def resident(model, prompt_cells):
    return replayed_logits(model, prompt_cells, 0)


def test_streamed_replayed_steps_equal_resident_ones(model, prompt_cells, resident):
    streamed = replayed_logits(model, prompt_cells, 80)
    for (_, pos), a, b in zip(STEPS, streamed, resident):
        assert a.tobytes() == b.tobytes(), f"step at {pos} differs"


def test_a_dropped_v_host_write_in_the_epilogue_breaks_it(model, prompt_cells, resident, monkeypatch):
    """The class of Strata #1188: step 15 still reads its cell from the ring (equal); step
    16 reads block 0 from the host copy, where cell 15's V was never written."""
    monkeypatch.setattr(matvec_fused, "MATVEC_KERNELS",
                        matvec_fused.matvec_kernels(matvec_fused.ROWS, store=store_cell_v_host_dropped))
    streamed = replayed_logits(model, prompt_cells, 80)
    assert streamed[0].tobytes() == resident[0].tobytes()
    assert np.abs(streamed[1] - resident[1]).max() > 1e-3 * np.abs(resident[1]).max()
