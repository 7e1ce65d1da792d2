"""Temperature / top-p sampling on the device: the kernel draws the reference's token;
the reference draws from the nucleus with the right probabilities."""
import numpy as np
import pytest

from strata_nb.kernels.step.sample_top_p import sample_top_p, sample_top_p_ref, uniform_ref


def draw(impl, logits, temperature, top_p, seed, counter):
    out = np.full(1, -1, np.int32)
    impl(logits, np.float32(1 / temperature), np.float32(top_p), seed, np.array([counter], np.int32), out)
    return int(out[0])


@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.9), (1.0, 1.0), (1.5, 0.5), (0.2, 0.95)])
def test_kernel_draws_the_references_token(temperature, top_p):
    """Random logits (no ties): a sum's last bits differ between the two, and a pick could
    differ only if u * mass fell within them of a boundary; these draws are not such."""
    rng = np.random.default_rng(1)
    for trial in range(3):
        logits = (rng.standard_normal(300) * 3).astype(np.float32)
        args = (logits, temperature, top_p, 1000 + trial, 17 * trial + 5)
        assert draw(sample_top_p, *args) == draw(sample_top_p_ref, *args)


def test_reference_draws_the_nucleus_with_its_probabilities():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.06, 0.04], np.float32))
    counts = np.bincount([draw(sample_top_p_ref, logits, 1.0, 0.85, 7, c) for c in range(20000)], minlength=5)
    # top_p 0.85: the nucleus is {0.4, 0.3, 0.2} (0.9 >= 0.85); 0.06 and 0.04 are never drawn
    assert counts[3] == counts[4] == 0
    p = np.array([0.4, 0.3, 0.2]) / 0.9
    sigma = np.sqrt(20000 * p * (1 - p))
    assert np.all(np.abs(counts[:3] - 20000 * p) < 5 * sigma), counts


def test_uniform_is_in_range_and_varies_with_the_counter():
    u = np.array([uniform_ref(5, c) for c in range(4000)])
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.02
    assert len(set(u.tolist())) > 3990


def test_a_cold_temperature_is_greedy():
    logits = np.random.default_rng(2).standard_normal(200).astype(np.float32)
    assert draw(sample_top_p_ref, logits, 1e-3, 1.0, 3, 9) == int(np.argmax(logits))
    assert draw(sample_top_p, logits, 1e-3, 1.0, 3, 9) == int(np.argmax(logits))
