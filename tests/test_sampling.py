import numpy as np
import pytest

from strata_nb.engine.sampling import sample
from strata_nb.errors import StrataError
from strata_nb.settings import SamplingSettings


def draws(logits, s, n=400):
    rng = np.random.default_rng(s.seed)
    return [sample(logits, s, rng) for _ in range(n)]


LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03], np.float32))


def test_greedy_is_argmax():
    assert set(draws(LOGITS, SamplingSettings(temperature=0.0), 20)) == {0}


def test_top_k_keeps_k():
    assert set(draws(LOGITS, SamplingSettings(temperature=1.0, top_k=2, seed=1))) == {0, 1}


def test_top_p_keeps_the_smallest_set_with_that_mass():
    # 0.5 + 0.25 = 0.75 < 0.8, so token 2 is needed too; 3 and 4 never appear
    assert set(draws(LOGITS, SamplingSettings(temperature=1.0, top_p=0.8, seed=2))) == {0, 1, 2}


def test_temperature_sampling_follows_the_distribution():
    got = np.bincount(draws(LOGITS, SamplingSettings(temperature=1.0, seed=3), 4000), minlength=5) / 4000
    np.testing.assert_allclose(got, np.exp(LOGITS), atol=0.03)


def test_seed_repeats():
    s = SamplingSettings(temperature=0.9, seed=7)
    assert draws(LOGITS, s, 50) == draws(LOGITS, s, 50)


@pytest.mark.parametrize("kw", [{"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0},
                                {"top_p": 1.5}, {"top_k": -1}, {"max_tokens": 0}, {"seed": -5}])
def test_bad_values(kw):
    with pytest.raises(StrataError):
        SamplingSettings(**kw)
