"""What tests and notebook 10 run on every rank: the course's ``fully_shard`` beside torch's on
the transformer. Introduced in notebooks/10_sharded_data_parallelism.ipynb."""

from __future__ import annotations

import numpy as np
import torch

from course_lib import dry_run, fsdp
from course_lib import transformer as tf
from course_lib.comm import get_comm
from course_lib.sharding import shard_bounds

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}
CONFIG = tf.GPTConfig(context=16, d_model=32, n_heads=4, n_layers=2)


def fully_shard_beside_torch(param_dtype: str | None = None, reduce_dtype: str | None = None,
                             steps: int = 3, batch: int = 8, lr: float = 1e-2) -> dict:
    """The transformer (float32, :data:`CONFIG`) sharded per block and at the root by the
    course's :func:`fsdp.fully_shard` and by torch's, each trained ``steps`` AdamW steps on
    this rank's sequences of the same batches, with the same mixed-precision policy (names of
    :data:`DTYPES`). Returns both runs' ``losses``, the largest difference of their parameters
    after (``diff``), the bytes the course's ring ``sent`` in each step and ``torch``'s
    collectives in each step, as :class:`dry_run.Collective` s.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    comm = get_comm("torch")
    dtypes = dict(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    ours, theirs = tf.GPT(CONFIG), tf.GPT(CONFIG)
    mesh = init_device_mesh("cpu", (comm.world_size,), mesh_dim_names=("dp",))
    for block in ours.blocks:
        fsdp.fully_shard(block, comm, fsdp.MixedPrecisionPolicy(**dtypes))
    fsdp.fully_shard(ours, comm, fsdp.MixedPrecisionPolicy(**dtypes))
    for block in theirs.blocks:
        torch_fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(**dtypes))
    torch_fully_shard(theirs, mesh=mesh, mp_policy=MixedPrecisionPolicy(**dtypes))
    optimizers = {"ours": torch.optim.AdamW(ours.parameters(), lr=lr),
                  "torch": torch.optim.AdamW(theirs.parameters(), lr=lr)}
    recorder = dry_run.Recorder({mesh.get_group().group_name: "dp"})
    data, rng = tf.encode(tf.load_text()[:20_000]), np.random.default_rng(0)
    rows = slice(*shard_bounds(batch, comm.rank, comm.world_size))
    out = {"losses": [], "torch_losses": [], "sent": [], "torch": []}
    for _ in range(steps):
        x, y = tf.get_batch(data, batch, CONFIG.context, rng)
        before = comm.bytes_sent
        loss = ours(x[rows], y[rows])[1] / y[rows].numel()
        loss.backward()
        out["sent"].append(comm.bytes_sent - before)
        out["losses"].append(loss.item())
        recorder.calls = []
        with recorder:
            loss = theirs(x[rows], y[rows])[1] / y[rows].numel()
            loss.backward()
        out["torch"].append(recorder.calls)
        out["torch_losses"].append(loss.item())
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad()
    whole = fsdp.full_state_dict(ours)
    out["diff"] = max(float((whole[name] - p.full_tensor()).abs().max())
                      for name, p in theirs.named_parameters())
    dist.barrier()
    return out


TIMED = tf.GPTConfig(context=64, d_model=64, n_heads=4)  # blocks that compute a while


def prefetch_on_rank(prefetch: bool, link: str = "1GbE", steps: int = 3, batch: int = 32,
                     config: tf.GPTConfig = TIMED) -> dict:
    """The transformer (float32, ``config``) sharded per block and at the root by
    :func:`fsdp.fully_shard`, with or without ``prefetch``, trained ``steps`` AdamW steps on
    this rank's sequences over an emulated ``link``. Returns the last step's ``timeline``
    (every gather, reduce-scatter, forward and backward), each step's ``seconds`` and the
    ``peak`` bytes of whole parameters held at once.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    import time

    from course_lib.runtime import netem
    from course_lib.runtime.timeline import Timeline
    comm = get_comm("torch")
    comm.link = netem.make_link(link)
    timeline, model = Timeline(comm.rank), tf.GPT(config)
    for block in model.blocks:
        fsdp.fully_shard(block, comm, prefetch=prefetch, timeline=timeline)
    fsdp.fully_shard(model, comm, prefetch=prefetch, timeline=timeline)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data, rng = tf.encode(tf.load_text()[:20_000]), np.random.default_rng(0)
    rows = slice(*shard_bounds(batch, comm.rank, comm.world_size))
    seconds = []
    for _ in range(steps):
        x, y = tf.get_batch(data, batch, config.context, rng)
        timeline.clear()
        start = time.perf_counter()
        (model(x[rows], y[rows])[1] / y[rows].numel()).backward()
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - start)
    return {"timeline": timeline, "seconds": seconds, "peak": fsdp.shared(comm)["peak"]}
