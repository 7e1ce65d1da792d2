"""The expert cache on the numpy backend: any number of slots gives the same logits, bit
for bit, as every expert resident (every KV format, resident and streamed KV); the policy
really moves experts while it does; the counters add up; and the negative control: a
swap marked resident before its copy lands (`--fault expert-early-resident`) changes the
logits, so the parity test catches it.

The model: a 2-layer random-weight model made an MoE of 8 full copies of its FFN, each
token routed to 2 by a random router (moefy's copies file): 16 experts in all, an uneven
load, and exact for any routing.
"""
import numpy as np
import pytest

from strata_nb import Engine
from strata_nb.cli import main
from strata_nb.errors import SettingError
from strata_nb.model.moefy import moefy
from strata_nb.model.synthetic import write_synthetic_gguf

PROMPT = [5, 77, 130, 42, 9, 201, 66, 18, 90, 12, 7]
STEPS = 24
EVERY = 16  # 2 layers x 8 experts


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    folder = tmp_path_factory.mktemp("experts")
    dense = write_synthetic_gguf(folder / "dense.gguf", d_ff=256, seed=3)
    return str(moefy(dense, folder / "copies.gguf", "copies", 8, used=2, seed=5))


def run(path, slots, kv="fp16", kv_resident=0, **more):
    """Logits of the prompt and of STEPS greedy decode steps, and the engine."""
    eng = Engine.load(model=path, device="cpu", max_context=256, kv=kv, kv_resident=kv_resident,
                      expert_cache=slots, adapt_every=1, **more)
    logits = [eng.prefill(PROMPT)]
    token = int(np.argmax(logits[0]))
    for pos in range(len(PROMPT), len(PROMPT) + STEPS):
        logits.append(eng.decode_one_token(token, pos))
        token = int(np.argmax(logits[-1]))
    return np.stack(logits), eng


@pytest.fixture(scope="module")
def resident(copies):
    return run(copies, "auto")[0]


@pytest.mark.parametrize("slots", [0, 1, 5, 15])
def test_any_cache_size_gives_the_all_resident_logits(slots, copies, resident):
    logits, eng = run(copies, slots)
    np.testing.assert_array_equal(logits, resident)
    stats, cache = eng.weights.experts.stats(), eng.weights.experts
    assert cache.n_slots == slots
    passes = 1 + STEPS
    assert stats.lookups == (len(PROMPT) + STEPS) * 2 * 2  # tokens x layers x K
    if slots:
        assert stats.copies > 0 and stats.bytes_moved == stats.copies * cache.expert_bytes
        assert 0 < stats.hits < stats.lookups
        assert (cache.res_host >= 0).sum() == stats.copies - stats.swaps <= slots  # a slot holds one expert
    else:
        assert stats.hits == stats.copies == 0
    if slots == 1:
        assert stats.swaps > 0  # one slot, 16 experts: the policy trades it
    assert passes == cache._passes


@pytest.mark.parametrize("kv, kv_resident", [("int8", 0), ("q4_0", 0), ("k8v4", 0), ("k8v4", 64), ("fp16", 64)])
def test_the_cache_leaves_every_kv_format_as_it_was(kv, kv_resident, copies):
    want, _ = run(copies, "auto", kv=kv, kv_resident=kv_resident)
    got, eng = run(copies, 3, kv=kv, kv_resident=kv_resident)
    np.testing.assert_array_equal(got, want)
    assert eng.weights.experts.stats().copies > 0


def test_all_resident_holds_every_expert_from_the_start(copies):
    _, eng = run(copies, "auto")
    cache = eng.weights.experts
    assert cache.n_slots == EVERY and sorted(cache.res_host.tolist()) == list(range(EVERY))
    stats = cache.stats()
    assert stats.hits == stats.lookups and stats.swaps == 0


