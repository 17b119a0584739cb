"""Kubernetes training jobs: one description, four operators' manifests, checked offline.

Introduced in notebooks/12_scaling_out.ipynb. On a Kubernetes cluster nobody types ``torchrun``
on each machine. A controller (an *operator*) watches for a custom resource that describes the
whole job, creates one pod per node plus a headless Service so that the pods find each other by
name, and writes into each pod the environment its launcher reads:

==========  =================================  ===============================  ===================
resource    operator, apiVersion               pods it creates                  each pod is told
==========  =================================  ===============================  ===================
PyTorchJob  training-operator                  ``<job>-master-0``,              ``MASTER_ADDR``,
            ``kubeflow.org/v1``                ``<job>-worker-<i>``             ``RANK``, ``PET_*``
TFJob       training-operator, deprecated      ``<job>-chief-0``, ``-ps-<i>``,  ``TF_CONFIG``
            ``kubeflow.org/v1``                ``<job>-worker-<i>``
MPIJob      mpi-operator                       ``<job>-launcher``,              launcher: hostfile
            ``kubeflow.org/v2beta1``           ``<job>-worker-<i>``             for ``mpirun``
TrainJob    Kubeflow Trainer v2                ``<job>-node-0-<i>``             ``PET_*`` (torch
            ``trainer.kubeflow.org/v1alpha1``  (the pods of a JobSet)           runtime)
==========  =================================  ===============================  ===================

``torchrun`` reads every option it is not given from ``PET_<OPTION>`` (``PET_NNODES``,
``PET_NODE_RANK``, ``PET_MASTER_ADDR``...), so the same container command runs on every pod.
:class:`JobSpec` is one description of a job; :func:`pytorch_job`, :func:`tf_job`,
:func:`mpi_job` and :func:`train_job` write it for each operator. A mistake in a manifest is
found by the cluster only when the job is submitted, or worse when its pods start; here it is
found before, in four layers (:mod:`course_lib.k8s.validate`: ``validate`` lists the problems,
``check`` raises them):

1. the YAML text reads back as the same plain JSON-like data (``yaml_problems``);
2. every pod template against Kubernetes' own OpenAPI schema for ``v1/PodTemplateSpec``, as
   shipped by the ``kubernetes-validate`` package (``pod_problems``);
3. the whole job against the operator's CRD schema, unknown fields rejected as
   ``kubectl apply``'s strict field validation does (``crd_problems``; the schemas and their
   sources are in ``course_lib/k8s/schemas/``);
4. what the operators' webhooks and controllers require and no schema says: restart policies,
   container names and images, replica counts, replicas x processes = world size, the MPI
   flavour (:mod:`course_lib.k8s.rules`).

:mod:`course_lib.k8s.pods` shows what the operator would write into each pod::

    from course_lib import k8s
    from course_lib.k8s import pods as k8s_pods, validate as k8s_validate
    spec = k8s.JobSpec("ddp", image="pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime",
                       command=["-m", "course_lib.train"], nodes=2, processes_per_node=2)
    job = k8s_validate.check(k8s.pytorch_job(spec))  # ManifestError listing every problem
    Path("job.yaml").write_text(k8s.to_yaml(job))    # kubectl apply -f job.yaml
    for pod in k8s_pods.pod_environments(job):
        print(pod)                                   # ddp-worker-0: RANK=1 WORLD_SIZE=4 ...

This module holds the description, the four writers and what the others read a manifest with;
it stays one file so that the four writers sit side by side, where their differences are the lesson.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

K8S_VERSION = "1.30"
WORLD_SIZE_ANNOTATION = "course-lib/world-size"
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
# mpi-operator pkg/apis/kubeflow/validation/validation.go validRestartPolicies
MPI_RESTART_POLICIES = ("Never", "OnFailure")
MPI_IMPLEMENTATIONS = ("OpenMPI", "Intel", "MPICH")
KINDS = ("PyTorchJob", "TFJob", "MPIJob", "TrainJob")

# The operators' defaults: training-operator pkg/apis/kubeflow.org/v1 (pytorch_types.go,
# tensorflow_types.go: container name, port name, port), kubeflow/trainer pkg/constants.
PYTORCH_CONTAINER, PYTORCH_PORT_NAME, PYTORCH_PORT = "pytorch", "pytorchjob-port", 23456
TF_CONTAINER, TF_PORT_NAME, TF_PORT = "tensorflow", "tfjob-port", 2222
TRAINER_PORT = 29500                      # kubeflow/trainer pkg/constants ContainerTrainerPort
MPI_HOSTFILE = "/etc/mpi/hostfile"        # mpi-operator configMountPath + hostfileName

_API = {"PyTorchJob": "kubeflow.org/v1", "TFJob": "kubeflow.org/v1",
        "MPIJob": "kubeflow.org/v2beta1", "TrainJob": "trainer.kubeflow.org/v1alpha1"}
# Where each kind keeps its replicas, the replica types its operator knows, the container it
# looks for, and the stored CRD schema it is checked against (course_lib/k8s/schemas/).
REPLICA_SPECS = {"PyTorchJob": "pytorchReplicaSpecs", "TFJob": "tfReplicaSpecs",
                 "MPIJob": "mpiReplicaSpecs"}
REPLICA_TYPES = {"PyTorchJob": ("Master", "Worker"),
                 "TFJob": ("Chief", "Master", "PS", "Worker", "Evaluator"),
                 "MPIJob": ("Launcher", "Worker")}
CONTAINER_NAMES = {"PyTorchJob": PYTORCH_CONTAINER, "TFJob": TF_CONTAINER}
SCHEMA_FILES = {"PyTorchJob": "pytorchjobs.kubeflow.org_v1.yaml",
                "TFJob": "tfjobs.kubeflow.org_v1.yaml",
                "MPIJob": "mpijobs.kubeflow.org_v2beta1.yaml",
                "TrainJob": "trainjobs.trainer.kubeflow.org_v1alpha1.yaml"}
# kubeflow/trainer pkg/constants TorchRunReservedEnvNames: the torch plugin writes these itself.
TORCH_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                      "PET_MASTER_PORT")


# --------------------------------------------------------------------------- the description


@dataclass
class Resources:
    """What each pod asks the scheduler for: CPUs, memory and GPUs, as Kubernetes quantities
    (``"2"``, ``"500m"``, ``"4Gi"``). Introduced in notebooks/12_scaling_out.ipynb."""

    cpu: str = "2"
    memory: str = "4Gi"
    gpu: int = 0
    gpu_resource: str = "nvidia.com/gpu"

    def to_k8s(self) -> dict:
        """The container's ``resources``: requests equal to limits, the GPUs in limits only
        (an extended resource cannot be overcommitted). Introduced in
        notebooks/12_scaling_out.ipynb."""
        requests = {"cpu": self.cpu, "memory": self.memory}
        limits = dict(requests)
        if self.gpu:
            limits[self.gpu_resource] = self.gpu
        return {"limits": limits, "requests": requests}


@dataclass
class JobSpec:
    """One description of a distributed training job, whatever operator runs it.

    ``command`` is the Python program and its arguments as written after ``python``
    (``["-m", "course_lib.train", "--steps", "20"]`` or ``["train.py"]``): each generator puts
    its own launcher in front (``torchrun``, ``mpirun -n N python``, ``python``). ``nodes`` pods
    each run ``processes_per_node`` processes. Introduced in notebooks/12_scaling_out.ipynb."""

    name: str
    image: str
    command: list[str]
    nodes: int = 2
    processes_per_node: int = 1
    resources: Resources = field(default_factory=Resources)
    restart_policy: str = "OnFailure"
    namespace: str = "default"
    mpi_implementation: str = "MPICH"       # MPIJob: OpenMPI, Intel or MPICH
    parameter_servers: int = 1              # TFJob: PS replicas
    elastic: tuple[int, int] | None = None  # PyTorchJob: (min, max) nodes, torchrun rendezvous
    runtime: str = "torch-distributed"      # TrainJob: the ClusterTrainingRuntime
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.processes_per_node < 1:
            raise ValueError("nodes and processes_per_node must be at least 1")
        self.command = list(self.command)  # a list of its own, whatever sequence was given

    @property
    def world_size(self) -> int:
        """Processes in the job: nodes x processes per node. Introduced in
        notebooks/12_scaling_out.ipynb."""
        return self.nodes * self.processes_per_node


def _metadata(spec):
    # The intended world size travels with the manifest, so that rule_problems can tell when
    # someone edits replicas or nprocPerNode and forgets the rest.
    return {"name": spec.name, "namespace": spec.namespace,
            "annotations": {WORLD_SIZE_ANNOTATION: str(spec.world_size)}}


def _container(name, spec, command, port=None):
    container = {"name": name, "image": spec.image}
    if command:
        container["command"] = list(command)
    if spec.env:
        container["env"] = [{"name": k, "value": str(v)} for k, v in spec.env.items()]
    container["resources"] = spec.resources.to_k8s()
    if port:
        container["ports"] = [{"name": port[0], "containerPort": port[1]}]
    return container


def _replica(replicas, restart_policy, container):
    # A fresh copy per replica type: shared dicts would come out of yaml.safe_dump as &id001.
    return {"replicas": replicas, "restartPolicy": restart_policy,
            "template": {"spec": {"containers": [copy.deepcopy(container)]}}}


def pytorch_job(spec: JobSpec) -> dict:
    """A Kubeflow ``PyTorchJob`` (``kubeflow.org/v1``, training-operator): one Master pod and
    ``nodes - 1`` Worker pods, each running ``torchrun`` in a container that must be named
    ``pytorch``; ``nprocPerNode`` processes per pod. With ``spec.elastic = (min, max)``: Worker
    pods only and an ``elasticPolicy`` (c10d rendezvous on the first worker). Introduced in
    notebooks/12_scaling_out.ipynb."""
    container = _container(PYTORCH_CONTAINER, spec, ["torchrun", *spec.command],
                           port=(PYTORCH_PORT_NAME, PYTORCH_PORT))
    if spec.elastic is None:
        replicas = {"Master": _replica(1, spec.restart_policy, container)}
        if spec.nodes > 1:
            replicas["Worker"] = _replica(spec.nodes - 1, spec.restart_policy, container)
    else:
        replicas = {"Worker": _replica(spec.nodes, spec.restart_policy, container)}
    job = {"nprocPerNode": str(spec.processes_per_node), "pytorchReplicaSpecs": replicas}
    if spec.elastic is not None:
        low, high = spec.elastic
        job["elasticPolicy"] = {"minReplicas": low, "maxReplicas": high, "rdzvBackend": "c10d",
                                "maxRestarts": 3}
    return {"apiVersion": _API["PyTorchJob"], "kind": "PyTorchJob", "metadata": _metadata(spec),
            "spec": job}


def tf_job(spec: JobSpec) -> dict:
    """A Kubeflow ``TFJob`` (``kubeflow.org/v1``), laid out as for TensorFlow's
    ParameterServerStrategy: one Chief, ``parameter_servers`` PS and ``nodes - 1`` Worker pods,
    one TensorFlow task each, in a container that must be named ``tensorflow``. TFJob is
    deprecated upstream: training-operator v1 still serves it, Kubeflow Trainer v2 has no
    TensorFlow runtime. Introduced in notebooks/12_scaling_out.ipynb."""
    if spec.processes_per_node != 1:
        raise ValueError("a TFJob runs one TensorFlow task per pod: processes_per_node must be 1")
    container = _container(TF_CONTAINER, spec, ["python", *spec.command],
                           port=(TF_PORT_NAME, TF_PORT))
    replicas = {"Chief": _replica(1, spec.restart_policy, container)}
    if spec.parameter_servers:
        replicas["PS"] = _replica(spec.parameter_servers, spec.restart_policy, container)
    if spec.nodes > 1:
        replicas["Worker"] = _replica(spec.nodes - 1, spec.restart_policy, container)
    return {"apiVersion": _API["TFJob"], "kind": "TFJob", "metadata": _metadata(spec),
            "spec": {"tfReplicaSpecs": replicas}}


def mpi_job(spec: JobSpec) -> dict:
    """An ``MPIJob`` (``kubeflow.org/v2beta1``, mpi-operator): ``nodes`` Worker pods with
    ``slotsPerWorker`` = processes per node, and a Launcher pod that runs
    ``mpirun -n <world size> python ...`` and reaches the workers over ssh. The workers get no
    command: the operator then starts ``sshd`` in them. Introduced in
    notebooks/12_scaling_out.ipynb."""
    launcher = _container("launcher", spec,
                          ["mpirun", "-n", str(spec.world_size), "python", *spec.command])
    # The launcher only starts mpirun: it needs no GPU (the operator hides them from it anyway).
    launcher["resources"] = Resources(cpu="1", memory="1Gi").to_k8s()
    worker = _container("worker", spec, command=None)
    return {"apiVersion": _API["MPIJob"], "kind": "MPIJob", "metadata": _metadata(spec),
            "spec": {"slotsPerWorker": spec.processes_per_node,
                     "mpiImplementation": spec.mpi_implementation,
                     "runPolicy": {"cleanPodPolicy": "Running"},
                     "mpiReplicaSpecs": {
                         "Launcher": _replica(1, spec.restart_policy, launcher),
                         "Worker": _replica(spec.nodes, spec.restart_policy, worker)}}}


def train_job(spec: JobSpec) -> dict:
    """A Kubeflow Trainer v2 ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``): no pod template
    at all, only a reference to a ClusterTrainingRuntime (``torch-distributed``, installed with
    Trainer) and what differs from it: image, command, ``numNodes``, ``numProcPerNode``,
    ``resourcesPerNode``. Introduced in notebooks/12_scaling_out.ipynb."""
    trainer = {"image": spec.image, "command": ["torchrun", *spec.command],
               "numNodes": spec.nodes, "numProcPerNode": spec.processes_per_node,
               "resourcesPerNode": spec.resources.to_k8s()}
    if spec.env:
        trainer["env"] = [{"name": k, "value": str(v)} for k, v in spec.env.items()]
    return {"apiVersion": _API["TrainJob"], "kind": "TrainJob", "metadata": _metadata(spec),
            "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org",
                                    "kind": "ClusterTrainingRuntime", "name": spec.runtime},
                     "trainer": trainer}}


GENERATORS = {"PyTorchJob": pytorch_job, "TFJob": tf_job, "MPIJob": mpi_job,
              "TrainJob": train_job}


def generate(spec: JobSpec, kind: str) -> dict:
    """The manifest of ``kind`` (one of :data:`KINDS`) for ``spec``. Introduced in
    notebooks/12_scaling_out.ipynb."""
    if kind not in GENERATORS:
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    return GENERATORS[kind](spec)


def to_yaml(manifest: dict) -> str:
    """The manifest as YAML text, keys in the order they were written (what ``kubectl apply -f``
    reads). Introduced in notebooks/12_scaling_out.ipynb."""
    return yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False)


# --------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a manifest: which manifest, which layer found it, where (a field
    path such as ``spec.pytorchReplicaSpecs.Worker.replicas``) and what. Introduced in
    notebooks/12_scaling_out.ipynb."""

    manifest: str
    layer: str
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.manifest}: {self.path or '(top)'}: {self.message} [{self.layer}]"


