"""What an allreduce should cost: the alpha-beta-gamma model (notebooks 05-08 and 12).

Introduced in notebooks/05_allreduce.ipynb.

The model (Hockney 1994; used for MPI collectives by Thakur, Rabenseifner & Gropp 2005 and for
the ring by Patarasuk & Yuan 2009) prices every message the same way:

    sending a message of n bytes      alpha + n * beta     (alpha: latency in s, beta: s per byte)
    adding n bytes into a buffer      n * gamma            (gamma: s per byte of reduction)

A link is full duplex: a rank can send to one peer and receive from another at the same time,
each at 1 / beta bytes per second. An algorithm's time is what lies on its critical path, and
for every allreduce algorithm below that is three numbers: how many messages follow one another
(the alpha count), how many bytes per input byte cross one rank's link one after another (the
beta count) and how many bytes per input byte one rank reduces (the gamma count).

Allreduce of n bytes over p ranks (L = ceil(log2 p); with p a power of two L = log2 p):

    naive               2(p-1) alpha + 2(p-1) n beta     + (p-1) n gamma
    tree                2 L alpha    + 2 L n beta        + L n gamma
    recursive_doubling  L alpha      + L n beta          + L n gamma
    rabenseifner        2 L alpha    + 2 (p-1)/p n beta  + (p-1)/p n gamma
    ring                2(p-1) alpha + 2 (p-1)/p n beta  + (p-1)/p n gamma

naive: every rank sends its whole buffer to rank 0, which receives them one after another over
its single link, sums them, and sends the result back one rank at a time (a parameter server with
one server). tree: reduce up a binomial tree, then broadcast down it. recursive_doubling: in step
k rank r swaps its whole buffer with rank r XOR 2^k. rabenseifner: recursive halving
reduce-scatter, then recursive doubling all-gather, so messages shrink as n/2, n/4, ...
ring: reduce-scatter then all-gather around a ring, 2(p-1) steps of n/p bytes each.

Where p is not a power of two the formulas use L = ceil(log2 p). For tree this is exact; for
recursive doubling and Rabenseifner real implementations (MPICH) first fold the extra ranks into a
power of two, which costs one or two more steps than the formula says: read them as estimates.

The lower bound: every byte of rank r's input must reach the p-1 others and every byte of the
result needs the p-1 other inputs, so each rank must send at least (p-1)/p n bytes and receive as
many to reduce, and again to share the result: 2 (p-1)/p n bytes over its link, which takes
2 (p-1)/p n beta = 2 (p-1)/p n / B at bandwidth B (Patarasuk & Yuan 2009). Ring and Rabenseifner
meet it exactly; no algorithm's bandwidth term can go below it, however many ranks.

The reported bandwidths follow nccl-tests: algbw = n / t, and busbw = algbw * 2(p-1)/p for
allreduce, which is the link speed an algorithm on the lower bound would need: compare busbw with
the hardware's bandwidth whatever p is.

    from course_lib import costmodel
    costmodel.allreduce_time("ring", 100e6, 64, costmodel.LINKS["100GbE"])   # seconds

A GPU's data on its way to another GPU (notebook 12) crosses several links one after another.
Without GPUDirect it is staged through host memory: GPU -> host (PCIe), host -> NIC -> wire ->
NIC -> host (the network), host -> GPU (PCIe). With GPUDirect RDMA the NIC reads and writes GPU
memory itself, so only the network pass is left; inside one server GPUDirect P2P moves GPU to GPU
over PCIe (one pass instead of two), NVLink without PCIe at all. Each pass over n bytes costs
alpha + n beta of its link (:data:`PCIE` for the bus). Moving the whole buffer pass after pass
(store and forward) costs the sum; cutting it into k chunks of c bytes lets pass s work on chunk
i while pass s+1 works on chunk i-1 (a pipeline), so the slowest pass runs once over the whole
buffer and every other pass adds only one chunk::

    store and forward   sum_s (alpha_s + n beta_s)
    pipelined           sum_s (alpha_s + c beta_s) + (k - 1) max_s (alpha_s + c beta_s)

    costmodel.path_time(64e6, costmodel.gpu_paths()["across nodes, staged through host memory"])

One file a little over a lesson's length: one model, its numbers, its fit and its use for the
GPU's paths, each function a formula of the docstring above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Number = float | np.ndarray  # a scalar, or an array of them (the functions broadcast)

ALGORITHMS = ("naive", "tree", "recursive_doubling", "rabenseifner", "ring")


@dataclass(frozen=True)
class Link:
    """A network (or GPU interconnect) in the alpha-beta-gamma model.

    Introduced in notebooks/05_allreduce.ipynb.

    alpha: latency of one message in seconds; beta: seconds per byte on one direction of a
    rank's link (1 / bandwidth); gamma: seconds per byte to add a received buffer into one's own
    (0 = reduction is free next to the network).
    """

    name: str
    alpha: float
    beta: float
    gamma: float = 0.0

    @property
    def bandwidth(self) -> float:
        """Bytes per second in one direction (1 / beta)."""
        return 1.0 / self.beta if self.beta > 0 else float("inf")

    def __str__(self) -> str:
        return (f"{self.name}: alpha = {self.alpha * 1e6:.3g} us, "
                f"bandwidth = {self.bandwidth / 1e9:.3g} GB/s")


# Round numbers for teaching, per direction of one rank's link. Bandwidth is the line rate
# (Gb/s / 8 = GB/s); latency is a typical small-message one-way time as MPI or NCCL sees it,
# software stack included, not the wire alone. Measure your own with bench.py + fit_alpha_beta.
LINKS = {
    # 10 Gb/s Ethernet through the kernel's TCP stack: tens of microseconds per message.
    "10GbE": Link("10GbE", alpha=25e-6, beta=1 / 1.25e9),
    # 100 Gb/s Ethernet, TCP: the wire got 10x faster, the software stack much less so.
    "100GbE": Link("100GbE", alpha=10e-6, beta=1 / 12.5e9),
    # InfiniBand HDR, 200 Gb/s, RDMA (no kernel in the data path): about 1.5 us MPI latency.
    "InfiniBand HDR": Link("InfiniBand HDR", alpha=1.5e-6, beta=1 / 25e9),
    # NVLink 3 (A100): 12 links x 25 GB/s = 300 GB/s per GPU per direction (600 GB/s both ways);
    # a kernel launch and NCCL's protocol put alpha at a few microseconds inside one server.
    "NVLink": Link("NVLink", alpha=3e-6, beta=1 / 300e9),
}


# The bus between a GPU (or a NIC) and the host, per direction of a x16 slot. Line rate: 16 GT/s
# (PCIe 4.0) or 32 GT/s (5.0) per lane x 16 lanes x 128/130 encoding = 31.5 and 63 GB/s. beta is
# the effective rate, about 80 % of that (packet headers and flow control): what cudaMemcpy from
# pinned host memory reaches, ~25 and ~50 GB/s. alpha is one copy's fixed cost (a call and a DMA
# set-up), a few microseconds. The line rates are in PCIE_LINE_RATE, for comparison.
PCIE = {
    "PCIe 4.0 x16": Link("PCIe 4.0 x16", alpha=5e-6, beta=1 / 25e9),
    "PCIe 5.0 x16": Link("PCIe 5.0 x16", alpha=5e-6, beta=1 / 50e9),
}
PCIE_LINE_RATE = {"PCIe 4.0 x16": 16e9 * 16 * 128 / 130 / 8,   # 31.5 GB/s per direction
                  "PCIe 5.0 x16": 32e9 * 16 * 128 / 130 / 8}   # 63 GB/s per direction


def _log2_steps(p):
    return np.ceil(np.log2(p))


def coefficients(algorithm: str, p: Number) -> tuple[Number, Number, Number]:
    """(alpha count, beta count, gamma count) of ``algorithm`` on ``p`` ranks.

    Introduced in notebooks/05_allreduce.ipynb.

    The time of an allreduce of n bytes is ``a * alpha + b * n * beta + c * n * gamma``.
    ``p`` may be a numpy array (each count is then an array)."""
    p = np.asarray(p, dtype=float)
    if np.any(p < 1):
        raise ValueError(f"the number of ranks must be >= 1, got {p}")
    steps = _log2_steps(p)  # L = ceil(log2 p)
    share = (p - 1) / p  # the part of the buffer each rank sends in a reduce-scatter
    if algorithm == "naive":
        return 2 * (p - 1), 2 * (p - 1), p - 1
    if algorithm == "tree":
        return 2 * steps, 2 * steps, steps
    if algorithm == "recursive_doubling":
        return steps, steps, steps
    if algorithm == "rabenseifner":
        return 2 * steps, 2 * share, share
    if algorithm == "ring":
        return 2 * (p - 1), 2 * share, share
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")


def _scalar_or_array(x):
    return float(x) if np.ndim(x) == 0 else x


def allreduce_time(algorithm: str, n_bytes: Number, p: Number, link: Link) -> Number:
    """Predicted seconds for an allreduce of ``n_bytes`` over ``p`` ranks.

    Introduced in notebooks/05_allreduce.ipynb.

    ``n_bytes`` and ``p`` broadcast against each other as numpy arrays; a float comes back for
    scalars. See the module docstring for the formulas."""
    a, b, c = coefficients(algorithm, p)
    n = np.asarray(n_bytes, dtype=float)
    return _scalar_or_array(a * link.alpha + b * n * link.beta + c * n * link.gamma)


def all_to_all_time(n_bytes: Number, p: Number, link: Link, algorithm: str = "pairwise"
                    ) -> Number:
    """Predicted seconds for an all-to-all in which every rank holds ``n_bytes`` in p equal
    blocks. Pairwise exchange: p - 1 steps, each one message of n/p bytes,
    (p-1) alpha + (p-1)/p n beta. Naive, through rank 0: the root receives p - 1 counts and
    p - 1 whole buffers, then sends p - 1 buffers, one after another on its link:
    3 (p-1) alpha + 2 (p-1) n beta.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    p = np.asarray(p, dtype=float)
    n = np.asarray(n_bytes, dtype=float)
    if algorithm == "naive":
        return _scalar_or_array(3 * (p - 1) * link.alpha + 2 * (p - 1) * n * link.beta)
    if algorithm != "pairwise":
        raise ValueError(f"unknown all-to-all {algorithm!r}: pairwise or naive")
    return _scalar_or_array((p - 1) * link.alpha + (p - 1) / p * n * link.beta)


