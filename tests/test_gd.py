"""Tests of course_lib.gd: the three methods agree where they must, schedules and update rules
give their textbook values, bad input fails loudly, divergence stops a run."""

import math

import numpy as np
import pytest

from course_lib import data, gd, models, scaling_rule


@pytest.fixture
def linear():
    X, y, _ = data.make_linear(n_samples=37, n_features=2, seed=3)
    return models.LinearRegression(), X, y, np.zeros(3)


def test_batch_gd_reaches_least_squares(linear):
    problem, X, y, theta0 = linear
    lr = 1.0 / np.linalg.eigvalsh(X.T @ X / len(X)).max()
    hist = gd.batch_gd(problem, X, y, theta0, lr, num_epochs=3000, record_thetas=False)
    theta_star = np.linalg.lstsq(X, y, rcond=None)[0]
    np.testing.assert_allclose(hist.final_theta, theta_star, atol=1e-6)
    assert not hist.diverged and hist.thetas == []
    assert np.all(np.diff(hist.losses) <= 1e-12)  # batch GD with a safe lr never goes up


def test_history_lengths_and_contents(linear):
    problem, X, y, theta0 = linear
    hist = gd.minibatch_sgd(problem, X, y, theta0, 0.05, num_epochs=3, batch_size=10)
    n_updates = 3 * 4  # 37 samples -> batches 10, 10, 10, 7
    assert len(hist.losses) == len(hist.thetas) == n_updates + 1
    assert len(hist.lrs) == len(hist.epochs) == len(hist.batch_losses) == n_updates
    assert hist.epochs == [0] * 4 + [1] * 4 + [2] * 4
    assert hist.losses[0] == pytest.approx(problem.loss(theta0, X, y))
    np.testing.assert_array_equal(hist.thetas[0], theta0)
    for theta, loss in zip(hist.thetas, hist.losses, strict=True):
        assert loss == pytest.approx(problem.loss(theta, X, y))
    np.testing.assert_array_equal(hist.final_theta, hist.thetas[-1])
    assert hist.final_loss == hist.losses[-1]
    np.testing.assert_allclose(hist.epochs_elapsed[[0, 1, 4, 12]], [0, 0.25, 1, 3])
    np.testing.assert_array_equal(theta0, 0.0)  # the caller's theta0 is untouched


def test_minibatch_with_full_batch_equals_batch_gd(linear):
    problem, X, y, theta0 = linear
    full = gd.batch_gd(problem, X, y, theta0, 0.3, num_epochs=25)
    mini = gd.minibatch_sgd(problem, X, y, theta0, 0.3, num_epochs=25, batch_size=len(X))
    np.testing.assert_allclose(mini.thetas, full.thetas, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mini.losses, full.losses, rtol=1e-12)
    big = gd.minibatch_sgd(problem, X, y, theta0, 0.3, num_epochs=25, batch_size=1000)
    np.testing.assert_allclose(big.final_theta, full.final_theta, rtol=1e-12)


@pytest.mark.parametrize("optimizer", [None, gd.Momentum(0.5), gd.Adagrad()])
def test_sgd_equals_minibatch_with_batch_size_one(linear, optimizer):
    problem, X, y, theta0 = linear
    sched = gd.step_decay(0.05, 0.5, 2)
    a = gd.sgd(problem, X, y, theta0, 0.05, 4, seed=7, schedule=sched, optimizer=optimizer)
    b = gd.minibatch_sgd(problem, X, y, theta0, 0.05, 4, batch_size=1, seed=7, schedule=sched,
                         optimizer=optimizer)
    np.testing.assert_array_equal(np.array(a.thetas), np.array(b.thetas))
    assert a.batch_losses == b.batch_losses and a.lrs == b.lrs