class ManifestError(ValueError):
    """Raised by ``k8s_validate.check``; ``problems`` lists every :class:`Problem`. Introduced in
    notebooks/12_scaling_out.ipynb."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the manifest:\n{lines}")


# --------------------------------------------------------------------------- reading a manifest


def label_of(manifest: Any) -> str:
    """``Kind/name`` of a manifest, for messages. Introduced in notebooks/12_scaling_out.ipynb."""
    if not isinstance(manifest, dict):
        return "<manifest>"
    meta = manifest.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return f"{manifest.get('kind') or '?'}/{name or '?'}"


def field_path(*parts: str | int) -> str:
    """A field path as kubectl prints it: ``field_path("spec", "containers", 0, "image")`` is
    ``spec.containers[0].image``. Introduced in notebooks/12_scaling_out.ipynb."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part != "":
            text += f".{part}" if text else str(part)
    return text


def kind_of(manifest: Any) -> str | None:
    """The manifest's ``kind`` if it is a string, else None. Introduced in
    notebooks/12_scaling_out.ipynb."""
    kind = lookup(manifest, "kind")
    return kind if isinstance(kind, str) else None


def lookup(obj: Any, *keys: str | int, default: Any = None) -> Any:
    """``obj[k1][k2]...`` through dicts and lists, or ``default`` as soon as a key is missing
    or a value has the wrong type: a broken manifest is read without raising. Introduced in
    notebooks/12_scaling_out.ipynb."""
    for key in keys:
        if isinstance(obj, dict) and key in obj:
            obj = obj[key]
        elif isinstance(obj, list) and isinstance(key, int) and -len(obj) <= key < len(obj):
            obj = obj[key]
        else:
            return default
    return obj


