"""Pipeline parallelism: schedules and simulator, every schedule equal to one process and to
torch.distributed.pipelining, a dead stage named within the deadline, the benchmark's rows."""

import pytest
import torch

from course_lib import pipeline as P
from course_lib.testing import pipeline as K
from course_lib.testing.timing import assert_no_hang

CLUSTER_SIZE = 4  # the shared cluster of tests/conftest.py


@pytest.mark.parametrize("N,M", [(2, 1), (2, 4), (4, 2), (4, 8), (3, 16)])
def test_simulated_bubble_is_the_formula_and_1f1b_keeps_at_most_n_alive(N, M):
    for schedule in ("gpipe", "1f1b"):
        sim = P.simulate(schedule, N, M, t_forward=1.0, t_backward=2.0)
        assert sim.bubble == pytest.approx(P.bubble_fraction(N, M))
        assert sim.makespan == pytest.approx((M + N - 1) * 3.0)
    assert P.simulate("gpipe", N, M).peak_live == [M] * N
    assert P.simulate("1f1b", N, M).peak_live == [min(N - s, M) for s in range(N)]
    naive = P.simulate("naive", N, M)
    assert naive.bubble == pytest.approx(P.bubble_fraction(N, 1)) and naive.peak_live == [1] * N


def test_1f1b_order_warms_up_alternates_and_cools_down():
    assert P.schedule_order("1f1b", 0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0),
                                                 ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert P.schedule_order("1f1b", 2, 3, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1),
                                                 ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert P.schedule_order("1f1b", 0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_an_order_that_deadlocks_is_named():
    bad = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("B", 1), ("F", 0), ("B", 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        P.simulate("1f1b", 2, 2, orders=bad)


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="schedule must be one of"):
        P.schedule_order("zigzag", 0, 2, 2)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        P.schedule_order("gpipe", 0, 2, 0)
    with pytest.raises(ValueError, match="cannot make 4 stages"):
        P.balance([1.0, 2.0], 4)
    with pytest.raises(ValueError, match="add up to the model's 3 layers"):
        P.split_model(torch.nn.Sequential(*[torch.nn.Tanh()] * 3), [1, 1])


def test_balance_minimises_the_slowest_stage():
    assert P.balance([1, 1, 5, 1, 1, 1], 3) == [2, 1, 3]
    assert P.balance([1.0] * 7, 3) in ([3, 2, 2], [2, 3, 2], [2, 2, 3])
    assert P.balance([4, 1, 1, 1, 1], 2) == [1, 4]


@pytest.mark.parametrize("schedule", P.SCHEDULES)
@pytest.mark.parametrize("M", [1, 3, 16])
def test_every_schedule_equals_one_process(cluster, schedule, M):
    reports = cluster.run(K.pipeline_matches_one_process, schedule, M)
    assert max(r["grad"] for r in reports) < 1e-10, reports
    assert reports[-1]["loss"] < 1e-10
    expected = P.simulate(schedule, 4, M).peak_live
    assert [r["peak_live"] for r in reports] == expected


def test_uneven_stages_on_three_ranks_with_fewer_microbatches_than_stages(cluster):
    reports = cluster.run(K.pipeline_matches_one_process, "1f1b", 2, [1, 4, 2], num_layers=7,
                          world_size=3)
    assert reports[3] is None
    assert max(r["grad"] for r in reports[:3]) < 1e-10 and reports[2]["loss"] < 1e-10


@pytest.mark.parametrize("schedule,M", [("gpipe", 4), ("1f1b", 4), ("zb-h1", 4), ("zb-v", 8)])
def test_same_loss_and_gradients_as_torch_pipelining(cluster, schedule, M):
    # zb-v: 8 layers in 2N = 8 chunks; torch's ZBV schedule wants M >= 2N - 1
    reports = cluster.run(K.torch_pipelining_matches, schedule, M,
                          num_layers=8 if schedule == "zb-v" else 6)
    assert max(r["grad"] for r in reports) < 1e-10, reports
    assert reports[0 if schedule == "zb-v" else -1]["loss"] < 1e-10


def test_a_stage_that_never_sends_is_named_on_every_rank_within_the_deadline(cluster):
    reports = cluster.run(K.silent_stage, 1, 2.0, timeout=30)
    for rank, (message, seconds) in enumerate(reports):
        if rank == 1:
            assert message == "silent"
            continue
        assert message.startswith(f"stage {rank} (rank {rank}):"), message
        assert_no_hang(seconds, 2.0 * 3)  # the chain of the stages' deadlines at worst
    assert "from stage 1" in reports[2][0] or "from stage 1" in reports[0][0]
    assert cluster.run(K.pipeline_matches_one_process, "1f1b", 4)[-1]["loss"] < 1e-10


def test_bench_rows_put_the_measurement_beside_the_prediction(cluster):
    from course_lib.bench import pipeline as bench
    rows = bench.measure(cluster, stages=[2, 4], schedules=["gpipe", "1f1b"],
                         microbatches=[1, 4], forward_s=0.005, backward_s=0.01)
    assert [(r["stages"], r["schedule"], r["microbatches"]) for r in rows] == [
        (N, s, M) for N in (2, 4) for s in ("gpipe", "1f1b") for M in (1, 4)]
    for r in rows:
        assert r["formula_bubble"] == pytest.approx(P.bubble_fraction(r["stages"],
                                                                      r["microbatches"]))
        assert r["peak_live"] == r["simulated_peak_live"]
        assert 0 < r["bubble"] < 1 and r["step_ms"] > 0 and r["simulated_ms"] > 0
    text = bench.format_table(rows)
    assert "formula" in text and "ceiling" in text


def test_bench_rows_of_the_zero_bubble_schedules(cluster):
    from course_lib.bench import pipeline as bench
    rows = bench.measure(cluster, stages=[4], schedules=["1f1b", "zb-h1", "zb-v"],
                         microbatches=[2, 8], forward_s=0.004, backward_s=0.008)
    for r in rows:
        formula = r["formula_bubble"]
        if r["schedule"] != "1f1b" and r["microbatches"] == 2:  # too few for the formula
            assert formula != formula  # NaN, printed as "-"
        else:
            assert formula == pytest.approx(P.schedule_bubble(r["schedule"], 4,
                                                              r["microbatches"]))
        assert r["peak_live"] == r["simulated_peak_live"]
        assert (r["weight_ms"] > 0) == (r["schedule"] != "1f1b")  # W measured as its own pass
        assert 0 < r["bubble"] < 1
    assert "(N-1)/(6M+N-1)" in bench.format_table(rows)


def test_layer_times_time_every_layer_and_leave_no_gradient():
    model = K.sleeping_model(forward_ms=(1, 2, 4))
    x, _ = K.make_batch(4, 4, dtype=torch.float32)
    times = P.layer_times(model, x)
    assert len(times) == 3 and all(t >= 3 * f / 1e3 for t, f in zip(times, (1, 2, 4), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert sum(P.balance(times, 2)) == 3


@pytest.mark.parametrize("N,M,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 16, 4), (3, 9, 3)])
def test_interleaved_bubble_is_the_formula_with_v_chunks(N, M, v):
    sim = P.simulate("interleaved", N, M, t_forward=1.0, t_backward=2.0, virtual_stages=v)
    assert sim.bubble == pytest.approx(P.bubble_fraction(N, M, v))
    for s in range(N):
        order = P.interleaved_order(s, N, M, v)
        assert sorted(order) == sorted((op, m, c) for op in "FB" for m in range(M)
                                       for c in range(v))
    with pytest.raises(ValueError, match="not a multiple of 4"):
        P.interleaved_order(0, 4, 6, 2)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_zero_bubble_orders_are_torch_pipelinings(schedule):
    for N in (2, 3, 4, 5):
        for M in (1, 2, 3, 4, 5, 8, 9, 12, 16):
            if schedule == "zb-h1" and M % max(1, M // N):
                continue  # torch refuses M that its rounds of N do not divide
            ours = [P.zb_v_order(s, N, M) if schedule == "zb-v" else
                    P.schedule_order(schedule, s, N, M) for s in range(N)]
            assert ours == K.torch_orders(schedule, N, M), (N, M)


@pytest.mark.parametrize("N,M", [(2, 4), (4, 4), (4, 8), (3, 16), (8, 15)])
def test_zero_bubble_leaves_a_third_then_a_sixth_of_the_idle_slots(N, M):
    one = P.simulate("1f1b", N, M)  # F = 1, B + W = 2
    h1 = P.simulate("zb-h1", N, M)  # B = W = 1: the same work, split
    assert h1.bubble == pytest.approx(P.schedule_bubble("zb-h1", N, M))
    assert h1.makespan - 3 * M == pytest.approx((one.makespan - 3 * M) / 3)  # idle slots: 1/3
    assert h1.peak_live == [N] * N  # later stages keep up to N, as 1F1B's first
    if M >= 2 * N - 1:
        v = P.simulate("zb-v", N, M)
        assert v.bubble == pytest.approx(P.schedule_bubble("zb-v", N, M))
        assert v.makespan - 3 * M == pytest.approx((one.makespan - 3 * M) / 6)
        assert v.peak_live == [2 * N] * N  # chunks of half a stage: N micro-batches' worth
    with pytest.raises(ValueError, match="needs M >= 7"):
        P.schedule_bubble("zb-v", 4, 6)


def test_a_weight_gradient_before_its_backward_is_named():
    good = P.schedule_order("zb-h1", 1, 3, 2)
    P.check_order(good, 1, 2)
    with pytest.raises(ValueError, match="weight gradient of micro-batch 0 comes before"):
        P.check_order([("F", 0), ("W", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 1)], 0, 2)
    with pytest.raises(ValueError, match=r"missing \[\('W', 1\)\]"):
        P.check_order(good[:-1] if good[-1] == ("W", 1) else
                      [s for s in good if s != ("W", 1)], 1, 2)


def test_w_is_the_weight_half_of_autograds_backward():
    layer = torch.nn.Linear(5, 3).double()
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    dy = torch.randn(2, 4, 3, dtype=torch.float64)
    layer(x).backward(dy)
    for param, grad in P.weight_grads(layer, x, dy):
        torch.testing.assert_close(grad, param.grad)
    kept = []
    with P.weights_put_off(layer, kept):
        out = layer(x.clone().requires_grad_())
    out.backward(dy)  # B: the input's gradient only
    assert kept[0][2] is not None and all(p.requires_grad for p in layer.parameters())


@pytest.mark.parametrize("schedule", [*P.SCHEDULES, "zb-v"])
def test_every_schedule_equals_one_process_with_ranks_as_threads(schedule):
    import copy

    from course_lib.comm.recording import run_ranks
    N, M, v_shaped = 3, 6, schedule == "zb-v"
    model, (x, y) = K.make_mlp(6, 8), K.make_batch(12, 8)  # made once: threads share the RNG
    counts = P.balance([1.0] * 6, 2 * N if v_shaped else N)
    parts = P.split_model(copy.deepcopy(model), counts)

    def stage_of(comm):
        return P.v_chunks(parts, comm.rank) if v_shaped else parts[comm.rank]
    results, _ = run_ranks(lambda _, comm: K.run_stage(stage_of(comm), comm, M, x, y, schedule),
                           [None] * N, timeout=20, check_sizes=False)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    for mine, ref in zip(parts, P.split_model(model, counts), strict=True):
        for a, b in zip(mine.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    assert results[0 if v_shaped else -1].loss == pytest.approx(loss.item(), abs=1e-12)
    assert [r.peak_live for r in results] == P.simulate(schedule, N, M).peak_live


def test_bench_torch_comparison_needs_real_layers_and_is_refused_before_any_engine():
    from course_lib.testing import command_line
    out = command_line.run("bench", "pipeline", "--schedules", "zb-v", "--torch")
    assert out.returncode == 1 and "--torch times torch's schedules on real layers" in out.stderr
    out = command_line.run("bench", "pipeline", "--schedules", "zb-x")
    assert out.returncode == 2 and "zb-v" in out.stderr  # the schedules it knows, named
