"""Lab 09's checks (course_lib/checks/lab09_model_parallelism.py): the reference passes, typical
mistakes fail with their hint. Exercises 2 and 3 run on a real 2-rank cluster (Gloo, short
deadlines): a deadlocked step comes back as a hint naming each rank's message."""

import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from course_lib import collectives, pipeline
from course_lib.checks import CheckFailed
from course_lib.checks import lab09_model_parallelism as checks
from course_lib.comm import wait_all

# the engines cannot import this test module: send its functions by value, as in a notebook
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CLUSTER_SIZE = 2  # the shared cluster of tests/conftest.py


def reference_order(stage, num_stages, num_microbatches):
    return pipeline.schedule_order("1f1b", stage, num_stages, num_microbatches)


def gpipe_order(stage, num_stages, num_microbatches):
    return pipeline.schedule_order("gpipe", stage, num_stages, num_microbatches)


def warmup_one_too_many(stage, num_stages, num_microbatches):
    warmup = min(num_stages - stage, num_microbatches)
    order = [("F", m) for m in range(warmup)]
    for m in range(warmup, num_microbatches):
        order += [("F", m), ("B", m - warmup)]
    return order + [("B", m) for m in range(num_microbatches - warmup, num_microbatches)]


def cool_down_newest_first(stage, num_stages, num_microbatches):
    order = reference_order(stage, num_stages, num_microbatches)
    warmup = min(num_stages - stage - 1, num_microbatches)
    return order[:len(order) - warmup] + order[len(order) - warmup:][::-1]


def backward_before_forward(stage, num_stages, num_microbatches):
    order = reference_order(stage, num_stages, num_microbatches)
    i, j = order.index(("F", 0)), order.index(("B", 0))
    order[i], order[j] = order[j], order[i]
    return order


def forgets_the_cool_down(stage, num_stages, num_microbatches):
    return [s for s in reference_order(stage, num_stages, num_microbatches)
            if s[0] == "F" or s[1] < num_microbatches - 1]


