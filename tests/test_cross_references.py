"""Cross-references between notebooks, labs and the README stay true when notebooks are renumbered.

What counts as a reference, in every markdown cell of every notebook and lab and in README.md
(fenced code and LaTeX left out):

* ``notebook 05``, ``Notebooks 03–08``, ``notebooks 05 and 06``, ``notebook 05's``, ``lab 05``;
* a bare number in parentheses after what it names: ``allreduce (05)``, ``(00, 02)``;
* a course-map row: a table row that starts ``| 05 | allreduce |``;
* a link to a notebook or lab, ``[06 · data-parallel SGD](06_data_parallel_sgd.ipynb)``, or
  its file name anywhere, ``labs/04_parameter_server.ipynb``;
* a notebook's or lab's own title, ``# 05 · ...`` or ``# Lab 05 · ...``.

What is checked:

1. **The number exists**: ``notebooks/NN_*.ipynb`` (``labs/NN_*.ipynb`` for a lab), a named
   file or a link's target exists, a link's text carries its target's number, a title its
   file's number.
2. **A named topic matches.** In a course-map row the name cell contains the words of that
   notebook's file name (``10 | sharded data parallelism``), and a table that maps ten or more
   numbers lists every notebook. Around any other single reference, the words that name it
   (its clause, at most ten words on each side, or the whole table cell it sits in) must not
   name *another* notebook's topic (``TOPICS``) unless they also name its own:
   ``saves checkpoints (notebook 10)`` fails, since checkpoints are notebook 11's;
   ``the parameter server of notebook 04`` passes.
3. **Planned notebooks** (18 and later) may be named only in a clause that says they are
   not there yet, with one of the words ``coming``, ``planned``, ``future`` or ``to come``:
   "notebook 18 (coming: ...)".
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = {p.name[:2]: p for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))}
LABS = {p.name[:2]: p for p in sorted((ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))}
SOURCES = [*NOTEBOOKS.values(), *LABS.values(),
           *sorted((ROOT / "labs" / "solutions").glob("*.ipynb")), ROOT / "README.md"]

# Words that name each notebook's topic (case aside, plural or not). A word may belong to
# several notebooks: a reference fails only where its words name others and not its own.
TOPICS = {
    "00": ("welcome", "first cluster", "%%px"),
    "01": ("gradient descent", "learning rate", "annealing", "adagrad", "softmax"),
    "02": ("parallel computing", "message passing", "messages between", "point-to-point",
           "sendrecv", "deadlock", "race", "lost update", "numa"),
    "03": ("hogwild", "lock-free", "shared memory", "sparse update"),
    "04": ("parameter server", "server", "ps job", "stale", "backup worker", "chief"),
    "05": ("allreduce", "all-reduce", "ring", "tree", "alpha-beta", "cost model", "emulated",
           "netem", "reduce-scatter", "all-gather", "lower bound", "collective", "nccl"),
    "06": ("data-parallel", "data parallel", "ddp", "distributeddataparallel", "bucket",
           "horovod", "broadcast", "tensor fusion", "overlap", "synchronous",
           "average gradient"),
    "07": ("large mini-batch", "large batch", "linear scaling", "warmup", "warm-up",
           "straggler", "global batch"),
    "08": ("local sgd", "compression", "top-k", "quantization", "fp16", "error feedback"),
    "09": ("model parallel", "pipeline", "tensor parallel", "megatron", "gpipe", "1f1b"),
    "10": ("sharded", "zero", "fsdp", "training state", "memory budget"),
    "11": ("fault", "checkpoint", "chief", "restart", "resume", "failure", "torchft"),
    "12": ("scaling out", "launcher", "torchrun", "mpiexec", "mpirun", "srun", "slurm",
           "kubernetes", "host", "node", "multi-host"),
    "13": ("hyper-parameter", "hyperparameter", "embarrassingly parallel", "many experiments",
           "random search", "successive halving", "asha", "hyperband", "optuna"),
    "14": ("transformer", "long sequence", "ring attention", "zig-zag", "online softmax",
           "context parallel", "sequence length"),
    "15": ("mixture of experts", "mixture-of-experts", "expert parallel", "router",
           "capacity factor", "top-k dispatch", "load-balancing", "load balancing"),
    "16": ("device mesh", "init_device_mesh"),
    "17": ("debugging", "clinic", "stack dump", "fingerprint", "divergence", "hang"),
}
SUFFIX = r"(?:s|es|d|ed|ing|ped|ness)?\b"  # buckets, bucketed, overlapped, staleness
KEYWORDS = {num: re.compile(r"\b(?:" + "|".join(map(re.escape, words)) + ")" + SUFFIX, re.I)
            for num, words in TOPICS.items()}

REF = re.compile(r"\b(?P<kind>notebook|lab)s?\s+(?P<nums>\d\d(?:\s*(?:–|-|,|and|or|to)\s*\d\d)*)",
                 re.IGNORECASE)
PAREN = re.compile(r"(?<![\w(])\((?P<nums>[01]\d(?:,\s*[01]\d)*)\)")
ROW = re.compile(r"^\|\s*(?P<num>\d\d)\s*\|(?P<name>[^|\n]*)\|", re.MULTILINE)
LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+\.ipynb)\)")
FILE = re.compile(r"\b\d\d_[a-z0-9_]+\.ipynb\b")
FILES = {p.name for p in [*NOTEBOOKS.values(), *LABS.values()]}
TITLE = re.compile(r"\A#\s+(?:Lab\s+)?(?P<num>\d\d)\s+·")
COMING = re.compile(r"\b(?:coming|planned|future|to come)\b", re.IGNORECASE)
CLAUSE_END = re.compile(r"[.;:?](?:\s|$)|\n\s*\n")


def markdown(path):
    """(label, text) of each markdown cell of a notebook, or of the whole README."""
    if path.suffix == ".md":
        return [(path.name, path.read_text())]
    cells = json.loads(path.read_text())["cells"]
    return [(f"{path.relative_to(ROOT)} cell {i}", "".join(c["source"]))
            for i, c in enumerate(cells) if c["cell_type"] == "markdown"]


def prose(text):
    """The text without fenced code and LaTeX, and without the backticks of inline code."""
    text = re.sub(r"```.*?```", " ", text, flags=re.DOTALL)
    text = re.sub(r"\$\$.*?\$\$|\$[^$\n]*\$", " ", text, flags=re.DOTALL)
    return text.replace("`", "")


def squash(text):
    return re.sub(r"[^a-z0-9]", "", text.lower())


def topics_named(window):
    return {num for num, pattern in KEYWORDS.items() if pattern.search(window)}


def clause_around(text, start, end):
    """The clause holding text[start:end]: from the previous clause end to the next one."""
    begin = max((m.end() for m in CLAUSE_END.finditer(text, 0, start)), default=0)
    after = CLAUSE_END.search(text, end)
    return begin, after.start() if after else len(text)


def naming_window(text, start, end):
    """The words that name what text[start:end] refers to: its whole table cell, or its clause
    (at most ten words on each side)."""
    line_start = text.rfind("\n", 0, start) + 1
    line_end = text.find("\n", end) % (len(text) + 1)
    if text[line_start:line_end].lstrip().startswith("|"):
        cell_start = text.rfind("|", line_start, start) + 1
        cell_end = text.find("|", end, line_end)
        return text[cell_start:cell_end if cell_end >= 0 else line_end]
    begin, stop = clause_around(text, start, end)
    return " ".join(text[begin:start].split()[-10:] + text[end:stop].split()[:10])


def wrong_topic(num, window):
    """A message when ``window`` names other notebooks' topics and not notebook ``num``'s."""
    named = topics_named(window)
    if num in NOTEBOOKS and named and num not in named:
        others = ", ".join(f"{n} ({NOTEBOOKS[n].stem[3:]})" for n in sorted(named))
        return (f"'{' '.join(window.split())}' names {others}, not {num} "
                f"({NOTEBOOKS[num].stem[3:]})")
    return None


def missing(num, kind, text, start, end):
    """A message when ``kind`` number ``num`` does not exist and its clause does not say it is
    coming."""
    known = LABS if kind == "lab" else NOTEBOOKS
    if num in known:
        return None
    begin, stop = clause_around(text, start, end)
    if COMING.search(text[begin:stop]):
        return None
    return f"{kind} {num} does not exist ({kind}s: {min(known)}-{max(known)})"


def problems(text, here=ROOT / "notebooks"):
    """Every wrong cross-reference in one markdown text; links resolve against ``here``."""
    text, found = prose(text), []
    for m in REF.finditer(text):
        kind, nums = m["kind"].lower(), re.findall(r"\d\d", m["nums"])
        found += [missing(n, kind, text, *m.span()) for n in nums]
        if len(nums) == 1:
            found.append(wrong_topic(nums[0], naming_window(text, *m.span())))
    for m in PAREN.finditer(text):
        nums = re.findall(r"\d\d", m["nums"])
        found += [missing(n, "notebook", text, *m.span()) for n in nums]
        if len(nums) == 1:
            found.append(wrong_topic(nums[0], naming_window(text, *m.span())))
    rows = list(ROW.finditer(text))
    for m in rows:
        num, name = m["num"], m["name"]
        if num not in NOTEBOOKS:
            found.append(missing(num, "notebook", text, *m.span()))
        elif not all(word in squash(name) for word in NOTEBOOKS[num].stem[3:].split("_")
                     if word != "and"):
            found.append(f"course-map row {num} is '{name.strip()}', but notebook {num} is "
                         f"{NOTEBOOKS[num].name}")
    mapped = {m["num"] for m in rows}
    if len(mapped) >= 10 and not set(NOTEBOOKS) <= mapped:
        found.append(f"the course map misses notebooks {sorted(set(NOTEBOOKS) - mapped)}")
    for m in LINK.finditer(text):
        target = (here / m["target"]).resolve()
        numbers = re.findall(r"(?<!\d)\d\d(?!\d)", m["text"])
        if not target.exists():
            found.append(f"link to {m['target']}: no such file")
        elif len(numbers) == 1 and numbers[0] != target.name[:2]:
            found.append(f"link '{m['text']}' goes to {target.name}")
    found += [f"{name}: no such notebook or lab" for name in FILE.findall(text)
              if name not in FILES]
    return [p for p in found if p]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cross_references_are_true(path):
    here = ROOT / "labs" if path.parent.name == "solutions" else path.parent  # links as generated
    wrong = [f"{label}: {p}" for label, text in markdown(path) for p in problems(text, here)]
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize("path", [*NOTEBOOKS.values(), *LABS.values()],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_title_carries_the_file_number(path):
    title = markdown(path)[0][1]
    m = TITLE.match(title)
    assert m and m["num"] == path.name[:2], f"{path.name} opens with {title.splitlines()[0]!r}"


@pytest.mark.parametrize("text, expected", [
    # the course map before notebook 10 (sharded data parallelism) was added
    ("| # | notebook | the idea |\n|---|---|---|\n"
     + "".join(f"| {NOTEBOOKS[n].name[:2]} | {NOTEBOOKS[n].stem[3:].replace('_', ' ')} | x |\n"
               for n in sorted(NOTEBOOKS)[:10])
     + "| 10 | fault tolerance | checkpoints and restarts |\n"
       "| 11 | scaling out | torchrun, mpirun, SLURM |\n"
       "| 12 | hyper-parameter search | many independent experiments at once |\n",
     ["course-map row 10", "course-map row 11", "course-map row 12", "misses notebooks"]),
    ('The processes hardly talk to each other. This is "embarrassingly parallel" and is the '
     "topic of notebook 12.", ["names 13 (hyperparameter_search), not 12"]),
    ("| **hybrid** | combinations | NCCL within a node + MPI across nodes (11) |",
     ["not 11 (fault_tolerance)"]),
    ("in real systems it also counts steps, writes logs and saves checkpoints (notebook 10).",
     ["names 11 (fault_tolerance), not 10"]),
    ("Notebook 19 (the broken jobs) shows it.", ["notebook 19 does not exist"]),
    ("[lab 05](../labs/05_all_reduce.ipynb), [lab 04](../labs/05_allreduce.ipynb)",
     ["link to ../labs/05_all_reduce.ipynb: no such file", "link 'lab 04' goes to",
      "05_all_reduce.ipynb: no such notebook or lab"]),
])
def test_the_check_catches_stale_references(text, expected):
    found = problems(text)
    assert len(found) == len(expected) and all(
        e in p for e, p in zip(expected, found, strict=True)), found


@pytest.mark.parametrize("text", [
    "the parameter server of notebook 04; hierarchical allreduce (notebook 05)",
    "| **hybrid** | combinations | NCCL within a node + MPI across nodes (12) |",
    "notebook 15 (coming: mixture of experts and the all-to-all)",
    "Notebooks 03–08 measure both. A model of 16 layers of Linear(32, 32) (17 tensors).",
    "[06 · data-parallel SGD](06_data_parallel_sgd.ipynb)",
])
def test_true_references_pass(text):
    assert problems(text) == []
