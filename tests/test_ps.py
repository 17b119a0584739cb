"""The parameter server: sync equals single-process mini-batch SGD, async converges, failures
end in errors that name the worker, the staleness-aware step tames high staleness."""

import time

import numpy as np
import pytest

from course_lib import data, gd, ps
from course_lib.checkpoint import Store
from course_lib.models import LinearRegression, SoftmaxRegression
from course_lib.runtime.cluster import RemoteError
from course_lib.testing.timing import assert_no_hang

CLUSTER_SIZE = 4  # the shared cluster of tests/conftest.py


@pytest.fixture(scope="module")
def linear():
    X, y, _ = data.make_linear(n_samples=300, n_features=5, noise=0.3, seed=0)
    return LinearRegression(), X, y, np.zeros(X.shape[1])


def test_make_spec_and_roles():
    spec = ps.make_spec(2, 1, world_size=4)
    assert spec == {"ps": [0, 1], "worker": [2], "idle": [3]}
    assert [ps.role_of(spec, r) for r in range(4)] == ["ps", "ps", "worker", "idle"]
    with pytest.raises(ValueError, match="server"):
        ps.make_spec(0, 3)


def test_apply_push_staleness_and_aware_step():
    theta = np.array([1.0, 2.0])
    new, version, tau = ps.apply_push(theta, 7, np.array([1.0, 1.0]), 3, lr=0.4)
    assert (version, tau) == (8, 4) and np.allclose(new, [0.6, 1.6])
    new, _, _ = ps.apply_push(theta, 7, np.array([1.0, 1.0]), 3, lr=0.4, staleness_aware=True)
    assert np.allclose(new, [0.9, 1.9]) and np.allclose(theta, [1.0, 2.0])
    new, _, tau = ps.apply_push(theta, 5, np.array([1.0, 1.0]), 5, lr=0.4, staleness_aware=True)
    assert tau == 0 and np.allclose(new, [0.6, 1.6])  # fresh gradient: full step


def test_the_policies_alone_sync_backup_and_async():
    """The server's decisions, without a server: a sync step waits for every running worker (the
    first N - b with backup workers, dropping a late push), an async push is applied at once,
    rejected when too stale, and taken as fresh when computed on versions a restart lost."""
    shard = ps.Shard(np.zeros(2))
    sync = ps.Synchronous(lr=0.5, num_workers=3)
    assert sync.push(shard, 1, np.array([2.0, 0.0]), 2, pulled=0) == "held"
    assert not sync.ready({1, 2, 3})
    assert sync.push(shard, 2, np.array([0.0, 4.0]), 2, pulled=0) == "held"
    assert not sync.ready({1, 2, 3}) and sync.ready({1, 2})  # worker 3 said done
    assert sync.step(shard) == [1, 2] and shard.version == 1
    assert shard.theta.tolist() == [-0.25, -0.5]  # lr * (sum of sums) / (sum of counts)

    shard, backup = ps.Shard(np.zeros(1)), ps.Synchronous(lr=1.0, num_workers=3, backup_workers=1)
    backup.push(shard, 1, np.array([1.0]), 1, pulled=0)
    backup.push(shard, 3, np.array([3.0]), 1, pulled=0)
    assert backup.ready({1, 2, 3}) and backup.step(shard) == [1, 3]
    assert backup.push(shard, 2, np.array([9.0]), 1, pulled=0) == "dropped"  # late
    assert backup.dropped == [(2, 0)] and shard.theta.tolist() == [-2.0]

    shard, asyn = ps.Shard(np.zeros(1), version=5), ps.Asynchronous(lr=1.0, max_staleness=2)
    assert asyn.push(shard, 1, np.array([2.0]), 2, pulled=4) == "applied"  # staleness 1
    assert asyn.push(shard, 2, np.array([1.0]), 1, pulled=3) == "rejected"  # 6 - 3 > 2
    assert asyn.push(shard, 3, np.array([1.0]), 1, pulled=9) == "applied"   # after a restart
    assert shard.version == 7 and shard.theta.tolist() == [-2.0]
    assert asyn.counts() == dict(staleness=[1, 0], rejected=1, dropped=[], from_lost=1)


@pytest.mark.parametrize("num_servers,num_workers", [(1, 1), (1, 3), (2, 2), (3, 1)])
def test_sync_equals_single_process_minibatch_sgd(cluster, linear, num_servers, num_workers):
    problem, X, y, theta0 = linear
    spec = ps.make_spec(num_servers, num_workers, world_size=4)
    result = ps.train(cluster, spec, problem, X, y, theta0, lr=0.1, num_epochs=2, batch_size=32)
    ref = gd.minibatch_sgd(problem, X, y, theta0, 0.1, 2, 32, seed=0).final_theta
    assert np.abs(result.theta - ref).max() < 1e-6
    assert set(result.staleness_histogram().nonzero()[0]) == {0}
    steps = 2 * int(np.ceil(len(X) / 32))
    assert all(s["version"] == steps for s in result.servers)
    assert [w["steps"] for w in result.workers] == [steps] * num_workers
    assert result.pushes == steps * num_workers * num_servers and result.pushes_per_s > 0


