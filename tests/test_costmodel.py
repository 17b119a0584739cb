"""The alpha-beta-gamma cost model: formulas by hand, the shape claims, the fit, nccl-tests bw."""

import numpy as np
import pytest

from course_lib import costmodel
from course_lib.costmodel import ALGORITHMS, Link

# alpha = 1 s, beta = 0.1 s/byte, gamma = 0.01 s/byte, n = 100 bytes: a message costs 11 s.
TOY = Link("toy", alpha=1.0, beta=0.1, gamma=0.01)

HAND = {
    # p = 4, log2 p = 2
    (4, "naive"): 2 * 3 * 11 + 3 * 1.0,                      # 69
    (4, "tree"): 2 * 2 * 11 + 2 * 1.0,                       # 46
    (4, "recursive_doubling"): 2 * (1 + 10 + 1),             # 24
    (4, "rabenseifner"): 2 * 2 * 1 + 2 * 0.75 * 10 + 0.75,   # 19.75
    (4, "ring"): 2 * 3 * 1 + 2 * 0.75 * 10 + 0.75,           # 21.75
    # p = 5 is not a power of two: ceil(log2 5) = 3
    (5, "naive"): 2 * 4 * 11 + 4 * 1.0,                      # 92
    (5, "tree"): 2 * 3 * 11 + 3 * 1.0,                       # 69
    (5, "recursive_doubling"): 3 * 12,                       # 36
    (5, "rabenseifner"): 2 * 3 * 1 + 2 * 0.8 * 10 + 0.8,     # 22.8
    (5, "ring"): 2 * 4 * 1 + 2 * 0.8 * 10 + 0.8,             # 24.8
    # p = 2: every algorithm but naive/tree is one exchange
    (2, "recursive_doubling"): 12.0,
    (2, "ring"): 2 * 1 + 10 + 0.5,
}


@pytest.mark.parametrize(("p", "algorithm"), sorted(HAND))
def test_formulas_match_hand_computed_values(p, algorithm):
    assert costmodel.allreduce_time(algorithm, 100, p, TOY) == pytest.approx(HAND[p, algorithm])


def test_one_rank_costs_nothing_and_bad_input_is_refused():
    for name in ALGORITHMS:
        assert costmodel.allreduce_time(name, 1e6, 1, TOY) == 0.0
    with pytest.raises(ValueError, match="unknown algorithm"):
        costmodel.allreduce_time("butterfly", 100, 4, TOY)
    with pytest.raises(ValueError, match=">= 1"):
        costmodel.allreduce_time("ring", 100, 0, TOY)


def test_vectorised_over_sizes_and_ranks():
    ps = np.array([2, 4, 8, 16])
    ns = np.array([1e3, 1e6])
    for name in ALGORITHMS:
        grid = costmodel.allreduce_time(name, ns[:, None], ps[None, :], TOY)
        assert grid.shape == (2, 4)
        for i, n in enumerate(ns):
            for j, p in enumerate(ps):
                assert grid[i, j] == pytest.approx(costmodel.allreduce_time(name, n, p, TOY))
    assert isinstance(costmodel.allreduce_time("ring", 100, 4, TOY), float)


def test_ring_bandwidth_term_tends_to_2n_beta_and_meets_the_lower_bound():
    link = Link("bw only", alpha=0.0, beta=1e-9)
    n = 1e8
    for p in [2, 3, 7, 64, 1000, 4096]:
        ring = costmodel.allreduce_time("ring", n, p, link)
        assert ring == pytest.approx(costmodel.lower_bound(n, p, link), rel=1e-12)
        assert ring == pytest.approx(2 * (p - 1) / p * n * link.beta)
        for name in ALGORITHMS:  # nothing beats the bound
            assert costmodel.allreduce_time(name, n, p, link) >= ring * (1 - 1e-12)
    assert costmodel.allreduce_time("ring", n, 10**6, link) == pytest.approx(2 * n * 1e-9,
                                                                          rel=1e-5)


def test_ring_flattens_while_naive_grows_linearly():
    link = costmodel.LINKS["100GbE"]
    n = 100e6
    ps = np.array([2, 4, 8, 16, 32, 64])
    ring = costmodel.allreduce_time("ring", n, ps, link)
    naive = costmodel.allreduce_time("naive", n, ps, link)
    assert ring[-1] / ring[0] < 2.2                     # 32x the ranks, about 2x the time
    assert np.all(np.diff(ring) > 0) and np.all(np.diff(ring) / ring[:-1] < 0.6)
    assert naive / (ps - 1) == pytest.approx(np.full(len(ps), naive[0]))  # exactly linear in p-1
    assert naive[-1] / ring[-1] > 30


