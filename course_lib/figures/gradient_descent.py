"""Figures of notebook 01 (gradient descent), drawn from runs of `course_lib.gd`.

Every function returns a matplotlib ``Figure`` built without pyplot (so it works under any
backend, shows once in a notebook, and leaks nothing) and saves it when given ``path``.
``save_all(out_dir)`` regenerates the PNGs in ``images/`` (``make images``):

    python -c "from course_lib.figures import gradient_descent as f; f.save_all('images')"
"""

from __future__ import annotations

import time
from pathlib import Path

import matplotlib as mpl
import numpy as np
from matplotlib.figure import Figure

from course_lib import data, gd, models
from course_lib.figures import finish


def _epoch_means(hist):
    """Mean full-data loss over the updates of each epoch, drawn mid-epoch (start at x = 0)."""
    ep = np.asarray(hist.epochs)
    loss = np.asarray(hist.losses[1:])
    means = [loss[ep == e].mean() for e in np.unique(ep)]
    return np.r_[0.0, np.arange(len(means)) + 0.5], np.array([hist.losses[0], *means])


def _curves(ax, histories, optimum=None):
    """Loss (or loss - optimum) of each run against epochs, log scale. Runs with several
    updates per epoch get a faint per-update line and a bold line of per-epoch means."""
    for i, (name, hist) in enumerate(histories.items()):
        off = optimum or 0.0
        label = f"{name} (diverged)" if hist.diverged else str(name)
        if len(hist.epochs) > len(set(hist.epochs)):
            ax.plot(hist.epochs_elapsed, np.asarray(hist.losses) - off, color=f"C{i}",
                    lw=0.5, alpha=0.35)
            x, loss = _epoch_means(hist)
            ax.plot(x, loss - off, color=f"C{i}", lw=1.8, label=label + ", epoch mean")
        else:
            ax.plot(hist.epochs_elapsed, np.asarray(hist.losses) - off, color=f"C{i}", lw=1.8,
                    label=label)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("J(θ) - J(θ*)" if optimum is not None else "J(θ)")
    ax.legend(fontsize=8)


def plot_loss_curves(histories, optimum=None, title="Full-data loss", path=None):
    """Loss of several runs on one epoch axis (``optimum`` subtracted when given)."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    _curves(ax, histories, optimum)
    ax.set_title(title)
    return finish(fig, path)


def plot_sgd_fluctuation(history, num_updates=400, path=None):
    """SGD's noisy per-sample losses next to the full loss after each of the first updates."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    n = min(num_updates, len(history.batch_losses))
    ax.plot(np.arange(n), history.batch_losses[:n], ".", ms=3, alpha=0.5,
            label="loss of the sample used for the update")
    ax.plot(np.arange(n + 1), history.losses[: n + 1], lw=1.5, color="C3",
            label="full-data loss J(θ) after the update")
    ax.set_yscale("log")
    ax.set_xlabel("update")
    ax.set_title("SGD: each step follows one sample, so the loss does not always decrease")
    ax.legend(fontsize=8)
    return finish(fig, path)


def plot_lr_sweep(histories, lr_max=None, optimum=None, path=None):
    """Left: loss curves per learning rate. Right: loss after the run against lr.

    ``histories`` maps lr -> History; ``lr_max`` (e.g. 2 / largest Hessian eigenvalue) is drawn
    as the stability limit; ``optimum`` (the minimum loss) is subtracted when given.
    """
    off = optimum or 0.0
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    lrs = sorted(histories)
    cmap = mpl.colormaps["viridis"]
    for i, lr in enumerate(lrs):
        hist = histories[lr]
        ax1.plot(hist.epochs_elapsed, np.asarray(hist.losses) - off,
                 color=cmap(i / max(len(lrs) - 1, 1)),
                 label=f"lr={lr:.3g}" + (" diverged" if hist.diverged else ""))
    top = 100 * max(h.losses[0] - off for h in histories.values())
    ylabel = "J(θ) - J(θ*)" if optimum is not None else "J(θ)"
    ax1.set(yscale="log", xlabel="epoch", ylabel=ylabel, title="loss curves")
    ax1.set_ylim(top=top)
    ax1.legend(fontsize=7, ncol=2)
    final = np.array([histories[lr].final_loss - off for lr in lrs])
    bad = np.array([histories[lr].diverged or not final[i] < top for i, lr in enumerate(lrs)])
    ax2.plot(np.array(lrs)[~bad], final[~bad], "o-", label="converging")
    if bad.any():
        ax2.plot(np.array(lrs)[bad], np.full(bad.sum(), top), "x", color="C3", ms=10, mew=2,
                 label="blew up")
    if lr_max is not None:
        ax2.axvline(lr_max, color="C3", ls="--", label=f"2/λ_max = {lr_max:.3g}")
    ax2.legend(fontsize=8)
    ax2.set(xscale="log", yscale="log", xlabel="learning rate", ylabel=ylabel + " at the end",
            title="too small: slow; too large: diverges")
    return finish(fig, path)