def test_a_spec_not_in_rank_order_labels_each_shard_with_the_values_it_holds(cluster, linear):
    problem, X, y, theta0 = linear
    theta0 = np.linspace(-1, 1, 21)
    X = np.random.default_rng(0).normal(size=(64, 21))
    y = X @ np.ones(21)
    spec = {"ps": [3, 1], "worker": [2, 0], "idle": []}
    result = ps.train(cluster, spec, problem, X, y, theta0, lr=0.1, num_epochs=1, batch_size=32)
    ref = gd.minibatch_sgd(problem, X, y, theta0, 0.1, 1, 32, seed=0).final_theta
    assert np.abs(result.theta - ref).max() < 1e-6
    assert [s["server"] for s in result.servers] == [3, 1]
    assert [s["shard"] for s in result.servers] == [(0, 11), (11, 21)]
    assert [len(s["theta"]) for s in result.servers] == [11, 10]


def test_sync_softmax_uneven_shards(cluster):
    X, y, _, _ = data.load_digits()
    X, y = X[:200], y[:200]
    problem = SoftmaxRegression(10)
    theta0 = problem.init(X.shape[1], seed=1)
    spec = ps.make_spec(3, 1, world_size=4)  # 650 parameters over 3 servers: unequal shards
    result = ps.train(cluster, spec, problem, X, y, theta0, lr=0.5, num_epochs=1, batch_size=50)
    ref = gd.minibatch_sgd(problem, X, y, theta0, 0.5, 1, 50, seed=0).final_theta
    assert np.abs(result.theta - ref).max() < 1e-6


def test_async_converges_near_sync_and_measures_staleness(cluster, linear):
    problem, X, y, theta0 = linear
    spec = ps.make_spec(1, 3, world_size=4)
    kw = dict(lr=0.05, num_epochs=8, batch_size=30)
    sync = ps.train(cluster, spec, problem, X, y, theta0, **kw)
    asyn = ps.train(cluster, spec, problem, X, y, theta0, mode="async", delay=0.002, **kw)
    best = problem.loss(np.linalg.lstsq(X, y, rcond=None)[0], X, y)
    assert problem.loss(asyn.theta, X, y) < max(1.1 * problem.loss(sync.theta, X, y), 1.05 * best)
    hist = asyn.staleness_histogram()
    assert hist.sum() == sum(w["steps"] for w in asyn.workers) and len(hist) > 1
    assert [s["per_worker"] for s in asyn.servers][0] == {w["worker"]: w["steps"]
                                                          for w in asyn.workers}


def test_async_survives_a_silent_worker(cluster, linear):
    problem, X, y, theta0 = linear
    spec = ps.make_spec(1, 3, world_size=4)
    result = ps.train(cluster, spec, problem, X, y, theta0, lr=0.05, num_epochs=4, batch_size=30,
                      mode="async", faults=["ps-worker-step:stop@4:rank=2"], timeout=2)
    assert result.lost_workers == [2]
    assert [w["steps"] for w in result.workers] == [40, 3, 40]
    assert problem.loss(result.theta, X, y) < problem.loss(theta0, X, y) / 2


def test_async_survives_a_worker_whose_process_dies(cluster, linear):
    problem, X, y, theta0 = linear
    spec = ps.make_spec(1, 3, world_size=4)
    result = ps.train(cluster, spec, problem, X, y, theta0, lr=0.05, num_epochs=4, batch_size=30,
                      mode="async", faults=["ps-worker-step:kill@4:rank=3"], timeout=2)
    assert result.lost_workers == [3]
    assert [w.get("died", False) for w in result.workers] == [False, False, True]
    assert [w["steps"] for w in result.workers[:2]] == [40, 40]
    assert problem.loss(result.theta, X, y) < problem.loss(theta0, X, y) / 2
    again = ps.train(cluster, spec, problem, X, y, theta0, lr=0.05, num_epochs=1, batch_size=30)
    assert np.isfinite(again.theta).all()  # the next call restarted the dead engine


