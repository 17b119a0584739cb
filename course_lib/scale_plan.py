"""Planning a run at scale: the memory, step time and model FLOPs utilisation of a transformer
on a cluster, for every way of splitting it.

Introduced in notebooks/16_planning_a_run.ipynb. :mod:`course_lib.planner` counts exactly what
a rank of the course's model holds and sends; this module turns counts into seconds and plans
models that do not fit a laptop. A rank's step under a 1F1B pipeline of ``m`` micro-batches
over ``pp`` stages (Narayanan et al. 2021)::

    step        = m * micro + (pp - 1) * micro / v  + optimizer + data-parallel time exposed
                  (the work)   (the bubble)
    micro       = compute + tp allreduces + what the cp ring does not hide + pp sends

(v: the stages each rank holds in the interleaved schedule, 1 in plain 1F1B.)

* **compute**: the FLOPs of the rank's share (forward 2, backward 4 per weight and token;
  attention 4 s d per token forward, the whole s x s computed; the head of the vocabulary) over
  the FLOP/s the device reaches (peak x efficiency; ranks sharing cores share them);
* **tp**: four ring allreduces per layer of a micro-batch's activations (two in forward, two
  in backward; one more with full recomputation), on the critical path;
* **cp**: ring attention's key/value blocks, hidden under attention's computation when that
  takes longer (:func:`costmodel.ring_attention_time`);
* **pp**: one activation forward and one gradient backward per micro-batch and stage boundary;
* **dp**: the gradients' ring allreduce over dp (and cp, whose ranks saw other tokens), ZeRO-3
  adding the parameters' all-gathers, hidden under the last micro-batch's backward when
  overlapped;
* **optimizer**: seconds per parameter held, a memory-bound update.

Each term goes over the link its group crosses: the dimensions are laid out tp fastest, then
cp, ep, dp, pp (as Megatron orders them), so a group lies inside a node while it and the faster
dimensions fit in one. Memory in 16-bit mixed precision: 2 + 2 + 12 bytes per parameter (ZeRO
dividing them over dp) and the activations of Korthikanti et al. (2022) per layer and
micro-batch, ``s b h (34 + 5 a s / h)`` bytes without parallelism: tensor and sequence
parallelism divide all of it by t, selective recomputation drops the ``5 a s / h`` term, full
recomputation keeps ``2 s b h``; the first pipeline stage holds pp micro-batches of its layers.
The same count without dropout and in the course's dtype is the course's own block
(:func:`sequence_parallel.block_activation_bytes`), to the LayerNorms' statistics.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from course_lib import costmodel
from course_lib.planner import Layout
from course_lib.transformer import GPTConfig

ORDER = ("tp", "cp", "ep", "dp", "pp")  # fastest first: tp's group of neighbours in one node


@dataclass(frozen=True)
class Model:
    """A transformer's sizes, as the plan needs them. ``ffn``: the MLP's hidden width;
    ``kv_heads``: fewer key/value heads (grouped-query attention); ``gated``: three MLP
    matrices (SwiGLU); ``vocab_parallel``: the head split over tp (Megatron) or whole on each
    tp rank (the course). Introduced in notebooks/16_planning_a_run.ipynb."""

    name: str
    layers: int
    d_model: int
    heads: int
    vocab: int
    ffn: int
    kv_heads: int | None = None
    gated: bool = False
    vocab_parallel: bool = True
    tied: bool = False  # the head reads the token embedding

    @property
    def layer_weights(self) -> int:
        """Matrix elements of one layer (its FLOPs: 2 per element and token, forward)."""
        d, kv = self.d_model, (self.kv_heads or self.heads) / self.heads
        return int(d * d * (2 + 2 * kv) + (3 if self.gated else 2) * d * self.ffn)

    @property
    def parameters(self) -> int:
        """All parameters, approximately (biases and LayerNorms left out)."""
        return self.layers * self.layer_weights + self.vocab * self.d_model * (1 + (not self.tied))

    @classmethod
    def of(cls, cfg: GPTConfig) -> Model:
        """The course's transformer: tied head, whole on every tp rank."""
        return cls("course GPT", cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.vocab_size,
                   cfg.hidden or 4 * cfg.d_model, vocab_parallel=False, tied=True)


