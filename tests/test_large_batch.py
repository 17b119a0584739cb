"""Large mini-batches: the numpy network's gradient equals torch's, the experiment shows what the
linear scaling rule and warmup do (and where they stop working), and lab 07's checks. The
schedule itself is tested with the rest of gd in test_gd.py."""

import numpy as np
import pytest

from course_lib import large_batch


# ---------------------------------------------------------------- the numpy network
def test_mlp_gradient_matches_torch_autograd():
    import torch
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(13, 5)), rng.integers(0, 4, 13)
    problem = large_batch.MLPClassifier(4, hidden=(6, 3), init_scale=1.4)
    theta = problem.init(5, seed=2) + 0.1 * rng.normal(size=problem.n_params(5))
    t = torch.tensor(theta, requires_grad=True)
    z, i = torch.tensor(X), 0
    for k, (a, b) in enumerate([(5, 6), (6, 3), (3, 4)]):
        W, bias = t[i:i + a * b].reshape(a, b), t[i + a * b:i + a * b + b]
        z, i = z @ W + bias, i + a * b + b
        z = torch.relu(z) if k < 2 else z
    loss = torch.nn.functional.cross_entropy(z, torch.tensor(y), reduction="sum")
    loss.backward()
    assert problem.loss_sum(theta, X, y) == pytest.approx(loss.item(), rel=1e-12)
    np.testing.assert_allclose(problem.grad_sum(theta, X, y), t.grad.numpy(), rtol=1e-10,
                               atol=1e-12)
    parts = sum(problem.grad_sum(theta, X[a:b], y[a:b]) for a, b in [(0, 4), (4, 9), (9, 13)])
    np.testing.assert_allclose(parts / 13, problem.grad(theta, X, y), atol=1e-12)


def test_mlp_rejects_bad_shapes():
    problem = large_batch.MLPClassifier(3, hidden=4)
    with pytest.raises(ValueError, match="theta"):
        problem.loss(np.zeros(5), np.zeros((2, 3)), np.zeros(2, int))
    with pytest.raises(ValueError, match="y has shape"):
        problem.grad(problem.init(3), np.zeros((2, 3)), np.zeros(3, int))


# ---------------------------------------------------------------- the experiment
def test_scaling_keeps_accuracy_and_warmup_rescues_the_largest_batch():
    rows = large_batch.accuracy_vs_batch((32, 256, 512, 1024), seeds=(0, 1, 2))
    acc = {(r["batch_size"], r["variant"]): r["mean"] for r in rows}
    base = acc[32, "fixed"]
    assert base > 0.9 and acc[32, "scaled"] == acc[32, "warmup"] == base
    assert acc[256, "fixed"] < acc[256, "scaled"] - 0.03      # fewer updates: fixed lr loses
    assert acc[256, "scaled"] > base - 0.02                    # the rule keeps accuracy
    assert acc[512, "scaled"] < base - 0.1                     # scaling alone breaks ...
    assert acc[512, "warmup"] > base - 0.02                    # ... warmup rescues it
    assert acc[1024, "warmup"] < base - 0.2                    # 10 updates: nothing helps
    updates = {r["batch_size"]: r["updates"] for r in rows}
    assert updates == {32: 420, 256: 50, 512: 20, 1024: 10}    # full batches x 10 epochs
    assert large_batch.largest_batch_within(rows, "warmup", 0.02) == 512
    assert large_batch.largest_batch_within(rows, "fixed", 0.02) == 32
    assert "warmup acc" in large_batch.format_table(rows)


def test_largest_batch_within_and_bad_variant():
    rows = [dict(batch_size=b, variant="v", mean=m) for b, m in
            [(8, 0.90), (16, 0.895), (32, 0.85), (64, 0.891)]]
    assert large_batch.largest_batch_within(rows, "v", 0.01) == 64   # largest, not first gap
    assert large_batch.largest_batch_within(rows, "v", 0.001) == 8
    with pytest.raises(ValueError, match="variant"):
        large_batch.schedule_for("huge", 64, 0.1, 32, 1, 1000)
    with pytest.raises(ValueError, match="unknown setting"):
        large_batch.accuracy_vs_batch((32,), seeds=(0,), lr=0.1)


def test_linear_scaling_is_a_worse_approximation_early_in_training():
    problem = large_batch.MLPClassifier(10, (64, 64), 1.4)
    start = problem.init(64, seed=0)
    trained = large_batch.train_and_test(32, lambda u: 0.1, num_epochs=3)["theta"]
    early = large_batch.linear_scaling_gap(start, 2, 32, 0.1)
    late = large_batch.linear_scaling_gap(trained, 2, 32, 0.1)
    assert early > 2 * late > 0
    run = large_batch.train_and_test(64, lambda u: 0.1, num_epochs=5, target=0.8)
    assert run["updates_to_target"] == run["updates"] < 5 * 21
