"""What the Kubernetes operators require of a training job and no schema says (layer 4 of
:mod:`course_lib.k8s.validate`).

Introduced in notebooks/12_scaling_out.ipynb. A manifest can match its CRD's schema and still be
turned down by the operator's webhook, or start pods that never find each other: a container
the operator does not look for, two Masters, ``mpirun -n`` different from the workers' slots, a
pod hostname longer than a DNS label. :func:`rule_problems` finds these, each with the reason
the operator gives (its Go source is named in comments). It stays one file: one rule set per
kind, each short, and the checks every kind shares, all called from :func:`rule_problems`.
"""

from __future__ import annotations

import re
import shlex

from course_lib.k8s import (
    CONTAINER_NAMES,
    KINDS,
    MPI_IMPLEMENTATIONS,
    MPI_RESTART_POLICIES,
    REPLICA_SPECS,
    REPLICA_TYPES,
    RESTART_POLICIES,
    TORCH_RESERVED_ENV,
    WORLD_SIZE_ANNOTATION,
    Problem,
    as_int,
    field_path,
    kind_of,
    label_of,
    lookup,
    replica_count,
    world_size,
)

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


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
                return as_int(tokens[i + 1])
            if token.startswith(flag + "="):
                return as_int(token.split("=", 1)[1])
    return None


def _no_image(kind):
    """Why a container without an image is refused: Kubernetes' pod template schema leaves
    ``image`` optional (a Deployment may fill it in), the operators do not."""
    if kind == "MPIJob":    # mpi-operator's ValidateMPIJob does not look at images
        return "mpi-operator accepts the job, but Kubernetes refuses to create a pod without one"
    # training-operator pkg/webhooks (utils.ValidateReplicaSpecs): containers[i].image required
    return (f"the {kind} webhook rejects the job (a pod template may leave it out, "
            "the operator may not)")


def _container_rules(kind, rtype, template, where, label):
    problems = []
    containers = lookup(template, "spec", "containers")
    if not containers:
        return [Problem(label, "rules", field_path(*where, "spec", "containers"),
                        f"{rtype} has no containers: the operator has nothing to run")]
    if not isinstance(containers, list):
        return problems                         # layers 2 and 3 say what is wrong
    for i, container in enumerate(containers):
        if isinstance(container, dict) and not container.get("image"):
            name = container.get("name")
            who = f"{rtype} container {name!r}" if name else f"{rtype} container {i}"
            problems.append(Problem(label, "rules",
                                    field_path(*where, "spec", "containers", i, "image"),
                                    f"{who} has no image: {_no_image(kind)}"))
    names = [c.get("name") for c in containers if isinstance(c, dict)]
    wanted = CONTAINER_NAMES.get(kind)
    if wanted and wanted not in names:
        problems.append(Problem(
            label, "rules", field_path(*where, "spec", "containers"),
            f"no container named {wanted!r} in {rtype} (found {names}): the {kind} webhook "
            f"rejects the job, and the operator sets its port and environment only in "
            f"the {wanted!r} container"))
    return problems


def _replica_rules(manifest, label):
    kind, spec = manifest["kind"], lookup(manifest, "spec", default={})
    key = REPLICA_SPECS[kind]
    replicas = lookup(spec, key)
    if not isinstance(replicas, dict):
        return []
    problems = []
    for rtype, rspec in replicas.items():
        where = ("spec", key, rtype)
        if rtype not in REPLICA_TYPES[kind]:
            problems.append(Problem(label, "rules", field_path(*where),
                                    f"unknown replica type {rtype!r}: a {kind} has "
                                    f"{', '.join(REPLICA_TYPES[kind])}"))
        if not isinstance(rspec, dict):
            continue
        policy = rspec.get("restartPolicy")
        if kind == "MPIJob" and policy is not None and policy not in MPI_RESTART_POLICIES:
            problems.append(Problem(label, "rules", field_path(*where, "restartPolicy"),
                                    f"{policy!r}: mpi-operator allows only Never or OnFailure "
                                    "(its ValidateMPIJob refuses the job)"))
        elif policy is not None and policy not in RESTART_POLICIES:
            problems.append(Problem(label, "rules", field_path(*where, "restartPolicy"),
                                    f"{policy!r} is not a restart policy: one of "
                                    f"{', '.join(RESTART_POLICIES)}"))
        count = rspec.get("replicas", 1)
        if kind == "TFJob" and isinstance(count, int) and count < 0:   # the others: kind rules
            problems.append(Problem(label, "rules", field_path(*where, "replicas"),
                                    f"{count} replicas"))
        problems += _container_rules(kind, rtype, rspec.get("template"), (*where, "template"),
                                     label)
    return problems