@dataclass(frozen=True)
class Hardware:
    """Devices in nodes of ``per_node``, their ``memory`` (bytes), ``peak`` FLOP/s and the
    ``efficiency`` (fraction of peak) the model's matrix products reach; links inside and
    between nodes; ``optimizer_seconds`` per parameter updated; ``cores``: devices that share
    this many cores (a laptop's ranks) compute that much slower; ``overlap``: messages travel
    while the device computes (a GPU's copy engines and NICs do; ranks that fill every core
    cannot: moving a message takes the CPU they compute on).
    Introduced in notebooks/16_planning_a_run.ipynb."""

    name: str
    devices: int
    per_node: int
    memory: float
    peak: float
    efficiency: float
    inside: costmodel.Link
    between: costmodel.Link
    optimizer_seconds: float = 0.0
    cores: int | None = None
    overlap: bool = True

    @property
    def share(self) -> float:
        """The part of a core each device gets when all compute at once (1: its own)."""
        return 1.0 if self.cores is None else min(1.0, self.cores / self.devices)

    @property
    def flops(self) -> float:
        """FLOP/s one device reaches when all compute at once."""
        return self.peak * self.efficiency * self.share


@dataclass(frozen=True)
class Run:
    """A global ``batch`` of sequences of ``sequence`` tokens, split by ``layout`` into
    micro-batches of ``micro_batch`` sequences; ``recompute`` None, "attention" or "full";
    16-bit numbers (``itemsize``) unless told. Introduced in notebooks/16_planning_a_run.ipynb."""

    batch: int
    sequence: int
    layout: Layout = field(default_factory=Layout)
    micro_batch: int | None = None  # None: the rank's whole share at once
    recompute: str | None = None
    itemsize: int = 2
    virtual: int = 1  # interleaved 1F1B: each rank holds this many stages, the bubble / virtual

    @property
    def sequences_per_rank(self) -> int:
        return self.batch // (self.layout.dp * self.layout.ep)

    @property
    def micro_batches(self) -> int:
        return self.sequences_per_rank // (self.micro_batch or self.sequences_per_rank)


def group_link(run: Run, dim: str, cluster: Hardware) -> costmodel.Link:
    """The link a group along ``dim`` crosses: inside a node while it and the faster dimensions
    fit in one. Introduced in notebooks/16_planning_a_run.ipynb."""
    span = math.prod(getattr(run.layout, d) for d in ORDER[:ORDER.index(dim) + 1])
    return cluster.inside if span <= cluster.per_node else cluster.between


def flops_per_sequence(model: Model, sequence: int, recompute: str | None = None) -> dict:
    """FLOPs of one sequence's forward and backward: ``layers`` (the blocks, recomputation
    included) and ``head``. Introduced in notebooks/16_planning_a_run.ipynb."""
    s, d = sequence, model.d_model
    weights, attention = 2 * model.layer_weights * s, 4 * s * s * d  # forward, one layer
    # recomputation stops once backward has what it saved (torch's checkpoint): attention's
    # core recomputes its scores, not their product with V; a block, all but its last matrix
    again = {None: 0, "attention": attention / 2,
             "full": weights + attention - 2 * d * model.ffn * s}[recompute]
    return dict(layers=model.layers * (3 * (weights + attention) + again),
                head=6 * model.vocab * d * s)


