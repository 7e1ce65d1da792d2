"""The two kernel tiers run one engine: `--kernels plain` (one plain kernel per op,
src/strata_nb/kernels/) and `--kernels fast` (src/strata_nb/fast/) give the numpy
backend's greedy tokens, for every KV format, fully resident and streamed with QSA, and on
an MoE file with speculation.

On a GPU the tiny synthetic model (2 layers, d 128, 1 KV head of 64) decodes 64 tokens
after a 40-token prompt: 104 cells, 7 blocks, where the streamed cache holds 5 (a ring of
1 and a pool of 4), so QSA (3 blocks a query) selects and the pool misses, evicts and
reads in place. The tiers sum in other orders than the references (each kernel's own tolerance),
and a greedy pick flips only where the top two logits are closer than that: the tokens
must be equal. Under the simulator (the sim_engine tier, which CI runs) it is two cases
of 3 tokens after a 20-token prompt on a model of half the width (d 64, one head), minutes;
the default tier holds each plain kernel to its reference instead.
"""
import numpy as np
import pytest

from conftest import ON_GPU
from strata_nb.backend import get_backend
from strata_nb.engine.engine import Engine
from strata_nb.kv_layout import USER_FORMATS
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.model.moefy import moefy
from strata_nb.model.synthetic import write_synthetic_gguf
from strata_nb.settings import SamplingSettings, Settings

PROMPT = [3 + (7 * i) % 90 for i in range(40 if ON_GPU else 20)]
TOKENS = 64 if ON_GPU else 3
# Under the simulator a plain decode step of this model is about a minute (a warp per row
# of W, each lane a Python thread): CI runs two cases for a few tokens, a GPU every case
# for 64 (STRATA_NB_GPU=1 runs this file in seconds).
SIM_CASES = {("k8v4", "streamed"), ("fp16", "resident")}
MODES = {"resident": {}, "streamed": dict(kv_resident=80, kv_window=16, qsa_budget=48)}
TIERS = (("cpu", "fast"), ("cuda", "plain"), ("cuda", "fast"))  # numpy (the references), plain, fast


def greedy(path: str, device: str, kernels: str, n: int, prompt=PROMPT, stats=None, **settings) -> list[int]:
    """The engine's own greedy loop: the prefill's pick, then n - 1 decode steps (on the
    device step where the tier has one), or speculation with --spec (its counts into stats)."""
    s = Settings(model=path, max_context=128, device=device, kernels=kernels, **settings)
    eng = Engine(s, GGUFModel(path), get_backend(device, kernels), quiet=True)
    assert eng.be.name == "numpy" or eng.be.kernels == kernels
    first = int(np.argmax(eng.prefill(prompt)))
    if s.spec:
        stats = dict(passes=0, drafts_offered=0, drafts_accepted=0) if stats is None else stats
        later = eng.speculate(first, len(prompt), n - 1, prompt, stats)
    else:
        later = eng.tokens_after(first, len(prompt), n - 1, SamplingSettings(), None, eng.device_step())
    return [first, *later]


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    """The tiny model on a GPU; under the simulator one of half its width (2 layers, d 64,
    one head of 64, d_ff 64), whose plain decode step takes about half as long."""
    if ON_GPU:
        return tiny_model
    return str(write_synthetic_gguf(tmp_path_factory.mktemp("two_tiers") / "narrow.gguf", d_model=64, d_ff=64,
                                    n_heads=1, n_kv_heads=1, head_dim=64, seed=1))


@pytest.mark.sim_engine
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kv", USER_FORMATS)
def test_plain_fast_and_numpy_decode_the_same_tokens(model, kv, mode):
    if not ON_GPU and (kv, mode) not in SIM_CASES:
        pytest.skip("under the simulator two cases run (SIM_CASES); a GPU runs every format and mode")
    runs = {tier: greedy(model, *tier, TOKENS, kv=kv, **MODES[mode]) for tier in TIERS}
    want = runs[TIERS[0]]
    assert len(want) == TOKENS
    for tier, got in runs.items():
        assert got == want, f"{tier}: {got} != numpy's {want}"


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    """A 1-layer MoE file: 4 copies of a dense FFN's experts, 2 used a token."""
    folder = tmp_path_factory.mktemp("two_tiers_moe")
    dense = write_synthetic_gguf(folder / "dense.gguf", n_layers=1, d_model=64, d_ff=64, n_heads=1, n_kv_heads=1,
                                 head_dim=64, seed=4)
    return str(moefy(dense, folder / "copies.gguf", "copies", 4, used=2, seed=2))


@pytest.mark.sim_engine
def test_an_moe_file_with_speculation_decodes_the_same_tokens_in_both_tiers(moe_file):
    """--spec 4 on an MoE file, half its experts in VRAM slots (the rest read from the
    host copy): the verify window's passes and the experts on plain and fast kernels."""
    n = TOKENS if ON_GPU else 4
    prompt = PROMPT if ON_GPU else PROMPT[:6]  # the simulator's MoE prefill: a warp per row, token and expert
    settings = dict(kv="k8v4", spec=4, expert_cache=2, adapt_every=1)
    stats = {tier: dict(passes=0, drafts_offered=0, drafts_accepted=0) for tier in TIERS}
    runs = {tier: greedy(moe_file, *tier, n, prompt, stats[tier], **settings) for tier in TIERS}
    assert runs[("cuda", "plain")] == runs[("cpu", "fast")] == runs[("cuda", "fast")]
    assert stats[("cuda", "plain")]["drafts_accepted"] >= 1, stats  # the window kept a draft


def test_kernels_is_checked_and_named_by_its_flag():
    from strata_nb.errors import SettingError

    with pytest.raises(SettingError, match="kernels") as err:
        Settings(kernels="fastest")
    assert err.value.flag == "--kernels"


def test_an_engine_refuses_a_backend_of_the_other_tier(tiny_model):
    from strata_nb.errors import StrataError

    s = Settings(model=tiny_model, max_context=64, device="cuda", kernels="fast")
    with pytest.raises(StrataError, match="--kernels fast"):
        Engine(s, GGUFModel(tiny_model), get_backend("cuda", "plain"), quiet=True)