def test_minibatch_epoch_contract(linear):
    """Re-implement the documented contract by hand and compare bit for bit."""
    problem, X, y, _ = linear
    theta = np.array([0.5, -1.0, 2.0])
    theta_lib, losses_lib = gd.minibatch_sgd_epoch(problem, X, y, theta, 0.1, 8,
                                                   np.random.default_rng(42))
    rng = np.random.default_rng(42)
    order = rng.permutation(len(X))
    th, losses = theta.copy(), []
    for start in range(0, len(X), 8):
        idx = order[start:start + 8]
        losses.append(problem.loss(th, X[idx], y[idx]))
        th = th - 0.1 * problem.grad(th, X[idx], y[idx])
    np.testing.assert_array_equal(theta_lib, th)
    assert losses_lib == losses and len(losses) == 5
    np.testing.assert_array_equal(theta, [0.5, -1.0, 2.0])  # input not modified


def test_minibatch_sgd_builds_on_epochs_with_one_rng(linear):
    problem, X, y, theta0 = linear
    hist = gd.minibatch_sgd(problem, X, y, theta0, 0.1, 3, batch_size=8, seed=5)
    rng, theta = np.random.default_rng(5), theta0
    for _ in range(3):
        theta, _ = gd.minibatch_sgd_epoch(problem, X, y, theta, 0.1, 8, rng)
    np.testing.assert_array_equal(hist.final_theta, theta)


def test_schedules_values():
    assert gd.constant(0.1)(17) == 0.1
    step = gd.step_decay(0.8, drop=0.5, epochs_per_drop=10)
    assert [step(e) for e in (0, 9, 10, 19, 20, 35)] == [0.8, 0.8, 0.4, 0.4, 0.2, 0.1]
    assert gd.exponential_decay(1.0, 0.5)(2) == pytest.approx(math.exp(-1.0))
    assert gd.inverse_time_decay(0.3, 0.5)(4) == pytest.approx(0.1)
    assert gd.inverse_time_decay(0.3, 0.5)(0) == 0.3
    for bad in (lambda: gd.constant(0), lambda: gd.step_decay(0.1, drop=1.5),
                lambda: gd.exponential_decay(-1, 0.1), lambda: gd.inverse_time_decay(1, -1)):
        with pytest.raises(ValueError):
            bad()


def test_schedule_is_applied_per_epoch(linear):
    problem, X, y, theta0 = linear
    hist = gd.minibatch_sgd(problem, X, y, theta0, 0.1, 4, batch_size=20,
                            schedule=gd.step_decay(0.1, 0.5, 2))
    assert hist.lrs == [0.1] * 4 + [0.05] * 4
    hist = gd.batch_gd(problem, X, y, theta0, 0.1, 3, schedule=gd.inverse_time_decay(0.1, 1.0))
    assert hist.lrs == pytest.approx([0.1, 0.05, 0.1 / 3])


def test_momentum_by_hand():
    opt = gd.Momentum(beta=0.9)
    theta = np.array([1.0, -2.0])
    g1, g2 = np.array([0.5, 1.0]), np.array([-1.0, 2.0])
    theta = opt.step(theta, g1, 0.1)  # v = 0.1 * g1 = [0.05, 0.1]
    np.testing.assert_allclose(theta, [0.95, -2.1])
    theta = opt.step(theta, g2, 0.1)  # v = 0.9 * [0.05, 0.1] + 0.1 * g2 = [-0.055, 0.29]
    np.testing.assert_allclose(theta, [1.005, -2.39])
    opt.reset()
    np.testing.assert_allclose(opt.step(np.zeros(2), g1, 1.0), -g1)


def test_momentum_correction_by_hand():
    g1, g2 = np.array([0.5, 1.0]), np.array([-1.0, 2.0])
    for correction, v2 in ((True, 0.9 * (0.2 / 0.1) * 0.1 * g1 + 0.2 * g2),   # rescaled to 0.2
                           (False, 0.9 * 0.1 * g1 + 0.2 * g2)):
        opt = gd.Momentum(beta=0.9, correction=correction)
        theta = opt.step(np.zeros(2), g1, 0.1)               # v = 0.1 * g1 either way
        np.testing.assert_allclose(opt.step(theta, g2, 0.2), theta - v2, rtol=1e-15)
        opt.reset()                                          # forgets v and the last rate
        np.testing.assert_allclose(opt.step(np.zeros(2), g1, 0.4), -0.4 * g1)


