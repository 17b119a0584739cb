"""A job's life under kubectl: a PyTorchJob's pods run here as local processes, watched.

Introduced in notebooks/12_scaling_out.ipynb. On a cluster one follows a job with ``kubectl get
pods -w`` (each pod Pending, then Running, then Succeeded or Failed), ``kubectl describe
pytorchjob <job>`` (the conditions the operator sets: Created, Running, Succeeded or Failed, each
with a reason, a message and when it last changed) and ``kubectl logs <pod>``. No API server runs
here: :func:`run_watched` starts the job's two pods as processes on two hosts named like the
pods (:mod:`course_lib.runtime.hosts`), each with the environment the operator would give it
(:func:`course_lib.k8s.pods.pod_environments`), polls them while they run and records every
phase it sees; the conditions follow from those phases as the training-operator's controller
derives them. The ``kubectl_*`` functions print what was observed in kubectl's formats::

    from course_lib.k8s import watch as k8s_watch
    run = k8s_watch.run_watched(job)              # job: a checked two-pod PyTorchJob
    print(k8s_watch.kubectl_get_pods_watch(run))
    print(k8s_watch.kubectl_describe_job(run))
    print(k8s_watch.kubectl_logs(run, "digits-master-0"))

:func:`run_locally` runs the job the same way and returns each pod's output. It stays one file:
what is observed (the top half) and how kubectl prints it (the bottom half) share the records.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from course_lib.k8s.pods import pod_environments
from course_lib.runtime import hosts
from course_lib.runtime.launch import kill_tree

# --------------------------------------------------------------------------- a job's life
# The training-operator's condition reasons and messages for a PyTorchJob (kubeflow/training-
# operator pkg/util/status.go NewReason: kind + "Created" / "Running" / "Succeeded" / "Failed";
# pkg/controller.v1/pytorch/pytorchjob_controller.go UpdateJobStatus for the messages).
CONDITION_MESSAGES = {"Created": "PyTorchJob {name} is created.",
                      "Running": "PyTorchJob {name} is running.",
                      "Succeeded": "PyTorchJob {name} is successfully completed.",
                      "Failed": "PyTorchJob {name} is failed because {failed} {rtype} replica(s) "
                                "failed."}


@dataclass
class PodRun:
    """One pod of :func:`run_watched`: its name, replica type, the phases observed with the
    time each began (``[(seconds since the job's creation, phase)]``, Pending, Running, then
    Succeeded or Failed), its exit code, kubectl's reason (Completed, Error, DeadlineExceeded)
    and its log (stdout and stderr). Introduced in notebooks/12_scaling_out.ipynb."""

    name: str
    replica: str
    phases: list[tuple[float, str]] = field(default_factory=list)
    exit_code: int | None = None
    reason: str = ""
    log: str = ""

    @property
    def phase(self) -> str:
        """The last phase observed."""
        return self.phases[-1][1]


@dataclass
class JobRun:
    """What :func:`run_watched` observed of a job: its pods, its conditions as the operator
    would have set them (dicts with ``type``, ``status``, ``reason``, ``message`` and the
    seconds since creation of ``lastTransitionTime``/``lastUpdateTime``), the wall-clock time of
    its creation and, once done, of its completion (seconds since creation).
    Introduced in notebooks/12_scaling_out.ipynb."""

    name: str
    namespace: str
    created_utc: float
    pods: dict[str, PodRun]
    conditions: list[dict] = field(default_factory=list)
    completion: float | None = None

    def set_condition(self, ctype: str, status: str, at: float, **fields: object) -> None:
        """The operator's setCondition: nothing once Failed; a condition of the same type is
        replaced, keeping its transition time when its status did not change; Succeeded and
        Failed turn Running to False."""
        if any(c["type"] == "Failed" and c["status"] == "True" for c in self.conditions):
            return
        old = next((c for c in self.conditions if c["type"] == ctype), None)
        reason = "PyTorchJob" + ctype
        if old and old["status"] == status and old["reason"] == reason:
            return
        new = dict(type=ctype, status=status, reason=reason,
                   message=CONDITION_MESSAGES[ctype].format(name=self.name, **fields),
                   lastUpdateTime=at,
                   lastTransitionTime=old["lastTransitionTime"] if old and
                   old["status"] == status else at)
        kept = [c for c in self.conditions if c["type"] != ctype]
        if ctype in ("Succeeded", "Failed"):
            kept = [dict(c, status="False") if c["type"] == "Running" else c for c in kept]
        self.conditions = kept + [new]

    def update(self, at: float) -> None:
        """UpdateJobStatus with a Master replica: Running while the master runs, Succeeded when
        it has succeeded (the master decides: a job that succeeded stays so), Failed as soon as
        a replica has failed before that (nothing restarts it here)."""
        by_type = {}
        for pod in self.pods.values():
            by_type.setdefault(pod.replica, []).append(pod.phase)
        master = by_type.get("Master", [])
        if "Running" in master:
            self.set_condition("Running", "True", at)
        if master and all(p == "Succeeded" for p in master):
            self.set_condition("Succeeded", "True", at)
        if any(c["type"] == "Succeeded" for c in self.conditions):
            by_type = {}  # succeeded: a worker failing afterwards changes nothing
        for rtype, phases in by_type.items():
            if "Failed" in phases:
                self.set_condition("Failed", "True", at, failed=phases.count("Failed"),
                                   rtype=rtype)
        if self.completion is None and any(c["type"] in ("Succeeded", "Failed") and
                                           c["status"] == "True" for c in self.conditions):
            self.completion = at


def run_watched(manifest: dict, timeout: float = 180.0, poll: float = 0.05) -> JobRun:
    """Run a two-pod PyTorchJob here as :func:`run_locally` does, watching it: every ``poll``
    seconds each pod's process is looked at (not started yet: Pending, while its host is made;
    alive: Running; exited 0: Succeeded, else Failed) and the job's
    conditions follow as the training-operator sets them. Past ``timeout`` the processes still
    alive are killed (Failed, DeadlineExceeded). No Kubernetes API server is involved: these are
    local processes named as the operator names its pods. Returns a :class:`JobRun`. Needs root.
    Introduced in notebooks/12_scaling_out.ipynb."""
    pods = pod_environments(manifest)
    if manifest["kind"] != "PyTorchJob" or len(pods) != 2:
        raise ValueError(f"run_watched runs a PyTorchJob of two pods, not a {manifest['kind']} "
                         f"of {len(pods)}")
    t0, created = time.monotonic(), time.time()
    run = JobRun(manifest["metadata"]["name"], manifest["metadata"].get("namespace", "default"),
                 created, {p.pod: PodRun(p.pod, p.replica, [(0.0, "Pending")]) for p in pods})
    run.set_condition("Created", "True", 0.0)
    with tempfile.TemporaryDirectory() as tmp, hosts.make_hosts([p.pod for p in pods]) as machines:
        procs, logs = {}, {}
        for pod, host in zip(pods, machines, strict=True):
            command = manifest["spec"]["pytorchReplicaSpecs"][pod.replica]["template"]["spec"][
                "containers"][0]["command"]
            if command[0] == "torchrun":  # this machine's torchrun: the one beside its Python
                command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
            logs[pod.pod] = open(f"{tmp}/{pod.pod}.log", "w+")  # noqa: SIM115 - closed below
            procs[pod.pod] = host.popen(command, env={**os.environ, **pod.env,
                                                      "GLOO_SOCKET_IFNAME": host.interface},
                                        stdout=logs[pod.pod], stderr=subprocess.STDOUT)
        try:
            while True:
                at = time.monotonic() - t0
                # one look at each process per round: the phases recorded and the decision to
                # stop read the same exit codes (a process that exits in between is seen next)
                codes = {name: proc.poll() for name, proc in procs.items()}
                for name, code in codes.items():
                    pod = run.pods[name]
                    phase = "Running" if code is None else "Succeeded" if code == 0 else "Failed"
                    if phase != pod.phase:
                        pod.phases.append((at, phase))
                        pod.exit_code = code
                        pod.reason = {"Succeeded": "Completed", "Failed": "Error"}.get(phase, "")
                run.update(at)
                if all(code is not None for code in codes.values()):
                    break
                if at > timeout:
                    for name, proc in procs.items():
                        if proc.poll() is None:
                            kill_tree([proc.pid])
                            proc.wait()
                            pod = run.pods[name]
                            pod.phases.append((time.monotonic() - t0, "Failed"))
                            pod.exit_code, pod.reason = proc.returncode, "DeadlineExceeded"
                    run.update(time.monotonic() - t0)
                    break
                time.sleep(poll)
        finally:
            for name, proc in procs.items():
                if proc.poll() is None:  # Ctrl-C: nothing outlives the job
                    kill_tree([proc.pid])
                    proc.wait()
                logs[name].seek(0)
                run.pods[name].log = logs[name].read()
                logs[name].close()
    return run


# --------------------------------------------------------------------------- kubectl's formats
NOT_A_CLUSTER = ("# no Kubernetes API server runs here: these are the job's local processes, "
                 "named as the operator names its pods, printed as kubectl prints pods and jobs")


def run_locally(manifest: dict, timeout: float = 180.0) -> dict[str, str]:
    """Run a two-pod PyTorchJob here as the cluster would: each pod a host of its own named like
    the pod (:func:`course_lib.runtime.hosts.make_hosts`, so ``MASTER_ADDR=<job>-master-0``
    resolves), its container's command, and exactly the environment :func:`pod_environments` gives
    it. Returns each pod's output (rank 0's last line is the script's JSON result); raises
    RuntimeError naming the first pod that failed or ran late. Needs root.
    Introduced in notebooks/12_scaling_out.ipynb."""
    run = run_watched(manifest, timeout)
    for pod in run.pods.values():
        if pod.phase != "Succeeded":
            raise RuntimeError(f"{pod.name} failed ({pod.reason}, exit code {pod.exit_code}): "
                               f"{pod.log.strip()[-1500:]}")
    return {name: pod.log for name, pod in run.pods.items()}


def kubectl_age(seconds: float) -> str:
    """A duration as kubectl prints an AGE (k8s.io/apimachinery duration.HumanDuration):
    '45s', '2m5s', '12m', '5h3m', '3d4h'. Introduced in notebooks/12_scaling_out.ipynb."""
    s = int(seconds)
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = m // 60
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    return f"{h // 24}d{h % 24}h" if h % 24 else f"{h // 24}d"


def _columns(rows, gap=3):
    # kubectl's tabwriter: left-aligned columns, three spaces apart (two in describe's tables)
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join((" " * gap).join(f"{c!s:<{w}}" for c, w in zip(r, widths, strict=True))
                     .rstrip() for r in rows)


def _status_column(pod, phase):
    if phase == "Pending":
        return "ContainerCreating"  # scheduled; its sandbox (the host here) is being made
    return {"Running": "Running", "Succeeded": "Completed"}.get(phase, pod.reason or "Error")


def kubectl_get_pods_watch(run: JobRun) -> str:
    """``kubectl get pods -l training.kubeflow.org/job-name=<job> -w`` for a :class:`JobRun`:
    a line per pod at its creation, then one each time its phase was seen to change, with
    kubectl's READY, STATUS (ContainerCreating, Running, Completed, Error) and AGE at that
    moment. Introduced in notebooks/12_scaling_out.ipynb."""
    events = sorted((at, i, pod, phase) for i, pod in enumerate(run.pods.values())
                    for at, phase in pod.phases)
    rows = [("NAME", "READY", "STATUS", "RESTARTS", "AGE")]
    rows += [(pod.name, "1/1" if phase == "Running" else "0/1", _status_column(pod, phase), 0,
              kubectl_age(at)) for at, _, pod, phase in events]
    return _columns(rows)


def kubectl_get_job(run: JobRun, now: float | None = None) -> str:
    """``kubectl get pytorchjob <job>``: NAME, STATE (the last condition's type, the CRD's
    printer column) and AGE. Introduced in notebooks/12_scaling_out.ipynb."""
    now = time.time() if now is None else now
    state = run.conditions[-1]["type"] if run.conditions else ""
    return _columns([("NAME", "STATE", "AGE"),
                     (run.name, state, kubectl_age(now - run.created_utc))])


def _utc(run, at):
    moment = datetime.datetime.fromtimestamp(run.created_utc + at, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _describe(value, indent):
    """kubectl describe's layout of an object: keys title-cased, sorted, scalar values aligned
    two spaces past the longest scalar key of their map; a list of maps one after another."""
    pad, lines = "  " * indent, []
    if isinstance(value, list):
        for item in value:
            lines += _describe(item, indent)
        return lines
    # lastTransitionTime -> Last Transition Time: a space before every capital but the first
    title = {k: re.sub(r"(?<!^)(?=[A-Z])", " ", k[0].upper() + k[1:]) for k in value}
    width = max([len(title[k]) for k, v in value.items() if not isinstance(v, (dict, list))],
                default=0)
    for key in sorted(value, key=lambda k: title[k]):
        v = value[key]
        if isinstance(v, (dict, list)):
            lines += [f"{pad}{title[key]}:"] + _describe(v, indent + 1)
        else:
            lines.append(f"{pad}{title[key]}:{' ' * (width - len(title[key]) + 2)}{v}")
    return lines


def kubectl_describe_job(run: JobRun, now: float | None = None) -> str:
    """``kubectl describe pytorchjob <job>`` for a :class:`JobRun`, the spec left out: the
    status (conditions with reason, message, lastTransitionTime; replica statuses; start and
    completion time) and the events of the pods' creation and exits.
    Introduced in notebooks/12_scaling_out.ipynb."""
    now = time.time() if now is None else now
    replicas = {}
    for pod in run.pods.values():
        counts = replicas.setdefault(pod.replica, {})
        key = {"Running": "active", "Succeeded": "succeeded", "Failed": "failed"}.get(pod.phase)
        if key:
            counts[key] = counts.get(key, 0) + 1
    status = {"conditions": [{k: (_utc(run, v) if k.endswith("Time") else v)
                              for k, v in c.items()} for c in run.conditions],
              "replicaStatuses": replicas, "startTime": _utc(run, 0.0)}
    if run.completion is not None:
        status["completionTime"] = _utc(run, run.completion)
    head = [f"Name:         {run.name}", f"Namespace:    {run.namespace}",
            "API Version:  kubeflow.org/v1", "Kind:         PyTorchJob",
            "Spec:         (the manifest's spec, as applied)", "Status:"]
    events = [("Normal", "SuccessfulCreatePod", 0.0, f"Created pod: {pod.name}")
              for pod in run.pods.values()]
    events += [("Normal", "ExitedWithCode", pod.phases[-1][0],
                f"Pod: {run.namespace}.{pod.name} exited with code {pod.exit_code}")
               for pod in run.pods.values() if pod.exit_code is not None]
    table = [("Type", "Reason", "Age", "From", "Message"),
             ("----", "------", "----", "----", "-------")]
    table += [(kind, reason, kubectl_age(now - run.created_utc - at), "pytorchjob-controller",
               text) for kind, reason, at, text in sorted(events, key=lambda e: e[2])]
    body = "\n".join("  " + line for line in _columns(table, gap=2).splitlines())
    return "\n".join(head + _describe(status, 1) + ["Events:", body])


def kubectl_logs(run: JobRun, pod: str, max_width: int | None = None) -> str:
    """``kubectl logs <pod>``: what the pod's process wrote (stdout and stderr), lines cut at
    ``max_width`` characters when given (marked with '...'). Introduced in
    notebooks/12_scaling_out.ipynb."""
    text = run.pods[pod].log.rstrip("\n")
    if max_width:
        text = "\n".join(line if len(line) <= max_width else line[:max_width - 3] + "..."
                         for line in text.splitlines())
    return text