def model_flops(model: Model, batch: int, sequence: int) -> float:
    """The FLOPs a step needs, recomputation not counted (for the model FLOPs utilisation).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    return batch * sum(flops_per_sequence(model, sequence).values())


def step_time(model: Model, run: Run, cluster: Hardware, overlap_grads: bool = True,
              held: int | None = None) -> dict[str, float]:
    """Seconds of one step of the slowest rank (the last pipeline stage, with the head), by
    term: compute, tp, cp, pp, bubble, dp (exposed), optimizer, total; see the module
    docstring. ``overlap_grads``: the data-parallel reduction hides under the last backward
    (False: the course's ``reduce_gradients``, after it). ``held``: the parameters a rank
    holds (default: the model's over tp and pp), reduced in one bucket.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    lay, pp, e = run.layout, run.layout.pp, run.itemsize
    b = run.micro_batch or run.sequences_per_rank
    s = run.sequence // lay.cp
    fl = flops_per_sequence(model, run.sequence, run.recompute)
    head = fl["head"] / lay.cp / (lay.tp if model.vocab_parallel else 1)
    compute = b * (fl["layers"] / (lay.tp * lay.cp * pp) + head) / cluster.flops
    layers = model.layers // pp
    again = run.recompute == "full"
    tp = (layers * (4 + again) * costmodel.allreduce_time(
        "ring", b * s * model.d_model * e, lay.tp, group_link(run, "tp", cluster))
        if lay.tp > 1 else 0.0)
    cp = 0.0
    if lay.cp > 1:  # keys and values of this rank's heads: forward (p-1) hops, backward 2(p-1)+1
        kv = 2 * b * s * model.d_model * (model.kv_heads or model.heads) / model.heads / lay.tp
        link = group_link(run, "cp", cluster)
        hops = (1 + (run.recompute is not None)) * (lay.cp - 1) + 2 * (lay.cp - 1) + 1
        send = hops * (link.alpha + kv * e * link.beta)
        hidden = b * 12 * s * run.sequence * model.d_model / lay.tp / cluster.flops
        cp = layers * (max(0.0, send - hidden) if cluster.overlap else send)
    pp_link = group_link(run, "pp", cluster)  # one activation forward, one gradient back
    pp_send = (2 * (pp_link.alpha + b * s * model.d_model * e * pp_link.beta)
               if pp > 1 else 0.0)
    micro = compute + tp + cp + pp_send
    m = run.micro_batches
    held = held or model.parameters / (lay.tp * pp)
    dp = 0.0
    for dim in ("dp", "cp"):
        n = getattr(lay, dim)
        if n > 1:
            link = group_link(run, dim, cluster)
            dp += costmodel.allreduce_time("ring", held * e, n, link)
    if lay.zero >= 3:  # the parameters gathered again in forward and in backward
        dp *= 2
    # what hides the reduction: the last micro-batch's backward
    window = 2 / 3 * compute if overlap_grads and cluster.overlap else 0.0
    out = dict(compute=m * compute, tp=m * tp, cp=m * cp, pp=m * pp_send,
               bubble=(pp - 1) * micro / run.virtual, dp=max(0.0, dp - window),
               optimizer=cluster.optimizer_seconds / cluster.share * held
               / (lay.dp if lay.zero else 1))
    out["total"] = math.fsum(out.values())
    return out


def layer_activation_bytes(s: float, b: float, h: int, a: int, itemsize: int = 2,
                           dropout: bool = True, recompute: str | None = None) -> float:
    """Korthikanti et al.'s bytes one transformer layer keeps for backward, counted tensor by
    tensor: 16 s b h numbers (LayerNorm inputs 2, Q K V input 1, Q K V 3, attention output 1,
    MLP input 1, GELU input 4 and output 4) and a s^2 b (attention's probabilities); dropout
    adds 1-byte masks (2 s b h + a s^2 b) and its output (a s^2 b numbers). In 16 bits with
    dropout: s b h (34 + 5 a s / h). ``recompute="attention"`` drops the a s^2 b terms,
    ``"full"`` keeps the layer's input alone. Introduced in notebooks/16_planning_a_run.ipynb."""
    if recompute == "full":
        return itemsize * s * b * h
    core = 0 if recompute == "attention" else a * s * s * b
    return itemsize * (16 * s * b * h + core) + dropout * (2 * s * b * h + core * (1 + itemsize))


def activation_bytes_16bit(model: Model, run: Run) -> float:
    """One rank's activations in 16 bits (:func:`layer_activation_bytes`, with dropout):
    tensor and sequence parallelism divide a layer's by t, context parallelism its sequence by
    cp; the first of pp stages holds min(pp, m) micro-batches of its layers (1F1B).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    lay = run.layout
    per_layer = layer_activation_bytes(run.sequence / lay.cp,
                                       run.micro_batch or run.sequences_per_rank,
                                       model.d_model, model.heads, recompute=run.recompute)
    in_flight = min(lay.pp, run.micro_batches)
    return model.layers / lay.pp * in_flight * per_layer / lay.tp


def memory_16bit(model: Model, run: Run) -> dict[str, float]:
    """Bytes per device in mixed precision with Adam: parameters 2, gradients 2, optimizer 12
    (fp32 master and two moments) per parameter, ZeRO dividing them over dp, and activations.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    lay = run.layout
    n = model.parameters / (lay.tp * lay.pp)
    over = lay.dp
    out = {"parameters": 2 * n / (over if lay.zero >= 3 else 1),
           "gradients": 2 * n / (over if lay.zero >= 2 else 1),
           "optimizer": 12 * n / (over if lay.zero >= 1 else 1),
           "activations": activation_bytes_16bit(model, run)}
    out["total"] = math.fsum(out.values())
    return out


def plan(model: Model, batch: int, sequence: int, cluster: Hardware,
         micro_batch: int = 1, max_tp: int = 8) -> list[dict]:
    """Every split of ``cluster``'s devices (powers of two along tp, pp, cp and dp; ZeRO 0-3;
    no, selective or full recomputation) with its memory, step time and model FLOPs
    utilisation, the fastest that fit first; each one that does not fit says what breaks.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    rows = []
    twos = [2**i for i in range(int(math.log2(cluster.devices)) + 1)]
    for tp, pp, cp in itertools.product([t for t in twos if t <= max_tp], twos, twos):
        dp, rest = divmod(cluster.devices, tp * pp * cp)
        if rest or batch % dp or model.layers % pp or model.heads % tp or sequence % cp:
            continue
        if (batch // dp) % micro_batch:
            continue
        for zero, recompute in itertools.product((0, 1, 3), (None, "attention", "full")):
            run = Run(batch, sequence, Layout(dp=dp, tp=tp, cp=cp, zero=zero, pp=pp),
                      micro_batch=micro_batch, recompute=recompute)
            memory = memory_16bit(model, run)
            time = step_time(model, run, cluster)
            mfu = model_flops(model, batch, sequence) / (time["total"] * cluster.devices
                                                          * cluster.peak)
            fits = memory["total"] <= cluster.memory
            rows.append(dict(run=run, memory=memory, time=time, mfu=mfu, fits=fits,
                             breaks=None if fits else breaks(memory, cluster.memory)))
    return sorted(rows, key=lambda r: (not r["fits"], r["time"]["total"]))


def breaks(memory: dict[str, float], budget: float) -> str:
    """Why a plan does not fit: its total against the budget and its largest kind.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    kind = max((k for k in memory if k != "total"), key=memory.get)
    return (f"{memory['total'] / 2**30:.0f} GiB > {budget / 2**30:.0f} GiB "
            f"({kind} {memory[kind] / 2**30:.0f} GiB)")


def describe(run: Run) -> str:
    """'tp8 pp16 dp64, ZeRO-1, mb 1, recompute full': a run's split in one line.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    lay = run.layout
    dims = [f"{d}{n}" for d, n in (("tp", lay.tp), ("cp", lay.cp), ("pp", lay.pp),
                                   ("dp", lay.dp)) if n > 1] or ["1 device"]
    extra = [f"ZeRO-{lay.zero}"] * bool(lay.zero) + [f"recompute {run.recompute}"] * bool(
        run.recompute)
    return " ".join(dims) + "".join(f", {x}" for x in extra)



# ---------------------------------------------------------------- real clusters, real runs
GiB = 2**30
# 16-bit dense peaks; links per GPU and direction. efficiency: what a transformer's kernels
# reach on average (large matrix products ~80% of peak, the rest memory-bound): an assumption.
CLUSTERS = {
    "A100 (Selene)": Hardware("A100 (Selene)", devices=3072, per_node=8, memory=80 * GiB,
                             peak=312e12, efficiency=0.6, inside=costmodel.LINKS["NVLink"],
                             between=costmodel.LINKS["InfiniBand HDR"]),
    "H100 (Llama 3)": Hardware("H100 (Llama 3)", devices=16384, per_node=8, memory=80 * GiB,
                              peak=989e12, efficiency=0.6,
                              inside=costmodel.Link("NVLink 4", alpha=3e-6, beta=1 / 450e9),
                              between=costmodel.Link("RoCE 400G", alpha=5e-6, beta=1 / 50e9)),
}

MODELS = {  # GPT-3-like models of Narayanan et al. (2021), vocabulary 51,200; Llama 3 405B
    "GPT 1.7B": Model("GPT 1.7B", 24, 2304, 24, 51200, 4 * 2304, tied=True),
    "GPT 18B": Model("GPT 18B", 40, 6144, 48, 51200, 4 * 6144, tied=True),
    "GPT 145B": Model("GPT 145B", 80, 12288, 96, 51200, 4 * 12288, tied=True),
    "GPT 530B": Model("GPT 530B", 105, 20480, 128, 51200, 4 * 20480, tied=True),
    "GPT 1T": Model("GPT 1T", 128, 25600, 160, 51200, 4 * 25600, tied=True),
    "Llama 3 405B": Model("Llama 3 405B", 126, 16384, 128, 128256, 53248, kv_heads=8,
                          gated=True),
}


@dataclass(frozen=True)
class Published:
    """A run with public numbers: its model, cluster, split and the TFLOP/s per GPU reported
    (hardware FLOPs: recomputation included where it ran). Introduced in
    notebooks/16_planning_a_run.ipynb."""

    model: str
    cluster: str
    devices: int
    run: Run
    tflops: float
    source: str


def _gpt(name, devices, tp, pp, batch, tflops):
    dp = devices // (tp * pp)
    return Published(name, "A100 (Selene)", devices,
                     Run(batch, 2048, Layout(dp=dp, tp=tp, pp=pp), micro_batch=1,
                         recompute="full"), tflops, "Narayanan et al. 2021, table 1")


def _llama(devices, cp, dp, sequence, batch, tflops):
    return Published("Llama 3 405B", "H100 (Llama 3)", devices,
                     Run(batch, sequence, Layout(dp=dp, tp=8, cp=cp, zero=2, pp=16),
                         micro_batch=1, virtual=4), tflops,
                     "Llama 3 report 2024, table 4; interleaved, 4 stages a rank assumed")


PUBLISHED = [_gpt("GPT 1.7B", 32, 1, 1, 512, 137), _gpt("GPT 18B", 256, 8, 1, 1024, 135),
             _gpt("GPT 145B", 1536, 8, 8, 2304, 148), _gpt("GPT 530B", 2520, 8, 35, 2520, 163),
             _gpt("GPT 1T", 3072, 8, 64, 3072, 163),
             _llama(8192, 1, 64, 8192, 2048, 430), _llama(16384, 1, 128, 8192, 2048, 400),
             _llama(16384, 16, 8, 131072, 128, 380)]


def predict_published(published: list[Published] = PUBLISHED) -> list[dict]:
    """Each published run beside the plan's TFLOP/s per GPU and MFU for it (the same split,
    model and cluster; data-parallel reduction overlapped with the last backward).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    rows = []
    for p in published:
        model = MODELS[p.model]
        cluster = replace(CLUSTERS[p.cluster], devices=p.devices)
        time = step_time(model, p.run, cluster)
        done = p.run.batch * sum(flops_per_sequence(model, p.run.sequence,
                                                    p.run.recompute).values())
        rows.append(dict(published=p, time=time,
                         tflops=done / time["total"] / p.devices / 1e12,
                         mfu=model_flops(model, p.run.batch, p.run.sequence)
                         / (time["total"] * p.devices * cluster.peak),
                         published_mfu=p.tflops * 1e12 * model_flops(
                             model, p.run.batch, p.run.sequence) / done / cluster.peak))
    return rows