def plot_schedules(schedules, num_epochs, histories=None, optimum=None, path=None):
    """Learning rate against epoch for each schedule; with ``histories``, their loss curves."""
    fig = Figure(figsize=(11 if histories else 6, 4), layout="constrained")
    axes = fig.subplots(1, 2 if histories else 1, squeeze=False)[0]
    epochs = np.arange(num_epochs)
    for name, schedule in schedules.items():
        axes[0].step(epochs, [schedule(e) for e in epochs], where="post", label=name)
    axes[0].set(xlabel="epoch", ylabel="learning rate", title="annealing schedules")
    axes[0].legend(fontsize=8)
    if histories:
        _curves(axes[1], histories, optimum)
        axes[1].set_title("SGD with each schedule")
    return finish(fig, path)


def plot_contour_paths(problem, X, y, histories, optimum_theta=None, path=None):
    """Contours of J over a 2-parameter model, with each run's path of theta on top."""
    pts = np.vstack([np.asarray(h.thetas) for h in histories.values()])
    if optimum_theta is not None:
        pts = np.vstack([pts, optimum_theta])
    lo, hi = pts.min(axis=0), pts.max(axis=0)
    pad = 0.15 * (hi - lo) + 1e-3
    t0, t1 = np.meshgrid(np.linspace(lo[0] - pad[0], hi[0] + pad[0], 120),
                         np.linspace(lo[1] - pad[1], hi[1] + pad[1], 120))
    J = np.array([problem.loss(np.array([a, b]), X, y) for a, b in zip(t0.ravel(), t1.ravel(),
                                                                          strict=True)])
    J = J.reshape(t0.shape)
    fig = Figure(figsize=(7, 5.5), layout="constrained")
    ax = fig.add_subplot()
    levels = J.min() + np.geomspace(1e-3, 1.0, 14) * (J.max() - J.min())
    ax.contour(t0, t1, J, levels=levels, colors="0.6", linewidths=0.7)
    for i, (name, hist) in enumerate(histories.items()):
        th = np.asarray(hist.thetas)
        ax.plot(th[:, 0], th[:, 1], "-", color=f"C{i}", lw=1.0, alpha=0.8, label=name,
                marker="o" if len(th) < 60 else None, ms=3)
    ax.plot(*pts[0], "ks", label="start")
    if optimum_theta is not None:
        ax.plot(*optimum_theta, "r*", ms=14, label="least squares θ*")
    ax.set(xlabel="θ₀ (intercept)", ylabel="θ₁ (slope)", title="paths of θ on the loss surface")
    ax.legend(fontsize=8)
    return finish(fig, path)


def plot_per_parameter_error(histories, theta_star, path=None):
    """One panel per run: |θ_j - θ*_j| against epoch for every parameter j."""
    fig = Figure(figsize=(5 * len(histories), 4), layout="constrained")
    axes = fig.subplots(1, len(histories), sharey=True, squeeze=False)[0]
    for ax, (name, hist) in zip(axes, histories.items(), strict=True):
        err = np.abs(np.asarray(hist.thetas) - theta_star)
        for j in range(err.shape[1]):
            ax.plot(hist.epochs_elapsed, err[:, j], label=f"θ{j}")
        ax.set(yscale="log", xlabel="epoch", title=name)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("|θ_j - θ*_j|")
    return finish(fig, path)


