"""Figures on slides: a deck shows each figure across a 1280 x 720 slide, so its text is only as
readable as its size there. Measure it (:func:`slide_text_px`, :func:`too_small_for_slides`),
raise what is smaller than a room reads (:func:`raise_small_text`, :func:`for_slides`), and,
with ``COURSE_LIB_SLIDE_TEXT`` set, fail a notebook cell whose figure is too small
(:func:`watch_slide_text`; the notebook tests set it). Introduced in
notebooks/01_gradient_descent.ipynb."""

import functools
import sys

# A figure on a slide fills the slide's width (1280 less 2 x 48 px of padding) or its height
# (664 px), whichever it reaches first (slides/template/course.css): its text is as large on the
# screen as its points times that scale, whatever its dpi.
SLIDE_PX = (1184, 664)
SLIDE_TEXT_PX = 14  # the smallest figure text a room reads at 1280 x 720


def _px_per_point(fig, slide=SLIDE_PX):
    width, height = fig.get_size_inches()
    return min(slide[0] / width, slide[1] / height) / 72


def slide_text_px(fig, slide=SLIDE_PX):
    """The figure's texts (title, labels, ticks, legend, annotations) as ``[(px, text)]``,
    smallest first: each one's height in pixels when ``fig`` fills a 1280 x 720 slide.
    Introduced in notebooks/01_gradient_descent.ipynb."""
    from matplotlib.text import Text
    fig.draw_without_rendering()  # tick labels and the layout exist once drawn
    px_per_point = _px_per_point(fig, slide)
    shown = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()
             and (t.axes is None or t.axes.get_visible())]
    return sorted((round(t.get_fontsize() * px_per_point, 1), t.get_text()) for t in shown)


def least_points(fig, least=SLIDE_TEXT_PX):
    """The font size, in points, that shows as ``least`` pixels when ``fig`` fills a slide.
    Introduced in notebooks/01_gradient_descent.ipynb."""
    return least / _px_per_point(fig)


def raise_small_text(fig, least=SLIDE_TEXT_PX):
    """Raise every text of ``fig`` smaller than ``least`` pixels on a slide to that size, as a
    browser's minimum font size does: larger texts keep their sizes. Returns ``fig``.
    Introduced in notebooks/01_gradient_descent.ipynb."""
    from matplotlib.text import Text
    points = least_points(fig, least)
    fig.draw_without_rendering()  # the tick labels exist
    for ax in fig.axes:  # ticks made at a later draw copy these sizes
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            for which in ("major", "minor"):
                sizes = [t.get_fontsize() for t in axis.get_ticklabels(which=which)]
                if sizes and min(sizes) < points:
                    ax.tick_params(axis=name, which=which, labelsize=points)
    for text in fig.findobj(Text):
        if text.get_fontsize() < points:
            text.set_fontsize(points)
    return fig


def for_slides(draw):
    """Decorator of the course's figure functions: the figure(s) they return (a figure, axes,
    or a list or tuple of them) get :func:`raise_small_text`. Introduced in
    notebooks/01_gradient_descent.ipynb."""
    @functools.wraps(draw)
    def drawn(*args, **kwargs):
        result = draw(*args, **kwargs)
        for fig in _figures_in(result):
            raise_small_text(fig)
        return result
    return drawn


def _figures_in(result):
    """The figures of a figure, axes, or a list, tuple or array of axes; none for anything else."""
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    if getattr(getattr(result, "dtype", None), "kind", "") == "O":  # an array of axes
        result = list(result.flat)
    items = result if isinstance(result, (list, tuple)) else [result]
    found = []
    for item in items[:100]:
        fig = item if isinstance(item, Figure) else item.figure if isinstance(item, Axes) else None
        if fig is not None and fig not in found:
            found.append(fig)
    return found


def text_fits(room, text, size, margin=2):
    """Whether ``text`` at ``size`` points fits in ``room`` points across (a label inside a
    bar): a digit or letter is about 0.64 of the size wide. Introduced in
    notebooks/09_model_parallelism.ipynb."""
    return room >= 0.64 * size * len(text) + margin


SLIDE_TEXT_ENV = "COURSE_LIB_SLIDE_TEXT"  # set: every figure a cell shows is measured


def too_small_for_slides(fig, least=SLIDE_TEXT_PX):
    """The figure's texts below ``least`` pixels on a 1280 x 720 slide, as a message naming
    them, or ``None`` when a room reads every one. Introduced in
    notebooks/01_gradient_descent.ipynb."""
    small = [(px, text) for px, text in slide_text_px(fig) if px < least]
    if not small:
        return None
    named = ", ".join(f"{text[:30]!r} {px} px" for px, text in small[:4])
    return (f"{len(small)} text(s) of a {fig.get_size_inches()[0]:.3g} x "
            f"{fig.get_size_inches()[1]:.3g} in figure below {least} px on a 1280 x 720 slide: "
            f"{named}: a larger font or a narrower figure")


def watch_slide_text():
    """In IPython with ``COURSE_LIB_SLIDE_TEXT`` set (the notebook tests set it): after each
    cell, raise when a figure it shows (drawn by pyplot, or the cell's value) has text a room
    cannot read on a slide. Introduced in notebooks/01_gradient_descent.ipynb."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return

    def check(figures):
        problems = [p for p in map(too_small_for_slides, figures) if p]
        if problems:
            raise ValueError("\n".join(problems))

    def drawn():
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None:
            check([pyplot.figure(n) for n in pyplot.get_fignums()])

    def returned(result):  # a figure, axes, or a list of them, as a cell's value
        if "matplotlib.figure" in sys.modules:
            check(_figures_in(result.result))

    # first in line: the inline backend shows and closes the cell's figures after execution
    shell.events.callbacks["post_execute"].insert(0, drawn)
    shell.events.register("post_run_cell", returned)