def test_crossover_between_latency_and_bandwidth_optimal_algorithms():
    link = Link("l", alpha=1e-5, beta=1e-9)
    p = 8
    n_star = costmodel.crossover_bytes("recursive_doubling", "rabenseifner", p, link)
    # 3 extra alpha against 3 - 2 * 7/8 = 1.25 fewer beta per byte
    assert n_star == pytest.approx(3 * 1e-5 / (1.25 * 1e-9))
    below, above = 0.5 * n_star, 2 * n_star
    assert (costmodel.allreduce_time("recursive_doubling", below, p, link)
            < costmodel.allreduce_time("rabenseifner", below, p, link))
    assert (costmodel.allreduce_time("recursive_doubling", above, p, link)
            > costmodel.allreduce_time("rabenseifner", above, p, link))
    assert costmodel.crossover_bytes("ring", "naive", p, link) == float("inf")


def _noisy_times(algorithm, n, p, link, noise, seed):
    rng = np.random.default_rng(seed)
    exact = costmodel.allreduce_time(algorithm, n, p, link)
    return exact * (1 + noise * rng.standard_normal(len(n)))


@pytest.mark.parametrize(("algorithm", "p"), [("ring", 2), ("ring", 4), ("tree", 8),
                                              ("naive", 3)])
def test_fit_recovers_alpha_and_beta_from_noisy_times(algorithm, p):
    true = Link("true", alpha=20e-6, beta=1 / 5e9)
    n = np.geomspace(8, 64e6, 25)
    seconds = _noisy_times(algorithm, n, p, true, noise=0.02, seed=0)
    fit = costmodel.fit_alpha_beta(n, seconds, algorithm=algorithm, p=p)
    assert fit.name == "measured"
    assert fit.alpha == pytest.approx(true.alpha, rel=0.03)
    assert fit.beta == pytest.approx(true.beta, rel=0.03)
    assert fit.bandwidth == pytest.approx(5e9, rel=0.03)


def test_fit_subtracts_a_known_gamma_and_keeps_alpha_nonnegative():
    true = Link("true", alpha=5e-6, beta=1e-9, gamma=2e-10)
    n = np.geomspace(1e3, 1e8, 12)
    seconds = costmodel.allreduce_time("ring", n, 4, true)
    fit = costmodel.fit_alpha_beta(n, seconds, "ring", 4, gamma=true.gamma)
    assert (fit.alpha, fit.beta, fit.gamma) == pytest.approx((5e-6, 1e-9, 2e-10), rel=1e-6)
    # pure bandwidth data with noise that would pull a free fit's alpha below zero
    n = np.array([1e6, 2e6, 4e6])
    seconds = n * 1e-9 * np.array([0.95, 1.0, 1.0])
    free = np.linalg.lstsq(np.column_stack([np.ones(3), n]), seconds, rcond=None)[0]
    assert free[0] < 0
    fit = costmodel.fit_alpha_beta(n, seconds, "ring", 2)
    assert fit.alpha == 0.0 and fit.beta == pytest.approx(1e-9, rel=0.05)


@pytest.mark.parametrize(("n", "t", "message"), [
    ([1e3, 1e4], [1e-3], "2 values but seconds has 1"),
    ([1e3], [1e-3], "at least 2"),
    ([1e3, 1e3], [1e-3, 2e-3], "at least 2"),
    ([0, 1e3], [1e-3, 2e-3], "positive"),
    ([-5, 1e3], [1e-3, 2e-3], "positive"),
    ([1e3, 1e4], [0.0, 2e-3], "times must be positive"),
])
def test_fit_rejects_bad_input(n, t, message):
    with pytest.raises(ValueError, match=message):
        costmodel.fit_alpha_beta(n, t)


def test_busbw_is_algbw_times_2_p_minus_1_over_p():
    n, t = 256e6, 0.05
    assert costmodel.algbw(n, t) == pytest.approx(n / t)
    for p in [1, 2, 4, 8, 1000]:
        assert costmodel.busbw(n, t, p) == pytest.approx(n / t * 2 * (p - 1) / p)
    # an algorithm on the lower bound shows busbw = link bandwidth, whatever p
    link = Link("bw only", alpha=0.0, beta=1 / 10e9)
    for p in [2, 16, 512]:
        t = costmodel.allreduce_time("ring", n, p, link)
        assert costmodel.busbw(n, t, p) == pytest.approx(10e9)


def test_predict_table_reaches_thousands_of_ranks_and_formats():
    rows = costmodel.predict_table(100e6, [2, 64, 4096], costmodel.LINKS["InfiniBand HDR"])
    assert [r["p"] for r in rows] == [2, 64, 4096]
    assert set(rows[0]) == {"p", *ALGORITHMS, "lower_bound"}
    assert all(r["ring"] >= r["lower_bound"] for r in rows)
    text = costmodel.format_table(rows, unit="ms")
    assert len(text.splitlines()) == 4 and "4096" in text and "rabenseifner" in text


