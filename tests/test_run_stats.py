"""`--stats` reports load, warm-up, prefill and the steady decode rate apart: the first
WARM_STEPS decode steps (on a GPU: the steps that compile kernels and capture the graph)
are warm-up, not decode. On the numpy backend here; the cuda backend's device step, with
a slow first launch standing in for a compile, in tests/kernels/test_run_ahead.py."""
import time

from strata_nb.engine.engine import WARM_STEPS, Engine
from strata_nb.settings import SamplingSettings

SLOW = 0.5  # seconds the stand-in compile adds to the first decode step


def slow_first_call(obj, name):
    """Make obj.name sleep SLOW on its first call, as a first launch that compiles would."""
    real, calls = getattr(obj, name), []

    def wrapped(*args, **kwargs):
        if not calls:
            time.sleep(SLOW)
        calls.append(1)
        return real(*args, **kwargs)

    setattr(obj, name, wrapped)


def test_the_first_steps_are_warm_up_not_decode_numpy(tiny_model):
    eng = Engine.load(model=tiny_model, device="cpu", max_context=64)
    assert eng.load_seconds > 0
    slow_first_call(eng, "decode_one_token")
    tokens = []
    "".join(eng.generate_ids([3 + ord(c) for c in "ab"], SamplingSettings(max_tokens=12), on_token=tokens.append))
    s = eng.last_stats
    assert s.generated_tokens == len(tokens) == 12 and s.decode_steps == 12 - 1 - WARM_STEPS
    assert s.warmup_seconds >= SLOW > s.decode_seconds  # the slow step is warm-up
    assert s.decode_tok_s == s.decode_steps / s.decode_seconds and s.load_seconds == eng.load_seconds
    assert s.kernels_compiled == s.kernels_loaded == 0  # no kernels on the numpy backend


def test_a_run_too_short_for_steady_steps_times_them_all(tiny_model):
    eng = Engine.load(model=tiny_model, device="cpu", max_context=64)
    "".join(eng.generate_ids([5, 6], SamplingSettings(max_tokens=2)))
    assert eng.last_stats.decode_steps == 1 and eng.last_stats.decode_seconds > 0
