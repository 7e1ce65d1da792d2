"""Every fast launcher registered as a plain launcher's twin (src/strata_nb/fast/twins.py)
has a test that runs the two on the same inputs and holds them equal: bit for bit where
the arithmetic is the same (a plain kernel launched as dependent, the tiled matmul), else
within the plain kernel's written tolerance (the fused matvec, the split attention, the
fast expert kernels sum in other orders). This file keeps the list, so a twin registered
without its test fails here."""
import re
from pathlib import Path

from strata_nb.fast.twins import TWINS, load_twins

ROOT = Path(__file__).resolve().parents[1]
HELD_BY = {  # plain launcher -> the test file that holds its fast twin equal to it
    "strata_nb.kernels.dense.embed.embed": "tests/kernels/test_dense_kernels.py",
    "strata_nb.kernels.dense.matvec.matvec": "tests/kernels/test_dense_kernels.py",
    "strata_nb.kernels.dense.matmul.matmul": "tests/kernels/test_dense_kernels.py",
    "strata_nb.kernels.attention.attention.attention": "tests/kernels/test_attention_step.py",
    "strata_nb.kernels.kv.kv_append_k8v4.kv_append_k8v4": "tests/kernels/test_stream_kernels.py",
    "strata_nb.kernels.kv.key_sketch.key_sketch": "tests/kernels/test_stream_kernels.py",
    "strata_nb.kernels.step.argmax.argmax": "tests/kernels/test_step_twins.py",
    "strata_nb.kernels.step.block_scores.block_scores": "tests/kernels/test_step_twins.py",
    "strata_nb.kernels.experts.route.route": "tests/kernels/test_expert_kernels.py",
    "strata_nb.kernels.experts.expert_gate_up.expert_gate_up": "tests/kernels/test_expert_kernels.py",
    "strata_nb.kernels.experts.expert_down.expert_down": "tests/kernels/test_expert_kernels.py",
}


def test_every_twin_is_held_equal_to_its_plain_launcher_by_a_test():
    load_twins()
    twins = {f"{plain.__module__}.{plain.__name__}": fast for plain, fast in TWINS.items()}
    assert sorted(twins) == sorted(HELD_BY)
    for name, fast in twins.items():
        assert fast.plain_twin.__name__ == name.rsplit(".", 1)[1]
        assert fast.__module__.startswith("strata_nb.fast."), f"{name}'s twin lives in {fast.__module__}"
        short = fast.__module__.rsplit(".", 1)[1]
        test = (ROOT / HELD_BY[name]).read_text()
        assert re.search(rf"strata_nb\.fast(\.{short}\b| import .*\b{short}\b)", test), \
            f"{HELD_BY[name]} does not run {fast.__module__}"


def test_a_relaunched_twin_runs_the_plain_launcher_s_code():
    """relaunch swaps the kernel, nothing else: the twin is the plain launcher's code."""
    load_twins()
    for plain, fast in TWINS.items():
        if fast.__code__ is plain.__code__:
            assert fast.__globals__ is not plain.__globals__
