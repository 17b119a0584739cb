"""bench serving: the options, and one tiny run through the command line whose rows are checked,
never its timings."""

import csv

from course_lib.testing import command_line


def test_bad_options_are_refused():
    assert command_line.run("bench", "serving", "--batches", "0,2").returncode == 2
    out = command_line.run("bench", "serving", "--d-model", "60")
    assert out.returncode == 1 and "--d-model" in out.stderr


def test_a_tiny_run_prints_every_row(tmp_path):
    path = tmp_path / "serving.csv"
    out = command_line.run("bench", "serving", "--batches", "1,4", "--d-model", "64",
                           "--layers", "1", "--requests", "4", "--repeats", "1",
                           "--csv", str(path))
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(open(path)))
    assert [r["batch"] for r in rows] == ["1", "4"]
    assert all(float(r["course_ms"]) > 0 and float(r["native_ms"]) > 0 for r in rows)
    assert "critical batch" in out.stdout and "native = torch's scaled_dot_product_attention" \
        in out.stdout
    batching = [line for line in out.stdout.splitlines() if line.startswith(("static", "cont"))]
    assert len(batching) == 2 and all(line.endswith("True") for line in batching)
