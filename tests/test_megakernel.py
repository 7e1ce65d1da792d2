"""The megakernel (`--kernels mega`, src/strata_nb/fast/mega/): its plan, when it runs,
and its decode steps against the numpy backend's.

Under the simulator the whole kernel runs on a tiny model (1 layer, d 64, 2 query heads
sharing one KV head of 64) with two thread blocks at once (tests/sim_barriers.py:
concurrent_blocks; the simulator's own launch runs one block after another, and the
first grid barrier would wait forever), so the grid barrier, the sharing out of rows and
attention's shares across blocks all run. A GPU (STRATA_NB_GPU=1) runs the same tests
with a block per SM.

Tolerance. The megakernel sums in other orders than the references (the plain kernels'
dot products, block-wide norms of another width, attention folded in shares and merged),
so logits agree within TOLERANCE of the largest, and each pick is the references' argmax.
A dropped item (layer 0's down product) moves them far past it.
"""
import numpy as np
import pytest
from numba import cuda

from conftest import ON_GPU
from strata_nb.backend import get_backend
from strata_nb.engine.engine import Engine
from strata_nb.fast.mega import plan as mega_plan
from strata_nb.fast.mega.interpreter import grid_barrier
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.model.synthetic import write_synthetic_gguf
from strata_nb.settings import SamplingSettings, Settings

PROMPT = [3 + (7 * i) % 90 for i in range(19)]  # position 19 is the first step's: block 1's fourth cell
TOLERANCE = 2e-5  # of the largest |logit|: float32 sums in other orders (measured here: <= 2e-7)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_synthetic_gguf(tmp_path_factory.mktemp("mega") / "gqa.gguf", n_layers=1, d_model=64, d_ff=64,
                                    n_heads=2, n_kv_heads=1, head_dim=64, seed=3))


def engine(path, device, kernels="fast", **settings):
    s = Settings(model=path, max_context=64, device=device, kernels=kernels, **settings)
    return Engine(s, GGUFModel(path), get_backend(device, kernels), quiet=True)


# --8<-- [start:plan_test]
def test_a_step_of_the_default_model_is_153_items_152_barriers():
    items = mega_plan.build_plan(30)
    ops = [mega_plan.OPS[op] for op, _ in items]
    assert len(items) == 1 + 30 * 5 + 2 == 153
    assert ops[:6] == ["embed", "qkv", "attend", "wo", "gate_up", "down"]
    assert ops[-2:] == ["head", "pick"]
    assert [layer for op, layer in items if op == mega_plan.QKV] == list(range(30))
# --8<-- [end:plan_test]


def test_each_file_of_the_megakernel_reads_in_one_sitting():
    from pathlib import Path

    import strata_nb.fast.mega as mega

    long = {p.name: n for p in Path(mega.__file__).parent.glob("*.py") if (n := len(p.read_text().splitlines())) > 300}
    assert not long, f"over 300 lines: {long}"


def test_why_not_names_what_the_megakernel_does_not_run(model):
    from dataclasses import replace

    eng = engine(model, "cuda", "mega")
    cfg, types = eng.config, mega_plan.layer_types(eng.weights.layers)
    assert types == {"wqkv": {"Q4_1"}, "wo": {"Q4_1"}, "wgate_up": {"Q4_1"}, "wdown": {"Q4_1"}}
    assert mega_plan.why_not(cfg, "fp16", True, True, types) is None
    assert mega_plan.why_not(cfg, "k8v4", True, True, types) is None
    assert "int8" in mega_plan.why_not(cfg, "int8", True, True, types)
    assert "resident" in mega_plan.why_not(cfg, "fp16", False, True, types)
    assert "greedily" in mega_plan.why_not(cfg, "fp16", True, False, types)
    assert "gemma3" in mega_plan.why_not(replace(cfg, arch="gemma3"), "fp16", True, True, types)
    assert "experts" in mega_plan.why_not(replace(cfg, n_expert=4, n_expert_used=2), "fp16", True, True, types)
    mixed = types | {"wo": {"Q4_1", "Q8_0"}}
    assert mega_plan.why_not(cfg, "fp16", True, True, mixed) == "its layers' wo matrices differ in type (Q4_1, Q8_0)"


def test_the_engine_says_why_a_step_is_not_a_megakernel(model):
    eng = engine(model, "cuda", "mega", kv="int8")
    step = eng.device_step()
    assert type(step).__name__ == "DeviceStep"
    assert eng.mega_note == "the fast tier's (the megakernel: it reads fp16 and k8v4 KV, not int8)"
    eng = engine(model, "cuda", "mega")
    assert type(eng.device_step(SamplingSettings(temperature=0.7), np.random.default_rng(0))).__name__ == "DeviceStep"
    assert "greedily" in eng.mega_note


def test_info_prints_the_plan(model, capsys):
    from cli_runner import run_cli

    code, out, err = run_cli(["info", "--model", model, "--mega-plan"], capsys)
    assert code == 0, err
    assert "8 items, 7 grid barriers" in out, out
    assert "64 units (warps: a gate row and its up row each)" in out, out
    code, out, err = run_cli(["info", "--model", model, "--mega-plan", "--kv", "q4_0"], capsys)
    assert code == 2 and "the megakernel does not run" in err and "not q4_0" in err, err


def mega_engine(model, kv):
    eng = engine(model, "cuda", "mega", kv=kv)
    step = eng.device_step()
    assert type(step).__name__ == "MegaStep", eng.mega_note
    if not ON_GPU:
        step.grid = 2  # two thread blocks, run at once (concurrent_blocks)
    return eng, step


