"""Lab 09 checks: the 1F1B order of one stage, that stage's step with real messages,
Megatron's f and g, and the zero-bubble order ZB-H1.

Introduced in labs/09_model_parallelism.ipynb, on the framework of :mod:`course_lib.checks`:

- ``check_1f1b_order(one_f_one_b, cluster)`` compares the student's order with
  ``pipeline.schedule_order`` stage by stage, plays it in the simulator (bubble, live
  micro-batches), then runs it with ``pipeline.pipeline_step`` on the ranks against one process;
- ``check_stage_step(stage_step, one_f_one_b, cluster)`` runs the student's own step (receive,
  forward, send; receive the gradient, backward, send it back) on every stage, over a comm that
  names each message, so that a deadlock comes back after a short deadline as the message each
  rank waited for; loss and gradients against the whole model in one process;
- ``check_f_and_g(f, g, parallel_mlp, cluster)`` runs the student's ``torch.autograd.Function``
  classes alone (inputs watched for in-place changes), then a column-then-row-parallel MLP built
  on them, against the whole MLP in one process;
- ``check_zb_h1_order(zb_h1, cluster)`` compares the student's ZB-H1 order with
  ``pipeline.schedule_order("zb-h1", ...)``, names the usual mistakes (W right after every B, W's
  kept waiting by the wrong stages, all W's at the end, the newest W first), plays it in the
  simulator (a third of 1F1B's idle slots, at most N micro-batches alive), then runs it with a
  split backward on the ranks against one process.

Each hint is decoded from what came back: a gradient N (or M) times the right one, a rank's own
partial sum, the average instead of the sum, the message a stage waited for.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from course_lib import pipeline
from course_lib.checks.framework import (
    CheckFailed,
    not_implemented,
    pack_function,
    sequence_difference,
)

ORDER_CASES = [(0, 4, 8), (1, 4, 8), (3, 4, 8), (0, 2, 1), (0, 4, 2), (2, 4, 2), (0, 1, 3),
               (1, 3, 16)]  # (stage, num_stages, num_microbatches)


# ---------------------------------------------------------------- exercise 1: the 1F1B order
def _diagnose_order(stage, N, M, got):
    """What the student's order did, in words."""
    try:
        steps = [tuple(step) for step in got]
    except TypeError:
        steps = None
    if not steps or any(len(s) != 2 for s in steps):
        return "return a list of pairs: ('F', m) and ('B', m)."
    if any(op not in ("F", "B") or not isinstance(m, int) or isinstance(m, bool)
           for op, m in steps):
        op, m = next((op, m) for op, m in steps
                     if op not in ("F", "B") or not isinstance(m, int) or isinstance(m, bool))
        return (f"each step is a pair of 'F' or 'B' and a micro-batch number (an int); yours "
                f"has ({op!r}, {m!r}).")
    numbers = sorted({m for _, m in steps})
    if numbers and numbers[0] >= 1 and numbers[-1] == M:
        return f"micro-batches are numbered 0 to num_microbatches - 1 = {M - 1}; yours 1 to {M}."
    if numbers and numbers[-1] >= M:
        return (f"there are {M} micro-batches (0 to {M - 1}), and yours runs ('F', "
                f"{numbers[-1]}): the warm-up cannot have more forwards than there are "
                f"micro-batches.")
    try:
        pipeline.check_order(got, stage, M)
    except ValueError as e:
        return f"{e}. Each micro-batch m needs one ('F', m) and, later, one ('B', m)."
    if got == pipeline.schedule_order("gpipe", stage, N, M):
        return ("that is GPipe's order (all forwards, then all backwards): 1F1B starts the "
                "backwards after a warm-up of num_stages - stage - 1 forwards.")
    def leading_forwards(order):
        return next((i for i, (op, _) in enumerate(order) if op == "B"), len(order))
    got_lead = leading_forwards(got)
    want_lead = leading_forwards(pipeline.schedule_order("1f1b", stage, N, M))
    if got_lead == M and want_lead < M:
        return (f"every forward runs before any backward, as in GPipe: all {M} micro-batches "
                f"stay live. 1F1B starts the backwards after its warm-up.")
    if got_lead != want_lead:
        warmup = min(N - stage - 1, M)
        return (f"stage {stage} of {N} warms up with min(num_stages - stage - 1, "
                f"num_microbatches) = {warmup} forwards, then the steady state starts with one "
                f"more forward: {want_lead} forwards before its first backward; yours ran "
                f"{got_lead}.")
    if [m for op, m in got if op == "B"] != sorted(m for op, m in got if op == "B"):
        return "run the backwards in the order of the micro-batches: the oldest first."
    return ("after the warm-up, alternate: one forward (the next micro-batch), then one "
            "backward (the oldest whose forward has run); when the forwards run out, the "
            "remaining backwards (the cool-down).")


def _order(fn, stage, N, M):
    got = fn(stage, N, M)
    if not isinstance(got, (str, bytes)) and hasattr(got, "__iter__"):
        got = list(got)  # a list, a tuple or a generator of steps
        return [tuple(step) if hasattr(step, "__iter__") and not isinstance(step, str)
                else step for step in got]
    return got


def run_order_on_rank(payload, num_microbatches, num_layers=4):
    """On every rank: one pipeline step in the student's order against one process (see
    ``testing.pipeline.pipeline_matches_one_process``)."""
    import cloudpickle

    from course_lib.testing.pipeline import pipeline_matches_one_process
    return pipeline_matches_one_process(cloudpickle.loads(payload), num_microbatches,
                                        num_layers=num_layers)