def ring_attention_time(block_bytes: Number, p: Number, compute_s: Number, link: Link,
                        overlap: bool = True) -> Number:
    """Predicted seconds of ring attention's forward on p ranks: p steps, each a block's
    computation (``compute_s / p``, a balanced rank's); between them p - 1 key/value blocks of
    ``block_bytes`` passed on. Overlapped, each transfer hides under a step's computation when
    that takes longer: (p-1) max(alpha + n beta, c/p) + c/p. Not overlapped (compute, then
    send): c + (p-1)(alpha + n beta). The transfer hides once c/p > alpha + n beta: compute
    grows as T^2, a block as T, so a long enough sequence always hides it.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    p = np.asarray(p, dtype=float)
    step = np.asarray(compute_s, dtype=float) / p
    send = link.alpha + np.asarray(block_bytes, dtype=float) * link.beta
    if overlap:
        return _scalar_or_array((p - 1) * np.maximum(send, step) + step)
    return _scalar_or_array(p * step + (p - 1) * send)


def lower_bound(n_bytes: Number, p: Number, link: Link) -> Number:
    """The bandwidth term no allreduce can beat: 2 (p-1)/p * n * beta = 2 (p-1)/p * n / B.

    Each rank must send (and receive) (p-1)/p of its buffer once to reduce and once more to
    share the result. Latency and reduction time come on top.
    Introduced in notebooks/05_allreduce.ipynb."""
    p = np.asarray(p, dtype=float)
    n = np.asarray(n_bytes, dtype=float)
    return _scalar_or_array(2 * (p - 1) / p * n * link.beta)


def crossover_bytes(fast_for_small: str, fast_for_large: str, p: int, link: Link) -> float:
    """Message size above which ``fast_for_large`` beats ``fast_for_small`` on ``p`` ranks.

    With time = A + B n for each algorithm, the lines cross at n = (A1 - A2) / (B2 - B1)
    (notebooks/05_allreduce.ipynb: the tiny-allreduce problem; why libraries switch algorithm
    by size). Returns inf when ``fast_for_large`` never wins and 0 when it wins at every size."""
    a1, b1, c1 = coefficients(fast_for_small, p)
    a2, b2, c2 = coefficients(fast_for_large, p)
    fixed = (a2 - a1) * link.alpha  # what the large-message algorithm pays more per call
    per_byte = (b1 - b2) * link.beta + (c1 - c2) * link.gamma  # and saves per byte
    if per_byte > 0:
        return max(float(fixed / per_byte), 0.0)
    return 0.0 if fixed < 0 else float("inf")


def algbw(n_bytes: Number, seconds: Number) -> Number:
    """Algorithm bandwidth in bytes/s: data size over time (nccl-tests).

    Introduced in notebooks/05_allreduce.ipynb."""
    return _scalar_or_array(np.asarray(n_bytes, dtype=float) / np.asarray(seconds, dtype=float))


def busbw(n_bytes: Number, seconds: Number, p: Number) -> Number:
    """Bus bandwidth of an allreduce in bytes/s: algbw * 2(p-1)/p (nccl-tests).

    Introduced in notebooks/05_allreduce.ipynb.

    The bytes each rank must move at least (the lower bound) per second: compare it with the
    link's bandwidth, whatever the number of ranks."""
    p = np.asarray(p, dtype=float)
    return _scalar_or_array(algbw(n_bytes, seconds) * 2 * (p - 1) / p)


