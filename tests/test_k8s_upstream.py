"""The validator on the operators' own example manifests, read where they are kept (never copied
here): ../shared/k8s_examples beside the repository, as CI has it, or the folder named by
COURSE_LIB_K8S_EXAMPLES (SOURCES.txt there names each file's repository and commit). Every job
manifest validates clean, one test per file; broken copies, each made from a real manifest by
a change to the loaded documents, are caught with the message the operator would give. Without
the folder (a clone on its own) these tests skip and say why."""

import copy
import os
from pathlib import Path

import pytest

from course_lib import k8s
from course_lib.k8s import validate as k8s_validate

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = Path(os.environ.get("COURSE_LIB_K8S_EXAMPLES")
                or REPO.parent / "shared" / "k8s_examples")
MISSING = (f"no upstream example manifests at {EXAMPLES}: they are read from "
           "../shared/k8s_examples beside the repository (CI has it) or from "
           "$COURSE_LIB_K8S_EXAMPLES")
# The training-operator's own MPIJob (kubeflow.org/v1), which mpi-operator's v2beta1 replaced:
# this validator knows MPIJob v2beta1 only.
MPIJOB_V1 = "'kubeflow.org/v1': a MPIJob here is 'kubeflow.org/v2beta1'"


def _api_version(kind):
    crd = k8s_validate.crd(kind)
    return f"{crd['group']}/{crd['version']}"


def _files():
    """``(relative path, in scope)`` for every YAML file: in scope when it holds a training job
    of an apiVersion this validator knows."""
    if not EXAMPLES.is_dir():
        return []
    out = []
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        jobs = k8s_validate.training_jobs(k8s_validate.load_all(path.read_text()))
        known = [j for j in jobs if j.get("apiVersion") == _api_version(j["kind"])]
        out.append((path.relative_to(EXAMPLES).as_posix(), bool(known) and known == jobs))
    return out


FILES = _files()


def _params(in_scope):
    params = [f for f, scope in FILES if scope == in_scope]
    return params or [pytest.param(None, marks=pytest.mark.skip(reason=MISSING), id="no-examples")]


def _load(relative):
    if not EXAMPLES.is_dir():
        pytest.skip(MISSING)
    return k8s_validate.load_all((EXAMPLES / relative).read_text())


@pytest.mark.parametrize("relative", _params(True))
def test_an_upstream_job_manifest_validates_clean(relative):
    text = (EXAMPLES / relative).read_text()
    assert k8s_validate.validate_all(text, relative) == []
    jobs = k8s_validate.training_jobs(k8s_validate.load_all(text))
    assert jobs and all(k8s_validate.validate(job) == [] for job in jobs)
    if len(k8s_validate.load_all(text)) == 1:     # one manifest: the single-manifest readers too
        assert k8s_validate.validate(text) == [] and k8s_validate.check(text) == jobs[0]


@pytest.mark.parametrize("relative", _params(False))
def test_an_upstream_file_outside_the_validator_says_so(relative):
    text = (EXAMPLES / relative).read_text()
    jobs = k8s_validate.training_jobs(k8s_validate.load_all(text))
    if not jobs:                 # a Service, Pod, PVC or ClusterTrainingRuntime: passed over
        assert k8s_validate.validate_all(text, relative) == []
    else:
        assert [(p.layer, p.path) for p in k8s_validate.validate_all(text)] == \
            [("crd", "apiVersion")] * len(jobs)
        assert all(MPIJOB_V1 in p.message for p in k8s_validate.validate_all(text))


def test_the_examples_are_those_of_sources_txt():
    sources = EXAMPLES / "SOURCES.txt"
    if not sources.is_file():
        pytest.skip(MISSING if not EXAMPLES.is_dir() else f"no SOURCES.txt in {EXAMPLES}")
    listed = sorted(f"{repo.replace('/', '__')}/{path}"
                    for repo, _commit, path in (line.split() for line in
                                                sources.read_text().splitlines() if line.strip()))
    assert listed == [f for f, _ in FILES]
    if not os.environ.get("COURSE_LIB_K8S_EXAMPLES"):  # the corpus in shared/: 33 files, of
        assert sum(scope for _, scope in FILES) == 26  # which 26 are job manifests it covers


