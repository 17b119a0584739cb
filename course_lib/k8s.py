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
found before, in four layers (:func:`validate` lists the problems, :func:`check` raises them):

1. the YAML text reads back as the same plain JSON-like data (:func:`yaml_problems`);
2. every pod template against Kubernetes' own OpenAPI schema for ``v1/PodTemplateSpec``, as
   shipped by the ``kubernetes-validate`` package (:func:`pod_problems`);
3. the whole job against the operator's CRD schema, unknown fields rejected as
   ``kubectl apply``'s strict field validation does (:func:`crd_problems`; the schemas and their
   sources are in ``course_lib/k8s_schemas/``);
4. what the operators' webhooks and controllers require and no schema says: restart policies,
   container names, replicas x processes = world size, the MPI flavour (:func:`rule_problems`).

:func:`pod_environments` shows what the operator would write into each pod::

    spec = k8s.JobSpec("ddp", image="pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime",
                       command=["-m", "course_lib.train"], nodes=2, processes_per_node=2)
    job = k8s.check(k8s.pytorch_job(spec))          # raises ManifestError listing every problem
    Path("job.yaml").write_text(k8s.to_yaml(job))   # kubectl apply -f job.yaml
    for pod in k8s.pod_environments(job):
        print(pod)                                  # ddp-worker-0: RANK=1 WORLD_SIZE=4 ...
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from importlib import resources

import yaml

K8S_VERSION = "1.30"
WORLD_SIZE_ANNOTATION = "course-lib/world-size"
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
MPI_IMPLEMENTATIONS = ("OpenMPI", "Intel", "MPICH")
KINDS = ("PyTorchJob", "TFJob", "MPIJob", "TrainJob")

# Kubernetes' quantity grammar (apimachinery resource.Quantity), as controller-gen writes it into
# every CRD. Kubernetes' own OpenAPI document says only "string or number" and leaves the grammar
# to the API server, so layer 2 adds it (see _registry).
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
_QUANTITY = re.compile(QUANTITY_PATTERN)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DEFINITIONS_URI = "https://kubernetes.io/api/_definitions.json"

# The operators' defaults: training-operator pkg/apis/kubeflow.org/v1 (pytorch_types.go,
# tensorflow_types.go: container name, port name, port), kubeflow/trainer pkg/constants.
PYTORCH_CONTAINER, PYTORCH_PORT_NAME, PYTORCH_PORT = "pytorch", "pytorchjob-port", 23456
TF_CONTAINER, TF_PORT_NAME, TF_PORT = "tensorflow", "tfjob-port", 2222
TRAINER_PORT = 29500                      # kubeflow/trainer pkg/constants ContainerTrainerPort
MPI_HOSTFILE = "/etc/mpi/hostfile"        # mpi-operator configMountPath + hostfileName

_API = {"PyTorchJob": "kubeflow.org/v1", "TFJob": "kubeflow.org/v1",
        "MPIJob": "kubeflow.org/v2beta1", "TrainJob": "trainer.kubeflow.org/v1alpha1"}
_REPLICAS = {"PyTorchJob": "pytorchReplicaSpecs", "TFJob": "tfReplicaSpecs",
             "MPIJob": "mpiReplicaSpecs"}
_REPLICA_TYPES = {"PyTorchJob": ("Master", "Worker"),
                  "TFJob": ("Chief", "Master", "PS", "Worker", "Evaluator"),
                  "MPIJob": ("Launcher", "Worker")}
_CONTAINER = {"PyTorchJob": PYTORCH_CONTAINER, "TFJob": TF_CONTAINER}
_SCHEMA_FILES = {"PyTorchJob": "pytorchjobs.kubeflow.org_v1.yaml",
                 "TFJob": "tfjobs.kubeflow.org_v1.yaml",
                 "MPIJob": "mpijobs.kubeflow.org_v2beta1.yaml",
                 "TrainJob": "trainjobs.trainer.kubeflow.org_v1alpha1.yaml"}
# kubeflow/trainer pkg/constants TorchRunReservedEnvNames: the torch plugin writes these itself.
_TORCH_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
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

    def to_k8s(self):
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

    def __post_init__(self):
        if self.nodes < 1 or self.processes_per_node < 1:
            raise ValueError("nodes and processes_per_node must be at least 1")
        self.command = list(self.command)

    @property
    def world_size(self):
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


def pytorch_job(spec):
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


def tf_job(spec):
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


def mpi_job(spec):
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


def train_job(spec):
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