def _nonneg_lstsq(A, y):
    """min |A x - y| over x >= 0 for two unknowns: the free solution if it is nonnegative, else
    the best solution with one unknown pinned at zero."""
    x, *_ = np.linalg.lstsq(A, y, rcond=None)
    if np.all(x >= 0):
        return x
    best, best_err = np.zeros(2), float(np.sum(y ** 2))
    for j in range(2):
        col = A[:, j]
        xj = max(float(col @ y) / float(col @ col), 0.0) if col @ col > 0 else 0.0
        err = float(np.sum((y - xj * col) ** 2))
        if err < best_err:
            best = np.zeros(2)
            best[j] = xj
            best_err = err
    return best


def fit_alpha_beta(n_bytes: Sequence[float] | np.ndarray, seconds: Sequence[float] | np.ndarray,
                   algorithm: str = "ring", p: int = 2, gamma: float = 0.0) -> Link:
    """Fit a Link's alpha and beta to measured allreduce times.

    Introduced in notebooks/05_allreduce.ipynb.

    ``n_bytes[i]`` took ``seconds[i]`` with ``algorithm`` on ``p`` ranks; gamma is taken as
    given and its part subtracted. The fit is least squares on relative errors (each point is
    divided by its own time, so microsecond and second points count alike), with alpha and beta
    kept >= 0. Returns ``Link("measured", alpha, beta, gamma)``."""
    n = np.asarray(n_bytes, dtype=float).ravel()
    t = np.asarray(seconds, dtype=float).ravel()
    if n.shape != t.shape:
        raise ValueError(f"n_bytes has {n.size} values but seconds has {t.size}")
    if n.size < 2 or np.unique(n).size < 2:
        raise ValueError("fitting alpha and beta needs at least 2 different message sizes")
    if np.any(~np.isfinite(n)) or np.any(n <= 0):
        raise ValueError("message sizes must be positive and finite")
    if np.any(~np.isfinite(t)) or np.any(t <= 0):
        raise ValueError("times must be positive and finite")
    a, b, c = (float(v) for v in coefficients(algorithm, p))
    if a == 0:
        raise ValueError(f"p={p} rank(s) send no message: nothing to fit")
    # t_i - c n_i gamma = a alpha + b n_i beta, each row divided by t_i (relative errors)
    A = np.column_stack([np.full_like(n, a), b * n]) / t[:, None]
    y = (t - c * n * gamma) / t
    alpha, beta = _nonneg_lstsq(A, y)
    return Link("measured", alpha=float(alpha), beta=float(beta), gamma=gamma)


