"""The expert kernels against their references: the router's ids and counts exactly and
its weights within weights_tolerance; the experts' gate|up + SwiGLU and down + weighted
add within their tolerances; and reading an expert from its slot gives the same bits as
reading it from the host copy.

Under the simulator: 2 tokens, 5 experts of which each token takes 2, D = 64, F = 32
(every simulated thread is a Python thread: 4,096 of them a launch here), two layers' entries in the tables. On a GPU the default
model's shapes (D = 576, F = 192 as moefy's split of 8 experts), 8 experts, 2 tokens.
"""
import numpy as np
import pytest

from conftest import ON_GPU
from kernels.test_dense_kernels import assert_within, quantized
from strata_nb.kernels.experts.expert_down import down_tolerance, expert_down, expert_down_ref
from strata_nb.kernels.experts.expert_gate_up import expert_gate_up, expert_gate_up_ref, gate_up_tolerance
from strata_nb.kernels.dense.matvec_fused import read_ahead_ref
from strata_nb.kernels.dense.rmsnorm import rmsnorm_tolerance
from strata_nb.kernels.experts.route import route, route_ref, weights_tolerance
from strata_nb.model.dequant import dequantize
from strata_nb.gpu.launch import DeviceArgs
from strata_nb.kernels.experts.expert_rows import stage_words
from strata_nb.kernels.experts import expert_down as down_module, expert_gate_up as gate_up_module

E, K, T = (8, 2, 2) if ON_GPU else (5, 2, 2)
D, F = (576, 192) if ON_GPU else (64, 32)
LAYERS = 2  # the tables hold two layers' entries; the tests use layer 1's
AT = E  # layer 1's first entry


def stacked(rng, qtype, n, shape):
    """(n, rows, bytes) uint8: n random matrices in GGUF form."""
    return np.stack([quantized(rng, qtype, shape) for _ in range(n)])


def table(rng, n_slots):
    """res with layer 1's experts 0 and 3 in slots n_slots - 1 and 0, the rest on the host."""
    res = np.full(LAYERS * E, -1, np.int32)
    if n_slots:
        res[AT + 0], res[AT + 3] = n_slots - 1, 0
    return res


@pytest.mark.parametrize("qtype, d", [("F32", D), ("Q8_0", D), ("F32", 1088)])
@pytest.mark.parametrize("plain", [False, True], ids=["fast", "plain"])
def test_route_matches_the_reference(qtype, d, plain):
    """d = 1,088: a router row longer than the parts a lane of the plain kernel reads
    ahead (PRELOAD)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((T, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    raw = quantized(rng, qtype, (E, d), scale=0.3)
    res = table(rng, 2)
    outs = {}
    for name, fn, router in (("ref", route_ref, dequantize(raw, qtype)), ("kernel", route, raw)):
        x_norm = np.zeros((T, d), np.float32)
        chosen = np.zeros((T, K), np.int32)
        weights = np.zeros((T, K), np.float32)
        lookups = np.full(LAYERS * E, 5, np.int32)  # counters only grow: start them anywhere
        hits = np.full(LAYERS * E, 7, np.int32)
        args = (x, norm, 1e-5) + ((router,) if name == "ref" else (raw, qtype))
        slot_of = np.full((T, K), 9, np.int32)
        fn(*args, x_norm, chosen, weights, slot_of, res, AT, lookups, hits, *(() if name == "ref" else (plain,)))
        outs[name] = x_norm, chosen, weights, lookups, hits, slot_of
    (xn, c, w, lk, h, so), (xn_k, c_k, w_k, lk_k, h_k, so_k) = outs["ref"], outs["kernel"]
    assert_within(xn_k, xn, rmsnorm_tolerance(xn))
    np.testing.assert_array_equal(c_k, c)
    np.testing.assert_array_equal(so_k, so)
    np.testing.assert_array_equal(so, res[AT + c])  # the lookups the expert kernels read
    assert (c[:, 0] != c[:, 1]).all()
    assert_within(w_k, w, weights_tolerance(xn, dequantize(raw, qtype)) * np.abs(w))
    np.testing.assert_allclose(w_k.sum(axis=1), 1, atol=1e-6)
    np.testing.assert_array_equal(lk_k, lk)
    np.testing.assert_array_equal(h_k, h)
    assert lk.sum() == 5 * LAYERS * E + T * K and (lk[:AT] == 5).all()  # layer 0's entries untouched
    assert h.sum() - 7 * LAYERS * E == sum(int(res[AT + e] >= 0) for e in c.ravel())


@pytest.mark.parametrize("plain", [False, True], ids=["fast", "plain"])
def test_route_counts_no_padding(plain):
    """A padded prompt chunk's rows after `last` repeat its last token: they are routed (the
    expert kernels compute them) but not counted as the cache's lookups and hits, in the
    kernel as in the reference. Here 5 rows, of which rows 0 .. 1 are tokens."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, D)).astype(np.float32)
    raw = quantized(rng, "F32", (E, D), scale=0.3)
    res, last = table(rng, 2), np.array([1], np.int32)
    outs = []
    for fn, router in ((route_ref, dequantize(raw, "F32")), (route, raw)):
        c, w, so = np.zeros((5, K), np.int32), np.zeros((5, K), np.float32), np.zeros((5, K), np.int32)
        lookups, hits = np.zeros(LAYERS * E, np.int32), np.zeros(LAYERS * E, np.int32)
        args = (x, np.ones(D, np.float32), 1e-5) + ((router,) if fn is route_ref else (raw, "F32"))
        fn(*args, np.zeros((5, D), np.float32), c, w, so, res, AT, lookups, hits,
           *((last,) if fn is route_ref else (plain, last)))
        outs.append((c, lookups, hits))
    (c, lk, h), (c_k, lk_k, h_k) = outs
    np.testing.assert_array_equal(c_k, c)
    np.testing.assert_array_equal(lk_k, lk)
    np.testing.assert_array_equal(h_k, h)
    assert lk.sum() == 2 * K  # two tokens' choices; the three padding rows' none
    np.testing.assert_array_equal(lk[AT:], np.bincount(c[:2].ravel(), minlength=E))