def _check_cases(name: str, student_fn: Callable, schedule: str, steps: str,
                 diagnose: Callable) -> bool:
    """Every case of ORDER_CASES against ``pipeline.schedule_order(schedule, ...)``: True when
    all match, False (after the notice) when the exercise is not written yet; a CheckFailed
    with ``diagnose``'s hint at the first case that differs."""
    __tracebackhide__ = True
    for number, (stage, N, M) in enumerate(ORDER_CASES, start=1):
        where = f"{name}: case {number}/{len(ORDER_CASES)} (stage {stage} of {N}, M = {M})"
        try:
            got = _order(student_fn, stage, N, M)
        except NotImplementedError:
            return not_implemented(name)
        except Exception as err:
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}\n"
                              f"Hint: return a list of {steps} pairs.") from err
        expected = pipeline.schedule_order(schedule, stage, N, M)
        if got != expected:
            raise CheckFailed(f"{where}\n{sequence_difference(expected, got)}\n"
                              f"Hint: {diagnose(stage, N, M, got)}")
    return True


def _run_on_ranks(name: str, student_fn: Callable, cluster, how: str = "") -> None:
    """The student's order run for real on every rank of ``cluster`` with M = 1, 3, 6 micro-
    batches, against one process."""
    __tracebackhide__ = True
    payload = pack_function(student_fn)
    for M in (1, 3, 6):
        reports = cluster.run(run_order_on_rank, payload, M)
        worst = max(r["grad"] for r in reports)
        if worst > 1e-10 or reports[-1]["loss"] > 1e-10:
            raise CheckFailed(f"{name}: on {cluster.n} ranks with M = {M} the gradients "
                              f"differ from one process by {worst:.3g}\nHint: the order "
                              "is right, so look at how the function is called.")
    print(f"  run on {cluster.n} ranks{how}, M = 1, 3, 6: gradients equal one process's")


def check_1f1b_order(student_fn: Callable, cluster=None) -> bool:
    """Lab 09, exercise 1: ``one_f_one_b(stage, num_stages, num_microbatches)`` returns the
    1F1B order of that stage; checked case by case, in the simulator, then (with ``cluster``)
    run for real on its ranks against one process."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_1f1b_order"
    if not _check_cases(name, student_fn, "1f1b", "('F', m) and ('B', m)", _diagnose_order):
        return False
    N, M = 4, 8
    sim = pipeline.simulate("1f1b", N, M, orders=[_order(student_fn, s, N, M) for s in range(N)])
    print(f"  simulated, N = {N}, M = {M}: bubble {sim.bubble:.3f} (formula "
          f"{pipeline.bubble_fraction(N, M):.3f}), live micro-batches per stage {sim.peak_live}")
    if cluster is not None:
        _run_on_ranks(name, student_fn, cluster)
    print(f"✓ {name}: {len(ORDER_CASES)}/{len(ORDER_CASES)} cases match the reference")
    return True


# ---------------------------------------------------------------- exercise 2: one stage's step
# seconds each message of the student's step may wait: a deadlock comes back as a hint in
# seconds (the library's waits default to 30 s)
STUDENT_TIMEOUT = 3.0
STEP_CASES = [1, 2, 4]  # micro-batches per step; batch 8, 4 layers of width 8, 2 layers a stage


class StageComm:
    """The student's comm, which names every message it carries: "the activation of
    micro-batch 1 to rank 1". Activations go to stage + 1 and gradients to stage - 1, in the
    order of the micro-batches, so the k-th activation (or gradient) sent between two stages is
    micro-batch k's. ``stuck()`` says which message a rank waited on when a deadline passed."""

    def __init__(self, comm):
        self._comm, self.counts, self.posted, self.blocked = comm, {}, [], None

    def __getattr__(self, name):  # rank, world_size, timeout, barrier, ...
        return getattr(self._comm, name)

    def _what(self, direction, buf, peer):
        kind = "activation" if (peer > self._comm.rank) == (direction == "send") else "gradient"
        m = self.counts[direction, kind] = self.counts.get((direction, kind), -1) + 1
        what = (f"{'send' if direction == 'send' else 'receive'} of the {kind} of micro-batch "
                f"{m} {'to' if direction == 'send' else 'from'} rank {peer}")
        if buf is None:  # the course's comm would fail somewhere deep inside: name it here
            raise ValueError(f"rank {self._comm.rank}: the buffer of the {what} is None")
        return what

    def send(self, buf, dst, tag=0, timeout=None, **kwargs):
        self.blocked = f"a blocking comm.send: the {self._what('send', buf, dst)}"
        self._comm.send(buf, dst, tag, timeout, **kwargs)
        self.blocked = None  # still set if the send raised: where the rank waited

    def recv(self, buf, src, tag=0, timeout=None, **kwargs):
        self.blocked = f"a blocking comm.recv: the {self._what('recv', buf, src)}"
        out = self._comm.recv(buf, src, tag, timeout, **kwargs)
        self.blocked = None
        return out

    def isend(self, buf, dst, tag=0, **kwargs):
        what = self._what("send", buf, dst)
        request = self._comm.isend(buf, dst, tag, **kwargs)
        self.posted.append((request, f"the wait for comm.isend's {what}"))
        return request

    def irecv(self, buf, src, tag=0, **kwargs):
        what = self._what("recv", buf, src)
        request = self._comm.irecv(buf, src, tag, **kwargs)
        self.posted.append((request, f"the wait for comm.irecv's {what}"))
        return request

    def stuck(self):
        """The message this rank was waiting for: a blocking call, else the first posted
        message not completed."""
        return self.blocked or next((what for request, what in self.posted
                                     if not request.done), None)


