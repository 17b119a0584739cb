"""What a Kubernetes operator writes into each pod of a training job.

Introduced in notebooks/12_scaling_out.ipynb. The operators' Go source decides each pod's name and
environment (the file and function are named in comments): :func:`pod_environments` computes
them for a checked manifest of :mod:`course_lib.k8s` (:mod:`course_lib.k8s.watch` runs a two-pod
PyTorchJob with them on two network namespaces named like its pods, watched as ``kubectl``
would), and :func:`kubectl_dry_run` asks a real cluster when one answers. It stays one file:
one function per operator, each a transcription of that operator's Go source, read side by side.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

from course_lib.k8s import (
    MPI_HOSTFILE,
    PYTORCH_CONTAINER,
    PYTORCH_PORT,
    PYTORCH_PORT_NAME,
    TF_CONTAINER,
    TF_PORT,
    TF_PORT_NAME,
    TRAINER_PORT,
    as_int,
    lookup,
    replica_count,
)
from course_lib.k8s.validate import check

# --------------------------------------------------------------------------- pod environments


@dataclass
class PodEnvironment:
    """What the operator writes into one pod: its hostname, replica type and index, the
    environment of its main container, files it mounts (the MPI hostfile) and, where known,
    the global ranks of the processes it will run. Introduced in
    notebooks/12_scaling_out.ipynb."""

    pod: str
    replica: str
    index: int
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{self.pod} ({self.replica} {self.index}"
                 + (f", ranks {self.ranks}" if self.ranks else "") + ")"]
        lines += [f"  {key}={value}" for key, value in self.env.items()]
        for path, text in self.files.items():
            lines.append(f"  {path}:")
            lines += [f"    {line}" for line in text.splitlines()]
        return "\n".join(lines)


def _user_env(container):
    return {v["name"]: str(v.get("value", "")) for v in lookup(container, "env") or []
            if isinstance(v, dict) and "name" in v and "valueFrom" not in v}


def _named(template, name):
    for container in lookup(template, "spec", "containers") or []:
        if lookup(container, "name") == name:
            return container
    return None


def _port(template, container_name, port_name, default):
    # The operators' defaulting webhooks add the named port when it is missing.
    for port in lookup(_named(template, container_name), "ports") or []:
        if lookup(port, "name") == port_name:
            return port.get("containerPort", default)
    return default


def _pytorch_envs(job):
    # kubeflow/training-operator pkg/controller.v1/pytorch: envvar.go setPodEnv,
    # master.go MasterEnvVarGenerator.Generate, elastic.go ElasticEnvVarGenerator.Generate.
    name, spec = job["metadata"]["name"], job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(replica_count(r) for r in replicas.values())
    nproc_text = str(spec.get("nprocPerNode", "auto"))     # defaulted to "auto" by the webhook
    nproc = as_int(nproc_text)
    world = total * (nproc or 1)          # getNprocPerNodeInt: 1 when not an integer
    master = replicas.get("Master")
    elastic = spec.get("elasticPolicy")
    pods = []
    for rtype in ("Master", "Worker"):
        rspec = replicas.get(rtype)
        for index in range(replica_count(rspec) if rspec else 0):
            env = _user_env(_named(rspec["template"], PYTORCH_CONTAINER))
            env["PYTHONUNBUFFERED"] = "0"
            rank = index + (rtype == "Worker")          # workers come after the master
            if master is not None:
                port = str(_port(master["template"], PYTORCH_CONTAINER, PYTORCH_PORT_NAME,
                                 PYTORCH_PORT))
                address = f"{name}-master-0"
                env.update(MASTER_PORT=port, PET_MASTER_PORT=port, MASTER_ADDR=address,
                           PET_MASTER_ADDR=address, WORLD_SIZE=str(world), RANK=str(rank),
                           PET_NPROC_PER_NODE=nproc_text, PET_NODE_RANK=str(rank))
            if elastic is not None:
                host = elastic.get("rdzvHost", f"{name}-worker-0")
                port = elastic.get("rdzvPort") or _port(replicas["Worker"]["template"],
                                                        PYTORCH_CONTAINER, PYTORCH_PORT_NAME,
                                                        PYTORCH_PORT)
                low, high = elastic.get("minReplicas"), elastic.get("maxReplicas")
                env["PET_RDZV_ENDPOINT"] = f"{host}:{port}"
                env["PET_RDZV_BACKEND"] = elastic.get("rdzvBackend", "c10d")
                env["PET_NNODES"] = (f"{low}:{high}" if low is not None and high is not None
                                     else str(replica_count(replicas["Worker"])))
                if "maxRestarts" in elastic:
                    env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
                if "rdzvId" in elastic:
                    env["PET_RDZV_ID"] = elastic["rdzvId"]
            else:
                env["PET_NNODES"] = str(total)
            # torchrun then starts nproc processes: global rank = node rank x nproc + local.
            ranks = (list(range(rank * nproc, (rank + 1) * nproc))
                     if master is not None and nproc else [])
            pods.append(PodEnvironment(f"{name}-{rtype.lower()}-{index}", rtype, index, env,
                                       ranks=ranks))
    return pods


def _tf_envs(job):
    # kubeflow/training-operator pkg/controller.v1/tensorflow: tensorflow.go genClusterSpec and
    # genTFConfigJSONStr; tfjob_controller.go SetClusterSpec puts TF_CONFIG into the first
    # container named "tensorflow", and only when the job has more than one pod (isDistributed).
    name = job["metadata"]["name"]
    namespace = job["metadata"].get("namespace", "default")
    replicas = job["spec"]["tfReplicaSpecs"]
    cluster = {}
    for rtype in sorted(replicas, key=str.lower):     # Go's encoding/json sorts map keys
        port = _port(replicas[rtype]["template"], TF_CONTAINER, TF_PORT_NAME, TF_PORT)
        cluster[rtype.lower()] = [f"{name}-{rtype.lower()}-{i}.{namespace}.svc:{port}"
                                  for i in range(replica_count(replicas[rtype]))]
    distributed = sum(replica_count(r) for r in replicas.values()) != 1
    pods = []
    for rtype, rspec in replicas.items():
        for index in range(replica_count(rspec)):
            container = _named(rspec["template"], TF_CONTAINER)
            env = _user_env(container)
            if distributed and container is not None:
                config = {"cluster": cluster, "task": {"type": rtype.lower(), "index": index},
                          "environment": "cloud"}
                env["TF_CONFIG"] = json.dumps(config, separators=(",", ":"))
            pods.append(PodEnvironment(f"{name}-{rtype.lower()}-{index}", rtype, index, env))
    return pods


def _mpi_envs(job):
    # kubeflow/mpi-operator pkg/controller/mpi_job_controller.go: newConfigMap (the hostfile),
    # newLauncherPodTemplate and newWorker (the environment), the env var lists at the top.
    name, spec = job["metadata"]["name"], job["spec"]
    namespace = job["metadata"].get("namespace", "default")
    flavour = spec.get("mpiImplementation", "OpenMPI")
    slots = spec.get("slotsPerWorker", 1)
    as_worker = bool(spec.get("runLauncherAsWorker", False))
    replicas = spec["mpiReplicaSpecs"]
    workers = as_int(lookup(replicas, "Worker", "replicas")) or 0       # workerReplicas()
    hosts = ([f"{name}-launcher"] if as_worker else []) + [f"{name}-worker-{i}"
                                                          for i in range(workers)]
    line = "{}.{}.{}.svc slots={}" if flavour == "OpenMPI" else "{}.{}.{}.svc:{}"
    # <pod>.<job's headless Service>.<namespace>.svc: the name each worker resolves to
    hostfile = "".join(line.format(host, name, namespace, slots) + "\n" for host in hosts)
    launcher_env = _user_env(lookup(replicas, "Launcher", "template", "spec", "containers", 0))
    launcher_env["K_MPI_JOB_ROLE"] = "launcher"
    if flavour == "OpenMPI":
        launcher_env.update(OMPI_MCA_orte_keep_fqdn_hostnames="true",
                            OMPI_MCA_orte_default_hostfile=MPI_HOSTFILE,
                            OMPI_MCA_plm_rsh_args="-o ConnectionAttempts=10",
                            OMPI_MCA_orte_set_default_slots=str(slots))
    elif flavour == "Intel":
        launcher_env.update(I_MPI_HYDRA_HOST_FILE=MPI_HOSTFILE,
                            I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS="-o ConnectionAttempts=10",
                            I_MPI_PERHOST=str(slots))
    else:
        launcher_env.update(HYDRA_HOST_FILE=MPI_HOSTFILE,
                            HYDRA_LAUNCH_EXTRA_ARGS="-o ConnectionAttempts=10")
    if not as_worker:                   # the launcher must not grab the node's GPUs
        launcher_env.update(NVIDIA_VISIBLE_DEVICES="", NVIDIA_DRIVER_CAPABILITIES="")
    # mpirun fills the hostfile's slots in order: the first host gets ranks 0..slots-1.
    first = slots if as_worker else 0
    pods = [PodEnvironment(f"{name}-launcher", "Launcher", 0, launcher_env,
                           files={MPI_HOSTFILE: hostfile},
                           ranks=list(range(slots)) if as_worker else [])]
    for index in range(workers):
        env = _user_env(lookup(replicas, "Worker", "template", "spec", "containers", 0))
        env["K_MPI_JOB_ROLE"] = "worker"
        start = first + index * slots
        pods.append(PodEnvironment(f"{name}-worker-{index}", "Worker", index, env,
                                   ranks=list(range(start, start + slots))))
    return pods


def _quantity_value(quantity):
    """resource.Quantity.Value(): the quantity rounded up to an integer."""
    text = str(quantity)
    suffixes = {"m": Decimal("0.001"), "k": Decimal(10) ** 3, "M": Decimal(10) ** 6,
                "G": Decimal(10) ** 9, "T": Decimal(10) ** 12, "Ki": Decimal(2) ** 10,
                "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40}
    for suffix in sorted(suffixes, key=len, reverse=True):  # "Mi" before "M" and "m"
        if text.endswith(suffix):
            return math.ceil(Decimal(text[: -len(suffix)]) * suffixes[suffix])
    try:
        return math.ceil(Decimal(text))
    except InvalidOperation as error:
        raise ValueError(f"{quantity!r} is not a quantity") from error


def _trainjob_nproc(trainer):
    # kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go EnforceMLPolicy and
    # calculateNumProcPerNode (commit 85eed65): "auto" becomes the CPU count when no GPU is
    # asked for; when the limits do not decide, the requests are consulted, and a node without
    # requests gets 1 process. Since Trainer v2.2 a TrainJob's numProcPerNode is an int or left
    # out, and left out means auto (kubeflow/trainer#3239).
    value = trainer.get("numProcPerNode", "auto")
    resources_ = trainer.get("resourcesPerNode")
    if resources_ is None:
        return str(value)
    if value == "auto":
        use_cpu = lambda res: not any("gpu" in name.lower() for name in res)
        fallback = "auto"
    elif value == "cpu":
        use_cpu = lambda res: "cpu" in res
        fallback = 1
    else:
        use_cpu = lambda res: False
        fallback = value

    def calculate(res):
        if res is None:
            return 1, False
        if use_cpu(res):
            return max(1, _quantity_value(res.get("cpu", 0))), True
        return fallback, False

    nproc, used_cpu = calculate(resources_.get("limits"))
    if not used_cpu:
        nproc, _ = calculate(resources_.get("requests"))
    return str(nproc)


def _trainjob_envs(job):
    # kubeflow/trainer torch plugin (torch.go EnforceMLPolicy) on the torch-distributed runtime
    # (manifests/base/runtimes/torch_distributed.yaml): one JobSet replicated job "node" whose
    # Indexed Job has numNodes pods <name>-node-0-<i>, container "node".
    name, trainer = job["metadata"]["name"], job["spec"].get("trainer", {})
    runtime = job["spec"]["runtimeRef"]["name"]
    if runtime != "torch-distributed":
        raise ValueError(f"pod_environments knows the torch-distributed runtime, not {runtime!r}")
    nodes = trainer.get("numNodes", 1)         # torch-distributed's mlPolicy: numNodes 1
    nproc_text = _trainjob_nproc(trainer)
    nproc = as_int(nproc_text)
    pods = []
    for index in range(nodes):
        env = _user_env(trainer)
        env.update(PET_NNODES=str(nodes), PET_NPROC_PER_NODE=nproc_text,
                   # valueFrom fieldRef metadata.annotations['batch.kubernetes.io/
                   # job-completion-index']: the pod's index in the Indexed Job.
                   PET_NODE_RANK=str(index),
                   PET_MASTER_ADDR=f"{name}-node-0-0.{name}", PET_MASTER_PORT=str(TRAINER_PORT))
        ranks = list(range(index * nproc, (index + 1) * nproc)) if nproc else []
        pods.append(PodEnvironment(f"{name}-node-0-{index}", "node", index, env, ranks=ranks))
    return pods


def pod_environments(manifest: dict | str) -> list[PodEnvironment]:
    """For each pod the operator would create (after :func:`check` passes), the environment it
    writes into the main container, as its Go source does (file and function named in comments
    here): PyTorchJob ``MASTER_ADDR``/``PORT``, ``WORLD_SIZE``, ``RANK``, ``PET_*``; TFJob
    ``TF_CONFIG``; MPIJob the launcher's hostfile ``/etc/mpi/hostfile`` and ``OMPI_*``/
    ``HYDRA_*``/``I_MPI_*``; TrainJob the torch runtime's ``PET_*``. Variables the container
    declares itself come first. Introduced in notebooks/12_scaling_out.ipynb."""
    job = check(manifest)
    return {"PyTorchJob": _pytorch_envs, "TFJob": _tf_envs, "MPIJob": _mpi_envs,
            "TrainJob": _trainjob_envs}[job["kind"]](job)


# --------------------------------------------------------------------------- kubectl


def kubectl_available(timeout: float = 5.0) -> bool:
    """True when ``kubectl`` is on the PATH and a cluster answers it (``kubectl apply
    --dry-run=client`` still asks the API server which resources exist, so a binary alone is not
    enough; the CRDs must be installed there too). Introduced in
    notebooks/12_scaling_out.ipynb."""
    exe = shutil.which("kubectl")
    if exe is None:
        return False
    try:
        result = subprocess.run([exe, "version", f"--request-timeout={max(1, int(timeout))}s"],
                                capture_output=True, timeout=timeout + 5)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def kubectl_dry_run(path: str | Path, timeout: float = 30.0) -> str:
    """The output of ``kubectl apply --dry-run=client -f path``, or a line saying why it was
    skipped (no kubectl, or no cluster). Introduced in notebooks/12_scaling_out.ipynb."""
    if not kubectl_available():
        return (f"skipped `kubectl apply --dry-run=client -f {path}`: no kubectl on the PATH "
                "or no cluster answering it (the offline checks above stand in for it)")
    result = subprocess.run(["kubectl", "apply", "--dry-run=client", "-f", str(path)],
                            capture_output=True, text=True, timeout=timeout)
    return (result.stdout + result.stderr).strip()