def plot_two_minima(problem, histories, path=None):
    """A 1-D non-convex loss with the gradient-descent iterates from several starts."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    w = np.linspace(-1.6, 1.6, 400)
    ax1.plot(w, [problem.loss(np.array([v])) for v in w], color="k", lw=1)
    for i, (name, hist) in enumerate(histories.items()):
        th = np.asarray(hist.thetas)[:, 0]
        ax1.plot(th, hist.losses, "o-", color=f"C{i}", ms=3, lw=0.6, label=name)
        ax1.plot(th[-1], hist.losses[-1], "*", color=f"C{i}", ms=14)
        ax2.plot(hist.losses, color=f"C{i}", label=name)
    ax1.set(xlabel="θ", ylabel="J(θ)", title="where you start decides where you end")
    ax1.legend(fontsize=8)
    ax2.set(xlabel="update", ylabel="J(θ)", title="both runs converge, to different values")
    return finish(fig, path)


def plot_batch_size_tradeoff(problem, X, y, batch_sizes, lr, num_epochs=3, seed=0, path=None):
    """Run mini-batch SGD per batch size: samples/second of one epoch, and loss after
    ``num_epochs``. Small batches make more (noisier) progress per epoch; large batches use
    the hardware better. Timings vary run to run; only the shape matters."""
    theta0 = problem.init(X.shape[1], seed)
    speed, final = [], []
    for b in batch_sizes:
        rng, theta = np.random.default_rng(seed), theta0
        t0 = time.perf_counter()
        for _ in range(num_epochs):
            theta, _ = gd.minibatch_sgd_epoch(problem, X, y, theta, lr, b, rng)
        speed.append(num_epochs * len(X) / (time.perf_counter() - t0))
        final.append(problem.loss(theta, X, y))
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(batch_sizes, speed, "o-")
    ax1.set(xscale="log", yscale="log", xlabel="batch size", ylabel="samples / second",
            title="throughput")
    ax2.plot(batch_sizes, final, "o-", color="C1")
    ax2.set(xscale="log", yscale="log", xlabel="batch size", ylabel="J(θ)",
            title=f"loss after {num_epochs} epochs at lr={lr}")
    for ax in (ax1, ax2):
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    return finish(fig, path)


def save_all(out_dir, seed=0):
    """Write notebook 01's key figures as PNGs into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    X, y, _ = data.make_linear(n_samples=200, seed=seed)
    problem = models.LinearRegression()
    theta_star = np.linalg.lstsq(X, y, rcond=None)[0]
    j_star = problem.loss(theta_star, X, y)
    theta0, lr, num_epochs = np.array([0.0, 0.0]), 0.1, 30
    runs = {
        "batch GD": gd.batch_gd(problem, X, y, theta0, lr, num_epochs),
        "SGD": gd.sgd(problem, X, y, theta0, lr, num_epochs, seed=seed),
        "mini-batch (32)": gd.minibatch_sgd(problem, X, y, theta0, lr, num_epochs, 32, seed),
    }
    lr_max = 2 / np.linalg.eigvalsh(X.T @ X / len(X)).max()
    lrs = [*np.geomspace(3e-3, 0.8, 8).round(4), 0.9, 1.0]
    sweep = {lr: gd.batch_gd(problem, X, y, theta0, lr, 50) for lr in lrs}
    well = models.DoubleWell()
    starts = {f"start θ={w0}": gd.batch_gd(well, None, None, [w0], 0.05, 60) for w0 in (-0.3, 0.3)}
    schedules = {"constant": gd.constant(0.1), "step decay": gd.step_decay(0.1, 0.5, 5),
                 "exponential": gd.exponential_decay(0.1, 0.15),
                 "1/t": gd.inverse_time_decay(0.1, 0.5)}
    annealed = {name: gd.sgd(problem, X, y, theta0, 0.1, num_epochs, seed, schedule=s)
                for name, s in schedules.items()}
    files = {
        "01_loss_curves.png": lambda p: plot_loss_curves(runs, optimum=j_star, path=p),
        "01_contour_paths.png": lambda p: plot_contour_paths(problem, X, y, runs, theta_star,
                                                             path=p),
        "01_lr_sweep.png": lambda p: plot_lr_sweep(sweep, lr_max, j_star, path=p),
        "01_two_minima.png": lambda p: plot_two_minima(well, starts, path=p),
        "01_sgd_fluctuation.png": lambda p: plot_sgd_fluctuation(runs["SGD"], path=p),
        "01_schedules.png": lambda p: plot_schedules(schedules, num_epochs, annealed, j_star,
                                                     path=p),
    }
    for name, draw in files.items():
        draw(out / name)
    return [str(out / name) for name in files]
