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


def one_f_one_b(stage, N, M, warmup=lambda s, N, M: min(N - s - 1, M), first=0, as_str=False):
    """1F1B written out, with knobs for the usual mistakes."""
    w = warmup(stage, N, M)
    order = [("F", m) for m in range(w)]
    for m in range(w, M):
        order += [("F", m), ("B", m - w)]
    order += [("B", m) for m in range(max(M - w, 0), M)]
    order = [(op, m + first) for op, m in order]
    return [f"{op}{m}" for op, m in order] if as_str else order


def order_with(**knobs):
    return lambda stage, N, M: one_f_one_b(stage, N, M, **knobs)


@pytest.mark.parametrize("wrong,hint", [
    (order_with(warmup=lambda s, N, M: min(max(N - s - 2, 0), M)),
     r"case 1/8 [\s\S]*Hint: stage 0 of 4 warms up with .* = 3 forwards, then the steady state "
     r"starts with one more forward: 4 forwards before its first backward; yours ran 3"),
    (order_with(warmup=lambda s, N, M: N - s - 1),
     r"case 5/8 \(stage 0 of 4, M = 2\)[\s\S]*Hint: there are 2 micro-batches \(0 to 1\), and "
     r"yours runs \('F', 2\): the warm-up cannot have more forwards"),
    (order_with(warmup=lambda s, N, M: min(N - 1, M)), r"case 2/8 \(stage 1 of 4, M = 8\)[\s\S]*"
                                                      r"= 2 forwards.*yours ran 4"),
    (order_with(first=1), r"micro-batches are numbered 0 to num_microbatches - 1 = 7; yours 1 "
                          r"to 8"),
    (order_with(as_str=True), r"each step is a pair of 'F' or 'B' and a micro-batch number \(an "
                              r"int\); yours has \('F', '0'\)"),
    (lambda s, N, M: [("F", m) for m in range(M)] + [("B", m) for m in reversed(range(M))],
     r"every forward runs before any backward, as in GPipe: all 8 micro-batches stay live"),
], ids=["warm-up one short", "warm-up not capped by M", "every stage warms up as stage 0",
        "micro-batches from 1", "steps as strings", "GPipe, newest backward first"])
def test_more_order_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_1f1b_order(wrong)


def test_an_order_may_be_any_iterable_of_pairs(capsys):
    def generated(stage, N, M):
        yield from (list(step) for step in one_f_one_b(stage, N, M))
    assert checks.check_1f1b_order(generated) is True


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
               queue="dict", scale=True, backward_on_first=True, sends_at_end=False,
               wait=True, dtype=torch.float64, recv_shape=None, loss="sum",
               first_sends_back=False, irecv_waited=True):
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
                x = torch.empty(recv_shape or shape, dtype=dtype)
                if irecv_waited:
                    comm.recv(x, stage - 1)
                else:
                    comm.irecv(x, stage - 1)
                if requires_grad:
                    x.requires_grad_()
            out = stage_module(x)
            if last:
                out = F.mse_loss(out, targets[m]) / (M if scale else 1)
                total = total + out.item() if loss == "sum" else out.item()
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
                grad = torch.empty(shape, dtype=dtype)
                comm.recv(grad, stage + 1)
                out.backward(grad)
            if (not first or first_sends_back) and send_gradient:
                send(x.grad, stage - 1)
    for t, dst in later:
        send_now = comm.isend(t, dst)
        sends.append(send_now)
    if wait:
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


@pytest.mark.parametrize("knobs,hint", [
    # the peer may finish or wait in vain (a checked send's data leaves at its wait): both told
    ({"wait": False}, r"case 1/3 [\s\S]*stage \d returned with 1 message\(s\) (it )?posted "
                      r"(but )?(and )?never waited for[\s\S]*comm.isend's send of the"),
    ({"irecv_waited": False}, r"stage 1 returned with 1 message\(s\) (it )?posted (but )?(and )?"
                              r"never waited for[\s\S]*comm.irecv's receive of the activation"),
    ({"dtype": torch.float32}, r"your step raised:\n  rank 1: CommError: .*\nHint: a message did "
                               r"not fit its receive buffer: the buffer holds 64 float32 numbers "
                               r"\(256 bytes\), the message is 512 bytes of float64"),
    ({"recv_shape": (8, 8)}, r"case 2/3 [\s\S]*Hint: a message did not fit its receive buffer: "
                             r"the buffer holds 64 numbers, the message 32\. Every activation"),
    ({"loss": "last"}, r"case 2/3 .*\n  the last stage returned the loss 0\.627152, one "
                       r"process's is 1\.33002\nHint: return the sum"),
    ({"first_sends_back": True}, r"to rank -1 is None\nHint: stage 0 sent a gradient back to "
                                 r"rank -1: the first stage has no stage before it"),
], ids=["isends never waited", "irecv never waited", "float32 buffers", "whole-batch buffers",
        "the last loss only", "stage 0 sends back"])