def _torch_sgd_steps(problem, X, y, theta0, rates, beta, batch_size=8, seed=0):
    """torch.optim.SGD(momentum=beta) (the rate outside: u <- beta u + g, w <- w - lr u) on the
    batches of minibatch_sgd, the rate of update u set to rates[u]: every update's parameters."""
    import torch

    w = torch.tensor(theta0, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([w], lr=rates[0], momentum=beta)
    rng, thetas, u = np.random.default_rng(seed), [], 0
    while u < len(rates):
        order = rng.permutation(len(X))
        for start in range(0, len(X), batch_size):
            if u == len(rates):
                break
            idx = order[start:start + batch_size]
            w.grad = torch.from_numpy(problem.grad(w.detach().numpy(), X[idx], y[idx]))
            opt.param_groups[0]["lr"] = rates[u]
            opt.step()
            thetas.append(w.detach().numpy().copy())
            u += 1
    return np.array(thetas)


def test_momentum_with_correction_equals_torch_sgd_under_warmup(linear):
    """Goyal et al. (2017): the rate inside the momentum (eq. 10) with the correction lr/lr_prev
    takes the steps of the rate outside (eq. 9, torch.optim.SGD) under a changing rate; without
    the correction it does not."""
    problem, X, y, theta0 = linear
    per_epoch = gd.updates_per_epoch(len(X), 8)                  # 5
    warmup = scaling_rule.linear_scaling_warmup(0.01, 256, 8, warmup_epochs=2,
                                                updates_per_epoch=per_epoch)
    rates = [warmup(u) for u in range(4 * per_epoch)]            # 0.01 -> 0.32 in 10 updates
    assert rates[1] / rates[0] > 4 and rates[-1] == rates[10]    # a ramp, then a constant rate
    want = _torch_sgd_steps(problem, X, y, theta0, rates, beta=0.9)
    runs = {c: gd.minibatch_sgd(problem, X, y, theta0, 0.01, 4, batch_size=8, seed=0,
                                optimizer=gd.Momentum(0.9, correction=c), update_schedule=warmup)
            for c in (True, False)}
    assert runs[True].lrs == rates
    np.testing.assert_allclose(np.array(runs[True].thetas[1:]), want, rtol=1e-12, atol=1e-14)
    off = np.array(runs[False].thetas[1:])
    np.testing.assert_array_equal(off[0], want[0])               # the first step has no history
    gap = np.linalg.norm(off - want, axis=1) / np.linalg.norm(want - theta0, axis=1)
    assert gap[1:].min() > 0.05 and gap.max() > 0.3              # differs from the second step on


def test_momentum_correction_is_the_identity_at_a_constant_rate(linear):
    problem, X, y, theta0 = linear
    a, b = (gd.minibatch_sgd(problem, X, y, theta0, 0.05, 3, batch_size=8, seed=2,
                             optimizer=gd.Momentum(0.9, correction=c)) for c in (True, False))
    np.testing.assert_array_equal(np.array(a.thetas), np.array(b.thetas))   # bit for bit
    rates = [0.05] * len(a.lrs)
    want = _torch_sgd_steps(problem, X, y, theta0, rates, beta=0.9, seed=2)
    np.testing.assert_allclose(np.array(a.thetas[1:]), want, rtol=1e-12, atol=1e-14)


def test_adagrad_by_hand():
    opt = gd.Adagrad(eps=0.0)
    theta = np.array([0.0, 0.0])
    theta = opt.step(theta, np.array([3.0, 0.1]), 0.5)  # first step: lr * sign(g)
    np.testing.assert_allclose(theta, [-0.5, -0.5])
    theta = opt.step(theta, np.array([4.0, 0.0]), 0.5)  # G = [25, 0.01]: 0.5 * 4 / 5 = 0.4
    np.testing.assert_allclose(theta, [-0.9, -0.5])
    assert gd.SGD().step(np.array([1.0]), np.array([2.0]), 0.25)[0] == 0.5


def test_adagrad_learns_rare_features_faster():
    X, y, _ = data.make_sparse_linear(n_samples=500, frequencies=(1.0, 0.2, 0.04))
    problem = models.LinearRegression()
    theta_star = np.linalg.lstsq(X, y, rcond=None)[0]
    plain = gd.batch_gd(problem, X, y, np.zeros(3), 0.5, 100)
    ada = gd.batch_gd(problem, X, y, np.zeros(3), 0.5, 100, optimizer=gd.Adagrad())
    err_plain = np.abs(plain.final_theta - theta_star)
    err_ada = np.abs(ada.final_theta - theta_star)
    assert err_plain[2] > 0.1 and err_ada.max() < 0.01


def test_momentum_speeds_up_an_ill_conditioned_problem(linear):
    problem, X, y, theta0 = linear
    plain = gd.batch_gd(problem, X, y, theta0, 0.1, 100)
    heavy = gd.batch_gd(problem, X, y, theta0, 0.1, 100, optimizer=gd.Momentum(0.9))
    assert heavy.final_loss < plain.final_loss


def test_divergence_stops_early_without_warnings(linear):
    problem, X, y, theta0 = linear
    with np.errstate(all="raise"):
        hist = gd.batch_gd(problem, X, y, theta0, 50.0, num_epochs=10_000)
    assert hist.diverged and len(hist.losses) < 10_000
    assert not np.isfinite(hist.final_loss) or hist.final_loss > 1e10
    hist = gd.sgd(problem, X, y, theta0, 50.0, num_epochs=1000)
    assert hist.diverged and len(hist.losses) < 1000 * len(X)
    hist = gd.minibatch_sgd(problem, X, y, theta0, 50.0, num_epochs=1000, batch_size=4)
    assert hist.diverged and len(hist.epochs) < 1000 * 10
    assert not gd.batch_gd(problem, X, y, theta0, 0.1, 5).diverged


def test_bad_input_raises(linear):
    problem, X, y, theta0 = linear
    for lr in (0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="learning rate"):
            gd.batch_gd(problem, X, y, theta0, lr, 1)
    with pytest.raises(ValueError, match="num_epochs"):
        gd.sgd(problem, X, y, theta0, 0.1, -1)
    with pytest.raises(ValueError, match="batch_size"):
        gd.minibatch_sgd(problem, X, y, theta0, 0.1, 1, batch_size=0)
    with pytest.raises(ValueError, match="batch_size"):
        gd.minibatch_sgd_epoch(problem, X, y, theta0, 0.1, 0, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"\(2,\).*\(37, 3\)"):
        gd.minibatch_sgd(problem, X, y, np.zeros(2), 0.1, 1)
    with pytest.raises(ValueError, match="number of samples"):
        gd.batch_gd(problem, X, y[:-1], theta0, 0.1, 1)
    with pytest.raises(ValueError, match="learning rate"):
        gd.batch_gd(problem, X, y, theta0, 0.1, 3, schedule=lambda e: 0.1 - 0.1 * e)
    hist = gd.batch_gd(problem, X, y, theta0, 0.1, 0)
    assert len(hist.losses) == 1 and hist.lrs == []


# ------------------------------------------------- linear scaling + warmup (notebook 07)
def test_warmup_schedule_exact_values():
    sched = scaling_rule.linear_scaling_warmup(0.1, 1024, 32, warmup_epochs=3, updates_per_epoch=10)
    assert sched(0) == 0.1                                 # starts at the base rate
    assert sched(15) == pytest.approx(0.1 + 3.1 * 15 / 30, rel=1e-12)   # halfway: linear
    assert sched(29) == pytest.approx(0.1 + 3.1 * 29 / 30, rel=1e-12)
    assert sched(30) == sched(31) == sched(10**9) == pytest.approx(3.2, rel=1e-12)
    rates = [sched(u) for u in range(31)]
    np.testing.assert_allclose(np.diff(rates), 3.1 / 30, rtol=1e-9)  # per update, not per epoch


def test_warmup_schedule_edge_cases():
    assert [scaling_rule.linear_scaling_warmup(0.2, 64, 32, 0, 5)(u) for u in (0, 7)] == [0.4, 0.4]
    flat = scaling_rule.linear_scaling_warmup(0.05, 256, 256, 2, 7)
    assert {flat(u) for u in range(20)} == {0.05}
    frac = scaling_rule.linear_scaling_warmup(0.1, 512, 32, 0.5, 7)  # W = 3.5 updates
    assert frac(3) == pytest.approx(0.1 + 1.5 * 3 / 3.5) and frac(4) == pytest.approx(1.6)
    down = scaling_rule.linear_scaling_warmup(0.4, 16, 64, 1, 4)     # k = 1/4 ramps down
    assert down(0) == 0.4 and down(2) == pytest.approx(0.25) and down(4) == pytest.approx(0.1)


@pytest.mark.parametrize("args", [(0, 64, 32, 1, 5), (0.1, 0, 32, 1, 5), (0.1, 64, 32, -1, 5),
                                  (0.1, 64, 32, 1, 0), (0.1, 64.0, 32, 1, 5),
                                  (float("nan"), 64, 32, 1, 5)])
def test_warmup_schedule_rejects_bad_input(args):
    with pytest.raises(ValueError):
        scaling_rule.linear_scaling_warmup(*args)


def test_schedule_rejects_bad_update_and_updates_per_epoch():
    with pytest.raises(ValueError, match="update index"):
        scaling_rule.linear_scaling_warmup(0.1, 64, 32, 1, 5)(-1)
    assert gd.updates_per_epoch(1347, 32) == 43
    assert gd.updates_per_epoch(1347, 32, drop_last=True) == 42
    assert gd.updates_per_epoch(100, 1000, drop_last=True) == 1
    with pytest.raises(ValueError):
        gd.updates_per_epoch(100, 0)


# ---------------------------------------------------------------- mini-batch SGD per update
def test_constant_update_schedule_is_bit_for_bit_plain_minibatch(linear):
    problem, X, y, theta0 = linear
    plain = gd.minibatch_sgd(problem, X, y, theta0, 0.05, 3, batch_size=10, seed=4)
    per_update = gd.minibatch_sgd(problem, X, y, theta0, 0.05, 3, batch_size=10, seed=4,
                                  update_schedule=lambda u: 0.05)
    np.testing.assert_array_equal(plain.final_theta, per_update.final_theta)
    assert plain.losses == per_update.losses and plain.lrs == per_update.lrs


def test_update_schedule_is_applied_update_by_update(linear):
    problem, X, y, theta0 = linear
    sched = scaling_rule.linear_scaling_warmup(0.01, 20, 10, warmup_epochs=1.5, updates_per_epoch=2)
    hist = gd.minibatch_sgd(problem, X, y, theta0, 0.01, 3, batch_size=20, seed=1,
                            update_schedule=sched)
    assert hist.lrs == [sched(u) for u in range(6)] and hist.epochs == [0, 0, 1, 1, 2, 2]
    theta, rng, u = theta0.copy(), np.random.default_rng(1), 0   # the same loop by hand
    for _ in range(3):
        order = rng.permutation(len(X))
        for start in range(0, len(X), 20):
            idx = order[start:start + 20]
            theta = theta - sched(u) * problem.grad(theta, X[idx], y[idx])
            u += 1
    np.testing.assert_allclose(hist.final_theta, theta, rtol=1e-12)
    with pytest.raises(ValueError, match="not both"):
        gd.minibatch_sgd(problem, X, y, theta0, 0.1, 1, schedule=gd.constant(0.1),
                         update_schedule=sched)