@pytest.mark.parametrize("plain", [False, True], ids=["fast", "plain"])
def test_route_breaks_ties_toward_the_lower_id(plain):
    """Equal logits (a zero router): every expert equally likely; the reference's stable
    sort takes experts 0 .. K-1, and so must the kernel."""
    x = np.ones((1, D), np.float32)
    chosen = np.zeros((1, K), np.int32)
    weights = np.zeros((1, K), np.float32)
    zeros = np.zeros(LAYERS * E, np.int32)
    route(x, np.ones(D, np.float32), 1e-5, np.zeros((E, D), np.float32).view(np.uint8), "F32",
          np.zeros((1, D), np.float32), chosen, weights, np.zeros((1, K), np.int32), np.full(LAYERS * E, -1, np.int32), 0,
          zeros, zeros.copy(), plain)
    assert chosen.tolist() == [list(range(K))]
    np.testing.assert_allclose(weights, 1 / K, rtol=1e-6)


@pytest.mark.parametrize("plain", [False, True], ids=["fast", "plain"])
def test_route_over_32_experts(plain):
    """40 experts: the fast kernel's lanes hold two experts each (l and l + 32), so an
    expert past the first warp's lanes must be ranked, chosen and counted as one before
    them. The router favours experts 33 and 38 for the first token, 5 and 36 for the
    second."""
    rng = np.random.default_rng(3)
    e, k = 40, 3
    x = rng.standard_normal((2, D)).astype(np.float32)
    router = (0.05 * rng.standard_normal((e, D))).astype(np.float32)
    router[[33, 38]] += 0.5 * x[0] / np.linalg.norm(x[0])
    router[[5, 36]] += 0.5 * x[1] / np.linalg.norm(x[1])
    res = np.full(2 * e, -1, np.int32)
    res[e + 33], res[e + 5] = 0, 1  # layer 1's experts 33 and 5 resident
    outs = []
    for fn, r in ((route_ref, router), (route, router.view(np.uint8))):
        c, w, so = np.zeros((2, k), np.int32), np.zeros((2, k), np.float32), np.zeros((2, k), np.int32)
        lookups, hits, x_norm = np.zeros(2 * e, np.int32), np.zeros(2 * e, np.int32), np.zeros((2, D), np.float32)
        args = (x, np.ones(D, np.float32), 1e-5) + ((r,) if fn is route_ref else (r, "F32"))
        fn(*args, x_norm, c, w, so, res, e, lookups, hits, *(() if fn is route_ref else (plain,)))
        outs.append((c, w, so, lookups, hits, x_norm))
    (c, w, so, lk, h, xn), (c_k, w_k, so_k, lk_k, h_k, _) = outs
    assert set(c[0, :2]) == {33, 38} and set(c[1, :2]) == {5, 36}
    np.testing.assert_array_equal(c_k, c)
    np.testing.assert_array_equal(so_k, so)
    assert_within(w_k, w, weights_tolerance(xn, router) * np.abs(w))
    np.testing.assert_array_equal(lk_k, lk)
    np.testing.assert_array_equal(h_k, h)
    assert h[e + 33] == 1 and h[e + 5] == 1 and h.sum() == 2