def blocks_at_once():
    """The simulator's launches with every block at once; a GPU's as they are."""
    if ON_GPU:
        from contextlib import nullcontext

        return nullcontext()
    import sim_barriers

    if not sim_barriers.install():
        pytest.skip("the simulator's barriers are its own (STRATA_NB_SIM_BARRIERS=plain or another numba-cuda): "
                    "its launches run one block after another")
    return sim_barriers.concurrent_blocks()


def teacher_forced(model, kv, steps, drop=None):
    """The megakernel's logits and picks at PROMPT's next `steps` positions, each fed the
    numpy backend's pick, beside the numpy backend's logits. drop: (op, layer), an item
    left out of the plan (a negative control)."""
    ref = engine(model, "cpu", kv=kv)
    eng, step = mega_engine(model, kv)
    token = int(np.argmax(ref.prefill(PROMPT)))
    assert int(np.argmax(eng.prefill(PROMPT))) == token
    if drop is not None:
        keep = [i for i, item in enumerate(step.plan) if tuple(item) != drop]
        step.args = (eng.be.asarray(step.plan[keep]),) + step.args[1:]
    out = []
    with blocks_at_once():
        for pos in range(len(PROMPT), len(PROMPT) + steps):
            picked = step.run(token, pos)
            want = ref.decode_one_token(token, pos)
            out.append((step.logits_on_host(), picked, want))
            token = int(np.argmax(want))
    return out


@pytest.mark.sim_engine
@pytest.mark.parametrize("kv", ["fp16", "k8v4"])
def test_megakernel_steps_give_the_references_logits(model, kv):
    for got, picked, want in teacher_forced(model, kv, steps=2):
        assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max(), np.abs(got - want).max()
        assert picked == int(np.argmax(want))


@pytest.mark.sim_engine
def test_a_step_without_one_of_its_items_is_caught(model):
    (got, _, want), = teacher_forced(model, "k8v4", steps=1, drop=(mega_plan.DOWN, 0))
    assert np.abs(got - want).max() > 100 * TOLERANCE * np.abs(want).max()


@pytest.mark.sim_engine
def test_run_ahead_decodes_the_references_tokens(model):
    """The engine's own greedy loop: each step's pick and position fed to the next launch
    on the device (DeviceStep.run_ahead), as `strata-nb run` decodes."""
    ref = engine(model, "cpu")
    first = int(np.argmax(ref.prefill(PROMPT)))
    want = list(ref.tokens_after(first, len(PROMPT), 3, SamplingSettings(), None, None))
    eng, step = mega_engine(model, "fp16")
    assert int(np.argmax(eng.prefill(PROMPT))) == first
    with blocks_at_once():
        got = list(eng.tokens_after(first, len(PROMPT), 3, SamplingSettings(), None, step))
    assert got == want


# --8<-- [start:barrier_test]
@cuda.jit
def barrier_rounds_kernel(sync, seen, rounds):
    """Each round, every thread block writes its mark, waits at the grid barrier, then
    reads every block's mark for that round: a barrier that let a block through early
    would show a mark missing (0)."""
    b, t, n = cuda.blockIdx.x, cuda.threadIdx.x, cuda.gridDim.x
    for r in range(rounds):
        if t == 0:
            seen[r, b, b] = r + 1  # this block's mark
        grid_barrier(sync)
        if t < n and t != b:
            seen[r, b, t] = seen[r, t, t]  # every other block's mark, read after the barrier
        grid_barrier(sync)  # nobody writes round r + 1's marks before all have read round r's


def test_the_grid_barrier_holds_every_block_until_all_arrive():
    blocks, rounds = 3, 4
    sync = np.zeros(2, np.int32)
    seen = np.zeros((rounds, blocks, blocks), np.int32)
    with blocks_at_once():
        barrier_rounds_kernel[blocks, 32](sync, seen, rounds)
    want = np.broadcast_to(np.arange(1, rounds + 1)[:, None, None], seen.shape)
    assert (seen == want).all(), seen
    assert sync[0] == 0 and sync[1] == 2 * rounds  # ready for the next launch: none arrived, a generation a barrier
# --8<-- [end:barrier_test]


@pytest.mark.sim_engine
def test_a_clocked_step_times_every_item(model):
    """The timeline the lesson's figure is drawn from: a time for each item of the plan."""
    from strata_nb.fast.mega.step import MegaModel, MegaStep

    eng = engine(model, "cuda", "mega")
    token = int(np.argmax(eng.prefill(PROMPT)))
    step = MegaStep(eng.be, eng.weights, eng.kv, False, MegaModel(eng.be, eng.weights), clocked=True)
    step.run(token, len(PROMPT))
    took = step.item_ns()
    assert took.shape == (len(step.plan),) and (took > 0).all(), took


@pytest.mark.sim_engine
def test_run_stats_say_how_the_steps_ran(model, capsys):
    from cli_runner import run_cli

    argv = ["run", "--model", model, "--device", "cuda", "--kernels", "mega", "--max-context", "64", "--stats",
            "--max-tokens", "2", "--raw", "hi"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "decode steps: one megakernel launch a step" in err, err
    code, out, err = run_cli(argv + ["--kv", "int8"], capsys)
    assert code == 0, err
    assert "decode steps: the fast tier's (the megakernel: it reads fp16 and k8v4 KV, not int8)" in err, err