def _numpy(t):
    return None if t is None else t.detach().numpy().copy()


def stage_step_on_rank(payload, order_payload, num_microbatches, batch=8, width=8,
                       num_layers=4, timeout=STUDENT_TIMEOUT):
    """On every rank: the student's ``stage_step`` on this rank's stage of a small MLP
    (``testing.pipeline.make_mlp``, float64) and the whole model in one process. Returns this
    stage's gradients and the reference's, the loss (last stage), or the error and the message
    the rank was waiting for."""
    import copy

    import cloudpickle
    import torch

    from course_lib.comm import get_comm
    from course_lib.testing.pipeline import make_batch, make_mlp
    step, schedule = (cloudpickle.loads(p) for p in (payload, order_payload))
    comm = StageComm(get_comm("torch", timeout=timeout))
    stage, N, M = comm.rank, comm.world_size, num_microbatches
    model = make_mlp(num_layers, width)
    x, y = make_batch(batch, width)
    counts = pipeline.balance([1.0] * num_layers, N)
    mine = pipeline.split_model(copy.deepcopy(model), counts)[stage]
    first, last = stage == 0, stage == N - 1
    order = [tuple(s) for s in schedule(stage, N, M)]
    report = {"stage": stage, "error": None, "stuck": None, "loss": None, "want_loss": None}
    try:
        loss = step(mine, comm, order, (batch // M, width),
                    inputs=[t.clone() for t in x.chunk(M)] if first else None,
                    targets=[t.clone() for t in y.chunk(M)] if last else None)
    except Exception as err:  # noqa: BLE001 - reported to the check, which explains it
        text = str(err).splitlines()[0] if str(err) else ""
        report.update(error=f"{type(err).__name__}: {text}", stuck=comm.stuck())
        return report
    reference = torch.nn.functional.mse_loss(model(x), y)  # one process, the whole batch
    reference.backward()
    ref = pipeline.split_model(model, counts)[stage]
    report["unwaited"] = [what for request, what in comm.posted if not request.done]
    report["names"] = [name for name, _ in mine.named_parameters()]
    report["grads"] = [_numpy(p.grad) for p in mine.parameters()]
    report["wants"] = [_numpy(p.grad) for p in ref.parameters()]
    if last:
        report["loss"] = loss if isinstance(loss, (int, float, type(None))) else \
            float(loss) if getattr(loss, "numel", lambda: 0)() == 1 else repr(loss)[:60]
        report["want_loss"] = reference.item()
    return report


def _hint_stuck(reports):
    """Why ranks waited past their deadline, from the message each was waiting for."""
    for r in reports:
        if "Connection closed" in (r["error"] or ""):  # Gloo's long text: say what it means
            r["error"] = (r["error"].split(" failed:")[0] + " failed: its peer had given up "
                          "waiting and closed the connection")
    waits = "\n".join(f"  rank {r['stage']}: {r['error']}\n    it was waiting in "
                      f"{r['stuck'] or 'no message of its comm'}"
                      if r["error"] else f"  rank {r['stage']}: finished" for r in reports)
    stuck = [r["stuck"] or "" for r in reports if r["error"]]
    left = [r for r in reports if not r["error"] and r.get("unwaited")]
    if left:
        r = left[0]
        more = ", ..." if len(r["unwaited"]) > 1 else ""
        hint = (f"stage {r['stage']} returned with {len(r['unwaited'])} message(s) it posted "
                f"and never waited for ({r['unwaited'][0]}{more}): a posted message is done "
                f"only when its wait returns, and its peer waited in vain. Keep the requests "
                f"and wait for them before the step returns.")
    elif len(stuck) == len(reports) and all("blocking comm.send" in s for s in stuck):
        hint = ("every stage was sending and none receiving: Gloo's send waits until the peer "
                "has posted its receive. In 1F1B stage 0 sends the activation of micro-batch 1 "
                "while stage 1 sends the gradient of micro-batch 0 back: each waits for the "
                "other. Post every send with comm.isend, keep the requests, and wait for them "
                "all at the end (wait_all(requests)).")
    elif len(stuck) == len(reports) and all("receive" in s for s in stuck):
        hint = ("every stage was receiving and none sending: a message a stage waits for was "
                "never posted. Post each send when its tensor is ready (the activation right "
                "after its forward, the gradient right after its backward), not later.")
    elif any("isend" in s for s in stuck):
        hint = ("a send was posted but its peer never received it: every activation stage s "
                "sends is received by stage s + 1 in its forward, every gradient by stage "
                "s - 1 in its backward.")
    elif any("gradient" in s and "receive" in s for s in stuck):
        hint = ("a stage waited for a gradient that never came: after each backward, every "
                "stage but the first sends the gradient of its input, x.grad, to stage - 1.")
    elif any("activation" in s and "receive" in s for s in stuck):
        hint = ("a stage waited for an activation that never came: after each forward, every "
                "stage but the last sends its output (detached) to stage + 1.")
    else:
        hint = ("use the comm you are given for every message (comm.isend, comm.recv, ...): "
                "its waits have deadlines and name the message.")
    return f"{waits}\nHint: {hint}"


MISFIT = "but the receive buffer holds"  # the comm's words for a message that did not fit


def _hint_misfit(text):
    """What a message that did not fit its receive buffer says about the buffer."""
    import re
    m = re.search(r"of (\d+) x (\w+) \((\d+) bytes\).*?sent (\d+) bytes", text)
    if not m:
        return None
    n, dtype, held, sent = int(m[1]), m[2], int(m[3]), int(m[4])
    if dtype != "float64":  # everything the stages send is the model's float64
        return (f"a message did not fit its receive buffer: the buffer holds {n} {dtype} "
                f"numbers ({held} bytes), the message is {sent} bytes of float64. A receive "
                f"buffer must have the dtype of what is sent, not only its shape.")
    return (f"a message did not fit its receive buffer: the buffer holds {n} numbers, the "
            f"message {sent // 8}. Every activation and gradient between stages has the shape "
            f"`shape`: one micro-batch's rows, not the whole batch's.")


def _hint_error(reports):
    """A hint for an exception (not a deadline) on some rank."""
    text = " ".join(r["error"] for r in reports if r["error"])
    if MISFIT in text:
        misfit = next(r["error"] for r in reports if MISFIT in (r["error"] or ""))
        return _hint_misfit(misfit) or ("a message did not fit its receive buffer: every "
                                      "activation and gradient between stages has the shape "
                                      "`shape` (micro-batch rows x width).")
    if "to rank -1" in text:
        return ("stage 0 sent a gradient back to rank -1: the first stage has no stage before "
                "it, and its input needs no gradient.")
    if "is None" in text and "gradient" in text:
        return ("the gradient you sent back was None: x.grad stays None unless the received "
                "activation requires grad. Receive into a fresh tensor, then "
                "x.requires_grad_() before the forward, so that backward fills x.grad.")
    if "does not require grad" in text:
        return ("backward ran on a tensor with no graph: send out.detach() to the next stage, "
                "but keep out itself (it holds the graph) for the backward.")
    if "backward through the graph a second time" in text:
        return ("a graph was used by two backwards: each micro-batch's output gets exactly one "
                "backward; pop it from what you saved when you run it.")
    return "read each rank's error above."


def _ratio(got, want):
    """got / want when ``got`` is a multiple of ``want``, else None."""
    scale = float(np.abs(want).max())
    if got is None or got.shape != want.shape or scale == 0:
        return None
    k = float((got * want).sum() / (want * want).sum())
    return k if np.allclose(got, k * want, rtol=1e-9, atol=1e-12 * scale) else None


def check_stage_step(stage_step: Callable, schedule: Callable, cluster,
                     timeout: float = STUDENT_TIMEOUT) -> bool:
    """Lab 09, exercise 2: ``stage_step(stage_module, comm, order, shape, inputs, targets)``
    runs one training step of this rank's stage, in ``order`` = ``schedule(stage, num_stages,
    num_microbatches)`` (exercise 1's 1F1B), with real messages on the ranks of ``cluster``;
    every stage's gradients and the loss must equal one process's on the whole batch."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.runtime.cluster import ClusterTimeout, RemoteError
    name = "check_stage_step"
    try:
        ready = all(_order(schedule, s, cluster.n, M) == pipeline.schedule_order(
            "1f1b", s, cluster.n, M) for M in STEP_CASES for s in range(cluster.n))
    except Exception:  # noqa: BLE001 - exercise 1 unfinished, or raising: the same notice
        ready = False
    if not ready:
        print(f"… {name}: it runs your one_f_one_b of exercise 1; make check_1f1b_order pass "
              "first, then run this check again.")
        return False
    payload = (pack_function(stage_step), pack_function(schedule))
    for number, M in enumerate(STEP_CASES, start=1):
        where = (f"{name}: case {number}/{len(STEP_CASES)} ({cluster.n} stages, a batch of 8 "
                 f"rows in M = {M} micro-batch{'es' if M > 1 else ''})")
        try:
            # (the rank function's own deadline goes by position: cluster.run takes timeout=)
            reports = cluster.run(stage_step_on_rank, *payload, M, 8, 8, 4, timeout,
                                  timeout=10 + 4 * timeout)
        except RemoteError as err:  # the rank function itself failed: not the student's step
            raise CheckFailed(f"{where}\n  {err}\nHint: read the traceback.") from None
        except ClusterTimeout as err:
            raise CheckFailed(f"{where}\n  {err}\nHint: your step did not return: does it "
                              "wait without a deadline (torch.distributed directly)? Use "
                              "comm's sends and receives.") from None
        if any((r["error"] or "").startswith("NotImplementedError") for r in reports):
            return not_implemented(name)
        # a wait past its deadline (CommTimeout) closes Gloo's connection, so the peer's own
        # wait may fail first with a CommError: both are the deadlock's, not a bug of theirs
        timed_out = [r for r in reports if (r["error"] or "").startswith("Comm")
                     and MISFIT not in r["error"]]  # a message that did not fit is a mistake
        if any("CommTimeout" in (r["error"] or "") for r in reports) and len(timed_out) == sum(
                bool(r["error"]) for r in reports):
            raise CheckFailed(f"{where}\n  a rank waited past its {timeout:g} s deadline:"
                              f"\n{_hint_stuck(reports)}")
        if any(r["error"] for r in reports):  # an error; a peer's timeout is its consequence
            errors = "\n".join(f"  rank {r['stage']}: {r['error']}" for r in reports
                               if r["error"] and r not in timed_out)
            raise CheckFailed(f"{where}\n  your step raised:\n{errors}\nHint: "
                              f"{_hint_error(reports)}")
        _check_waited(where, reports)
        _check_step_results(where, M, reports)
    print(f"✓ {name}: M = {', '.join(map(str, STEP_CASES))} on {cluster.n} stages: the loss "
          "and every stage's gradients equal one process's, every message waited for")
    return True


def _check_waited(where, reports):
    """Every message a stage posted (isend, irecv) must have been waited for when it returns."""
    __tracebackhide__ = True
    for r in reports:
        if r["unwaited"]:
            kinds = " or ".join(sorted({w.split("comm.")[1].split("'")[0]
                                        for w in r["unwaited"]}))
            listed = "\n    ".join(r["unwaited"][:4]) + (
                f"\n    ... ({len(r['unwaited']) - 4} more)" if len(r["unwaited"]) > 4 else "")
            raise CheckFailed(
                f"{where}\n  stage {r['stage']} returned with {len(r['unwaited'])} message(s) "
                f"posted but never waited for:\n    {listed}\nHint: a message posted with "
                f"{kinds} is in flight until its wait returns: until then nothing says it has "
                f"left (or arrived), and its tensor must stay alive and unchanged. Two ranks on "
                f"one machine hide this (small messages are copied at once); over a network a "
                f"buffer freed or reused too early sends garbage, and the step's end does not "
                f"mean its messages are done. Keep the requests and wait for them.")


def _check_step_results(where, M, reports):
    """Compare each stage's gradients and the loss with one process's; explain a difference."""
    __tracebackhide__ = True
    last = reports[-1]
    if last["loss"] is None or isinstance(last["loss"], str):
        raise CheckFailed(f"{where}\n  the last stage returned {last['loss']!r}\nHint: the "
                          "last stage returns the step's loss: the sum over micro-batches of "
                          "each one's scaled loss (a float, loss.item()).")
    ratios = {_ratio(g, w) for r in reports for g, w in zip(r["grads"], r["wants"],
                                                             strict=True)}
    if M > 1 and all(k is not None and abs(k - M) < 1e-9 for k in ratios):
        raise CheckFailed(f"{where}\n  every gradient is {M} times one process's (and the "
                          f"loss {last['loss']:.6g} against {last['want_loss']:.6g})\nHint: "
                          f"each micro-batch's mse_loss is a mean over its own rows: divide it "
                          f"by num_microbatches (here {M}) before its backward, so that the "
                          f"sum over micro-batches is the mean over the whole batch.")
    for r in reports:
        if all(g is None for g in r["grads"]):
            raise CheckFailed(f"{where}\n  stage {r['stage']}'s parameters have no gradient "
                              f"(.grad is None)\nHint: stage {r['stage']} never ran a "
                              f"backward: for each ('B', m) it receives the gradient of its "
                              f"output from stage + 1 and calls out.backward(grad).")
    for r in reports:
        for pname, g, w in zip(r["names"], r["grads"], r["wants"], strict=True):
            if g is None or g.shape != w.shape or abs(g - w).max() > 1e-9:
                diff = "is None" if g is None else \
                    f"differs from one process's by {float(abs(g - w).max()):.3g}"
                others_ok = all(abs(g2 - w2).max() <= 1e-9 for q in reports
                                if q["stage"] != r["stage"]
                                for g2, w2 in zip(q["grads"], q["wants"], strict=True)
                                if g2 is not None)
                if M > 1 and others_ok and abs(last["loss"] - last["want_loss"]) < 1e-9:
                    hint = (f"the loss and the other stages are right, so stage "
                            f"{r['stage']}'s backwards met the wrong micro-batches: with 1F1B "
                            f"it holds several at once, and ('B', m) must run on micro-batch "
                            f"m's saved output (a dict by m, or the oldest first: a queue, "
                            f"not a stack).")
                else:
                    hint = ("compare with one process: the forward of ('F', m) on micro-batch "
                            "m, the loss scaled by 1/num_microbatches, each backward on its "
                            "own micro-batch's output with the gradient received for it.")
                raise CheckFailed(f"{where}\n  stage {r['stage']}: the gradient of {pname} "
                                  f"{diff}\nHint: {hint}")
    if abs(last["loss"] - last["want_loss"]) > 1e-9:
        raise CheckFailed(f"{where}\n  the last stage returned the loss {last['loss']:.6g}, "
                          f"one process's is {last['want_loss']:.6g}\nHint: return the sum "
                          f"of the micro-batches' scaled losses (each mse_loss / "
                          f"num_microbatches).")


# ---------------------------------------------------------------- exercise 3: Megatron's f and g
TP_CASES = [(4, 6, 8), (3, 5, 12)]  # (batch, d_model, hidden): MLP d_model -> hidden -> d_model
F_IS = ("f is the identity in forward (every rank already holds the same x) and allreduces "
        "(sums) the gradient in backward: each rank's slice of the column-parallel layer sends "
        "back only its part of dL/dx.")
G_IS = ("g allreduces (sums) in forward: each rank's row-parallel layer makes a partial sum of "
        "the output; and it is the identity in backward: after the sum every rank holds the "
        "same output, so the gradient arriving from above is already the whole one.")


def _randn(*shape, key):
    import torch
    g = torch.Generator().manual_seed(key)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def tp_on_rank(payload, batch, d_model, hidden, seed=0, timeout=STUDENT_TIMEOUT):
    """On every rank: the student's ``f`` and ``g`` alone (forward and backward, inputs
    watched for changes), then their ``parallel_mlp`` on this rank's shards against the whole
    MLP in one process (float64). Returns what each gave, what one process gives, and what
    the usual mistakes would give; or the error and the part that raised."""
    import cloudpickle
    import torch

    from course_lib.comm import get_comm
    f, g, mlp_fn = (cloudpickle.loads(p) for p in payload)
    comm = get_comm("torch", timeout=timeout)
    r, N = comm.rank, comm.world_size
    out = {"rank": r, "error": None}
    part = "f.apply(x, comm)"
    try:
        # f: the same x on every rank, a different gradient arriving on each
        x = _randn(batch, d_model, key=seed * 100 + 1).requires_grad_()
        grads = [_randn(batch, d_model, key=seed * 100 + 10 + q) for q in range(N)]
        given = grads[r].clone()
        y = f.apply(x, comm)
        out.update(f_y=_numpy(y), f_want_y=_numpy(x), f_x_changed=False)
        part = "f's backward"
        y.backward(given)
        out.update(f_grad=_numpy(x.grad), f_own=_numpy(grads[r]),
                   f_want_grad=_numpy(sum(grads)), f_grad_changed=not torch.equal(given,
                                                                                  grads[r]))
        # g: a different partial sum on each rank, the same gradient arriving on every rank
        part = "g.apply(x, comm)"
        parts = [_randn(batch, d_model, key=seed * 100 + 20 + q) for q in range(N)]
        p = parts[r].clone().requires_grad_()
        z = g.apply(p, comm)
        out.update(g_y=_numpy(z), g_own=_numpy(parts[r]), g_want_y=_numpy(sum(parts)),
                   g_x_changed=not torch.equal(p.detach(), parts[r]))
        part = "g's backward"
        dz = _randn(batch, d_model, key=seed * 100 + 30)
        z.backward(dz.clone())
        out.update(g_grad=_numpy(p.grad), g_want_grad=_numpy(dz))
        # the MLP: Linear(d, h) split by rows (output features), GELU, Linear(h, d) by columns
        part = "parallel_mlp"
        torch.manual_seed(seed)
        mlp = torch.nn.Sequential(torch.nn.Linear(d_model, hidden), torch.nn.GELU(),
                                  torch.nn.Linear(hidden, d_model)).double()
        xm = _randn(batch, d_model, key=seed * 100 + 40).requires_grad_()
        dy = _randn(batch, d_model, key=seed * 100 + 41)
        want = mlp(xm)
        (want * dy).sum().backward()
        k = hidden // N
        rows = slice(r * k, (r + 1) * k)
        (w1, b1), (w2, b2) = ((m.weight, m.bias) for m in (mlp[0], mlp[2]))

        def shard(t):  # a leaf of this rank's own, contiguous
            return t.detach().clone(memory_format=torch.contiguous_format).requires_grad_()
        shards = [shard(w1[rows]), shard(b1[rows]), shard(w2[:, rows]), shard(b2)]
        xs = xm.detach().clone().requires_grad_()
        got = mlp_fn(xs, *shards, comm)
        (got * dy).sum().backward()
        # what this rank alone computes: its partial sum of y and of dL/dx (no f, no g)
        xl = xm.detach().clone().requires_grad_()
        local = torch.nn.functional.gelu(xl @ shards[0].detach().T + shards[1].detach()) \
            @ shards[2].detach().T
        (local * dy).sum().backward()
        with torch.no_grad():  # the whole MLP with one term left out: the usual slips
            lin1, lin2 = torch.nn.functional.linear, torch.nn.functional.linear
            gelu = torch.nn.functional.gelu
            out["left_out"] = {
                "b1": _numpy(lin2(gelu(lin1(xm, w1)), w2, b2)),
                "the GELU": _numpy(lin2(lin1(xm, w1, b1), w2, b2)),
                "b2": _numpy(lin2(gelu(lin1(xm, w1, b1)), w2))}
        out.update(y=_numpy(got), want_y=_numpy(want), partial_y=_numpy(local + b2),
                   bias_n_y=_numpy(want + (N - 1) * b2), x_grad=_numpy(xs.grad),
                   want_x_grad=_numpy(xm.grad), partial_x_grad=_numpy(xl.grad),
                   grads=[_numpy(s.grad) for s in shards],
                   wants=[_numpy(w1.grad[rows]), _numpy(b1.grad[rows]),
                          _numpy(w2.grad[:, rows]), _numpy(b2.grad)])
    except Exception as err:  # noqa: BLE001 - reported to the check, which explains it
        text = str(err).splitlines()[0] if str(err) else ""
        out["error"] = (part, f"{type(err).__name__}: {text}")
    return out


def _same(got, want):
    return got is not None and got.shape == want.shape and \
        np.allclose(got, want, rtol=1e-9, atol=1e-12)


def _tp_error_hint(part, text):
    if "cannot be multiplied" in text and part == "parallel_mlp":
        return ("the shards are stored as torch.nn.Linear stores its weight, (out_features, "
                "in_features): w1 is (hidden / N, d_model) and w2 (d_model, hidden / N). x @ w1 "
                "needs the transpose (F.linear does it).")
    if "incorrect number of gradients" in text:
        return ("backward returns one gradient per input of forward: forward(ctx, x, comm) "
                "takes two, so return (grad, None), None for comm (it needs no gradient).")
    if "CommTimeout" in text or "did not complete" in text:
        return ("a rank waited past its deadline in a collective: every rank must run the same "
                "allreduces in the same order (no allreduce under `if comm.rank == ...`).")
    if "view size is not compatible" in text or "contiguous" in text:
        return ("collectives.allreduce works on a contiguous tensor: allreduce a contiguous "
                "copy, t.clone(memory_format=torch.contiguous_format).")
    return f"read the error: it came from {part}."


def _check_f(where, N, r):
    __tracebackhide__ = True
    if not _same(r["f_y"], r["f_want_y"]):
        if _same(r["f_y"], N * r["f_want_y"]):
            raise CheckFailed(f"{where}\n  rank {r['rank']}: f's forward returned {N} x its "
                              f"input: it allreduced the same x on all {N} ranks\nHint: {F_IS}")
        raise CheckFailed(f"{where}\n  rank {r['rank']}: f's forward did not return its input"
                          f"\nHint: {F_IS}")
    grad, want = r["f_grad"], r["f_want_grad"]
    if not _same(grad, want):
        if _same(grad, r["f_own"]):
            told = ("x.grad is the gradient this rank's backward was handed, unreduced: "
                    "the allreduce is missing")
        elif _same(grad, want / N):
            told = (f"x.grad is the average of the {N} ranks' gradients, not their sum: "
                    f"do not divide by the world size (collectives.allreduce sums)")
        elif grad is None:
            told = "x.grad is None: f's backward returned no gradient for x"
        else:
            told = "x.grad is not the sum of the ranks' gradients"
        raise CheckFailed(f"{where}\n  rank {r['rank']}: after f's backward, {told}\n"
                          f"Hint: {F_IS}")
    if r["f_grad_changed"]:
        raise CheckFailed(f"{where}\n  rank {r['rank']}: f's backward changed the gradient "
                          f"autograd handed it, in place (it now holds the sum)\nHint: "
                          f"collectives.allreduce works in place; the gradient belongs to "
                          f"autograd, which may hand it to others too: allreduce a copy "
                          f"(grad.clone()) and return that.")


def _check_g(where, N, r):
    __tracebackhide__ = True
    got, want = r["g_y"], r["g_want_y"]
    if not _same(got, want):
        if _same(got, r["g_own"]):
            told = "g's forward returned this rank's partial sum unchanged: no allreduce"
        elif _same(got, want / N):
            told = (f"g's forward returned the average of the {N} partial sums, not their sum: "
                    f"do not divide by the world size")
        else:
            told = "g's forward did not return the sum of the ranks' inputs"
        raise CheckFailed(f"{where}\n  rank {r['rank']}: {told}\nHint: {G_IS}")
    if r["g_x_changed"]:
        raise CheckFailed(f"{where}\n  rank {r['rank']}: g's forward changed its input x in "
                          f"place (it now holds the sum)\nHint: collectives.allreduce works "
                          f"in place; the input belongs to autograd (another function may "
                          f"have saved it for its backward): allreduce a copy (x.clone()) and "
                          f"return that.")
    grad, want = r["g_grad"], r["g_want_grad"]
    if not _same(grad, want):
        if _same(grad, N * want):
            told = (f"the gradient of g's input is {N} x the gradient g received: g's "
                    f"backward allreduced it too")
        elif _same(grad, want / N):
            told = f"the gradient of g's input is the gradient g received divided by {N}"
        elif grad is None:
            told = "the gradient of g's input is None: g's backward returned none for x"
        else:
            told = "the gradient of g's input is not the gradient g received"
        raise CheckFailed(f"{where}\n  rank {r['rank']}: {told}\nHint: {G_IS}")


MLP_IS = ("parallel_mlp: h = gelu(f(x) w1^T + b1) on this rank's hidden units, then "
          "y = g(h w2^T) + b2: the partial sums reduced by g, the bias added once, after.")


def _check_mlp(where, N, r):
    __tracebackhide__ = True
    y = r["y"]
    if not _same(y, r["want_y"]):
        if _same(y, r["partial_y"]):
            told = "y is this rank's partial sum (plus b2): it never went through g"
        elif _same(y, r["bias_n_y"]):
            told = (f"y has b2 {N} times: the bias was added on every rank before g summed "
                    f"them")
        elif any(_same(y, v) for v in r["left_out"].values()):
            term = next(k for k, v in r["left_out"].items() if _same(y, v))
            told = f"y is the whole MLP's output without {term}: {term} is left out"
        else:
            told = "y differs from the whole MLP's output"
        raise CheckFailed(f"{where}\n  rank {r['rank']}: {told}\nHint: {MLP_IS}")
    if not _same(r["x_grad"], r["want_x_grad"]):
        told = ("x.grad is this rank's partial sum: the input never went through f, so no "
                "allreduce added the other ranks' parts" if _same(r["x_grad"],
                                                                  r["partial_x_grad"])
                else "x.grad differs from the whole MLP's")
        raise CheckFailed(f"{where}\n  rank {r['rank']}: {told}\nHint: {MLP_IS}")
    for what, got, want in zip(("w1", "b1", "w2", "b2"), r["grads"], r["wants"], strict=True):
        if not _same(got, want):
            raise CheckFailed(f"{where}\n  rank {r['rank']}: {what}.grad differs from the "
                              f"same slice of the whole MLP's gradient\nHint: {MLP_IS}")


def check_f_and_g(f: type, g: type, parallel_mlp: Callable, cluster,
                  timeout: float = STUDENT_TIMEOUT) -> bool:
    """Lab 09, exercise 3: Megatron's ``f`` and ``g`` (``torch.autograd.Function`` classes,
    ``f.apply(x, comm)``) alone, then ``parallel_mlp(x, w1, b1, w2, b2, comm)`` built on them,
    on every rank of ``cluster`` against the whole MLP in one process: its output, dL/dx and
    the gradient of every weight's slice."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.runtime.cluster import ClusterTimeout, RemoteError
    name = "check_f_and_g"
    try:
        payload = [pack_function(fn) for fn in (f, g, parallel_mlp)]
    except Exception as err:
        raise CheckFailed(f"{name}: your classes cannot be sent to the engines ({err})\n"
                          "Hint: define them in the notebook, without the cluster in them."
                          ) from None
    N = cluster.n
    for number, (batch, d, hidden) in enumerate(TP_CASES, start=1):
        where = (f"{name}: case {number}/{len(TP_CASES)} (batch {batch}, MLP {d} -> {hidden} "
                 f"-> {d}, {N} ranks)")
        try:
            reports = cluster.run(tp_on_rank, payload, batch, d, hidden, number, timeout,
                                  timeout=10 + 4 * timeout)
        except (RemoteError, ClusterTimeout) as err:
            raise CheckFailed(f"{where}\n  {err}\nHint: read the traceback.") from None
        errors = [r for r in reports if r["error"]]
        if any(r["error"][1].startswith("NotImplementedError") for r in errors):
            return not_implemented(name)
        if errors:
            part, text = errors[0]["error"]
            lines = "\n".join(f"  rank {r['rank']}, in {r['error'][0]}: {r['error'][1]}"
                              for r in errors)
            raise CheckFailed(f"{where}\n  your code raised:\n{lines}\nHint: "
                              f"{_tp_error_hint(part, text)}")
        for r in reports:
            _check_f(where, N, r)
        for r in reports:
            _check_g(where, N, r)
        for r in reports:
            _check_mlp(where, N, r)
    print(f"✓ {name}: f and g alone, and the MLP built on them, match one process on {N} ranks "
          f"({len(TP_CASES)} cases: output, dL/dx and every weight's gradient)")
    return True