def predict_table(n_bytes: float, ps: Sequence[int], link: Link,
                  algorithms: Sequence[str] = ALGORITHMS) -> list[dict]:
    """Predicted seconds for each p in ``ps``, up to thousands of ranks.

    Introduced in notebooks/05_allreduce.ipynb.

    Returns one dict per p: ``{"p": p, <algorithm>: seconds, ..., "lower_bound": seconds}``."""
    rows = []
    for p in ps:
        row = {"p": int(p)}
        for name in algorithms:
            row[name] = allreduce_time(name, n_bytes, p, link)
        row["lower_bound"] = lower_bound(n_bytes, p, link)
        rows.append(row)
    return rows


def format_table(rows: list[dict], unit: str = "ms") -> str:
    """The rows of ``predict_table`` as an aligned text table, times in ``unit`` (s, ms, us).

    Introduced in notebooks/05_allreduce.ipynb."""
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    cols = list(rows[0])
    widths = [max(10, len(c) + 2) for c in cols]
    lines = ["".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True)) + f"  ({unit})"]
    for row in rows:
        cells = [f"{row['p']:>{widths[0]}d}"]
        cells += [f"{row[c] * scale:>{w}.4g}" for c, w in zip(cols[1:], widths[1:], strict=True)]
        lines.append("".join(cells))
    return "\n".join(lines)