def test_links_are_documented_round_numbers():
    links = costmodel.LINKS
    assert set(links) == {"10GbE", "100GbE", "InfiniBand HDR", "NVLink"}
    assert links["10GbE"].bandwidth == pytest.approx(1.25e9)
    assert links["InfiniBand HDR"].bandwidth == pytest.approx(25e9)
    assert 1e-6 <= links["InfiniBand HDR"].alpha <= 2e-6
    speeds = [links[k].bandwidth for k in ("10GbE", "100GbE", "InfiniBand HDR", "NVLink")]
    assert speeds == sorted(speeds)
    assert "GB/s" in str(links["NVLink"])


# ---------------------------------------------------------------- GPU to GPU: staged or direct
A = Link("a", alpha=1.0, beta=0.1)   # 100 bytes: 11 s; a 20-byte chunk: 3 s
W = Link("w", alpha=2.0, beta=0.2)   # 100 bytes: 22 s; a 20-byte chunk: 6 s


def test_store_and_forward_is_the_sum_of_the_passes():
    assert costmodel.path_time(100, [A]) == pytest.approx(11.0)
    assert costmodel.path_time(100, [A, W, A]) == pytest.approx(11 + 22 + 11)
    # arrays of sizes: 200 bytes is 1 + 20 and 2 + 40
    assert costmodel.path_time(np.array([100, 200]), [A, W]) == pytest.approx([33, 63])


def test_a_pipeline_costs_the_slowest_pass_plus_a_chunk_of_each_other():
    # 5 chunks of 20 bytes through A, W, A: one chunk of each (3 + 6 + 3), then 4 more of the
    # slowest (W: 6 each) = 36, against 44 store and forward
    assert costmodel.path_time(100, [A, W, A], chunk_bytes=20) == pytest.approx(12 + 4 * 6)
    # one stage: chunks only add latency, 5 x (1 + 2)
    assert costmodel.path_time(100, [A], chunk_bytes=20) == pytest.approx(15.0)
    # a chunk as large as the message is store and forward
    assert costmodel.path_time(100, [A, W], chunk_bytes=100) == \
        pytest.approx(costmodel.path_time(100, [A, W]))
    assert costmodel.path_time(100, [A, W], chunk_bytes=1000) == pytest.approx(33.0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        costmodel.path_time(100, [A], chunk_bytes=0)


def test_pcie_line_rate_and_effective_bandwidth():
    assert costmodel.PCIE_LINE_RATE["PCIe 4.0 x16"] == pytest.approx(31.5e9, rel=1e-3)
    assert costmodel.PCIE_LINE_RATE["PCIe 5.0 x16"] == pytest.approx(63.0e9, rel=1e-3)
    for name, link in costmodel.PCIE.items():
        assert link.bandwidth < costmodel.PCIE_LINE_RATE[name]   # effective below line rate
    assert costmodel.PCIE["PCIe 4.0 x16"].bandwidth == pytest.approx(25e9)
    assert costmodel.PCIE["PCIe 5.0 x16"].bandwidth == pytest.approx(50e9)


def test_gpudirect_paths_by_hand():
    paths = costmodel.gpu_paths()
    pcie, ib = costmodel.PCIE["PCIe 4.0 x16"], costmodel.LINKS["InfiniBand HDR"]
    n = 64e6
    staged = costmodel.path_time(n, paths["across nodes, staged through host memory"])
    assert staged == pytest.approx(2 * (5e-6 + n / 25e9) + 1.5e-6 + n / 25e9)
    assert costmodel.path_time(n, paths["across nodes, GPUDirect RDMA"]) == \
        pytest.approx(ib.alpha + n * ib.beta)
    # PCIe and InfiniBand HDR both carry 25 GB/s: staging triples a large transfer's time...
    assert staged / costmodel.path_time(n, [ib]) == pytest.approx(3.0, rel=1e-3)
    # ... and pipelining in 4 MB chunks hides all but one chunk's copies (16 chunks)
    piped = costmodel.path_time(n, paths["across nodes, staged through host memory"], 4e6)
    assert piped == pytest.approx(2 * (5e-6 + 4e6 / 25e9) + 1.5e-6 + 4e6 / 25e9
                                  + 15 * (5e-6 + 4e6 / 25e9))
    inside = costmodel.path_time(n, paths["inside a node, staged through host memory"])
    assert inside == pytest.approx(2 * costmodel.path_time(n, [pcie]))
    assert costmodel.path_time(n, paths["inside a node, NVLink"]) < \
        costmodel.path_time(n, paths["inside a node, GPUDirect P2P over PCIe"]) < inside
    with pytest.raises(ValueError, match="unknown link"):
        costmodel.path_time(n, ["carrier pigeon"])