def _pytorch_rules(manifest, label):
    spec, problems = manifest["spec"], []
    replicas = lookup(spec, "pytorchReplicaSpecs", default={})
    master = replicas.get("Master") if isinstance(replicas, dict) else None
    elastic = spec.get("elasticPolicy")
    # training-operator pkg/webhooks/pytorch validatePyTorchReplicaSpecs: Master replicas must be
    # 1 (a missing count included), any other replica type's at least 1.
    if isinstance(master, dict) and master.get("replicas") is None:
        problems.append(Problem(label, "rules", "spec.pytorchReplicaSpecs.Master.replicas",
                                "missing: the PyTorchJob webhook requires Master replicas: 1"))
    elif isinstance(master, dict) and replica_count(master) != 1:
        problems.append(Problem(label, "rules", "spec.pytorchReplicaSpecs.Master.replicas",
                                f"{replica_count(master)}: a PyTorchJob has exactly one Master "
                                "(MASTER_ADDR is <name>-master-0)"))
    for rtype, rspec in (replicas.items() if isinstance(replicas, dict) else ()):
        count = lookup(rspec, "replicas")
        if rtype != "Master" and isinstance(count, int) and not isinstance(count, bool) \
                and count < 1:
            problems.append(Problem(label, "rules",
                                    field_path("spec", "pytorchReplicaSpecs", rtype, "replicas"),
                                    f"{count}: a PyTorchJob's {rtype} replicas must be at least "
                                    "1 (its webhook rejects the job)"))
    if master is None and not elastic:
        problems.append(Problem(label, "rules", "spec.pytorchReplicaSpecs",
                                "no Master: without one (or an elasticPolicy) the operator "
                                "sets no MASTER_ADDR, RANK or WORLD_SIZE"))
    nproc = spec.get("nprocPerNode")
    if nproc is not None and as_int(nproc) is None and nproc not in ("auto", "cpu", "gpu"):
        problems.append(Problem(label, "rules", "spec.nprocPerNode",
                                f"{nproc!r}: an integer (as a string), auto, cpu or gpu"))
    if isinstance(elastic, dict):
        low, high = elastic.get("minReplicas"), elastic.get("maxReplicas")
        workers = replica_count(lookup(replicas, "Worker", default={}))
        if isinstance(low, int) and isinstance(high, int) and not low <= workers <= high:
            problems.append(Problem(label, "rules", "spec.pytorchReplicaSpecs.Worker.replicas",
                                    f"{workers} workers, outside elasticPolicy's "
                                    f"[{low}, {high}]"))
    return problems


def _tf_rules(manifest, label):
    replicas = lookup(manifest, "spec", "tfReplicaSpecs")
    if not isinstance(replicas, dict):
        return []
    chiefs = sum(replica_count(replicas[t]) for t in ("Chief", "Master")
                 if isinstance(replicas.get(t), dict))
    if chiefs > 1:
        return [Problem(label, "rules", "spec.tfReplicaSpecs",
                        f"{chiefs} Chief/Master pods: TensorFlow has at most one chief")]
    return []