def generate(spec, kind):
    """The manifest of ``kind`` (one of :data:`KINDS`) for ``spec``. Introduced in
    notebooks/12_scaling_out.ipynb."""
    if kind not in GENERATORS:
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    return GENERATORS[kind](spec)


def to_yaml(manifest):
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

    def __str__(self):
        return f"{self.manifest}: {self.path or '(top)'}: {self.message} [{self.layer}]"


class ManifestError(ValueError):
    """Raised by :func:`check`; ``problems`` lists every :class:`Problem`. Introduced in
    notebooks/12_scaling_out.ipynb."""

    def __init__(self, problems):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the manifest:\n{lines}")


def _label(manifest):
    if not isinstance(manifest, dict):
        return "<manifest>"
    meta = manifest.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return f"{manifest.get('kind') or '?'}/{name or '?'}"


def _path(*parts):
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part != "":
            text += f".{part}" if text else str(part)
    return text


def _kind(manifest):
    kind = _get(manifest, "kind")
    return kind if isinstance(kind, str) else None


def _get(obj, *keys, default=None):
    for key in keys:
        if isinstance(obj, dict) and key in obj:
            obj = obj[key]
        elif isinstance(obj, list) and isinstance(key, int) and -len(obj) <= key < len(obj):
            obj = obj[key]
        else:
            return default
    return obj


# --------------------------------------------------------------------------- layer 1: YAML


def _plain_problems(value, where, label):
    """Values that JSON (what the API server receives) cannot carry: YAML dates, byte strings,
    sets, non-string keys."""
    if isinstance(value, dict):
        out = []
        for key, item in value.items():
            if not isinstance(key, str):
                out.append(Problem(label, "yaml", _path(*where),
                                   f"key {key!r} is a {type(key).__name__}, not a string"))
            out += _plain_problems(item, (*where, str(key)), label)
        return out
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _plain_problems(item, (*where, i),
                                                                           label)]
    if value is None or isinstance(value, (str, bool, int, float)):
        return []
    return [Problem(label, "yaml", _path(*where),
                    f"YAML read {value!r} as a {type(value).__name__}, which JSON cannot carry: "
                    "quote it")]


def yaml_problems(text, name="job.yaml"):
    """Layer 1: ``text`` is one YAML document, a mapping of plain JSON values, and dumping what
    was read and reading it back gives the same thing. Introduced in
    notebooks/12_scaling_out.ipynb."""
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        context = getattr(error, "context", None)
        return [Problem(name, "yaml", where,
                        f"not valid YAML: {problem}" + (f" ({context})" if context else ""))]
    if len(documents) != 1:
        return [Problem(name, "yaml", "", f"expected one YAML document, found {len(documents)}")]
    data = documents[0]
    if not isinstance(data, dict):
        return [Problem(name, "yaml", "",
                        f"the document is a {type(data).__name__}, not a mapping")]
    label = _label(data)
    problems = _plain_problems(data, (), label)
    if not problems and yaml.safe_load(to_yaml(data)) != data:
        problems.append(Problem(label, "yaml", "", "does not survive a YAML round trip"))
    return problems


def load(text, name="job.yaml"):
    """The manifest in YAML ``text``; :class:`ManifestError` if layer 1 finds a problem.
    Introduced in notebooks/12_scaling_out.ipynb."""
    problems = yaml_problems(text, name)
    if problems:
        raise ManifestError(problems)
    return yaml.safe_load(text)


# --------------------------------------------------------------------------- JSON schema help

# jsonschema, referencing and kubernetes-validate are imported when a manifest is first
# validated: importing jsonschema takes seconds, generating a manifest needs none of them.


@functools.lru_cache(maxsize=1)
def _format_checker():
    import jsonschema

    checker = jsonschema.FormatChecker(formats=())
    checker.checks("quantity")(lambda value: not isinstance(value, str)
                               or bool(_QUANTITY.match(value)))
    return checker


def _schema_dir(version):
    """kubernetes-validate's strict schemas (additionalProperties: false everywhere) for the
    Kubernetes minor ``version``."""
    from kubernetes_validate.utils import all_versions

    folder = (resources.files("kubernetes_validate") / "kubernetes-json-schema"
              / f"v{version}.0-local-strict")
    if not folder.is_dir():
        raise ValueError(f"kubernetes-validate has no schemas for Kubernetes {version}: "
                         f"it ships {', '.join(all_versions())}")
    return folder


@functools.lru_cache(maxsize=4)
def _registry(version):
    from referencing import Registry, Resource

    definitions = json.loads((_schema_dir(version) / "_definitions.json").read_text())
    quantity = "io.k8s.apimachinery.pkg.api.resource.Quantity"
    # The OpenAPI document says "string or number"; the grammar is enforced by the API server.
    definitions["$defs"][quantity] = {"type": ["string", "number", "null"], "format": "quantity"}
    return Registry().with_resource(_DEFINITIONS_URI, Resource.from_contents(definitions))