def test_sync_names_the_missing_worker_within_the_deadline(cluster, linear):
    import time
    problem, X, y, theta0 = linear
    spec = ps.make_spec(1, 3, world_size=4)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match=r"no gradient from worker rank\(s\) \[3\]"):
        ps.train(cluster, spec, problem, X, y, theta0, lr=0.1, num_epochs=1, batch_size=30,
                 faults=["ps-worker-step:stop@3:rank=3"], timeout=2)
    assert_no_hang(time.monotonic() - t0, 2, timed_out=True)
    again = ps.train(cluster, spec, problem, X, y, theta0, lr=0.1, num_epochs=1, batch_size=30)
    assert np.isfinite(again.theta).all()  # the cluster recovers


def test_bounded_staleness_rejects_stale_pushes(cluster, linear):
    problem, X, y, theta0 = linear
    result = ps.train(cluster, ps.make_spec(1, 3, world_size=4), problem, X, y, theta0, lr=0.05,
                      num_epochs=2, batch_size=30, mode="async", max_staleness=0, delay=0.003)
    assert result.staleness.max() == 0
    assert result.servers[0]["rejected"] == sum(w["rejected"] for w in result.workers) > 0


def test_staleness_aware_step_tames_high_staleness():
    X, y, _ = data.make_linear(n_samples=1000, n_features=8, noise=0.5, seed=0)
    problem, theta0 = LinearRegression(), np.zeros(X.shape[1])
    best = problem.loss(np.linalg.lstsq(X, y, rcond=None)[0], X, y)
    finals = {}
    for aware in (False, True):
        finals[aware] = [ps.simulate_async(problem, X, y, theta0, lr=0.1, num_workers=16,
                                           num_updates=600, staleness_aware=aware,
                                           seed=seed)[0][-1] for seed in range(5)]
    assert np.median(finals[True]) < 2 * best
    assert np.median(finals[False]) > 10 * np.median(finals[True])
    losses, staleness = ps.simulate_async(problem, X, y, theta0, lr=0.1, num_workers=1,
                                          num_updates=50, seed=0)
    assert staleness.max() == 0 and losses[-1] < losses[0]


# ---------------------------------------------------------------- a server killed (notebook 11)
def test_async_server_killed_comes_back_from_its_checkpoint(cluster, linear, tmp_path):
    problem, X, y, theta0 = linear
    spec = ps.make_spec(1, 3, world_size=4)
    result = ps.train(cluster, spec, problem, X, y, theta0, lr=0.05, num_epochs=6, batch_size=30,
                      mode="async", checkpoints=Store(tmp_path / "ckpt"), checkpoint_every=20,
                      server_restarts=1, faults=["ps-server-update:kill@50"], timeout=10)
    # killed after update 50: before any worker can have finished its 60 steps (a finished
    # worker's 'done' is checkpointed too), so the last checkpoint is the 40th update's
    server = result.servers[0]
    assert [(r["attempt"], r["signal"]) for r in server["restarts"]] == [(0, 9)]
    assert server["restored_from"] == 40 and server["skipped"] == []  # 50 = 40 + 10 lost
    assert server["version"] == 40 + server["pushes"] and server["pushes"] > 60
    assert [w["steps"] for w in result.workers] == [60, 60, 60]   # every worker finished
    assert sum(w["resent"] for w in result.workers) >= 1           # what went unanswered
    killed = server["restarts"][0]["time"]
    seen = [(w["t0"] + t, v) for w in result.workers for t, v in zip(w["times"], w["versions"],
                                                                      strict=True)]
    before = max(v for t, v in seen if t < killed)
    after = min(v for t, v in seen if t > killed)
    near = sorted((round(t - killed, 3), v) for t, v in seen if abs(t - killed) < 3)
    assert after <= 40 + 3 < before <= 50, (  # the updates since the checkpoint were lost
        f"ready {server['ready'] - killed:.3f} s after the kill; (t - kill, version): {near}")
    assert problem.loss(result.theta, X, y) < problem.loss(theta0, X, y) / 10
    assert (tmp_path / "ckpt" / ".fault-0").exists()               # fired once, not again
    import matplotlib
    matplotlib.use("Agg")
    from course_lib.figures import fault_tolerance
    axes = fault_tolerance.server_restart(result)
    points = [line for line in axes[0].lines if line.get_label().startswith("worker")]
    assert sum(len(line.get_xdata()) for line in points) == 180
    assert axes[0].patches and axes[1].patches  # the outage, shaded on both


def test_server_restarts_bad_arguments(cluster, linear, tmp_path):
    problem, X, y, theta0 = linear
    spec = ps.make_spec(1, 3, world_size=4)
    with pytest.raises(ValueError, match="mode='async'"):
        ps.train(cluster, spec, problem, X, y, theta0, lr=0.1, server_restarts=1,
                 checkpoints=Store(tmp_path))
    with pytest.raises(ValueError, match="checkpoints"):
        ps.train(cluster, spec, problem, X, y, theta0, lr=0.1, mode="async", server_restarts=1)
    (tmp_path / "server-0").mkdir()
    with pytest.raises(ValueError, match="another run"):
        ps.train(cluster, spec, problem, X, y, theta0, lr=0.1, mode="async", server_restarts=1,
                 checkpoints=Store(tmp_path))



