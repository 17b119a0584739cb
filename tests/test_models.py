"""Tests of course_lib.models: analytic gradients, the shard-sum identity, shape checks."""

import numpy as np
import pytest
import torch

from course_lib import data, gd, models


def numerical_grad(f, theta, h=1e-6):
    """Central finite differences of a scalar function f at theta."""
    g = np.zeros_like(theta)
    for j in range(theta.size):
        e = np.zeros_like(theta)
        e[j] = h
        g[j] = (f(theta + e) - f(theta - e)) / (2 * h)
    return g


def problems():
    rng = np.random.default_rng(0)
    X_lin, y_lin, _ = data.make_linear(n_samples=23, n_features=3, seed=1)
    X_cls = rng.normal(size=(23, 4))
    y_cls = rng.integers(0, 3, size=23)
    return [
        (models.LinearRegression(), X_lin, y_lin, rng.normal(size=4)),
        (models.SoftmaxRegression(3), X_cls, y_cls, rng.normal(size=15)),
        (models.DoubleWell(), np.zeros((23, 1)), np.zeros(23), np.array([0.7, -0.2, 1.3])),
    ]


@pytest.mark.parametrize("case", range(3))
def test_gradient_matches_finite_differences(case):
    problem, X, y, theta = problems()[case]
    num = numerical_grad(lambda t: problem.loss(t, X, y), theta)
    np.testing.assert_allclose(problem.grad(theta, X, y), num, rtol=1e-6, atol=1e-8)
    num_sum = numerical_grad(lambda t: problem.loss_sum(t, X, y), theta)
    np.testing.assert_allclose(problem.grad_sum(theta, X, y), num_sum, rtol=1e-6, atol=1e-6)


def test_linear_loss_by_hand():
    X = np.array([[1.0, 2.0], [1.0, -1.0]])
    y = np.array([1.0, 2.0])
    theta = np.array([0.5, 1.0])
    # residuals: 0.5 + 2 - 1 = 1.5 and 0.5 - 1 - 2 = -2.5 -> J = (2.25 + 6.25) / 4
    p = models.LinearRegression()
    assert p.loss(theta, X, y) == pytest.approx(8.5 / 4)
    np.testing.assert_allclose(p.grad(theta, X, y), [(1.5 - 2.5) / 2, (3.0 + 2.5) / 2])


def test_softmax_loss_at_zero_is_log_k():
    p = models.SoftmaxRegression(10)
    X = np.random.default_rng(0).normal(size=(7, 5))
    y = np.arange(7)
    assert p.loss(np.zeros(p.n_params(5)), X, y) == pytest.approx(np.log(10))
    W, b = p.unpack(np.arange(60.0), 5)
    assert W.shape == (5, 10) and b.shape == (10,) and b[0] == 50.0


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_sum_of_shard_grad_sums_is_full_gradient(case, world_size):
    problem, X, y, theta = problems()[case]  # 23 samples: not divisible by 2..5
    m = len(X)
    total = sum(problem.grad_sum(theta, *data.shard(X, y, r, world_size))
                for r in range(world_size))
    np.testing.assert_allclose(total / m, problem.grad(theta, X, y), rtol=1e-12, atol=1e-12)
    loss_total = sum(problem.loss_sum(theta, *data.shard(X, y, r, world_size))
                     for r in range(world_size))
    assert loss_total / m == pytest.approx(problem.loss(theta, X, y), rel=1e-12)


def test_empty_shard_gives_zero_grad_sum():
    X, y, _ = data.make_linear(n_samples=3)
    p = models.LinearRegression()
    X_r, y_r = data.shard(X, y, rank=4, world_size=5)
    assert len(X_r) == 0
    np.testing.assert_array_equal(p.grad_sum(np.ones(2), X_r, y_r), [0.0, 0.0])
    with pytest.raises(ValueError, match="empty"):
        p.grad(np.ones(2), X_r, y_r)


def test_shape_mismatch_names_both_shapes():
    X, y, _ = data.make_linear(n_samples=10, n_features=2)
    with pytest.raises(ValueError, match=r"\(2,\).*\(10, 3\)"):
        models.LinearRegression().loss(np.zeros(2), X, y)
    with pytest.raises(ValueError, match=r"\(5,\).*\(10, 3\)"):
        models.LinearRegression().grad(np.zeros(3), X, y[:5])
    with pytest.raises(ValueError, match=r"\(7,\).*\(10, 3\)"):
        models.SoftmaxRegression(2).grad(np.zeros(7), X, np.zeros(10, dtype=int))
    with pytest.raises(ValueError, match="2-D"):
        models.LinearRegression().loss(np.zeros(3), X[0], y[:1])
    with pytest.raises(ValueError, match="labels"):
        models.SoftmaxRegression(2).loss(np.zeros(8), X, np.full(10, 2))


def test_init_shapes_and_determinism():
    assert models.LinearRegression().init(3, seed=0).shape == (3,)
    sm = models.SoftmaxRegression(10)
    np.testing.assert_array_equal(sm.init(64, seed=1), sm.init(64, seed=1))
    assert sm.init(64).shape == (650,)


def test_double_well_has_two_minima_and_gd_finds_each():
    well = models.DoubleWell()
    left, right = well.minima()
    np.testing.assert_allclose(well.grad(np.array([left, right])), 0.0, atol=1e-10)
    assert well.loss(np.array([left])) < well.loss(np.array([right]))  # left is global
    ends = [gd.batch_gd(well, None, None, [w0], 0.05, 200).final_theta[0] for w0 in (-0.3, 0.3)]
    np.testing.assert_allclose(ends, [left, right], atol=1e-6)


def test_softmax_regression_on_digits_beats_90_percent():
    X_train, y_train, X_test, y_test = data.load_digits()
    problem = models.SoftmaxRegression(10)
    hist = gd.minibatch_sgd(problem, X_train, y_train, problem.init(64, seed=0), lr=0.1,
                            num_epochs=8, batch_size=32, seed=0, record_thetas=False)
    assert hist.final_loss < hist.losses[0] / 5
    assert problem.accuracy(hist.final_theta, X_test, y_test) > 0.90
    assert problem.predict(hist.final_theta, X_test).shape == y_test.shape


def test_mlp_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = models.mlp(4, [8, 8], 3, seed=0)
    after = torch.rand(1)
    assert torch.equal(before, after)  # building the model drew nothing from the global RNG
    b = models.mlp(4, [8, 8], 3, seed=0)
    c = models.mlp(4, 8, 3, seed=1)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
    assert a(torch.zeros(5, 4)).shape == (5, 3)
    assert len(c) == 3 and len(a) == 5  # Linear ReLU Linear / Linear ReLU Linear ReLU Linear