def _k8s_ref(name):
    return {"$ref": f"{_DEFINITIONS_URI}#/$defs/{name}"}


def _validator(schema, version):
    import jsonschema

    return jsonschema.Draft202012Validator(schema, registry=_registry(version),
                                           format_checker=_format_checker())


def _error_problems(validator, instance, label, layer, prefix=()):
    from jsonschema.exceptions import best_match

    problems = []
    for error in validator.iter_errors(instance):
        if error.validator in ("anyOf", "oneOf") and error.context:
            error = best_match(error.context)   # the branch that came closest says more
        where = (*prefix, *error.absolute_path)
        if error.validator == "additionalProperties" and error.validator_value is False \
                and isinstance(error.instance, dict):
            known = set(error.schema.get("properties", {}))
            for key in sorted(set(error.instance) - known):
                problems.append(Problem(label, layer, _path(*where, key),
                                        "unknown field (not in the schema)"))
            continue
        message = error.message
        if (error.validator == "format" and error.validator_value == "quantity") or \
                (error.validator == "pattern" and error.validator_value == QUANTITY_PATTERN):
            message = (f"{error.instance!r} is not a Kubernetes quantity "
                       "(like 500m, 2, 1.5, 512Mi, 4Gi or 1G)")
        problems.append(Problem(label, layer, _path(*where), message))
    return sorted(set(problems), key=lambda p: (p.path, p.message))


# --------------------------------------------------------------------------- layer 2: pods


def pod_templates(manifest):
    """``(path, template)`` for every pod template in a PyTorchJob, TFJob or MPIJob (a TrainJob
    has none: its pods come from the runtime). Introduced in notebooks/12_scaling_out.ipynb."""
    key = _REPLICAS.get(_kind(manifest))
    replicas = _get(manifest, "spec", key) if key else None
    if not isinstance(replicas, dict):
        return []
    return [(("spec", key, rtype, "template"), spec["template"])
            for rtype, spec in replicas.items()
            if isinstance(spec, dict) and "template" in spec]


def pod_problems(manifest, k8s_version=K8S_VERSION):
    """Layer 2: each pod template against Kubernetes' own OpenAPI schema of
    ``io.k8s.api.core.v1.PodTemplateSpec`` (strict: unknown fields rejected) as shipped by
    ``kubernetes-validate``, quantities included; for a TrainJob, its ``resourcesPerNode`` and
    ``env`` against ``ResourceRequirements`` and ``EnvVar``. Introduced in
    notebooks/12_scaling_out.ipynb."""
    label, problems = _label(manifest), []
    if _kind(manifest) == "TrainJob":
        checks = [(("spec", "trainer", "resourcesPerNode"), "ResourceRequirements")]
        env = _get(manifest, "spec", "trainer", "env")
        if isinstance(env, list):
            checks += [(("spec", "trainer", "env", i), "EnvVar") for i in range(len(env))]
        for where, type_name in checks:
            value = _get(manifest, *where)
            if value is not None:
                validator = _validator(_k8s_ref(f"io.k8s.api.core.v1.{type_name}"), k8s_version)
                problems += _error_problems(validator, value, label, "pod", where)
        return problems
    validator = _validator(_k8s_ref("io.k8s.api.core.v1.PodTemplateSpec"), k8s_version)
    for where, template in pod_templates(manifest):
        problems += _error_problems(validator, template, label, "pod", where)
    return problems


# --------------------------------------------------------------------------- layer 3: CRD


@functools.lru_cache(maxsize=8)
def crd(kind):
    """The stored CRD excerpt for ``kind``: ``group``, ``version``, ``source`` (repository, path,
    commit) and ``openAPIV3Schema``. Introduced in notebooks/12_scaling_out.ipynb."""
    if kind not in _SCHEMA_FILES:
        raise ValueError(f"no CRD schema stored for kind {kind!r}: one of {', '.join(KINDS)}")
    text = (resources.files("course_lib") / "k8s_schemas" / _SCHEMA_FILES[kind]).read_text()
    return yaml.safe_load(text)


def _structural(schema):
    """The API server prunes every field a structural schema does not declare; ``kubectl``'s
    strict server-side field validation (GA in Kubernetes 1.27) turns that into an error. So:
    ``additionalProperties: false`` wherever properties are listed and unknown fields are not
    explicitly preserved."""
    if isinstance(schema, list):
        for item in schema:
            _structural(item)
        return schema
    if not isinstance(schema, dict):
        return schema
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    for sub in schema.get("properties", {}).values():
        _structural(sub)
    for key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"):
        if isinstance(schema.get(key), (dict, list)):
            _structural(schema[key])
    return schema


