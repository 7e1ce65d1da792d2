"""The expert kernels in their two tiers.

The plain kernels (kernels/experts/) against their references: the router's ids and
counts exactly and its weights within weights_tolerance; the experts' gate|up + SwiGLU and
down + weighted add within their tolerances; and reading an expert from its slot gives the
same bits as reading it from the host copy.

The fast kernels (fast/) against their plain twins on the same inputs: the router's
choices, lookups and counts exactly, its weights and normed row within the same
tolerances; the experts within gate_up_tolerance and down_tolerance, with misses staged
through shared memory and read in place. Each tolerance bounds how far two float32
evaluations of the same sums in different orders may be apart (the reference is one of
them), so it bounds the twins too: the plain kernels sum a warp's lanes, the fast ones
each thread's parts and then the warps' in order, and the fast router applies the norm
after its dot where the plain one norms the row first.

Under the simulator: 2 tokens, 5 experts of which each token takes 2, D = 64, F = 32
(every simulated thread is a Python thread: 4,096 of them a launch here), two layers'
entries in the tables. On a GPU the default model's shapes (D = 576, F = 192 as moefy's
split of 8 experts), 8 experts, 2 tokens.
"""
import numpy as np
import pytest

from conftest import ON_GPU
from kernels.test_dense_kernels import assert_within, quantized
from strata_nb.fast import expert_down as fast_down, expert_gate_up as fast_gate_up, route as fast_route
from strata_nb.fast.expert_rows import stage_words
from strata_nb.gpu.launch import DeviceArgs
from strata_nb.fast.matvec_fused import read_ahead_ref
from strata_nb.kernels.dense.rmsnorm import rmsnorm_tolerance
from strata_nb.kernels.experts import expert_down as plain_down, expert_gate_up as plain_gate_up, route as plain_route
from strata_nb.kernels.experts.expert_down import down_tolerance, expert_down_ref
from strata_nb.kernels.experts.expert_gate_up import expert_gate_up_ref, gate_up_tolerance
from strata_nb.kernels.experts.route import route_ref, weights_tolerance
from strata_nb.model.dequant import dequantize

E, K, T = (8, 2, 2) if ON_GPU else (5, 2, 2)
D, F = (576, 192) if ON_GPU else (64, 32)
LAYERS = 2  # the tables hold two layers' entries; the tests use layer 1's
AT = E  # layer 1's first entry
ROUTE = {"plain": plain_route.route, "fast": fast_route.route}
GATE_UP = {"plain": plain_gate_up.expert_gate_up, "fast": fast_gate_up.expert_gate_up}
DOWN = {"plain": plain_down.expert_down, "fast": fast_down.expert_down}


def stacked(rng, qtype, n, shape):
    """(n, rows, bytes) uint8: n random matrices in GGUF form."""
    return np.stack([quantized(rng, qtype, shape) for _ in range(n)])


def table(rng, n_slots):
    """res with layer 1's experts 0 and 3 in slots n_slots - 1 and 0, the rest on the host."""
    res = np.full(LAYERS * E, -1, np.int32)
    if n_slots:
        res[AT + 0], res[AT + 3] = n_slots - 1, 0
    return res


def routed(fn, x, norm, router, res, at, k, last=None):
    """fn's outputs for x: x_norm, chosen, weights, slot_of, lookups, hits. router: the
    (E, D) float32 rows for route_ref, (raw, qtype) for a launcher. The counters start at
    5 and 7 (they only grow: a kernel must add to them, not set them)."""
    n, d = x.shape
    out = (np.zeros((n, d), np.float32), np.zeros((n, k), np.int32), np.zeros((n, k), np.float32),
           np.full((n, k), 9, np.int32))
    counters = np.full(res.shape, 5, np.int32), np.full(res.shape, 7, np.int32)
    fn(x, norm, 1e-5, *(router if isinstance(router, tuple) else (router,)), *out, res, at, *counters, last=last)
    return out + counters