@pytest.mark.parametrize("plain", [False, True], ids=["fast", "plain"])
def test_route_breaks_ties_past_the_first_32_experts(plain):
    """40 experts, a zero router but for experts 33 and 38, which share one row: their
    logits are equal and the largest, so the lower id comes first, then expert 0, the
    lowest of the rest (all equal at 0)."""
    e, k = 40, 3
    x = np.ones((1, D), np.float32)
    router = np.zeros((e, D), np.float32)
    router[[33, 38]] = 0.01
    chosen = np.zeros((1, k), np.int32)
    route(x, np.ones(D, np.float32), 1e-5, router.view(np.uint8), "F32", np.zeros((1, D), np.float32), chosen,
          np.zeros((1, k), np.float32), np.zeros((1, k), np.int32), np.full(e, -1, np.int32), 0,
          np.zeros(e, np.int32), np.zeros(e, np.int32), plain)
    assert chosen.tolist() == [[33, 38, 0]]


def experts_case(qtype, n_slots, seed=2):
    rng = np.random.default_rng(seed)
    host_gu = stacked(rng, qtype, LAYERS * E, (2 * F, D))
    host_down = stacked(rng, qtype, LAYERS * E, (D, F))
    res = table(rng, n_slots)
    slots_gu = np.zeros((n_slots, 2 * F, host_gu.shape[2]), np.uint8)
    slots_down = np.zeros((n_slots, D, host_down.shape[2]), np.uint8)
    for e in range(E):
        if res[AT + e] >= 0:  # a resident expert's slot holds its bytes
            slots_gu[res[AT + e]], slots_down[res[AT + e]] = host_gu[AT + e], host_down[AT + e]
    chosen = np.array([[0, 3], [4, 0], [2, 1]][:T], np.int32) if not ON_GPU else np.array([[0, 3], [7, 5]], np.int32)
    weights = np.array([[0.7, 0.3], [0.55, 0.45], [0.9, 0.1]][:T], np.float32)
    x_norm = rng.standard_normal((T, D)).astype(np.float32)
    return host_gu, host_down, slots_gu, slots_down, res, chosen, weights, x_norm


def dq(stack, qtype):
    return np.stack([dequantize(m, qtype) for m in stack]) if len(stack) else np.zeros((0,), np.float32)


@pytest.mark.parametrize("qtype,n_slots", [("Q4_1", 2), ("Q4_0", 0), ("Q8_0", 2)])
@pytest.mark.parametrize("plain", [False, True], ids=["fast", "plain"])
def test_expert_gate_up_matches_the_reference(qtype, n_slots, plain):
    host_gu, _, slots_gu, _, res, chosen, _, x_norm = experts_case(qtype, n_slots)
    want = np.zeros((T, K, F), np.float32)
    f_host, f_slots = dq(host_gu, qtype), dq(slots_gu, qtype).reshape(n_slots, 2 * F, D)
    expert_gate_up_ref(x_norm, chosen, res, AT, f_slots, f_host, want)
    got = np.zeros((T, K, F), np.float32)
    expert_gate_up(x_norm, chosen, res[AT + chosen], AT, slots_gu, host_gu, qtype, got, plain=plain)
    assert_within(got, want, gate_up_tolerance(x_norm, chosen, lambda e: f_host[AT + e]))


