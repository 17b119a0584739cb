"""The figures of the notebooks, one module per notebook topic. Every module's ``save_all(out_dir)``
writes its figures into ``images/``: ``python -m course_lib images`` calls them all."""

from pathlib import Path

from course_lib.runtime.slide_text import (  # noqa: F401  (the figure modules' floor)
    for_slides,
    least_points,
    raise_small_text,
    text_fits,
    too_small_for_slides,
)


def finish(fig, path=None):
    """Raise the figure's small text to the slide floor, write it to ``path`` when one is
    given, and return it: the end of a figure function that draws on a ``Figure`` of its own.
    Introduced in notebooks/01_gradient_descent.ipynb."""
    raise_small_text(fig)
    if path is not None:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig


def save_figure(fig, out_dir, name, dpi=120):
    """Write ``fig`` as ``out_dir/name`` (laid out tight), close it, and return the path: the end
    of every ``save_all``. Introduced in notebooks/09_model_parallelism.ipynb."""
    import matplotlib.pyplot as plt
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if fig.get_layout_engine() is None:  # a figure made with layout="constrained" keeps it
        fig.tight_layout()
    fig.savefig(out / name, dpi=dpi)
    plt.close(fig)
    return out / name