def route_case(qtype, d, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    return x, norm, quantized(rng, qtype, (E, d), scale=0.3), table(rng, 2)


@pytest.mark.parametrize("qtype, d", [("F32", D), ("Q8_0", D), ("F32", 1088)])
def test_route_matches_the_reference(qtype, d):
    x, norm, raw, res = route_case(qtype, d)
    router = dequantize(raw, qtype)
    xn, c, w, so, lk, h = routed(route_ref, x, norm, router, res, AT, K)
    xn_k, c_k, w_k, so_k, lk_k, h_k = routed(plain_route.route, x, norm, (raw, qtype), res, AT, K)
    assert_within(xn_k, xn, rmsnorm_tolerance(xn))
    np.testing.assert_array_equal(c_k, c)
    np.testing.assert_array_equal(so_k, so)
    np.testing.assert_array_equal(so, res[AT + c])  # the lookups the expert kernels read
    assert (c[:, 0] != c[:, 1]).all()
    assert_within(w_k, w, weights_tolerance(xn, router) * np.abs(w))
    np.testing.assert_allclose(w_k.sum(axis=1), 1, atol=1e-6)
    np.testing.assert_array_equal(lk_k, lk)
    np.testing.assert_array_equal(h_k, h)
    assert lk.sum() == 5 * LAYERS * E + T * K and (lk[:AT] == 5).all()  # layer 0's entries untouched
    assert h.sum() - 7 * LAYERS * E == sum(int(res[AT + e] >= 0) for e in c.ravel())


@pytest.mark.fast_twin
@pytest.mark.parametrize("qtype, d", [("F32", D), ("Q8_0", D), ("F32", 1088)])
def test_the_fast_router_equals_the_plain_one(qtype, d):
    """The same inputs: the same choices, lookups and counts; the normed row and the
    weights within the reference's tolerances (module docstring). d = 1,088: 136 parts, so
    the fast kernel's lanes take a second round of ROUND parts, the last one short."""
    x, norm, raw, res = route_case(qtype, d)
    xn, c, w, so, lk, h = routed(plain_route.route, x, norm, (raw, qtype), res, AT, K)
    xn_f, c_f, w_f, so_f, lk_f, h_f = routed(fast_route.route, x, norm, (raw, qtype), res, AT, K)
    np.testing.assert_array_equal(c_f, c)
    np.testing.assert_array_equal(so_f, so)
    np.testing.assert_array_equal(lk_f, lk)
    np.testing.assert_array_equal(h_f, h)
    assert_within(xn_f, xn, rmsnorm_tolerance(xn))
    assert_within(w_f, w, weights_tolerance(xn, dequantize(raw, qtype)) * np.abs(w))


@pytest.mark.parametrize("tier", ["plain", "fast"])
def test_route_counts_no_padding(tier):
    """A padded prompt chunk's rows after `last` repeat its last token: they are routed (the
    expert kernels compute them) but not counted as the cache's lookups and hits, in the
    kernel as in the reference. Here 5 rows, of which rows 0 .. 1 are tokens."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, D)).astype(np.float32)
    raw = quantized(rng, "F32", (E, D), scale=0.3)
    res, last, norm = table(rng, 2), np.array([1], np.int32), np.ones(D, np.float32)
    _, c, _, _, lk, h = routed(route_ref, x, norm, dequantize(raw, "F32"), res, AT, K, last=last)
    _, c_k, _, _, lk_k, h_k = routed(ROUTE[tier], x, norm, (raw, "F32"), res, AT, K, last=last)
    np.testing.assert_array_equal(c_k, c)
    np.testing.assert_array_equal(lk_k, lk)
    np.testing.assert_array_equal(h_k, h)
    assert lk.sum() - 5 * LAYERS * E == 2 * K  # two tokens' choices; the three padding rows' none
    np.testing.assert_array_equal(lk[AT:] - 5, np.bincount(c[:2].ravel(), minlength=E))


@pytest.mark.parametrize("tier", ["plain", "fast"])
def test_route_breaks_ties_toward_the_lower_id(tier):
    """Equal logits (a zero router): every expert equally likely; the reference's stable
    sort takes experts 0 .. K-1, and so must the kernel."""
    router = np.zeros((E, D), np.float32).view(np.uint8)
    _, chosen, weights, *_ = routed(ROUTE[tier], np.ones((1, D), np.float32), np.ones(D, np.float32), (router, "F32"),
                                    np.full(LAYERS * E, -1, np.int32), 0, K)
    assert chosen.tolist() == [list(range(K))]
    np.testing.assert_allclose(weights, 1 / K, rtol=1e-6)


@pytest.mark.parametrize("tier", ["plain", "fast"])
def test_route_over_32_experts(tier):
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
    xn, c, w, so, lk, h = routed(route_ref, x, np.ones(D, np.float32), router, res, e, k)
    _, c_k, w_k, so_k, lk_k, h_k = routed(ROUTE[tier], x, np.ones(D, np.float32), (router.view(np.uint8), "F32"), res,
                                          e, k)
    assert set(c[0, :2]) == {33, 38} and set(c[1, :2]) == {5, 36}
    np.testing.assert_array_equal(c_k, c)
    np.testing.assert_array_equal(so_k, so)
    assert_within(w_k, w, weights_tolerance(xn, router) * np.abs(w))
    np.testing.assert_array_equal(lk_k, lk)
    np.testing.assert_array_equal(h_k, h)
    assert h[e + 33] == 7 + 1 and h[e + 5] == 7 + 1 and h.sum() - 7 * 2 * e == 2


@pytest.mark.parametrize("tier", ["plain", "fast"])
def test_route_breaks_ties_past_the_first_32_experts(tier):
    """40 experts, a zero router but for experts 33 and 38, which share one row: their
    logits are equal and the largest, so the lower id comes first, then expert 0, the
    lowest of the rest (all equal at 0)."""
    e, k = 40, 3
    router = np.zeros((e, D), np.float32)
    router[[33, 38]] = 0.01
    _, chosen, *_ = routed(ROUTE[tier], np.ones((1, D), np.float32), np.ones(D, np.float32),
                           (router.view(np.uint8), "F32"), np.full(e, -1, np.int32), 0, k)
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
def test_expert_gate_up_matches_the_reference(qtype, n_slots):
    host_gu, _, slots_gu, _, res, chosen, _, x_norm = experts_case(qtype, n_slots)
    want = np.zeros((T, K, F), np.float32)
    f_host, f_slots = dq(host_gu, qtype), dq(slots_gu, qtype).reshape(n_slots, 2 * F, D)
    expert_gate_up_ref(x_norm, chosen, res, AT, f_slots, f_host, want)
    got = np.zeros((T, K, F), np.float32)
    plain_gate_up.expert_gate_up(x_norm, chosen, res[AT + chosen], AT, slots_gu, host_gu, qtype, got)
    assert_within(got, want, gate_up_tolerance(x_norm, chosen, lambda e: f_host[AT + e]))


def stages(host, row_words: int) -> bool:
    """Whether the fast kernels stage a miss of this (entries, rows, bytes) stack (its rows
    are whole words and fit a staged row of row_words), or read it in place."""
    with DeviceArgs() as dev:
        return bool(stage_words(dev, host, row_words)[1])


@pytest.mark.fast_twin
@pytest.mark.parametrize("qtype,n_slots,stage", [("Q4_1", 2, True), ("Q4_1", 2, False), ("Q4_0", 0, True),
                                                 ("Q8_0", 2, True)])
def test_the_fast_gate_up_equals_the_plain_one(qtype, n_slots, stage):
    """Some choices miss: their rows staged through shared memory (stage) or read in place
    from the host copy; the rest read from their slots."""
    host_gu, _, slots_gu, _, res, chosen, _, x_norm = experts_case(qtype, n_slots)
    slot_of = res[AT + chosen]
    assert (slot_of < 0).any() and (stages(host_gu, fast_gate_up.STAGE_ROW_WORDS) or not stage)
    want, got = np.full((T, K, F), np.nan, np.float32), np.full((T, K, F), np.nan, np.float32)
    plain_gate_up.expert_gate_up(x_norm, chosen, slot_of, AT, slots_gu, host_gu, qtype, want)
    fast_gate_up.expert_gate_up(x_norm, chosen, slot_of, AT, slots_gu, host_gu, qtype, got, stage=stage)
    f_host = dq(host_gu, qtype)
    assert_within(got, want, gate_up_tolerance(x_norm, chosen, lambda e: f_host[AT + e]))


@pytest.mark.fast_twin
@pytest.mark.parametrize("warps,stage", [(1, False), (2, False), (2, True)])
def test_the_fast_gate_up_kernel_walks_its_parts_across_trips(warps, stage):
    """D = 576 (72 parts: one warp takes three trips, two warps two) and F = 5 (the last
    thread block has one of its two pairs), some experts missed (staged, or read in place):
    within the tolerance of the plain kernel."""
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
    want, got = np.full((2, K, f), np.nan, np.float32), np.full((2, K, f), np.nan, np.float32)
    plain_gate_up.expert_gate_up(x_norm, chosen, res[AT + chosen], AT, slots_gu, host_gu, "Q4_1", want)
    fast_gate_up.expert_gate_up(x_norm, chosen, res[AT + chosen], AT, slots_gu, host_gu, "Q4_1", got, warps=warps,
                                stage=stage)
    f_host = dq(host_gu, "Q4_1")
    assert_within(got, want, gate_up_tolerance(x_norm, chosen, lambda e: f_host[AT + e]))


@pytest.mark.fast_twin
def test_gate_up_reads_the_chosen_experts_down_matrices_ahead():
    """Every sector of each hit's down matrix is read once, from its slot: the grid's XOR
    is the XOR of each hit's. A miss's is not read ahead (it would cross the bus twice)."""
    host_gu, host_down, slots_gu, slots_down, res, chosen, _, x_norm = experts_case("Q4_1", 2)
    h = np.zeros((T, K, F), np.float32)
    warps = fast_gate_up.gate_up_warps(D)
    ahead_out = np.zeros(-(-F // fast_gate_up.PAIRS) * T * K * warps * 32, np.uint32)  # a slot per thread
    fast_gate_up.expert_gate_up(x_norm, chosen, res[AT + chosen], AT, slots_gu, host_gu, "Q4_1", h,
                                ahead=(slots_down, host_down), ahead_out=ahead_out)
    want = np.uint32(0)
    for e in chosen.ravel():
        if res[AT + e] >= 0:
            want ^= read_ahead_ref(host_down[AT + e])
    assert (res[AT + chosen] < 0).any() and want != 0
    assert np.bitwise_xor.reduce(ahead_out) == want


@pytest.mark.parametrize("tier,qtype", [("plain", "Q4_1"), pytest.param("fast", "Q4_1", marks=pytest.mark.fast_twin),
                                         pytest.param("fast", "Q8_0", marks=pytest.mark.fast_twin)])
def test_an_expert_reads_the_same_bits_from_its_slot_as_from_the_host_copy(tier, qtype):
    """All on the host (the fast kernels: each miss staged through shared memory, and read
    in place), then experts 0 and 3 in slots: the kernels' outputs are the same bits (the
    cache cannot change what a token computes, nor how a miss is read)."""
    host_gu, host_down, slots_gu, slots_down, res, chosen, weights, x_norm = experts_case(qtype, 2)
    on_host = np.full_like(res, -1)
    ways = ([(on_host, {"stage": True}), (on_host, {"stage": False}), (res, {"stage": True})] if tier == "fast"
            else [(on_host, {}), (res, {})])
    outs = []
    for table_now, how in ways:
        h = np.zeros((T, K, F), np.float32)
        GATE_UP[tier](x_norm, chosen, table_now[AT + chosen], AT, slots_gu, host_gu, qtype, h, **how)
        x = np.ones((T, D), np.float32)
        DOWN[tier](h, chosen, weights, table_now[AT + chosen], AT, slots_down, host_down, qtype, x, **how)
        outs.append((h, x))
    for other in outs[1:]:
        np.testing.assert_array_equal(outs[0][0], other[0])
        np.testing.assert_array_equal(outs[0][1], other[1])
    if tier == "fast":  # its first run staged: the rows are whole words and fit
        assert stages(host_gu, fast_gate_up.STAGE_ROW_WORDS)
        assert stages(host_down, fast_down.STAGE_ROW_WORDS) or host_down.shape[2] % 4
    if qtype != "Q4_1":
        return
    # and a slot that holds the wrong expert's bytes shows: the negative control
    slots_gu[0] = host_gu[AT + 1]
    h = np.zeros((T, K, F), np.float32)
    GATE_UP[tier](x_norm, chosen, res[AT + chosen], AT, slots_gu, host_gu, "Q4_1", h)
    assert not np.array_equal(h, outs[0][0])


@pytest.mark.parametrize("qtype,n_slots", [("Q4_1", 2), ("F16", 0)])
def test_expert_down_matches_the_reference(qtype, n_slots):
    _, host_down, _, slots_down, res, chosen, weights, _ = experts_case(qtype, n_slots, seed=3)
    rng = np.random.default_rng(4)
    h = rng.standard_normal((T, K, F)).astype(np.float32)
    x0 = rng.standard_normal((T, D)).astype(np.float32)
    f_host, f_slots = dq(host_down, qtype), dq(slots_down, qtype).reshape(n_slots, D, F)
    want = x0.copy()
    expert_down_ref(h, chosen, weights, res, AT, f_slots, f_host, want)
    got = x0.copy()
    plain_down.expert_down(h, chosen, weights, res[AT + chosen], AT, slots_down, host_down, qtype, got)
    assert_within(got, want, down_tolerance(h, chosen, weights, lambda e: f_host[AT + e], want))


@pytest.mark.fast_twin
@pytest.mark.parametrize("qtype,n_slots,stage", [("Q4_1", 2, True), ("Q4_1", 2, False), ("F16", 0, True)])
def test_the_fast_down_equals_the_plain_one(qtype, n_slots, stage):
    """Some choices miss: a block whose token chose one stages its rows of every chosen
    expert through shared memory (stage), or reads the misses in place."""
    _, host_down, _, slots_down, res, chosen, weights, _ = experts_case(qtype, n_slots, seed=3)
    slot_of = res[AT + chosen]
    assert (slot_of < 0).any() and (stages(host_down, fast_down.STAGE_ROW_WORDS) or not stage)
    rng = np.random.default_rng(4)
    h = rng.standard_normal((T, K, F)).astype(np.float32)
    x0 = rng.standard_normal((T, D)).astype(np.float32)
    want, got = x0.copy(), x0.copy()
    plain_down.expert_down(h, chosen, weights, slot_of, AT, slots_down, host_down, qtype, want)
    fast_down.expert_down(h, chosen, weights, slot_of, AT, slots_down, host_down, qtype, got, stage=stage)
    f_host = dq(host_down, qtype)
    assert_within(got, want, down_tolerance(h, chosen, weights, lambda e: f_host[AT + e], want))


@pytest.mark.fast_twin
@pytest.mark.parametrize("warps", [1, 2])
def test_the_fast_down_kernel_walks_its_terms_across_experts_and_trips(warps):
    """D = 10 outputs (the last thread block has 2 of its 4 rows) and F = 256 (32 parts an
    expert): with one warp a thread's terms span both experts over two trips; with two,
    the warps' sums meet in shared memory. Within the tolerance of the plain kernel, and
    the next product's rows read ahead."""
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
    want, got = x0.copy(), x0.copy()
    plain_down.expert_down(h, chosen, weights, res[AT + chosen], AT, slots_down, host_down, "Q4_1", want)
    ahead = rng.integers(0, 256, (8, 100), np.uint8)  # the next product's rows: 25 sectors
    ahead_out = np.zeros(-(-d // 4) * warps * 32, np.uint32)
    fast_down.expert_down(h, chosen, weights, res[AT + chosen], AT, slots_down, host_down, "Q4_1", got, warps=warps,
                          ahead=ahead, ahead_out=ahead_out)
    f_host = dq(host_down, "Q4_1")
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