def _mpi_rules(manifest, label):
    spec, problems = manifest["spec"], []
    replicas = lookup(spec, "mpiReplicaSpecs", default={})
    launcher = replicas.get("Launcher") if isinstance(replicas, dict) else None
    if not isinstance(launcher, dict) or replica_count(launcher) != 1:
        problems.append(Problem(label, "rules", "spec.mpiReplicaSpecs.Launcher",
                                "an MPIJob needs exactly one Launcher"))
    worker, as_worker = lookup(replicas, "Worker"), bool(spec.get("runLauncherAsWorker"))
    if not isinstance(worker, dict) and not as_worker:
        problems.append(Problem(label, "rules", "spec.mpiReplicaSpecs.Worker",
                                "an MPIJob needs Worker replicas for mpirun to reach"))
    # mpi-operator v2beta1 default.go gives a Worker without replicas 0; validation.go
    # validateWorkerReplicaSpec: at least 1, unless the launcher is a worker too.
    count = worker.get("replicas", 0) if isinstance(worker, dict) else 1  # no Worker: said above
    if isinstance(count, int) and not isinstance(count, bool) and count < 1 and not as_worker:
        shown = count if "replicas" in worker else "missing (mpi-operator defaults it to 0)"
        problems.append(Problem(label, "rules", "spec.mpiReplicaSpecs.Worker.replicas",
                                f"{shown}: an MPIJob's Worker replicas must be at least 1 unless "
                                "runLauncherAsWorker (mpi-operator's ValidateMPIJob refuses "
                                "the job)"))
    declared = spec.get("mpiImplementation", "OpenMPI")      # the CRD's default
    for rtype, rspec in (replicas.items() if isinstance(replicas, dict) else ()):
        containers = lookup(rspec, "template", "spec", "containers", default=[])
        for i, container in enumerate(containers if isinstance(containers, list) else []):
            image = lookup(container, "image")
            flavour = _image_mpi(image) if isinstance(image, str) else None
            if flavour and declared in MPI_IMPLEMENTATIONS and flavour != declared:
                problems.append(Problem(
                    label, "rules",
                    field_path("spec", "mpiReplicaSpecs", rtype, "template", "spec",
                               "containers", i, "image"),
                    f"{image!r} looks built with {flavour} but mpiImplementation is "
                    f"{declared}: the operator writes the hostfile and environment for "
                    f"{declared}, which {flavour}'s mpirun does not read"))
    first = lookup(launcher, "template", "spec", "containers", 0)
    tokens = []
    for key in ("command", "args"):
        value = lookup(first, key)
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
    name = lookup(spec, "runtimeRef", "name")
    if not isinstance(name, str) or not name:
        problems.append(Problem(label, "rules", "spec.runtimeRef.name",
                                "missing: a TrainJob names the (Cluster)TrainingRuntime it "
                                "runs on, e.g. torch-distributed"))
    trainer = lookup(spec, "trainer", default={})
    nodes = trainer.get("numNodes") if isinstance(trainer, dict) else None
    if nodes is not None and (as_int(nodes) or 0) < 1:
        problems.append(Problem(label, "rules", "spec.trainer.numNodes",
                                f"{nodes!r}: at least 1"))
    nproc = trainer.get("numProcPerNode") if isinstance(trainer, dict) else None
    # An int32 since Trainer v2.2 (kubeflow/trainer#3239: auto is what leaving it out means); a
    # string is the CRD layer's to report.
    if isinstance(nproc, int) and not isinstance(nproc, bool) and nproc < 1:
        problems.append(Problem(label, "rules", "spec.trainer.numProcPerNode",
                                f"{nproc!r}: at least 1"))
    env = trainer.get("env") if isinstance(trainer, dict) else None
    for i, var in enumerate(env if isinstance(env, list) else []):
        if lookup(var, "name") in TORCH_RESERVED_ENV:
            problems.append(Problem(label, "rules", field_path("spec", "trainer", "env", i, "name"),
                                    f"{var['name']} is reserved: the torch runtime sets it"))
    return problems


_KIND_RULES = {"PyTorchJob": _pytorch_rules, "TFJob": _tf_rules, "MPIJob": _mpi_rules,
               "TrainJob": _trainjob_rules}


def _longest_hostname(manifest):
    """The longest pod hostname the operator will make (each must be a DNS label, <= 63)."""
    name, kind = manifest["metadata"]["name"], manifest["kind"]
    if kind == "TrainJob":
        nodes = as_int(lookup(manifest, "spec", "trainer", "numNodes", default=1)) or 1
        return f"{name}-node-0-{nodes - 1}"
    replicas = lookup(manifest, "spec", REPLICA_SPECS[kind])
    if not isinstance(replicas, dict):
        return name
    # pods are <job>-<replica type>-<index>: the last index is the longest of each type
    names = [f"{name}-{rtype.lower()}-{max(replica_count(r) - 1, 0)}"
             for rtype, r in replicas.items() if isinstance(r, dict)]
    return max(names, key=len, default=name)


def rule_problems(manifest: dict) -> list[Problem]:
    """Layer 4: what the operators require and no schema says. Every kind: the name a DNS-1035
    label (pods and Services are named after it) with pod hostnames of at most 63 characters,
    and, when the ``course-lib/world-size`` annotation is there, replicas x processes equal to
    it. PyTorchJob/TFJob/MPIJob: known replica types, restart policies in Always, OnFailure,
    Never, ExitCode (an MPIJob: Never or OnFailure), an image in every container, the container
    the operator looks for (``pytorch``, ``tensorflow``), one Master/Chief/Launcher, at least one
    PyTorchJob/MPIJob Worker where there are Workers. MPIJob: the MPI implementation that the
    images announce, ``mpirun -n`` equal to the slots. TrainJob: a runtimeRef, numNodes and
    numProcPerNode at least 1, no reserved ``PET_*`` in env. Introduced in
    notebooks/12_scaling_out.ipynb."""
    label, kind = label_of(manifest), kind_of(manifest)
    if kind not in KINDS or not isinstance(lookup(manifest, "spec"), dict):
        return []                               # layer 3 says what is wrong
    problems = []
    name = lookup(manifest, "metadata", "name")
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
    if kind in REPLICA_SPECS:
        problems += _replica_rules(manifest, label)
    problems += _KIND_RULES[kind](manifest, label)
    declared = lookup(manifest, "metadata", "annotations", WORLD_SIZE_ANNOTATION)
    world = world_size(manifest)
    if declared is not None and world is not None and as_int(declared) != world:
        problems.append(Problem(label, "rules", f"metadata.annotations.{WORLD_SIZE_ANNOTATION}",
                                f"the job was described with {declared} processes but its "
                                f"replicas x processes per pod give {world}"))
    return problems