# ---------------------------------------------------------------- GPU to GPU: staged or direct
def _link(link):
    if isinstance(link, Link):
        return link
    for table in (LINKS, PCIE):
        if link in table:
            return table[link]
    raise ValueError(f"unknown link {link!r}: a Link, or one of {[*LINKS, *PCIE]}")


def path_time(n_bytes: Number, stages: Sequence[Link | str],
              chunk_bytes: float | None = None) -> Number:
    """Seconds to move ``n_bytes`` through ``stages`` (Links or names of :data:`LINKS` and
    :data:`PCIE`, in order), each stage one full pass over the data. ``chunk_bytes=None``: store
    and forward, the sum of the passes, sum_s (alpha_s + n beta_s). With chunks of c bytes (k =
    ceil(n / c), the last one shorter is priced as a full one): a pipeline, sum_s (alpha_s + c
    beta_s) + (k - 1) max_s (alpha_s + c beta_s), the slowest pass over the whole buffer plus one
    chunk of each other pass. Introduced in notebooks/12_scaling_out.ipynb."""
    links = [_link(s) for s in stages]
    n = np.asarray(n_bytes, dtype=float)
    if chunk_bytes is None:
        return _scalar_or_array(sum(link.alpha + n * link.beta for link in links))
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, not {chunk_bytes}")
    c = np.minimum(float(chunk_bytes), n)  # a buffer smaller than a chunk is one chunk
    k = np.ceil(n / c)
    per_chunk = [link.alpha + c * link.beta for link in links]
    return _scalar_or_array(sum(per_chunk) + (k - 1) * np.maximum.reduce(per_chunk))


def gpu_paths(pcie: str = "PCIe 4.0 x16", network: str = "InfiniBand HDR",
              nvlink: str = "NVLink") -> dict[str, list[str]]:
    """The stages a GPU's buffer crosses to reach another GPU, staged through host memory or
    direct (GPUDirect), as ``{name: [links]}`` for :func:`path_time`. Across nodes: staged is
    PCIe, the network, PCIe; GPUDirect RDMA is the network alone (the NIC reads GPU memory over
    PCIe while the wire carries it). Inside a node: staged is PCIe twice (GPU -> host -> GPU);
    GPUDirect P2P is one PCIe pass; NVLink one NVLink pass.
    Introduced in notebooks/12_scaling_out.ipynb."""
    return {"across nodes, staged through host memory": [pcie, network, pcie],
            "across nodes, GPUDirect RDMA": [network],
            "inside a node, staged through host memory": [pcie, pcie],
            "inside a node, GPUDirect P2P over PCIe": [pcie],
            "inside a node, NVLink": [nvlink]}
