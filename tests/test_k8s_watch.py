"""A job's life under kubectl (notebook 12): the operator's condition rules on made-up phases,
kubectl's formats, then real two-pod jobs run here and watched, one that succeeds and one whose
pods fail, their phases the ones their processes went through."""

import json

import pytest

from course_lib import k8s
from course_lib.k8s import watch as k8s_watch
from course_lib.k8s.watch import JobRun, PodRun
from course_lib.runtime import hosts

IMAGE = "pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime"


def _run(master, worker):
    pods = {"j-master-0": PodRun("j-master-0", "Master", [(0.0, "Pending")]),
            "j-worker-0": PodRun("j-worker-0", "Worker", [(0.0, "Pending")])}
    run = JobRun("j", "default", 1_700_000_000.0, pods)
    run.set_condition("Created", "True", 0.0)
    for t, (m, w) in enumerate(zip(master, worker, strict=True), 1):
        for pod, phase in ((pods["j-master-0"], m), (pods["j-worker-0"], w)):
            if phase != pod.phase:
                pod.phases.append((float(t), phase))
        run.update(float(t))
    return run


def _conditions(run):
    return [(c["type"], c["status"], c["reason"], c["lastTransitionTime"])
            for c in run.conditions]


def test_the_operator_s_conditions_follow_the_master():
    run = _run(["Running", "Running", "Succeeded"], ["Running", "Succeeded", "Succeeded"])
    assert _conditions(run) == [("Created", "True", "PyTorchJobCreated", 0.0),
                                ("Running", "False", "PyTorchJobRunning", 1.0),
                                ("Succeeded", "True", "PyTorchJobSucceeded", 3.0)]
    assert run.conditions[-1]["message"] == "PyTorchJob j is successfully completed."
    assert run.completion == 3.0


def test_a_failed_replica_fails_the_job_for_good():
    run = _run(["Running", "Running", "Succeeded"], ["Running", "Failed", "Failed"])
    assert _conditions(run)[1:] == [("Running", "False", "PyTorchJobRunning", 1.0),
                                    ("Failed", "True", "PyTorchJobFailed", 2.0)]
    assert run.conditions[-1]["message"] == \
        "PyTorchJob j is failed because 1 Worker replica(s) failed."
    assert run.completion == 2.0  # and the master's success later changes nothing


def test_kubectl_formats():
    assert [k8s_watch.kubectl_age(s) for s in (0, 59.9, 119, 125, 600, 11_000, 30_000,
                                                200_000)] == \
        ["0s", "59s", "119s", "2m5s", "10m", "3h3m", "8h", "2d7h"]
    run = _run(["Running", "Succeeded"], ["Running", "Succeeded"])
    run.pods["j-master-0"].exit_code = run.pods["j-worker-0"].exit_code = 0
    watch = k8s_watch.kubectl_get_pods_watch(run).splitlines()
    assert watch[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert [line.split()[:3] for line in watch[1:]] == [
        ["j-master-0", "0/1", "ContainerCreating"], ["j-worker-0", "0/1", "ContainerCreating"],
        ["j-master-0", "1/1", "Running"], ["j-worker-0", "1/1", "Running"],
        ["j-master-0", "0/1", "Completed"], ["j-worker-0", "0/1", "Completed"]]
    assert k8s_watch.kubectl_get_job(run, now=run.created_utc + 65).splitlines()[1].split() \
        == ["j", "Succeeded", "65s"]
    text = k8s_watch.kubectl_describe_job(run, now=run.created_utc + 10)
    assert "    Reason:                PyTorchJobSucceeded" in text
    assert "    Last Transition Time:  2023-11-14T22:13:22Z" in text  # created + 2 s, UTC
    assert "    Master:\n      Succeeded:  1" in text
    assert "Created pod: j-worker-0" in text and "exited with code 0" in text
    run.pods["j-master-0"].log = "a\n" + "x" * 200 + "\n"
    assert k8s_watch.kubectl_logs(run, "j-master-0", max_width=20) == "a\n" + "x" * 17 + "..."


def _job(name, steps):
    spec = k8s.JobSpec(name, image=IMAGE, command=["-m", "course_lib.train", "--steps", steps],
                       nodes=2)
    return k8s.pytorch_job(spec)


@pytest.fixture(scope="module")
def two_hosts():
    reason = hosts.unavailable_reason()
    if reason:
        pytest.skip(f"two hosts: {reason}")


def test_a_job_that_succeeds_is_watched_through_its_phases(two_hosts):
    run = k8s_watch.run_watched(_job("small", "2"), timeout=120)
    for pod in run.pods.values():
        assert [phase for _, phase in pod.phases] == ["Pending", "Running", "Succeeded"]
        times = [t for t, _ in pod.phases]
        assert times == sorted(times) and pod.exit_code == 0 and pod.reason == "Completed"
    assert [(c["type"], c["status"]) for c in run.conditions] == [
        ("Created", "True"), ("Running", "False"), ("Succeeded", "True")]
    master = run.pods["small-master-0"]
    assert run.completion == pytest.approx(master.phases[-1][0])
    result = json.loads(master.log.strip().splitlines()[-1])
    assert result["hosts"] == ["small-master-0", "small-worker-0"] and result["world_size"] == 2


def test_a_job_whose_pods_fail_ends_failed_with_their_logs(two_hosts):
    run = k8s_watch.run_watched(_job("broken", "two"), timeout=120)  # --steps two: exits 2
    for pod in run.pods.values():
        assert pod.phase == "Failed" and pod.exit_code != 0 and pod.reason == "Error"
        assert "argument --steps: invalid int value: 'two'" in pod.log
    assert run.conditions[-1]["type"] == "Failed"
    assert run.conditions[-1]["message"].startswith("PyTorchJob broken is failed because 1 ")
    assert "Error" in k8s_watch.kubectl_get_pods_watch(run)