def test_more_stage_step_mistakes(cluster, knobs, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_stage_step(mistake(**knobs), reference_order, cluster)


def test_stage_step_check_passes_the_reference(cluster, capsys):
    assert checks.check_stage_step(stage_step, reference_order, cluster) is True
    assert "every stage's gradients equal one process's, every message waited for" in \
        capsys.readouterr().out

    def unfinished(stage_module, comm, order, shape, inputs=None, targets=None):
        raise NotImplementedError
    assert checks.check_stage_step(unfinished, reference_order, cluster) is False
    assert checks.check_stage_step(stage_step, gpipe_order, cluster) is False  # exercise 1 first


# ---------------------------------------------------------------- exercise 3: f and g
def make_f(reduce_forward=False, reduce_backward=True, op="sum", in_place=False,
           one_gradient=False, divide_backward=False, no_gradient=False):
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
            if divide_backward:
                grad = grad / ctx.comm.world_size
            if no_gradient:
                return None, None
            return grad if one_gradient else (grad, None)
    return f


def make_g(**knobs):
    """Megatron's g (allreduce forward, identity backward), or one of its usual mistakes."""
    knobs = {"reduce_forward": True, "reduce_backward": False, **knobs}
    return make_f(**knobs)


def mlp(x, w1, b1, w2, b2, comm, f=None, g=None, bias_before_g=False, use_f=True,
        left_out=None):
    f, g = f or make_f(), g or make_g()
    x = f.apply(x, comm) if use_f else x
    h = x @ w1 + b1 if left_out == "transpose" else \
        F.linear(x, w1, None if left_out == "b1" else b1)
    h = h if left_out == "gelu" else F.gelu(h)
    if bias_before_g:
        return g.apply(F.linear(h, w2, b2), comm)
    return g.apply(F.linear(h, w2), comm) + (0 if left_out == "b2" else b2)


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


@pytest.mark.parametrize("f,g,fn,hint", [
    (make_f(), make_g(divide_backward=True), mlp,
     r"the gradient of g's input is the gradient g received divided by 2\nHint: g allreduces"),
    (make_f(no_gradient=True), make_g(), mlp,
     r"after f's backward, x.grad is None: f's backward returned no gradient for x\nHint: f is "
     r"the identity"),
    (make_f(), make_g(op="max"), mlp, r"g's forward did not return the sum of the ranks' inputs"),
    (make_f(), make_g(), mlp_with(left_out="transpose"),
     r"in parallel_mlp: RuntimeError: mat1 and mat2 shapes cannot be multiplied.*\nHint: the "
     r"shards are stored as torch.nn.Linear stores its weight"),
    (make_f(), make_g(), mlp_with(left_out="b1"), r"y is the whole MLP's output without b1"),
    (make_f(), make_g(), mlp_with(left_out="gelu"), r"y is the whole MLP's output without the "
                                                    r"GELU"),
    (make_f(), make_g(), mlp_with(left_out="b2"), r"y is the whole MLP's output without b2"),
], ids=["g backward divided", "f backward returns None", "g with max", "w1 not transposed",
        "no b1", "no GELU", "no b2"])
def test_more_f_and_g_mistakes(cluster, f, g, fn, hint):
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


# ---------------------------------------------------------------- exercise 4: the ZB-H1 order
def zb_h1(stage, N, M, waiting=lambda s, N: s, newest_first=False, at_end=False):
    """ZB-H1 written out (1F1B, a W after a B once more than ``waiting`` wait), with knobs."""
    order, pending = [], []
    for op, m in reference_order(stage, N, M):
        order.append((op, m))
        if op == "B":
            pending.append(m)
            if not at_end and len(pending) > waiting(stage, N):
                order.append(("W", pending.pop(-1 if newest_first else 0)))
    return order + [("W", m) for m in (pending[::-1] if newest_first else pending)]


def zb_with(**knobs):
    def order(stage, num_stages, num_microbatches):
        return zb_h1(stage, num_stages, num_microbatches, **knobs)
    return order


def w_before_b(stage, N, M):
    order = zb_h1(stage, N, M)
    i, j = order.index(("B", 0)), order.index(("W", 0))
    order[i], order[j] = order[j], order[i]
    return order


@pytest.mark.parametrize("wrong,hint", [
    (reference_order, "that is 1F1B's order"),
    (zb_with(waiting=lambda s, N: 0), "stage 1 lets its first 1 W's wait"),
    (zb_with(waiting=lambda s, N: N - 1 - s), "the other way round, stage s lets s wait"),
    (zb_with(at_end=True), "all W's run at the end"),
    (zb_with(newest_first=True), "oldest first"),
    (w_before_b, "weight gradient of micro-batch 0 comes before its backward"),
    (lambda s, N, M: [x for x in zb_h1(s, N, M) if x != ("W", M - 1)], r"missing \[\('W', 7\)\]"),
    (lambda s, N, M: gpipe_order(s, N, M) + [("W", m) for m in range(M)], "keep 1F1B's order"),
])
def test_zb_h1_check_names_the_mistake(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_zb_h1_order(wrong)


def test_zb_h1_check_passes_the_reference_and_runs_it_on_the_ranks(cluster, capsys):
    assert checks.check_zb_h1_order(zb_h1, cluster) is True
    out = capsys.readouterr().out
    assert "idle slots 3 against 9" in out and "[4, 4, 4, 4]" in out
    assert "gradients equal one process's" in out