@functools.lru_cache(maxsize=8)
def _crd_schema(kind):
    schema = _structural(copy.deepcopy(crd(kind)["openAPIV3Schema"]))
    # Whatever the CRD says about metadata, the API server checks it as an ObjectMeta.
    schema["properties"]["metadata"] = _k8s_ref("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
    schema.setdefault("required", [])
    schema["required"] = [*schema["required"], "apiVersion", "kind", "metadata", "spec"]
    return schema


def crd_problems(manifest, k8s_version=K8S_VERSION):
    """Layer 3: the whole job against its operator's CRD ``openAPIV3Schema`` (from
    ``course_lib/k8s_schemas/``), unknown fields rejected, ``metadata`` as an ObjectMeta.
    The CEL rules (``x-kubernetes-validations``) are not evaluated here. Introduced in
    notebooks/12_scaling_out.ipynb."""
    label, kind = _label(manifest), _kind(manifest)
    if kind not in _SCHEMA_FILES:
        return [Problem(label, "crd", "kind",
                        f"unknown kind {kind!r}: this module knows {', '.join(KINDS)}")]
    stored = crd(kind)
    expected = f"{stored['group']}/{stored['version']}"
    if _get(manifest, "apiVersion") != expected:
        return [Problem(label, "crd", "apiVersion",
                        f"{_get(manifest, 'apiVersion')!r}: a {kind} here is {expected!r}")]
    validator = _validator(_crd_schema(kind), k8s_version)
    return _error_problems(validator, manifest, label, "crd")


# --------------------------------------------------------------------------- layer 4: rules


def _int(value):
    """An int from an int or a string of digits, else None (booleans are not ints here)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _replicas(spec):
    count = _get(spec, "replicas", default=1)   # training-operator's default: 1
    return count if isinstance(count, int) and not isinstance(count, bool) else 0


def world_size(manifest):
    """How many processes the manifest starts (ranks of the job), or None where the pods decide
    (``nprocPerNode: auto``, elastic jobs). Introduced in notebooks/12_scaling_out.ipynb."""
    kind, spec = _kind(manifest), _get(manifest, "spec")
    if not isinstance(spec, dict):
        return None
    if kind == "PyTorchJob":
        if "elasticPolicy" in spec:
            return None
        nproc = _int(spec.get("nprocPerNode", "auto"))
        replicas = _get(spec, "pytorchReplicaSpecs")
        if not isinstance(replicas, dict):
            return None
        total = sum(_replicas(r) for r in replicas.values() if isinstance(r, dict))
        return total * nproc if nproc else None
    if kind == "TFJob":
        replicas = _get(spec, "tfReplicaSpecs")
        if not isinstance(replicas, dict):
            return None
        return sum(_replicas(r) for t, r in replicas.items()
                   if t in ("Chief", "Master", "Worker") and isinstance(r, dict))
    if kind == "MPIJob":
        slots = _int(spec.get("slotsPerWorker", 1)) or 0
        # mpi-operator's workerReplicas(): 0 when the Worker spec or its replicas are missing
        workers = _int(_get(spec, "mpiReplicaSpecs", "Worker", "replicas")) or 0
        return (workers + bool(spec.get("runLauncherAsWorker"))) * slots
    if kind == "TrainJob":
        nodes = _int(_get(spec, "trainer", "numNodes", default=1))
        nproc = _int(_get(spec, "trainer", "numProcPerNode"))
        return nodes * nproc if nodes and nproc else None
    return None


def _image_mpi(image):
    """The MPI flavour an image's name announces, if any."""
    name = image.lower()
    for flavour, marks in (("OpenMPI", ("openmpi", "ompi")), ("MPICH", ("mpich",)),
                           ("Intel", ("intel", "impi", "oneapi"))):
        if any(mark in name for mark in marks):
            return flavour
    return None


def _mpirun_np(tokens):
    """The process count given to mpirun/mpiexec (-n, -np, --np, -c), if any."""
    for i, token in enumerate(tokens):
        for flag in ("-n", "-np", "--np", "-c", "--n"):
            if token == flag and i + 1 < len(tokens):
                return _int(tokens[i + 1])
            if token.startswith(flag + "="):
                return _int(token.split("=", 1)[1])
    return None


def _container_rules(kind, rtype, template, where, label):
    problems = []
    containers = _get(template, "spec", "containers")
    if not containers:
        return [Problem(label, "rules", _path(*where, "spec", "containers"),
                        f"{rtype} has no containers: the operator has nothing to run")]
    if not isinstance(containers, list):
        return problems                         # layers 2 and 3 say what is wrong
    names = [c.get("name") for c in containers if isinstance(c, dict)]
    wanted = _CONTAINER.get(kind)
    if wanted and wanted not in names:
        problems.append(Problem(
            label, "rules", _path(*where, "spec", "containers"),
            f"no container named {wanted!r} in {rtype} (found {names}): the {kind} webhook "
            f"rejects the job, and the operator sets its port and environment only in "
            f"the {wanted!r} container"))
    return problems


def _replica_rules(manifest, label):
    kind, spec = manifest["kind"], _get(manifest, "spec", default={})
    key = _REPLICAS[kind]
    replicas = _get(spec, key)
    if not isinstance(replicas, dict):
        return []
    problems = []
    for rtype, rspec in replicas.items():
        where = ("spec", key, rtype)
        if rtype not in _REPLICA_TYPES[kind]:
            problems.append(Problem(label, "rules", _path(*where),
                                    f"unknown replica type {rtype!r}: a {kind} has "
                                    f"{', '.join(_REPLICA_TYPES[kind])}"))
        if not isinstance(rspec, dict):
            continue
        policy = rspec.get("restartPolicy")
        if policy is not None and policy not in RESTART_POLICIES:
            problems.append(Problem(label, "rules", _path(*where, "restartPolicy"),
                                    f"{policy!r} is not a restart policy: one of "
                                    f"{', '.join(RESTART_POLICIES)}"))
        count = rspec.get("replicas", 1)
        if isinstance(count, int) and count < 0:
            problems.append(Problem(label, "rules", _path(*where, "replicas"),
                                    f"{count} replicas"))
        problems += _container_rules(kind, rtype, rspec.get("template"), (*where, "template"),
                                     label)
    return problems


def _pytorch_rules(manifest, label):
    spec, problems = manifest["spec"], []
    replicas = _get(spec, "pytorchReplicaSpecs", default={})
    master = replicas.get("Master") if isinstance(replicas, dict) else None
    elastic = spec.get("elasticPolicy")
    if isinstance(master, dict) and _replicas(master) != 1:
        problems.append(Problem(label, "rules", "spec.pytorchReplicaSpecs.Master.replicas",
                                f"{_replicas(master)}: a PyTorchJob has exactly one Master "
                                "(MASTER_ADDR is <name>-master-0)"))
    if master is None and not elastic:
        problems.append(Problem(label, "rules", "spec.pytorchReplicaSpecs",
                                "no Master: without one (or an elasticPolicy) the operator "
                                "sets no MASTER_ADDR, RANK or WORLD_SIZE"))
    nproc = spec.get("nprocPerNode")
    if nproc is not None and _int(nproc) is None and nproc not in ("auto", "cpu", "gpu"):
        problems.append(Problem(label, "rules", "spec.nprocPerNode",
                                f"{nproc!r}: an integer (as a string), auto, cpu or gpu"))
    if isinstance(elastic, dict):
        low, high = elastic.get("minReplicas"), elastic.get("maxReplicas")
        workers = _replicas(_get(replicas, "Worker", default={}))
        if isinstance(low, int) and isinstance(high, int) and not low <= workers <= high:
            problems.append(Problem(label, "rules", "spec.pytorchReplicaSpecs.Worker.replicas",
                                    f"{workers} workers, outside elasticPolicy's "
                                    f"[{low}, {high}]"))
    return problems


def _tf_rules(manifest, label):
    replicas = _get(manifest, "spec", "tfReplicaSpecs")
    if not isinstance(replicas, dict):
        return []
    chiefs = sum(_replicas(replicas[t]) for t in ("Chief", "Master")
                 if isinstance(replicas.get(t), dict))
    if chiefs > 1:
        return [Problem(label, "rules", "spec.tfReplicaSpecs",
                        f"{chiefs} Chief/Master pods: TensorFlow has at most one chief")]
    return []


def _mpi_rules(manifest, label):
    spec, problems = manifest["spec"], []
    replicas = _get(spec, "mpiReplicaSpecs", default={})
    launcher = replicas.get("Launcher") if isinstance(replicas, dict) else None
    if not isinstance(launcher, dict) or _replicas(launcher) != 1:
        problems.append(Problem(label, "rules", "spec.mpiReplicaSpecs.Launcher",
                                "an MPIJob needs exactly one Launcher"))
    if not isinstance(_get(replicas, "Worker"), dict):
        problems.append(Problem(label, "rules", "spec.mpiReplicaSpecs.Worker",
                                "an MPIJob needs Worker replicas for mpirun to reach"))
    declared = spec.get("mpiImplementation", "OpenMPI")      # the CRD's default
    for rtype, rspec in (replicas.items() if isinstance(replicas, dict) else ()):
        containers = _get(rspec, "template", "spec", "containers", default=[])
        for i, container in enumerate(containers if isinstance(containers, list) else []):
            image = _get(container, "image")
            flavour = _image_mpi(image) if isinstance(image, str) else None
            if flavour and declared in MPI_IMPLEMENTATIONS and flavour != declared:
                problems.append(Problem(
                    label, "rules",
                    _path("spec", "mpiReplicaSpecs", rtype, "template", "spec", "containers", i,
                          "image"),
                    f"{image!r} looks built with {flavour} but mpiImplementation is "
                    f"{declared}: the operator writes the hostfile and environment for "
                    f"{declared}, which {flavour}'s mpirun does not read"))
    first = _get(launcher, "template", "spec", "containers", 0)
    tokens = []
    for key in ("command", "args"):
        value = _get(first, key)
        tokens += [str(t) for t in value] if isinstance(value, list) else []
    if len(tokens) == 1:                       # "bash -c '...'" style: look inside the string
        tokens = shlex.split(tokens[0])
    np_, world = _mpirun_np(tokens), world_size(manifest)
    if np_ is not None and world and np_ != world:
        problems.append(Problem(label, "rules",
                                "spec.mpiReplicaSpecs.Launcher.template.spec.containers[0]",
                                f"mpirun starts {np_} processes but the workers have {world} "
                                "slots (Worker replicas x slotsPerWorker)"))
    return problems


def _trainjob_rules(manifest, label):
    spec, problems = manifest["spec"], []
    name = _get(spec, "runtimeRef", "name")
    if not isinstance(name, str) or not name:
        problems.append(Problem(label, "rules", "spec.runtimeRef.name",
                                "missing: a TrainJob names the (Cluster)TrainingRuntime it "
                                "runs on, e.g. torch-distributed"))
    trainer = _get(spec, "trainer", default={})
    nodes = trainer.get("numNodes") if isinstance(trainer, dict) else None
    if nodes is not None and (_int(nodes) or 0) < 1:
        problems.append(Problem(label, "rules", "spec.trainer.numNodes",
                                f"{nodes!r}: at least 1"))
    nproc = trainer.get("numProcPerNode") if isinstance(trainer, dict) else None
    if nproc is not None and (_int(nproc) or 0) < 1 and nproc not in ("auto", "cpu", "gpu"):
        # kubeflow/trainer torch plugin, Torch.Validate
        problems.append(Problem(label, "rules", "spec.trainer.numProcPerNode",
                                f"{nproc!r}: an integer >= 1, auto, cpu or gpu"))
    env = trainer.get("env") if isinstance(trainer, dict) else None
    for i, var in enumerate(env if isinstance(env, list) else []):
        if _get(var, "name") in _TORCH_RESERVED_ENV:
            problems.append(Problem(label, "rules", _path("spec", "trainer", "env", i, "name"),
                                    f"{var['name']} is reserved: the torch runtime sets it"))
    return problems


_KIND_RULES = {"PyTorchJob": _pytorch_rules, "TFJob": _tf_rules, "MPIJob": _mpi_rules,
               "TrainJob": _trainjob_rules}


def _longest_hostname(manifest):
    """The longest pod hostname the operator will make (each must be a DNS label, <= 63)."""
    name, kind = manifest["metadata"]["name"], manifest["kind"]
    if kind == "TrainJob":
        nodes = _int(_get(manifest, "spec", "trainer", "numNodes", default=1)) or 1
        return f"{name}-node-0-{nodes - 1}"
    replicas = _get(manifest, "spec", _REPLICAS[kind])
    if not isinstance(replicas, dict):
        return name
    names = [f"{name}-{rtype.lower()}-{max(_replicas(r) - 1, 0)}"
             for rtype, r in replicas.items() if isinstance(r, dict)]
    return max(names, key=len, default=name)


def rule_problems(manifest):
    """Layer 4: what the operators require and no schema says. Every kind: the name a DNS-1035
    label (pods and Services are named after it) with pod hostnames of at most 63 characters,
    and, when the ``course-lib/world-size`` annotation is there, replicas x processes equal to
    it. PyTorchJob/TFJob/MPIJob: known replica types, restart policies in Always, OnFailure,
    Never, ExitCode, the container the operator looks for (``pytorch``, ``tensorflow``), one
    Master/Chief/Launcher. MPIJob: the MPI implementation that the images announce, ``mpirun
    -n`` equal to the slots. TrainJob: a runtimeRef, numProcPerNode an int, auto, cpu or gpu, no
    reserved ``PET_*`` in env. Introduced in notebooks/12_scaling_out.ipynb."""
    label, kind = _label(manifest), _kind(manifest)
    if kind not in KINDS or not isinstance(_get(manifest, "spec"), dict):
        return []                               # layer 3 says what is wrong
    problems = []
    name = _get(manifest, "metadata", "name")
    if not isinstance(name, str) or not _DNS1035.match(name) or len(name) > 63:
        problems.append(Problem(label, "rules", "metadata.name",
                                f"{name!r} is not a DNS-1035 label (lowercase letters, digits "
                                "and '-', starting with a letter, at most 63 characters)"))
    else:
        longest = _longest_hostname(manifest)
        if len(longest) > 63:
            problems.append(Problem(label, "rules", "metadata.name",
                                    f"pod hostname {longest!r} would be {len(longest)} "
                                    "characters: at most 63"))
    if kind in _REPLICAS:
        problems += _replica_rules(manifest, label)
    problems += _KIND_RULES[kind](manifest, label)
    declared = _get(manifest, "metadata", "annotations", WORLD_SIZE_ANNOTATION)
    world = world_size(manifest)
    if declared is not None and world is not None and _int(declared) != world:
        problems.append(Problem(label, "rules", f"metadata.annotations.{WORLD_SIZE_ANNOTATION}",
                                f"the job was described with {declared} processes but its "
                                f"replicas x processes per pod give {world}"))
    return problems


# --------------------------------------------------------------------------- all layers


def validate(manifest, k8s_version=K8S_VERSION):
    """Every problem of a manifest (a dict, or YAML text), layer by layer: YAML, pod templates,
    CRD schema, operator rules. An empty list when the operator would accept it. A problem that
    two layers find (a pod template field is checked by both the pod and the CRD schema) is
    listed once. Introduced in notebooks/12_scaling_out.ipynb."""
    if isinstance(manifest, str):
        problems = yaml_problems(manifest)
        if problems:
            return problems
        manifest = yaml.safe_load(manifest)
    else:
        problems = yaml_problems(to_yaml(manifest), _label(manifest))
    problems += pod_problems(manifest, k8s_version)
    problems += crd_problems(manifest, k8s_version)
    problems += rule_problems(manifest)
    seen, unique = set(), []
    for problem in problems:
        if (problem.path, problem.message) not in seen:
            seen.add((problem.path, problem.message))
            unique.append(problem)
    return unique


def check(manifest, k8s_version=K8S_VERSION):
    """The manifest (parsed, if it was YAML text) when :func:`validate` finds nothing, else
    :class:`ManifestError` listing every problem. Introduced in
    notebooks/12_scaling_out.ipynb."""
    problems = validate(manifest, k8s_version)
    if problems:
        raise ManifestError(problems)
    return yaml.safe_load(manifest) if isinstance(manifest, str) else manifest


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

    def __str__(self):
        lines = [f"{self.pod} ({self.replica} {self.index}"
                 + (f", ranks {self.ranks}" if self.ranks else "") + ")"]
        lines += [f"  {key}={value}" for key, value in self.env.items()]
        for path, text in self.files.items():
            lines.append(f"  {path}:")
            lines += [f"    {line}" for line in text.splitlines()]
        return "\n".join(lines)


def _user_env(container):
    return {v["name"]: str(v.get("value", "")) for v in _get(container, "env") or []
            if isinstance(v, dict) and "name" in v and "valueFrom" not in v}


def _named(template, name):
    for container in _get(template, "spec", "containers") or []:
        if _get(container, "name") == name:
            return container
    return None


def _port(template, container_name, port_name, default):
    # The operators' defaulting webhooks add the named port when it is missing.
    for port in _get(_named(template, container_name), "ports") or []:
        if _get(port, "name") == port_name:
            return port.get("containerPort", default)
    return default


def _pytorch_envs(job):
    # kubeflow/training-operator pkg/controller.v1/pytorch: envvar.go setPodEnv,
    # master.go MasterEnvVarGenerator.Generate, elastic.go ElasticEnvVarGenerator.Generate.
    name, spec = job["metadata"]["name"], job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(_replicas(r) for r in replicas.values())
    nproc_text = str(spec.get("nprocPerNode", "auto"))     # defaulted to "auto" by the webhook
    nproc = _int(nproc_text)
    world = total * (nproc or 1)          # getNprocPerNodeInt: 1 when not an integer
    master = replicas.get("Master")
    elastic = spec.get("elasticPolicy")
    pods = []
    for rtype in ("Master", "Worker"):
        rspec = replicas.get(rtype)
        for index in range(_replicas(rspec) if rspec else 0):
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
                                     else str(_replicas(replicas["Worker"])))
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
                                  for i in range(_replicas(replicas[rtype]))]
    distributed = sum(_replicas(r) for r in replicas.values()) != 1
    pods = []
    for rtype, rspec in replicas.items():
        for index in range(_replicas(rspec)):
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
    workers = _int(_get(replicas, "Worker", "replicas")) or 0       # workerReplicas()
    hosts = ([f"{name}-launcher"] if as_worker else []) + [f"{name}-worker-{i}"
                                                          for i in range(workers)]
    line = "{}.{}.{}.svc slots={}" if flavour == "OpenMPI" else "{}.{}.{}.svc:{}"
    hostfile = "".join(line.format(host, name, namespace, slots) + "\n" for host in hosts)
    launcher_env = _user_env(_get(replicas, "Launcher", "template", "spec", "containers", 0))
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
        env = _user_env(_get(replicas, "Worker", "template", "spec", "containers", 0))
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
    for suffix in sorted(suffixes, key=len, reverse=True):
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
    # requests gets 1 process.
    value = trainer.get("numProcPerNode", "auto")   # torch-distributed's mlPolicy says auto
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
    nproc = _int(nproc_text)
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