def as_int(value: Any) -> int | None:
    """An int from an int or a string of digits, else None (booleans are not ints here).
    Introduced in notebooks/12_scaling_out.ipynb."""
    if isinstance(value, bool):  # True is an int in Python; replicas: true is a mistake
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def replica_count(spec: Any) -> int:
    """The ``replicas`` of a replica spec: 1 when missing (the operators' default), 0 when not
    an integer. Introduced in notebooks/12_scaling_out.ipynb."""
    count = lookup(spec, "replicas", default=1)   # training-operator's default: 1
    return count if isinstance(count, int) and not isinstance(count, bool) else 0


def world_size(manifest: Any) -> int | None:
    """How many processes the manifest starts (ranks of the job), or None where the pods decide
    (``nprocPerNode: auto``, elastic jobs). Introduced in notebooks/12_scaling_out.ipynb."""
    kind, spec = kind_of(manifest), lookup(manifest, "spec")
    if not isinstance(spec, dict):
        return None
    if kind == "PyTorchJob":
        if "elasticPolicy" in spec:
            return None
        nproc = as_int(spec.get("nprocPerNode", "auto"))
        replicas = lookup(spec, "pytorchReplicaSpecs")
        if not isinstance(replicas, dict):
            return None
        total = sum(replica_count(r) for r in replicas.values() if isinstance(r, dict))
        return total * nproc if nproc else None
    if kind == "TFJob":
        replicas = lookup(spec, "tfReplicaSpecs")
        if not isinstance(replicas, dict):
            return None
        return sum(replica_count(r) for t, r in replicas.items()
                   if t in ("Chief", "Master", "Worker") and isinstance(r, dict))
    if kind == "MPIJob":
        slots = as_int(spec.get("slotsPerWorker", 1)) or 0
        # mpi-operator's workerReplicas(): 0 when the Worker spec or its replicas are missing
        workers = as_int(lookup(spec, "mpiReplicaSpecs", "Worker", "replicas")) or 0
        return (workers + bool(spec.get("runLauncherAsWorker"))) * slots
    if kind == "TrainJob":
        nodes = as_int(lookup(spec, "trainer", "numNodes", default=1))
        nproc = as_int(lookup(spec, "trainer", "numProcPerNode"))
        return nodes * nproc if nodes and nproc else None
    return None
