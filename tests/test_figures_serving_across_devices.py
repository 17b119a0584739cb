"""The figures of notebook 18 draw from their data
(course_lib/figures/serving_across_devices.py)."""

import matplotlib

matplotlib.use("Agg")

from course_lib import paged_attention as pa  # noqa: E402
from course_lib import transformer as tf  # noqa: E402
from course_lib.figures import serving_across_devices as figures  # noqa: E402


def test_every_figure_draws(tmp_path):
    import matplotlib.pyplot as plt
    cfg = tf.GPTConfig(context=32, d_model=16, n_heads=2, n_layers=1)
    model = tf.GPT(cfg).eval()
    todo = [pa.Request([1, 2, 3], 5), pa.Request([4, 5], 3, arrival=0.01)]
    runs = {"static": pa.serve(model, todo, pa.contiguous(cfg, 1), policy="static"),
            "continuous": pa.serve(model, todo, pa.PagedKVCache(cfg, 8, block_size=4))}
    rows = [{"draft": d, "k": k, "speedup": 1.2, "alpha": 0.6, "cost": 0.1, "verify": 1.1}
            for d in ("a", "b") for k in (1, 2)]
    for fig in (figures.roofline_figure([1, 2, 4], [1e-3, 1.1e-3, 1.5e-3], 10**6, 4, 1e11, 1e10,
                                        prefill=([1, 4], [1e-3, 1.2e-3])),
                figures.batching_figure(runs), figures.speculative_figure(rows),
                figures.deployment_figure()):
        assert fig.axes
        plt.close(fig)
    written = figures.save_all(tmp_path)
    assert [p.name for p in written] == ["18_deployment.png"] and written[0].stat().st_size > 0