def pod_environments(manifest):
    """For each pod the operator would create (after :func:`check` passes), the environment it
    writes into the main container, as its Go source does (file and function named in comments
    here): PyTorchJob ``MASTER_ADDR``/``PORT``, ``WORLD_SIZE``, ``RANK``, ``PET_*``; TFJob
    ``TF_CONFIG``; MPIJob the launcher's hostfile ``/etc/mpi/hostfile`` and ``OMPI_*``/
    ``HYDRA_*``/``I_MPI_*``; TrainJob the torch runtime's ``PET_*``. Variables the container
    declares itself come first. Introduced in notebooks/12_scaling_out.ipynb."""
    job = check(manifest)
    return {"PyTorchJob": _pytorch_envs, "TFJob": _tf_envs, "MPIJob": _mpi_envs,
            "TrainJob": _trainjob_envs}[job["kind"]](job)


def run_locally(manifest, timeout=180.0):
    """Run a two-pod PyTorchJob here as the cluster would: each pod a host of its own named like
    the pod (:func:`course_lib.hosts.make_hosts`, so ``MASTER_ADDR=<job>-master-0`` resolves),
    its container's command, and exactly the environment :func:`pod_environments` gives it.
    Returns each pod's output (rank 0's last line is the script's JSON result). Needs root.
    Introduced in notebooks/12_scaling_out.ipynb."""
    import sys

    from course_lib import hosts
    pods = pod_environments(manifest)
    if manifest["kind"] != "PyTorchJob" or len(pods) != 2:
        raise ValueError(f"run_locally runs a PyTorchJob of two pods, not a {manifest['kind']} "
                         f"of {len(pods)}")
    commands = []
    for pod in pods:
        replica = manifest["spec"]["pytorchReplicaSpecs"][pod.replica]
        command = replica["template"]["spec"]["containers"][0]["command"]
        if command[0] == "torchrun":  # this machine's torchrun: the one beside its Python
            command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
        commands.append(command)
    with hosts.make_hosts([pod.pod for pod in pods]) as machines:
        outputs = hosts.run_each(machines, commands,
                                 [{**os.environ, **pod.env} for pod in pods], timeout)
    return dict(zip([pod.pod for pod in pods], outputs, strict=True))


# --------------------------------------------------------------------------- kubectl


def kubectl_available(timeout=5.0):
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


def kubectl_dry_run(path, timeout=30.0):
    """The output of ``kubectl apply --dry-run=client -f path``, or a line saying why it was
    skipped (no kubectl, or no cluster). Introduced in notebooks/12_scaling_out.ipynb."""
    if not kubectl_available():
        return (f"skipped `kubectl apply --dry-run=client -f {path}`: no kubectl on the PATH "
                "or no cluster answering it (the offline checks above stand in for it)")
    result = subprocess.run(["kubectl", "apply", "--dry-run=client", "-f", str(path)],
                            capture_output=True, text=True, timeout=timeout)
    return (result.stdout + result.stderr).strip()