@pytest.mark.parametrize("wrong,hint", [
    (gpipe_order, "that is GPipe's order"),
    (warmup_one_too_many, r"warms up with min\(num_stages - stage - 1"),
    (cool_down_newest_first, "the oldest first"),
    (backward_before_forward, "comes before its forward"),
    (forgets_the_cool_down, r"missing \[\('B', 7\)\]"),
])
def test_order_check_names_the_mistake(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_1f1b_order(wrong)


def test_order_check_passes_the_reference_and_runs_it_on_the_ranks(cluster, capsys):
    assert checks.check_1f1b_order(reference_order, cluster) is True
    out = capsys.readouterr().out
    assert "bubble 0.273 (formula 0.273)" in out and "[4, 3, 2, 1]" in out
    assert "gradients equal one process's" in out

    def unfinished(stage, num_stages, num_microbatches):
        raise NotImplementedError
    assert checks.check_1f1b_order(unfinished) is False


# ---------------------------------------------------------------- exercise 2: one stage's step
def stage_step(stage_module, comm, order, shape, inputs=None, targets=None, *,
               blocking_send=False, send_gradient=True, requires_grad=True, keep_graph=True,
               queue="dict", scale=True, backward_on_first=True, sends_at_end=False):
    """The reference step, with knobs that turn it into the usual mistakes."""
    stage, N = comm.rank, comm.world_size
    first, last = stage == 0, stage == N - 1
    M = len(order) // 2
    saved, sends, later, total = {} if queue == "dict" else [], [], [], 0.0

    def send(t, dst):
        if sends_at_end:
            later.append((t, dst))
        elif blocking_send:
            comm.send(t, dst)
        else:
            sends.append(comm.isend(t, dst))
    for op, m in order:
        if op == "F":
            if first:
                x = inputs[m]
            else:
                x = torch.empty(shape, dtype=torch.float64)
                comm.recv(x, stage - 1)
                if requires_grad:
                    x.requires_grad_()
            out = stage_module(x)
            if last:
                out = F.mse_loss(out, targets[m]) / (M if scale else 1)
                total += out.item()
            else:
                send(out.detach(), stage + 1)
            kept = out if keep_graph else out.detach()
            if queue == "dict":
                saved[m] = (x, kept)
            else:
                saved.append((x, kept))
        else:
            x, out = saved.pop(m) if queue == "dict" else saved.pop()
            if last:
                out.backward()
            elif first and not backward_on_first:
                continue
            else:
                grad = torch.empty(shape, dtype=torch.float64)
                comm.recv(grad, stage + 1)
                out.backward(grad)
            if not first and send_gradient:
                send(x.grad, stage - 1)
    for t, dst in later:
        send_now = comm.isend(t, dst)
        sends.append(send_now)
    wait_all(sends)
    return total if last else None


def mistake(**knobs):
    def step(stage_module, comm, order, shape, inputs=None, targets=None):
        return stage_step(stage_module, comm, order, shape, inputs, targets, **knobs)
    return step


@pytest.mark.parametrize("knobs,hint", [
    ({"blocking_send": True}, r"deadline[\s\S]*blocking comm.send: the send of the "
     r"activation of micro-batch 1 to rank 1[\s\S]*every stage was sending and none receiving"),
    ({"sends_at_end": True}, "every stage was receiving and none sending"),
    ({"send_gradient": False}, r"receive of the gradient of micro-batch 0 from rank 1"
     r"[\s\S]*rank 1: finished[\s\S]*waited for a gradient that never came"),
    ({"requires_grad": False}, r"the gradient you sent back was None[\s\S]*x.requires_grad_"),
    ({"keep_graph": False}, "keep out itself"),
    ({"queue": "stack"}, r"case 2/3[\s\S]*stage 0: the gradient of[\s\S]*the wrong micro-batches"),
    ({"scale": False}, r"every gradient is 2 times one process's[\s\S]*divide it by "
     r"num_microbatches"),
    ({"send_gradient": False, "backward_on_first": False},
     r"stage 0's parameters have no gradient"),
])
def test_stage_step_check_names_the_mistake(cluster, knobs, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_stage_step(mistake(**knobs), reference_order, cluster)


def test_stage_step_check_passes_the_reference(cluster, capsys):
    assert checks.check_stage_step(stage_step, reference_order, cluster) is True
    assert "the loss and every stage's gradients equal one process's" in capsys.readouterr().out

    def unfinished(stage_module, comm, order, shape, inputs=None, targets=None):
        raise NotImplementedError
    assert checks.check_stage_step(unfinished, reference_order, cluster) is False
    assert checks.check_stage_step(stage_step, gpipe_order, cluster) is False  # exercise 1 first


# ---------------------------------------------------------------- exercise 3: f and g
def make_f(reduce_forward=False, reduce_backward=True, op="sum", in_place=False,
           one_gradient=False):
    """Megatron's f (identity forward, allreduce backward), or one of its usual mistakes."""
    def reduce(t, comm):
        t = t if in_place else t.clone()
        return collectives.allreduce(t, comm, op=op)

    class f(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, comm):
            ctx.comm = comm
            return reduce(x, comm) if reduce_forward else x

        @staticmethod
        def backward(ctx, grad):
            grad = reduce(grad, ctx.comm) if reduce_backward else grad
            return grad if one_gradient else (grad, None)
    return f


def make_g(**knobs):
    """Megatron's g (allreduce forward, identity backward), or one of its usual mistakes."""
    knobs = {"reduce_forward": True, "reduce_backward": False, **knobs}
    return make_f(**knobs)


def mlp(x, w1, b1, w2, b2, comm, f=None, g=None, bias_before_g=False, use_f=True):
    f, g = f or make_f(), g or make_g()
    h = F.gelu(F.linear(f.apply(x, comm) if use_f else x, w1, b1))
    if bias_before_g:
        return g.apply(F.linear(h, w2, b2), comm)
    return g.apply(F.linear(h, w2), comm) + b2


def mlp_with(**knobs):
    def parallel_mlp(x, w1, b1, w2, b2, comm):
        return mlp(x, w1, b1, w2, b2, comm, **knobs)
    return parallel_mlp


@pytest.mark.parametrize("f,g,fn,hint", [
    (make_g(), make_f(), mlp, r"f's forward returned 2 x its input"),
    (make_f(), make_g(reduce_backward=True), mlp, r"g's backward allreduced it too"),
    (make_f(reduce_backward=False), make_g(), mlp, r"unreduced: the allreduce is missing"),
    (make_f(op="average"), make_g(), mlp, r"the average of the 2 ranks' gradients, not their sum"),
    (make_f(), make_g(op="average"), mlp, r"the average of the 2 partial sums"),
    (make_f(), make_g(reduce_forward=False), mlp, r"partial sum unchanged: no allreduce"),
    (make_f(), make_g(in_place=True), mlp, r"g's forward changed its input x in place"),
    (make_f(in_place=True), make_g(), mlp, r"f's backward changed the gradient autograd handed"),
    (make_f(one_gradient=True), make_g(), mlp, r"return \(grad, None\)"),
    (make_f(), make_g(), mlp_with(bias_before_g=True), r"y has b2 2 times"),
    (make_f(), make_g(), mlp_with(use_f=False), r"x.grad is this rank's partial sum"),
])
def test_f_and_g_check_names_the_mistake(cluster, f, g, fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_f_and_g(f, g, fn, cluster)


def test_f_and_g_check_passes_the_reference(cluster, capsys):
    assert checks.check_f_and_g(make_f(), make_g(), mlp, cluster) is True
    assert "match one process on 2 ranks" in capsys.readouterr().out

    class unfinished(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, comm):
            raise NotImplementedError
    assert checks.check_f_and_g(unfinished, make_g(), mlp, cluster) is False