# --------------------------------------------------------------------------- broken copies

PT_SIMPLE = "kubeflow__training-operator/examples/pytorch/simple.yaml"
TF_SIMPLE = "kubeflow__training-operator/examples/tensorflow/simple.yaml"
MPI_PI = "kubeflow__mpi-operator/examples/v2beta1/pi/pi.yaml"
TRAINER = "kubeflow__trainer/examples/yaml/"
PT_WORKER = ["spec", "pytorchReplicaSpecs", "Worker"]
MPI = ["spec", "mpiReplicaSpecs"]


def _set(*path, value):
    def mutate(manifest):
        *parents, last = path
        for key in parents:
            manifest = manifest[key]
        manifest[last] = value
    return mutate


def _del(*path):
    def mutate(manifest):
        *parents, last = path
        for key in parents:
            manifest = manifest[key]
        del manifest[last]
    return mutate


def _rename(*path, to):
    def mutate(manifest):
        *parents, last = path
        for key in parents:
            manifest = manifest[key]
        manifest[to] = manifest.pop(last)
    return mutate


NO_IMAGE_WEBHOOK = "the {} webhook rejects the job (a pod template may leave it out, the " \
    "operator may not)"
NO_IMAGE_MPI = "mpi-operator accepts the job, but Kubernetes refuses to create a pod without one"
MPI_RESTART = "mpi-operator allows only Never or OnFailure (its ValidateMPIJob refuses the job)"