@pytest.mark.parametrize("warps,stage", [(1, False), (2, False), (2, True)])
def test_the_fast_gate_up_kernel_walks_its_parts_across_trips(warps, stage):
    """D = 576 (72 parts: one warp takes three trips, two warps two) and F = 5 (the last
    thread block has one of its two pairs), some experts missed (staged, or read in place):
    within the reference's tolerance."""
    d, f = 576, 5
    rng = np.random.default_rng(9)
    host_gu = stacked(rng, "Q4_1", LAYERS * E, (2 * f, d))
    res = table(rng, 2)
    slots_gu = np.zeros((2, 2 * f, host_gu.shape[2]), np.uint8)
    for e in range(E):
        if res[AT + e] >= 0:
            slots_gu[res[AT + e]] = host_gu[AT + e]
    chosen = np.array([[0, 3], [4, 0]], np.int32)
    assert (res[AT + chosen] < 0).any() and (res[AT + chosen] >= 0).any()
    x_norm = rng.standard_normal((2, d)).astype(np.float32)
    f_host = dq(host_gu, "Q4_1")
    want = np.zeros((2, K, f), np.float32)
    expert_gate_up_ref(x_norm, chosen, res, AT, dq(slots_gu, "Q4_1").reshape(2, 2 * f, d), f_host, want)
    got = np.full((2, K, f), np.nan, np.float32)
    expert_gate_up(x_norm, chosen, res[AT + chosen], AT, slots_gu, host_gu, "Q4_1", got, warps=warps, stage=stage)
    assert_within(got, want, gate_up_tolerance(x_norm, chosen, lambda e: f_host[AT + e]))