def test_a_prompt_chunk_fills_the_slots_with_its_most_used_experts(copies):
    """The cache adapts after every prompt chunk, whatever --adapt-every says, so the
    reply's first step finds the prompt's experts in their slots."""
    eng = Engine.load(model=copies, device="cpu", max_context=256, expert_cache=5, adapt_every=1000)
    cache = eng.weights.experts
    eng.prefill(PROMPT)
    lookups = np.asarray(cache.lookups).astype(np.int64)
    resident = np.flatnonzero(cache.res_host >= 0)
    assert cache.stats().copies == len(resident) == 5  # before any decode step
    most_used = np.argsort(-lookups, kind="stable")[:5]
    assert sorted(resident.tolist()) == sorted(most_used.tolist())
    before = cache.stats()
    eng.decode_one_token(int(PROMPT[-1]), len(PROMPT))
    assert cache.stats().since(before).hits > 0


def test_a_decode_step_adapts_by_the_counters_read_back_at_the_adapt_before(copies):
    """Between decode steps the host plans from the counters read back at the last adapt,
    so it never waits for the GPU there; after a prompt chunk it reads them as they are."""
    eng = Engine.load(model=copies, device="cpu", max_context=256, expert_cache=5, adapt_every=1)
    cache = eng.weights.experts
    counters = []
    eng.prefill(PROMPT)
    counters.append(np.asarray(cache.lookups).astype(np.int64).copy())
    np.testing.assert_array_equal(cache._seen, counters[0])  # the chunk's own lookups
    token = int(PROMPT[-1])
    for pos in range(len(PROMPT), len(PROMPT) + 3):
        token = int(np.argmax(eng.decode_one_token(token, pos)))
        counters.append(np.asarray(cache.lookups).astype(np.int64).copy())
        np.testing.assert_array_equal(cache._seen, counters[-2])  # one adapt behind
    assert (counters[-1] > counters[0]).any()


def test_negative_control_a_slot_marked_resident_before_its_copy_lands(copies, resident):
    logits, eng = run(copies, 5, fault="expert-early-resident")
    assert eng.weights.experts.stats().copies > 0
    assert not np.array_equal(logits, resident)
    assert np.abs(logits - resident).max() > 1e-3 * np.abs(resident).max()


def test_generate_reports_the_run_s_expert_stats(copies):
    eng = Engine.load(model=copies, device="cpu", max_context=256, expert_cache=4, adapt_every=2)
    text = "".join(eng.generate("hello there", max_tokens=12, chat=False))
    assert text
    x = eng.last_stats.extra["experts"]
    tokens = eng.last_stats.prompt_tokens + eng.last_stats.generated_tokens - 1
    assert x["lookups"] in (tokens * 4, (tokens + 1) * 4)  # a stop token ends the run a step early
    assert 0 <= x["hit_rate"] <= 1 and x["copies"] >= 4


@pytest.mark.parametrize("flags, message", [
    (["--expert-cache", "lots"], "--expert-cache must be 'auto' or a number of experts, got 'lots'"),
    (["--expert-cache", "-1"], "--expert-cache must be 'auto' or a number of experts >= 0, got -1"),
    (["--adapt-every", "0"], "--adapt-every must be at least 1 pass, got 0"),
    (["--adapt-swaps", "0"], "--adapt-swaps must be at least 1, got 0"),
    (["--vram-reserve-mib", "-5"], "--vram-reserve-mib must be >= 0, got -5"),
    (["--fault", "expert-early-resident"], "'expert-early-resident' breaks moving experts into slots: it needs "
                                           "--expert-cache between 1 and 15 (it is 16)"),
])
def test_bad_expert_flags_are_one_line_and_exit_2(flags, message, copies, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "hi", "--model", copies, "--device", "cpu", "--max-tokens", "2"] + flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and message in err[0], err


def test_the_fault_needs_an_moe_model(tiny_model):
    with pytest.raises(SettingError, match="it needs an MoE model"):
        Engine.load(model=tiny_model, device="cpu", fault="expert-early-resident")


def test_run_stats_print_the_expert_line(copies, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "hi", "--model", copies, "--device", "cpu", "--max-tokens", "4", "--raw", "--stats",
              "--expert-cache", "6"])
    err = capsys.readouterr().err
    assert exit_.value.code == 0
    assert "experts:" in err and "hit rate" in err and "(6 slots)" in err
    assert "expert cache: 6 of 16 experts in VRAM slots" in err
