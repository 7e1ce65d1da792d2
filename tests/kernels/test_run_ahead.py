"""Decode steps run ahead (engine/decode_step.py: DeviceStep.run_ahead): step k + 1 is
queued before step k's pick is read, and each step's pick lands in its own slot of the
mapped ring (fast/advance_step.py).

The queueing is checked on a stand-in step, one small kernel that makes the next token
from the token and the position (so a pick read from the wrong slot, or a step run at the
wrong position, gives a different sequence), followed by the real advance_step: fast
under the simulator, and on a GPU (STRATA_NB_GPU=1) captured into a graph and replayed
like the real step. Then greedy generate on the tiny model through the device step, with
a stop token, against the numpy backend's.
"""
import numpy as np
import pytest
from numba import cuda

from strata_nb.fast.backend import FastCudaBackend
from strata_nb.backend.numpy_backend import NumpyBackend
from strata_nb.engine.decode_step import PICK_RING
from strata_nb.engine.engine import Engine
from strata_nb.errors import StrataError
from strata_nb.gpu.launch import stream
from strata_nb.fast.advance_step import advance_step
from strata_nb.model.gguf_file import GGUFModel
from strata_nb.settings import SamplingSettings, Settings

pytestmark = pytest.mark.sim_engine  # decode steps queued and replayed under the simulator: minutes on a CPU

VOCAB = 97


@cuda.jit
def stand_in_kernel(token, pos):
    if cuda.grid(1) == 0:
        token[0] = (token[0] * 5 + pos[0] * 3 + 1) % VOCAB


def stand_in_next(token: int, pos: int) -> int:
    return (token * 5 + pos * 3 + 1) % VOCAB


def expected(token: int, pos: int, n: int) -> list[int]:
    out = []
    for p in range(pos, pos + n):
        token = stand_in_next(token, p)
        out.append(token)
    return out


@pytest.fixture(scope="module")
def eng(tiny_model):
    settings = Settings(model=tiny_model, kv="fp16", max_context=64, device="cuda")
    return Engine(settings, GGUFModel(tiny_model), FastCudaBackend())


@pytest.fixture
def step(eng):
    """A device step of the tiny engine whose launches are the stand-in's."""
    s = eng.device_step()
    queue, s.queued = s._queue, []

    def launch():
        stand_in_kernel[1, 1, stream()](s.token, s.pos)
        advance_step(s.token, s.pos, s.chosen)
        return s.token  # as logits: the step's output array

    def counted_queue(pos):  # launched, or replayed from the graph
        s.queued.append(1)
        return queue(pos)

    s.launch, s._queue = launch, counted_queue
    return s


def test_run_ahead_gives_the_step_by_step_picks(step):
    n = 3 * PICK_RING + 1  # the ring wraps three times
    want = expected(11, 5, n)
    assert list(step.run_ahead(11, 5, n)) == want
    assert step.next_input == (want[-1], 5 + n) and len(step.queued) == n
    assert [step.run(*step.next_input)] == expected(want[-1], 5 + n, 1)


def test_closing_early_leaves_one_step_run_past_the_last_pick(step):
    """Two picks read of eight: the third step was queued and has run. Its pick is where
    next_input says the device buffers are; decoding on from the last pick read rewrites
    the inputs and gives the uninterrupted sequence."""
    want = expected(3, 0, 8)
    ahead = step.run_ahead(3, 0, 8)
    assert [next(ahead), next(ahead)] == want[:2]
    ahead.close()
    assert len(step.queued) == 3 and step.next_input == (want[2], 3)
    assert list(step.run_ahead(want[1], 2, 6)) == want[2:]
    assert len(step.queued) == 9


def test_seek_makes_the_next_run_start_there(step):
    """After steps have run on, seek() puts the inputs back: the next run and run_ahead
    decode from the position sought (how the profile times every mode from one place)."""
    want = expected(7, 10, 5)
    assert list(step.run_ahead(7, 10, 5)) == want
    step.seek(7, 10)
    assert step.next_input == (7, 10)
    assert step.run(*step.next_input) == want[0]
    step.seek(7, 10)
    assert list(step.run_ahead(*step.next_input, 5)) == want


def test_a_run_past_the_cache_fails_before_any_step(step):
    with pytest.raises(StrataError, match="position 64 is outside the KV cache's 64 cells"):
        list(step.run_ahead(1, 60, 5))
    assert step.queued == [] and list(step.run_ahead(1, 60, 0)) == []


def test_generate_stops_with_a_step_queued_past_the_stop(eng, step):
    """generate's loop on a step run ahead: at a stop token the step queued after it has
    run and is waited for; the tokens before the stop are the step-by-step ones. (The
    prefill is a stand-in too: logits that pick token 40.)"""
    prompt, first = [3 + ord(c) for c in "ab"], 40
    t1, t2, t3 = expected(first, len(prompt), 3)
    assert t2 not in (first, t1)  # the stand-in's sequence, fixed by the constants above
    eng.prefill = lambda ids, on_chunk=None, start=0: np.eye(VOCAB, dtype=np.float32)[first]
    eng.reply_step = lambda *args: step
    eng.tokenizer.stop_ids = set(eng.tokenizer.stop_ids) | {t2}
    try:
        got = []
        "".join(eng.generate_ids(prompt, SamplingSettings(max_tokens=8), on_token=got.append))
    finally:
        del eng.prefill, eng.reply_step
        eng.tokenizer.stop_ids = set(eng.tokenizer.stop_ids) - {t2}
    assert got == [first, t1] and eng.last_stats.finish_reason == "stop"
    assert len(step.queued) == 3 and step.next_input == (t3, len(prompt) + 3)


def test_greedy_generate_on_the_device_step_equals_the_numpy_backend(tiny_model, eng):
    """The real step run ahead (two steps, the second queued while the first pick is read)
    against the numpy backend's generate."""
    prompt = [3 + ord(c) for c in "ab"]
    cpu = Engine(Settings(model=tiny_model, kv="fp16", max_context=64, device="cpu"), GGUFModel(tiny_model),
                 NumpyBackend())
    want, got = [], []
    "".join(cpu.generate_ids(prompt, SamplingSettings(max_tokens=3), on_token=want.append))
    "".join(eng.generate_ids(prompt, SamplingSettings(max_tokens=3), on_token=got.append))
    assert got == want and len(got) == 3 and eng.last_stats.finish_reason == "length"


def test_compile_time_is_warm_up_not_decode(eng, step):
    """The device step's first launch made slow, as a first launch that compiles is on a
    GPU: generate's stats put it in warm-up, and the decode rate is the other steps'."""
    from test_run_stats import SLOW, slow_first_call

    from strata_nb.engine.engine import WARM_STEPS

    eng.prefill = lambda ids, on_chunk=None, start=0: np.eye(VOCAB, dtype=np.float32)[40]
    eng.reply_step = lambda *args: step
    stops, eng.tokenizer.stop_ids = eng.tokenizer.stop_ids, set()  # the stand-in's tokens run to max_tokens
    slow_first_call(step, "launch")
    try:
        "".join(eng.generate_ids([3 + ord(c) for c in "ab"], SamplingSettings(max_tokens=10)))
    finally:
        del eng.prefill, eng.reply_step
        eng.tokenizer.stop_ids = stops
    s = eng.last_stats
    assert s.decode_steps == 10 - 1 - WARM_STEPS and s.warmup_seconds >= SLOW > s.decode_seconds