def test_gate_up_reads_the_chosen_experts_down_matrices_ahead():
    """Every sector of each hit's down matrix is read once, from its slot: the grid's XOR
    is the XOR of each hit's. A miss's is not read ahead (it would cross the bus twice)."""
    host_gu, host_down, slots_gu, slots_down, res, chosen, _, x_norm = experts_case("Q4_1", 2)
    h = np.zeros((T, K, F), np.float32)
    warps = gate_up_module.gate_up_warps(D)
    ahead_out = np.zeros(-(-F // gate_up_module.PAIRS) * T * K * warps * 32, np.uint32)  # a slot per thread
    expert_gate_up(x_norm, chosen, res[AT + chosen], AT, slots_gu, host_gu, "Q4_1", h, ahead=(slots_down, host_down),
                   ahead_out=ahead_out)
    want = np.uint32(0)
    for e in chosen.ravel():
        if res[AT + e] >= 0:
            want ^= read_ahead_ref(host_down[AT + e])
    assert (res[AT + chosen] < 0).any() and want != 0
    assert np.bitwise_xor.reduce(ahead_out) == want


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_an_expert_reads_the_same_bits_from_its_slot_as_from_the_host_copy(qtype):
    """All on the host (each miss staged through shared memory, and read in place), then
    experts 0 and 3 in slots: the kernels' outputs are the same bits (the cache cannot
    change what a token computes, nor how a miss is read)."""
    host_gu, host_down, slots_gu, slots_down, res, chosen, weights, x_norm = experts_case(qtype, 2)
    outs = []
    for table_now, stage in ((np.full_like(res, -1), True), (np.full_like(res, -1), False), (res, True)):
        h = np.zeros((T, K, F), np.float32)
        expert_gate_up(x_norm, chosen, table_now[AT + chosen], AT, slots_gu, host_gu, qtype, h, stage=stage)
        x = np.ones((T, D), np.float32)
        expert_down(h, chosen, weights, table_now[AT + chosen], AT, slots_down, host_down, qtype, x, stage=stage)
        outs.append((h, x))
    for other in outs[1:]:
        np.testing.assert_array_equal(outs[0][0], other[0])
        np.testing.assert_array_equal(outs[0][1], other[1])
    with DeviceArgs() as dev:  # the first run staged: its rows are whole words and fit
        assert stage_words(dev, host_gu, gate_up_module.STAGE_ROW_WORDS)[1] > 0
        assert stage_words(dev, host_down, down_module.STAGE_ROW_WORDS)[1] > 0 or host_down.shape[2] % 4
    if qtype != "Q4_1":
        return
    # and a slot that holds the wrong expert's bytes shows: the negative control
    slots_gu[0] = host_gu[AT + 1]
    h = np.zeros((T, K, F), np.float32)
    expert_gate_up(x_norm, chosen, res[AT + chosen], AT, slots_gu, host_gu, "Q4_1", h)
    assert not np.array_equal(h, outs[0][0])


@pytest.mark.parametrize("qtype,n_slots", [("Q4_1", 2), ("F16", 0)])
@pytest.mark.parametrize("plain", [False, True], ids=["fast", "plain"])
def test_expert_down_matches_the_reference(qtype, n_slots, plain):
    _, host_down, _, slots_down, res, chosen, weights, _ = experts_case(qtype, n_slots, seed=3)
    rng = np.random.default_rng(4)
    h = rng.standard_normal((T, K, F)).astype(np.float32)
    x0 = rng.standard_normal((T, D)).astype(np.float32)
    f_host, f_slots = dq(host_down, qtype), dq(slots_down, qtype).reshape(n_slots, D, F)
    want = x0.copy()
    expert_down_ref(h, chosen, weights, res, AT, f_slots, f_host, want)
    got = x0.copy()
    expert_down(h, chosen, weights, res[AT + chosen], AT, slots_down, host_down, qtype, got, plain=plain)
    assert_within(got, want, down_tolerance(h, chosen, weights, lambda e: f_host[AT + e], want))


@pytest.mark.parametrize("warps", [1, 2])
def test_the_fast_down_kernel_walks_its_terms_across_experts_and_trips(warps):
    """D = 10 outputs (the last thread block has 2 of its 4 rows) and F = 256 (32 parts an
    expert): with one warp a thread's terms span both experts over two trips; with two,
    the warps' sums meet in shared memory."""
    d, f = 10, 256
    rng = np.random.default_rng(8)
    host_down = stacked(rng, "Q4_1", LAYERS * E, (d, f))
    res = table(rng, 2)
    slots_down = np.zeros((2, d, host_down.shape[2]), np.uint8)
    for e in range(E):
        if res[AT + e] >= 0:
            slots_down[res[AT + e]] = host_down[AT + e]
    chosen = np.array([[0, 3], [4, 0]], np.int32)
    weights = np.array([[0.7, 0.3], [0.55, 0.45]], np.float32)
    h = rng.standard_normal((2, K, f)).astype(np.float32)
    x0 = rng.standard_normal((2, d)).astype(np.float32)
    f_host = dq(host_down, "Q4_1")
    want = x0.copy()
    expert_down_ref(h, chosen, weights, res, AT, dq(slots_down, "Q4_1").reshape(2, d, f), f_host, want)
    got = x0.copy()
    ahead = rng.integers(0, 256, (8, 100), np.uint8)  # the next product's rows: 25 sectors
    ahead_out = np.zeros(-(-d // 4) * warps * 32, np.uint32)
    expert_down(h, chosen, weights, res[AT + chosen], AT, slots_down, host_down, "Q4_1", got, warps=warps, ahead=ahead,
                ahead_out=ahead_out)
    assert_within(got, want, down_tolerance(h, chosen, weights, lambda e: f_host[AT + e], want))
    assert np.bitwise_xor.reduce(ahead_out) == read_ahead_ref(ahead)  # every sector read ahead, once


def test_the_three_references_composed_are_the_spec():
    """route_ref -> expert_gate_up_ref -> expert_down_ref, reading some experts from slots,
    equal moe_ffn_ref (kernels/experts/moe.py) on the same float32 weights: the same sums
    in another order (each expert's weighted output added per expert there, per token in
    the router's order here), so within 1e-5 of the output's scale."""
    from strata_nb.kernels.experts.moe import moe_ffn_ref
    from strata_nb.kernels.dense.rmsnorm import rmsnorm_ref

    rng = np.random.default_rng(6)
    n_tok = 9
    host_gu, host_down, slots_gu, slots_down, res, *_ = experts_case("Q4_1", 2)
    f_host_gu, f_host_down = dq(host_gu, "Q4_1"), dq(host_down, "Q4_1")
    f_slots_gu, f_slots_down = dq(slots_gu, "Q4_1"), dq(slots_down, "Q4_1")
    router = (0.3 * rng.standard_normal((E, D))).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    x = rng.standard_normal((n_tok, D)).astype(np.float32)
    x_norm, chosen = np.zeros_like(x), np.zeros((n_tok, K), np.int32)
    weights, counts = np.zeros((n_tok, K), np.float32), np.zeros(LAYERS * E, np.int32)
    got = x.copy()
    route_ref(got, norm, 1e-5, router, x_norm, chosen, weights, np.zeros_like(chosen), res, AT, counts, counts.copy())
    h = np.zeros((n_tok, K, F), np.float32)
    expert_gate_up_ref(x_norm, chosen, res, AT, f_slots_gu, f_host_gu, h)
    expert_down_ref(h, chosen, weights, res, AT, f_slots_down, f_host_down, got)
    normed = np.empty_like(x)
    rmsnorm_ref(x, norm, 1e-5, normed)
    want = moe_ffn_ref(x.copy(), normed, router, list(f_host_gu[AT:AT + E]), list(f_host_down[AT:AT + E]), K)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want - x).max()
    assert (res[AT + np.unique(chosen)] >= 0).any() and (res[AT + np.unique(chosen)] < 0).any()  # both sources
