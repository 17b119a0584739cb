"""Notebook 05's figures: the library's ring recorded step by step, message patterns, PNGs."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from course_lib.figures import allreduce as fa  # noqa: E402
from course_lib.sharding import shard_bounds  # noqa: E402


@pytest.mark.parametrize("world_size", range(1, 9))
def test_ring_ends_with_the_full_sum_on_every_rank(world_size):
    rng = np.random.default_rng(world_size)
    data = rng.standard_normal((world_size, 5 * world_size + 3))   # chunks of unequal size
    states = fa.record_ring(world_size, data=data)
    assert len(states) == 1 + 2 * (world_size - 1)
    assert states[0].phase == "start" and np.array_equal(states[0].buffers, data)
    final = states[-1]
    np.testing.assert_allclose(final.buffers, np.broadcast_to(data.sum(0), data.shape),
                               rtol=1e-12, atol=1e-12)
    assert final.holds.all()
    assert [s.phase for s in states[1:]] == (["reduce-scatter"] * (world_size - 1)
                                             + ["all-gather"] * (world_size - 1))


@pytest.mark.parametrize("world_size", range(2, 9))
def test_every_step_sends_one_chunk_per_rank_to_its_right_neighbour(world_size):
    for state in fa.record_ring(world_size)[1:]:
        assert sorted(src for src, _, _ in state.sends) == list(range(world_size))
        assert all(dst == (src + 1) % world_size for src, dst, _ in state.sends)
        chunks = [c for _, _, c in state.sends]
        assert sorted(chunks) == list(range(world_size))   # each chunk is in flight once
        # the stated schedule
        s = state.step - 1
        shift = 1 if state.phase == "reduce-scatter" else 0
        assert all(c == (src - s - shift) % world_size for src, _, c in state.sends)


@pytest.mark.parametrize("world_size", [2, 3, 4, 7])
def test_after_reduce_scatter_rank_r_owns_the_reduced_chunk_r(world_size):
    data = np.arange(world_size * 2 * world_size, dtype=float).reshape(world_size, -1) ** 2
    states = fa.record_ring(world_size, data=data)
    after = states[world_size - 1]
    assert after.phase == "reduce-scatter" and after.step == world_size - 1
    total = data.sum(0)
    for r in range(world_size):
        assert after.counts[r, r] == world_size
        lo, hi = shard_bounds(data.shape[1], r, world_size)
        np.testing.assert_array_equal(after.buffers[r, lo:hi], total[lo:hi])
        # a chunk a rank has not finished holds fewer contributions
        assert all(after.counts[r, c] < world_size for c in range(world_size) if c != r)


def test_record_ring_refuses_data_of_the_wrong_shape():
    with pytest.raises(ValueError, match="must be"):
        fa.record_ring(3, data=np.zeros((2, 6)))


def _reach(messages, world_size, phase):
    """Who each rank has heard from, following the messages of one phase in step order."""
    know = [{r} for r in range(world_size)]
    for _, src, dst, ph in sorted(messages):
        if ph == phase:
            know[dst] = know[dst] | know[src]
    return know


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8, 13])
def test_naive_and_tree_messages_reduce_to_rank_0_and_broadcast_back(world_size):
    levels = int(np.ceil(np.log2(world_size))) if world_size > 1 else 0
    for messages, num_steps in [(fa.naive_messages(world_size), 2 * (world_size - 1)),
                                (fa.tree_messages(world_size), 2 * levels)]:
        assert len(messages) == 2 * (world_size - 1)      # every rank sends once, receives once
        assert len({step for step, *_ in messages}) == num_steps
        reduced = _reach(messages, world_size, "reduce")
        assert reduced[0] == set(range(world_size))
        for step in {step for step, *_ in messages}:      # a rank is in one message a step
            busy = [r for st, src, dst, _ in messages if st == step for r in (src, dst)]
            assert len(busy) == len(set(busy))
        got = {0}
        for _, src, dst, ph in sorted(messages):
            if ph == "broadcast":
                assert src in got
                got.add(dst)
        assert got == set(range(world_size))


@pytest.mark.parametrize("world_size", [2, 3, 4])  # notebook 05 draws 4, lab 05 3
def test_ring_figure_has_one_panel_per_step(world_size):
    fig = fa.ring_steps_figure(world_size)
    assert len(fig.axes) == 2 * (world_size - 1)
    titles = [ax.get_title() for ax in fig.axes]
    assert sum("reduce-scatter" in t for t in titles) == world_size - 1
    assert sum("all-gather" in t for t in titles) == world_size - 1
    with pytest.raises(ValueError):
        fa.ring_steps_figure(1)


def test_naive_tree_and_cost_model_figures_have_two_panels():
    assert len(fa.naive_and_tree_figure(8).axes) == 2
    assert len(fa.naive_and_tree_figure(5).axes) == 2
    fig = fa.cost_model_figure("InfiniBand HDR", n_bytes=1e6, p_fixed=16)
    assert len(fig.axes) == 2
    left = fig.axes[0]
    assert len(left.get_lines()) == len(fa.costmodel.ALGORITHMS) + 1      # + the lower bound
    assert left.get_xlim()[1] >= 4096


def test_save_all_writes_the_three_pngs(tmp_path):
    paths = fa.save_all(tmp_path)
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == ["05_cost_model.png", "05_naive_and_tree.png", "05_ring_steps.png"]
    assert sorted(paths) == sorted(str(tmp_path / n) for n in names)
    assert all((tmp_path / n).stat().st_size > 10_000 for n in names)


def test_emulated_link_figure_puts_measured_dots_over_model_lines(tmp_path):
    from course_lib.runtime import netem
    link = netem.make_link("1Gbit/s,50us")
    rows = [dict(world_size=p, algorithm=a, size=n, link=link.text,
                 time_us=1.1e6 * netem.predict_allreduce(a, n, p, link),
                 busbw=n / netem.predict_allreduce(a, n, p, link) * 2 * (p - 1) / p / 1e9)
            for p in (2, 4) for a in ("naive", "ring") for n in (2**16, 2**20)]
    bare = [dict(r, time_us=r["time_us"] / 10, link=None) for r in rows]
    fig = fa.emulated_link_figure(rows, bare, path=tmp_path / "emulated.png")
    ax1, ax2, ax3 = fig.axes
    assert len(ax1.lines) == 4 and len(ax2.lines) == 6 and len(ax3.lines) == 3  # + the 100% line
    dots = [line for line in ax1.lines if line.get_linestyle() == "None"]
    assert [list(d.get_xdata()) for d in dots] == [[2, 4], [2, 4]]
    assert (tmp_path / "emulated.png").stat().st_size > 10_000
    assert "1 Gbit/s, 50 us" in fig.get_suptitle()


def test_links_figure_has_a_panel_per_link_and_marks_where_latency_takes_over():
    fig = fa.links_figure(100e6)
    assert len(fig.axes) == len(fa.costmodel.LINKS)
    assert all(len(ax.get_lines()) in (4, 5) for ax in fig.axes)  # 3 algorithms, bound, p*
    link = fa.costmodel.LINKS["10GbE"]
    p = fa.latency_takes_over(100e6, link)
    assert 2 * (p - 1) * link.alpha == pytest.approx(fa.costmodel.lower_bound(100e6, p, link))
