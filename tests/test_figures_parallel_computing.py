"""Notebook 02's figure: the four memory architectures, drawn into images/."""

from course_lib.figures import parallel_computing


def test_memory_architectures_figure(tmp_path):
    paths = parallel_computing.save_all(tmp_path)
    assert [p.name for p in paths] == ["02_memory_architectures.png"]
    assert paths[0].stat().st_size > 10_000