# ---------------------------------------------------------------- resent messages, one process
def _raw_server():
    """A ROUTER socket on a free port, as a server's, and its address."""
    import zmq
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    return sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def _message(sock, header, vector=()):
    import json
    sock.send_multipart([json.dumps(header).encode(), np.asarray(vector, np.float64).tobytes()])


def test_a_done_answered_late_is_heard_though_the_server_exits_at_once(monkeypatch):
    """The server answers the last 'done' after the worker's first wait (0.5 s) and exits at once:
    the worker, resending on the same socket, still hears that one reply (on a new socket, it
    would have waited for a server that is gone)."""
    import json
    import threading

    from course_lib.ps_server import ServerConnections
    from course_lib.runtime.engine import ENGINE
    monkeypatch.setitem(ENGINE, "rank", 1)
    server, address = _raw_server()

    def answer_once_late():
        if server.poll(5000):
            identity, header, _ = server.recv_multipart()
            time.sleep(0.8)
            server.send_multipart([identity, json.dumps(dict(op="ok", version=7)).encode(),
                                   np.zeros(3).tobytes()])
        server.close(linger=1000)  # gone: a resent 'done' finds nobody

    thread = threading.Thread(target=answer_once_late)
    thread.start()
    conn = ServerConnections([address], 3, timeout=4, retry=0.5)
    try:
        _, versions, _ = conn.done()
    finally:
        conn.close(linger=0)
        thread.join()
    assert versions == [7] and conn.resent == 1


def test_the_server_applies_a_push_sent_twice_once(monkeypatch):
    """A push that arrives twice (its worker heard no reply in time and sent it again) updates the
    parameters once, even when the copy comes after the worker's next push; a copy is answered
    with the current parameters."""
    import threading

    import zmq

    from course_lib import ps_server
    from course_lib.runtime.engine import ENGINE
    monkeypatch.setitem(ENGINE, "rank", 0)
    sock, address = _raw_server()
    cfg = ps.PSConfig(lr=1.0, mode="async", timeout=5, time_limit=20)
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        ps_server.serve({"ps": [0], "worker": [1]}, 2, cfg, cfg.policy(1), sock=sock)))
    thread.start()
    worker = zmq.Context.instance().socket(zmq.DEALER)
    worker.linger = 0
    worker.connect(address)
    try:
        replies = []
        for header, vector in [(dict(op="init"), [0, 0]),
                               (dict(op="push", count=1, version=0, seq=1), [1, 2]),
                               (dict(op="push", count=1, version=0, seq=1), [1, 2]),  # the copy
                               (dict(op="push", count=1, version=1, seq=2), [1, 1]),
                               # a copy of the first, read after the second (it was queued on
                               # the socket its worker closed)
                               (dict(op="push", count=1, version=0, seq=1), [1, 2]),
                               (dict(op="done", ack=True), [])]:
            _message(worker, dict(header, worker=1), vector)
            assert worker.poll(5000), f"no reply to {header}"
            _, payload = worker.recv_multipart()
            replies.append(np.frombuffer(payload, np.float64).tolist())
    finally:
        worker.close()
        thread.join(timeout=10)
    assert replies[1] == replies[2] == [-1, -2] and replies[3] == replies[4] == [-2, -3]
    assert result["pushes"] == 2 and result["duplicates"] == 2 and result["version"] == 2


def test_a_push_sent_again_on_a_slow_link_is_applied_once(cluster, linear, tmp_path):
    """Replies slower than the workers' first 0.5 s wait (a 600 ms link each way): pushes are sent
    again on a new socket, 'done' on the same one, and the run ends with one update per gradient
    (the server answers a copy of a push it applied from its record of each worker's last push;
    how many copies it reads depends on timing: a copy still queued when its socket closed is
    dropped by ZeroMQ)."""
    problem, X, y, theta0 = linear
    spec = ps.make_spec(1, 2, world_size=4)
    cluster.set_link("1Gbit/s,600ms")
    try:
        result = ps.train(cluster, spec, problem, X, y, theta0, lr=0.05, num_epochs=1,
                          batch_size=100, mode="async", checkpoints=Store(tmp_path / "ckpt"),
                          server_restarts=1, timeout=10)
    finally:
        cluster.set_link(None)
    server = result.servers[0]
    steps = sum(w["steps"] for w in result.workers)
    assert sum(w["resent"] for w in result.workers) >= 1
    assert server["pushes"] == steps and server["version"] == steps  # one update per gradient