BROKEN = {
    # name: (file, mutation, the one problem expected, as printed)
    "PyTorchJob image empty": (
        PT_SIMPLE, _set(*PT_WORKER, "template", "spec", "containers", 0, "image", value=""),
        "PyTorchJob/pytorch-simple: spec.pytorchReplicaSpecs.Worker.template.spec.containers[0]"
        ".image: Worker container 'pytorch' has no image: "
        + NO_IMAGE_WEBHOOK.format("PyTorchJob") + " [rules]"),
    "PyTorchJob image deleted": (
        PT_SIMPLE, _del("spec", "pytorchReplicaSpecs", "Master", "template", "spec",
                        "containers", 0, "image"),
        "PyTorchJob/pytorch-simple: spec.pytorchReplicaSpecs.Master.template.spec.containers[0]"
        ".image: Master container 'pytorch' has no image: "
        + NO_IMAGE_WEBHOOK.format("PyTorchJob") + " [rules]"),
    "TFJob image deleted": (
        TF_SIMPLE, _del("spec", "tfReplicaSpecs", "Worker", "template", "spec", "containers", 0,
                        "image"),
        "TFJob/tfjob-simple: spec.tfReplicaSpecs.Worker.template.spec.containers[0].image: "
        "Worker container 'tensorflow' has no image: " + NO_IMAGE_WEBHOOK.format("TFJob")
        + " [rules]"),
    "MPIJob image empty": (
        MPI_PI, _set(*MPI, "Worker", "template", "spec", "containers", 0, "image", value=""),
        "MPIJob/pi: spec.mpiReplicaSpecs.Worker.template.spec.containers[0].image: Worker "
        f"container 'mpi-worker' has no image: {NO_IMAGE_MPI} [rules]"),
    "MPIJob image deleted": (
        MPI_PI, _del(*MPI, "Launcher", "template", "spec", "containers", 0, "image"),
        "MPIJob/pi: spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].image: Launcher "
        f"container 'mpi-launcher' has no image: {NO_IMAGE_MPI} [rules]"),
    "PyTorchJob 0 workers": (
        PT_SIMPLE, _set(*PT_WORKER, "replicas", value=0),
        "PyTorchJob/pytorch-simple: spec.pytorchReplicaSpecs.Worker.replicas: 0: a PyTorchJob's "
        "Worker replicas must be at least 1 (its webhook rejects the job) [rules]"),
    "PyTorchJob Master without replicas": (
        PT_SIMPLE, _del("spec", "pytorchReplicaSpecs", "Master", "replicas"),
        "PyTorchJob/pytorch-simple: spec.pytorchReplicaSpecs.Master.replicas: missing: the "
        "PyTorchJob webhook requires Master replicas: 1 [rules]"),
    "MPIJob 0 workers": (
        MPI_PI, _set(*MPI, "Worker", "replicas", value=0),
        "MPIJob/pi: spec.mpiReplicaSpecs.Worker.replicas: 0: an MPIJob's Worker replicas must be "
        "at least 1 unless runLauncherAsWorker (mpi-operator's ValidateMPIJob refuses the job) "
        "[rules]"),
    "MPIJob Worker without replicas": (
        MPI_PI, _del(*MPI, "Worker", "replicas"),
        "MPIJob/pi: spec.mpiReplicaSpecs.Worker.replicas: missing (mpi-operator defaults it to 0): "
        "an MPIJob's Worker replicas must be at least 1 unless runLauncherAsWorker "
        "(mpi-operator's ValidateMPIJob refuses the job) [rules]"),
    "MPIJob Launcher restartPolicy Always": (
        MPI_PI, _set(*MPI, "Launcher", "restartPolicy", value="Always"),
        f"MPIJob/pi: spec.mpiReplicaSpecs.Launcher.restartPolicy: 'Always': {MPI_RESTART} "
        "[rules]"),
    "MPIJob Worker restartPolicy ExitCode": (
        MPI_PI, _set(*MPI, "Worker", "restartPolicy", value="ExitCode"),
        f"MPIJob/pi: spec.mpiReplicaSpecs.Worker.restartPolicy: 'ExitCode': {MPI_RESTART} "
        "[rules]"),
    "TrainJob with the removed podTemplateOverrides": (
        TRAINER + "02-runtime-patches.yaml",
        _rename("spec", "runtimePatches", to="podTemplateOverrides"),
        "TrainJob/runtime-patches-example: spec.podTemplateOverrides: unknown field (not in the "
        "schema) [crd]"),
    "TrainJob with the removed spec.labels": (
        TRAINER + "01-multi-node.yaml", _set("spec", "labels", value={"team": "ml"}),
        "TrainJob/multi-node-example: spec.labels: unknown field (not in the schema) [crd]"),
    "TrainJob numProcPerNode auto": (
        "kubeflow__trainer/examples/flux/lammps-train-job.yaml",
        _set("spec", "trainer", "numProcPerNode", value="auto"),
        "TrainJob/lammps-flux: spec.trainer.numProcPerNode: 'auto' is not of type "
        "'integer' [crd]"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_copy_of_an_upstream_manifest_is_caught(case):
    relative, mutate, expected = BROKEN[case]
    documents = _load(relative)
    (manifest,) = k8s_validate.training_jobs(documents)
    broken = copy.deepcopy(manifest)
    mutate(broken)
    assert [str(p) for p in k8s_validate.validate(broken)] == [expected]
    with pytest.raises(k8s.ManifestError, match="1 problem"):
        k8s_validate.check(broken)
    assert k8s_validate.validate(manifest) == []            # the original still passes


def test_mpijob_with_the_launcher_as_worker_may_have_no_workers():
    # mpi-operator validation_test.go: "valid with zero workers when launcher acts as worker"
    (manifest,) = k8s_validate.training_jobs(_load(MPI_PI))
    manifest["spec"]["runLauncherAsWorker"] = True
    manifest["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = 0
    assert not [p for p in k8s_validate.validate(manifest) if "Worker" in p.path]


def test_a_file_with_a_job_and_a_comment_only_document():
    # kubeflow/trainer examples/yaml/03-kueue-integration.yaml: one TrainJob, then `---` and a
    # LocalQueue left in comments; kubectl applies the TrainJob and skips the empty document.
    relative = TRAINER + "03-kueue-integration.yaml"
    _load(relative)
    text = (EXAMPLES / relative).read_text()
    assert k8s_validate.validate(text) == [] and k8s_validate.yaml_problems(text) == []
    assert k8s_validate.check(text)["metadata"]["name"] == "kueue-example"
    assert k8s_validate.load(text) == k8s_validate.load_all(text)[0]
    # The same file with its TrainJob broken: found, not a crash.
    broken = text.replace("numNodes: 3", "numNodes: 0")
    assert [str(p) for p in k8s_validate.validate(broken)] == [
        "TrainJob/kueue-example: spec.trainer.numNodes: 0: at least 1 [rules]"]