# ---------------------------------------------------------------- exercise 4: the ZB-H1 order
def _one_f_one_b(stage, N, M):
    """1F1B's order, written again here: the reference the mistakes below are built from."""
    warmup = min(N - stage - 1, M)
    order = [("F", m) for m in range(warmup)]
    for m in range(warmup, M):
        order += [("F", m), ("B", m - warmup)]
    return order + [("B", m) for m in range(M - warmup, M)]


def _w_after_b(stage, N, M, waiting, newest_first=False):
    """1F1B with each B followed by a W once more than ``waiting`` W's wait (None: all W's at
    the end); the W's left run last."""
    order, pending = [], []
    for op, m in _one_f_one_b(stage, N, M):
        order.append((op, m))
        if op == "B":
            pending.append(m)
            if waiting is not None and len(pending) > waiting:
                order.append(("W", pending.pop(-1 if newest_first else 0)))
    return order + [("W", m) for m in (pending[::-1] if newest_first else pending)]


def _diagnose_zb_h1(stage, N, M, got):
    """What the student's ZB-H1 order did, in words."""
    if not isinstance(got, list) or any(not isinstance(step, tuple) or len(step) != 2
                                        or step[0] not in ("F", "B", "W") for step in got):
        return "return a list of pairs: ('F', m), ('B', m) and ('W', m)."
    try:
        pipeline.check_order(got, stage, M)
    except ValueError as e:
        return f"{e}. Each micro-batch m needs ('F', m), then ('B', m), then ('W', m)."
    if not any(op == "W" for op, _ in got):
        return "that is 1F1B's order: ZB-H1 splits each backward into B, then later W."
    if [step for step in got if step[0] != "W"] != _one_f_one_b(stage, N, M):
        return ("keep 1F1B's order of the F's and B's (your one_f_one_b): ZB-H1 only adds the "
                "W's, the weights' gradients, which no other stage waits for.")
    if got == _w_after_b(stage, N, M, 0):
        return (f"every B is followed by its W at once; stage {stage} lets its first {stage} "
                f"W's wait (one per stage before it), so that its B's, which stage {stage - 1} "
                "waits for, come sooner.")
    if got == _w_after_b(stage, N, M, N - 1 - stage):
        return (f"stage {stage} let {N - 1 - stage} W's wait, num_stages - 1 - stage: it is the "
                f"other way round, stage s lets s wait (stage 0 none, the last stage "
                f"{N - 1}): a later stage has room, it holds fewer micro-batches in 1F1B.")
    if got == _w_after_b(stage, N, M, None):
        return (f"all W's run at the end: stage {stage} then holds all {M} micro-batches' "
                "activations until then (W needs each layer's input). Run the oldest W after "
                f"a B as soon as more than {stage} wait.")
    if got == _w_after_b(stage, N, M, stage, newest_first=True):
        return "run the waiting W's oldest first, as the B's ran."
    return (f"after each B, stage {stage} runs the oldest W that waits, but only once more "
            f"than {stage} W's wait; the W's still waiting at the end run last, oldest first.")


def check_zb_h1_order(student_fn: Callable, cluster=None) -> bool:
    """Lab 09, exercise 4: ``zb_h1(stage, num_stages, num_microbatches)`` returns the ZB-H1
    order of that stage; checked case by case, in the simulator, then (with ``cluster``) run
    with a split backward on its ranks against one process."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_zb_h1_order"
    if not _check_cases(name, student_fn, "zb-h1", "('F', m), ('B', m) and ('W', m)",
                        _diagnose_zb_h1):
        return False
    N, M = 4, 8
    orders = [_order(student_fn, s, N, M) for s in range(N)]
    sim, one = pipeline.simulate("zb-h1", N, M, orders=orders), pipeline.simulate("1f1b", N, M)
    print(f"  simulated, N = {N}, M = {M}, F = B = W: bubble {sim.bubble:.3f} (1F1B "
          f"{one.bubble:.3f}; idle slots {sim.makespan - 3 * M:g} against "
          f"{one.makespan - 3 * M:g}), live micro-batches per stage {sim.peak_live}")
    if cluster is not None:
        _run_on_ranks(name, student_fn, cluster, " with B and W apart")
    print(f"✓ {name}: {len(ORDER_CASES)}/{len(ORDER_CASES)} cases match the reference")
    return True
