"""Kubernetes training jobs: the four generators pass every layer; each kind of broken manifest is
caught by the layer meant for it, with the manifest, the field path and what is wrong; the pod
environments are the operators' (training-operator, mpi-operator, Trainer v2)."""

import copy
import json
import os
import re
from importlib import resources

import pytest
import yaml

from course_lib import k8s
from course_lib.k8s import pods as k8s_pods
from course_lib.k8s import rules as k8s_rules
from course_lib.k8s import validate as k8s_validate

TORCH = "pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime"
DDP = k8s.JobSpec("ddp", image=TORCH, command=["-m", "course_lib.train", "--steps", "20"],
                  nodes=2, processes_per_node=2)
SPECS = {
    "PyTorchJob": DDP,
    "TFJob": k8s.JobSpec("tf-ps", image="tensorflow/tensorflow:2.15.0", command=["train.py"],
                         nodes=3, parameter_servers=2),
    "MPIJob": k8s.JobSpec("pi", image="mpioperator/mpi-pi:mpich", command=["pi.py"], nodes=2,
                          processes_per_node=2, mpi_implementation="MPICH"),
    "TrainJob": DDP,
}


def job(kind):
    return k8s.generate(SPECS[kind], kind)


@pytest.mark.parametrize("kind", k8s.KINDS)
def test_every_generator_passes_every_layer(kind):
    manifest = job(kind)
    text = k8s.to_yaml(manifest)
    assert k8s_validate.yaml_problems(text) == []
    assert k8s_validate.pod_problems(manifest) == []
    assert k8s_validate.crd_problems(manifest) == []
    assert k8s_rules.rule_problems(manifest) == []
    assert k8s_validate.validate(manifest) == [] and k8s_validate.validate(text) == []
    assert k8s_validate.check(text) == manifest         # the YAML text reads back the same
    assert "&id" not in text                            # no YAML anchors for kubectl to see
    crd = k8s_validate.crd(kind)
    assert manifest["apiVersion"] == crd["group"] + "/" + crd["version"]


def test_the_generated_fields_are_the_operators():
    pt = job("PyTorchJob")["spec"]
    assert pt["nprocPerNode"] == "2"                         # a string in the CRD
    assert {t: r["replicas"] for t, r in pt["pytorchReplicaSpecs"].items()} == \
        {"Master": 1, "Worker": 1}
    container = pt["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["command"][0] == "torchrun"
    assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]

    tf = job("TFJob")["spec"]["tfReplicaSpecs"]
    assert {t: r["replicas"] for t, r in tf.items()} == {"Chief": 1, "PS": 2, "Worker": 2}
    assert tf["PS"]["template"]["spec"]["containers"][0]["name"] == "tensorflow"

    mpi = job("MPIJob")["spec"]
    assert mpi["mpiImplementation"] == "MPICH" and mpi["slotsPerWorker"] == 2
    launcher = mpi["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert launcher["command"][:3] == ["mpirun", "-n", "4"]
    assert "command" not in mpi["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]

    tj = job("TrainJob")["spec"]
    assert tj["runtimeRef"]["name"] == "torch-distributed"
    assert (tj["trainer"]["numNodes"], tj["trainer"]["numProcPerNode"]) == (2, 2)


def test_elastic_pytorch_job_and_one_task_per_tf_pod():
    elastic = k8s.pytorch_job(k8s.JobSpec("el", image=TORCH, command=["train.py"], nodes=2,
                                          elastic=(1, 4)))
    assert k8s_validate.validate(elastic) == []
    assert list(elastic["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    assert elastic["spec"]["elasticPolicy"]["minReplicas"] == 1
    with pytest.raises(ValueError, match="one TensorFlow task per pod"):
        k8s.tf_job(k8s.JobSpec("tf", image="tf", command=["t.py"], processes_per_node=2))


def _set(path, value):
    def mutate(manifest):
        *parents, last = path
        target = manifest
        for key in parents:
            target = target[key]
        target[last] = value
    return mutate


def _del(path):
    def mutate(manifest):
        *parents, last = path
        target = manifest
        for key in parents:
            target = target[key]
        del target[last]
    return mutate


WORKER = ["spec", "pytorchReplicaSpecs", "Worker"]
POD = [*WORKER, "template", "spec"]
CONTAINER = [*POD, "containers", 0]
MPI_WORKER = ["spec", "mpiReplicaSpecs", "Worker", "template", "spec", "containers", 0]

BROKEN = {
    # name: (kind, mutation, layer, path, words of the message)
    "unknown spec field": ("PyTorchJob", _set(["spec", "nprocsPerNode"], "2"), "crd",
                           "spec.nprocsPerNode", "unknown field"),
    "unknown runPolicy field": ("TFJob", _set(["spec", "runPolicy"], {"cleanup": "All"}), "crd",
                                "spec.runPolicy.cleanup", "unknown field"),
    "unknown container field": ("PyTorchJob", _set([*CONTAINER, "cmd"], ["x"]), "pod",
                                "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].cmd",
                                "unknown field"),
    "unknown metadata field": ("MPIJob", _set(["metadata", "label"], {"a": "b"}), "crd",
                               "metadata.label", "unknown field"),
    "wrong type in the CRD": ("PyTorchJob", _set(["spec", "nprocPerNode"], 2), "crd",
                              "spec.nprocPerNode", "is not of type 'string'"),
    "MPI implementation not in the enum": ("MPIJob", _set(["spec", "mpiImplementation"], "MVAPICH"),
                                           "crd", "spec.mpiImplementation", "is not one of"),
    "wrong apiVersion": ("MPIJob", _set(["apiVersion"], "kubeflow.org/v1"), "crd", "apiVersion",
                         "kubeflow.org/v2beta1"),
    "containers is a mapping": ("PyTorchJob", _set([*POD, "containers"], {}), "pod",
                                "spec.pytorchReplicaSpecs.Worker.template.spec.containers",
                                "is not of type 'array'"),
    "bad resource quantity": ("PyTorchJob", _set([*CONTAINER, "resources", "limits", "memory"],
                                                 "4 GB"), "pod",
                              "containers[0].resources.limits.memory",
                              "'4 GB' is not a Kubernetes quantity"),
    "bad quantity in a TrainJob": ("TrainJob", _set(["spec", "trainer", "resourcesPerNode",
                                                     "requests", "cpu"], "two"), "pod",
                                   "spec.trainer.resourcesPerNode.requests.cpu",
                                   "not a Kubernetes quantity"),
    "wrong restart policy": ("PyTorchJob", _set([*WORKER, "restartPolicy"], "OnError"), "rules",
                             "spec.pytorchReplicaSpecs.Worker.restartPolicy",
                             "'OnError' is not a restart policy"),
    "wrong container name": ("PyTorchJob", _set([*CONTAINER, "name"], "trainer"), "rules",
                             "spec.pytorchReplicaSpecs.Worker.template.spec.containers",
                             "no container named 'pytorch'"),
    "wrong TF container name": ("TFJob", _set(["spec", "tfReplicaSpecs", "PS", "template", "spec",
                                               "containers", 0, "name"], "tf"), "rules",
                                "spec.tfReplicaSpecs.PS.template.spec.containers",
                                "no container named 'tensorflow'"),
    "replicas x processes != world size": ("PyTorchJob", _set([*WORKER, "replicas"], 3), "rules",
                                           "metadata.annotations.course-lib/world-size",
                                           "described with 4 processes but"),
    "nprocPerNode edited alone": ("PyTorchJob", _set(["spec", "nprocPerNode"], "4"), "rules",
                                  "course-lib/world-size", "give 8"),
    "two masters": ("PyTorchJob", _set(["spec", "pytorchReplicaSpecs", "Master", "replicas"], 2),
                    "rules", "Master.replicas", "exactly one Master"),
    "MPI flavour of the image": ("MPIJob", _set([*MPI_WORKER, "image"], "mpi-pi:openmpi"), "rules",
                                 "spec.mpiReplicaSpecs.Worker.template.spec.containers[0].image",
                                 "looks built with OpenMPI but mpiImplementation is MPICH"),
    "mpirun -n != slots": ("MPIJob", _set(["spec", "slotsPerWorker"], 1), "rules",
                           "Launcher.template.spec.containers[0]", "mpirun starts 4 processes"),
    "TrainJob without runtimeRef": ("TrainJob", _del(["spec", "runtimeRef"]), "rules",
                                    "spec.runtimeRef.name", "(Cluster)TrainingRuntime"),
    "TrainJob with reserved env": ("TrainJob", _set(["spec", "trainer", "env"],
                                                    [{"name": "PET_NNODES", "value": "9"}]),
                                   "rules", "spec.trainer.env[0].name", "reserved"),
    "replica without a pod template": ("MPIJob", _del(["spec", "mpiReplicaSpecs", "Worker",
                                                        "template"]), "rules",
                                       "spec.mpiReplicaSpecs.Worker.template.spec.containers",
                                       "Worker has no containers"),
    "name not a DNS label": ("TFJob", _set(["metadata", "name"], "TF_PS"), "rules",
                             "metadata.name", "DNS-1035"),
    "container without an image": ("PyTorchJob", _del([*CONTAINER, "image"]), "rules",
                                   "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0]"
                                   ".image", "Worker container 'pytorch' has no image"),
    "empty image in a TFJob": ("TFJob", _set(["spec", "tfReplicaSpecs", "PS", "template", "spec",
                                              "containers", 0, "image"], ""), "rules",
                               "spec.tfReplicaSpecs.PS.template.spec.containers[0].image",
                               "the TFJob webhook rejects the job"),
    "MPIJob container without an image": ("MPIJob", _set([*MPI_WORKER, "image"], ""), "rules",
                                          "Worker.template.spec.containers[0].image",
                                          "Kubernetes refuses to create a pod without one"),
    "PyTorchJob with 0 workers": ("PyTorchJob", _set([*WORKER, "replicas"], 0), "rules",
                                  "spec.pytorchReplicaSpecs.Worker.replicas",
                                  "Worker replicas must be at least 1"),
    "Master without replicas": ("PyTorchJob", _del(["spec", "pytorchReplicaSpecs", "Master",
                                                     "replicas"]), "rules",
                                "spec.pytorchReplicaSpecs.Master.replicas", "requires Master"),
    "MPIJob with 0 workers": ("MPIJob", _set(["spec", "mpiReplicaSpecs", "Worker", "replicas"], 0),
                              "rules", "spec.mpiReplicaSpecs.Worker.replicas",
                              "unless runLauncherAsWorker"),
    "MPIJob restartPolicy Always": ("MPIJob", _set(["spec", "mpiReplicaSpecs", "Launcher",
                                                    "restartPolicy"], "Always"), "rules",
                                    "spec.mpiReplicaSpecs.Launcher.restartPolicy",
                                    "allows only Never or OnFailure"),
    "TrainJob numProcPerNode auto": ("TrainJob", _set(["spec", "trainer", "numProcPerNode"],
                                                      "auto"), "crd",
                                     "spec.trainer.numProcPerNode", "is not of type 'integer'"),
    "TrainJob podTemplateOverrides": ("TrainJob", _set(["spec", "podTemplateOverrides"], []),
                                      "crd", "spec.podTemplateOverrides", "unknown field"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_each_broken_manifest_is_caught_and_named(case):
    kind, mutate, layer, path, words = BROKEN[case]
    manifest = job(kind)
    mutate(manifest)
    problems = k8s_validate.validate(manifest)
    hits = [p for p in problems if p.layer == layer and path in p.path and words in p.message]
    assert hits, f"{case}: expected [{layer}] {path}: {words}; got {[str(p) for p in problems]}"
    with pytest.raises(k8s.ManifestError) as raised:
        k8s_validate.check(manifest)
    text = str(raised.value)
    assert f"{manifest['kind']}/{manifest['metadata']['name']}: {hits[0].path}" in text
    assert words in text


def test_check_lists_every_problem_once():
    manifest = job("PyTorchJob")
    _set([*WORKER, "restartPolicy"], "Sometimes")(manifest)
    _set([*CONTAINER, "resources", "limits", "cpu"], "lots")(manifest)
    _set(["spec", "extra"], True)(manifest)
    with pytest.raises(k8s.ManifestError) as raised:
        k8s_validate.check(manifest)
    layers = sorted(p.layer for p in raised.value.problems)
    assert layers == ["crd", "pod", "rules"]      # the quantity: found by pod and crd, listed once
    assert str(raised.value).startswith("3 problem(s)")


@pytest.mark.parametrize("text, where, words", [
    ("apiVersion: kubeflow.org/v1\nkind: [PyTorchJob\n", "line 3", "not valid YAML"),
    ("spec:\n\treplicas: 2\n", "line 2, column 1", "'\\t'"),
    ("kind: TFJob\n---\nkind: TFJob\n", "", "expected one YAML document, found 2"),
    ("# only a comment\n---\n# and another\n", "", "expected one YAML document, found 0"),
    ("- a\n- b\n", "", "not a mapping"),
    ("kind: TFJob\nmetadata: {name: x}\nspec: {start: 2025-01-31}\n", "spec.start", "a date"),
])
def test_malformed_yaml_is_caught_with_its_place(text, where, words):
    problems = k8s_validate.validate(text)
    assert len(problems) == 1 and problems[0].layer == "yaml"
    assert where in problems[0].path and words in problems[0].message
    with pytest.raises(k8s.ManifestError, match="not valid YAML|document|mapping|date"):
        k8s_validate.load(text)


def test_a_yaml_stream_is_read_as_kubectl_reads_it():
    # One job, then `---` and only comments (kubeflow/trainer's 03-kueue-integration.yaml):
    # kubectl skips the empty document, and so does every reader here.
    manifest = job("TrainJob")
    text = k8s.to_yaml(manifest) + "---\n# apiVersion: kueue.x-k8s.io/v1beta1\n# kind: LocalQueue\n"
    assert k8s_validate.validate(text) == [] and k8s_validate.yaml_problems(text) == []
    assert k8s_validate.check(text) == manifest and k8s_validate.load(text) == manifest
    assert k8s_validate.load_all(text) == [manifest]
    # A file of several: validate_all checks each training job, passes over the other kinds.
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "etcd"}}
    broken = job("PyTorchJob")
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 0
    stream = "---\n".join(k8s.to_yaml(m) for m in (service, manifest, broken)) + "---\n"
    assert k8s_validate.validate(stream)[0].message.startswith(
        "expected one YAML document, found 3")
    loaded = k8s_validate.load_all(stream)
    assert [m["kind"] for m in k8s_validate.training_jobs(loaded)] == ["TrainJob", "PyTorchJob"]
    assert [str(p) for p in k8s_validate.validate_all(stream)] == [
        "PyTorchJob/ddp: spec.pytorchReplicaSpecs.Worker.replicas: 0: a PyTorchJob's Worker "
        "replicas must be at least 1 (its webhook rejects the job) [rules]",
        "PyTorchJob/ddp: metadata.annotations.course-lib/world-size: the job was described with "
        "4 processes but its replicas x processes per pod give 2 [rules]"]


def test_unquoted_number_in_yaml_text_meets_the_crd():
    text = k8s.to_yaml(job("PyTorchJob")).replace("nprocPerNode: '2'", "nprocPerNode: 2")
    problems = k8s_validate.validate(text)
    assert [(p.layer, p.path) for p in problems] == [("crd", "spec.nprocPerNode")]


def test_pod_environments_of_a_2_by_2_pytorchjob():
    pods = k8s_pods.pod_environments(job("PyTorchJob"))
    assert [p.pod for p in pods] == ["ddp-master-0", "ddp-worker-0"]
    for node_rank, pod in enumerate(pods):
        env = pod.env
        assert env["RANK"] == env["PET_NODE_RANK"] == str(node_rank)
        assert env["WORLD_SIZE"] == "4" and env["PET_NNODES"] == "2"
        assert env["PET_NPROC_PER_NODE"] == "2"
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "ddp-master-0"
        assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == "23456"
    # torchrun turns node rank r into processes r*2, r*2+1
    assert [p.ranks for p in pods] == [[0, 1], [2, 3]]
    assert "ddp-worker-0 (Worker 0, ranks [2, 3])" in str(pods[1])


def test_pod_environments_of_an_elastic_pytorchjob():
    manifest = k8s.pytorch_job(k8s.JobSpec("el", image=TORCH, command=["t.py"], nodes=2,
                                           elastic=(1, 3)))
    env = k8s_pods.pod_environments(manifest)[1].env
    assert env["PET_RDZV_ENDPOINT"] == "el-worker-0:23456" and env["PET_NNODES"] == "1:3"
    assert "RANK" not in env and "WORLD_SIZE" not in env    # torchrun's rendezvous decides


def test_tf_config_of_a_parameter_server_job():
    pods = k8s_pods.pod_environments(job("TFJob"))
    assert [p.pod for p in pods] == ["tf-ps-chief-0", "tf-ps-ps-0", "tf-ps-ps-1",
                                     "tf-ps-worker-0", "tf-ps-worker-1"]
    config = json.loads(pods[2].env["TF_CONFIG"])
    assert config["task"] == {"type": "ps", "index": 1} and config["environment"] == "cloud"
    assert list(config["cluster"]) == ["chief", "ps", "worker"]
    assert config["cluster"]["worker"][1] == "tf-ps-worker-1.default.svc:2222"
    assert pods[2].env["TF_CONFIG"].startswith('{"cluster":{"chief":')   # Go's compact JSON


@pytest.mark.parametrize("flavour, line, env", [
    ("MPICH", "pi-worker-1.pi.default.svc:2", {"HYDRA_HOST_FILE": "/etc/mpi/hostfile"}),
    ("OpenMPI", "pi-worker-1.pi.default.svc slots=2",
     {"OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile",
      "OMPI_MCA_orte_set_default_slots": "2"}),
    ("Intel", "pi-worker-1.pi.default.svc:2", {"I_MPI_HYDRA_HOST_FILE": "/etc/mpi/hostfile"}),
])
def test_mpi_hostfile_and_environment(flavour, line, env):
    spec = copy.deepcopy(SPECS["MPIJob"])
    spec.mpi_implementation, spec.image = flavour, "mpi-pi:latest"
    launcher, *workers = k8s_pods.pod_environments(k8s.mpi_job(spec))
    hostfile = launcher.files["/etc/mpi/hostfile"]
    assert hostfile.splitlines()[1] == line and len(hostfile.splitlines()) == 2
    assert env.items() <= launcher.env.items()
    assert launcher.env["NVIDIA_VISIBLE_DEVICES"] == ""
    assert [w.env["K_MPI_JOB_ROLE"] for w in workers] == ["worker", "worker"]
    assert [w.ranks for w in workers] == [[0, 1], [2, 3]]


def test_trainjob_environment_from_the_torch_runtime():
    pods = k8s_pods.pod_environments(job("TrainJob"))
    assert [p.pod for p in pods] == ["ddp-node-0-0", "ddp-node-0-1"]
    assert pods[1].env == {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
                           "PET_MASTER_ADDR": "ddp-node-0-0.ddp", "PET_MASTER_PORT": "29500"}
    # numProcPerNode left out (auto: since Trainer v2.2 the field is an int or nothing) on
    # CPU-only nodes: one process per CPU of the limits
    manifest = job("TrainJob")
    del manifest["spec"]["trainer"]["numProcPerNode"]
    manifest["spec"]["trainer"]["resourcesPerNode"]["limits"]["cpu"] = "2500m"
    manifest["metadata"]["annotations"].clear()
    assert k8s_pods.pod_environments(manifest)[0].env["PET_NPROC_PER_NODE"] == "3"


def test_pod_environments_refuses_a_broken_manifest():
    manifest = job("PyTorchJob")
    _set([*WORKER, "restartPolicy"], "Sometimes")(manifest)
    with pytest.raises(k8s.ManifestError, match="restart policy"):
        k8s_pods.pod_environments(manifest)


def test_world_size():
    assert [k8s.world_size(job(kind)) for kind in k8s.KINDS] == [4, 3, 4, 4]


def test_stored_crd_schemas_name_their_source():
    readme = (resources.files("course_lib.k8s") / "schemas" / "README.md").read_text()
    assert "Apache" in readme
    for kind in k8s.KINDS:
        source = k8s_validate.crd(kind)["source"]
        assert re.fullmatch(r"[0-9a-f]{40}", source["commit"])
        assert source["commit"] in readme and source["path"] in readme
        assert source["release"] in readme                      # which release it comes from
    spec = k8s_validate.crd("TrainJob")["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "runtimePatches" in spec and "podTemplateOverrides" not in spec   # Trainer v2.2
    schema = k8s_validate.crd("MPIJob")["openAPIV3Schema"]
    assert schema["properties"]["spec"]["properties"]["mpiImplementation"]["enum"] == \
        ["OpenMPI", "Intel", "MPICH"]


def test_kubectl_step_is_skipped_without_kubectl(monkeypatch, tmp_path):
    assert isinstance(k8s_pods.kubectl_available(), bool)
    monkeypatch.setattr(k8s_pods.shutil, "which", lambda name: None)
    assert k8s_pods.kubectl_available() is False
    path = tmp_path / "job.yaml"
    path.write_text(k8s.to_yaml(job("PyTorchJob")))
    message = k8s_pods.kubectl_dry_run(path)
    assert message.startswith("skipped `kubectl apply --dry-run=client -f ")
    assert yaml.safe_load(path.read_text()) == job("PyTorchJob")


def test_a_pytorchjob_s_pods_train_here_with_the_operator_s_environment():
    from course_lib.runtime import hosts
    reason = hosts.unavailable_reason()
    if reason:
        pytest.skip(f"two hosts: {reason}")
    spec = k8s.JobSpec("digits", image="pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime",
                       command=["-m", "course_lib.train", "--steps", "4"], nodes=2)
    from course_lib.k8s import watch as k8s_watch
    outputs = k8s_watch.run_locally(k8s.pytorch_job(spec), timeout=120)
    result = json.loads(outputs["digits-master-0"].strip().splitlines()[-1])
    assert result["hosts"] == ["digits-master-0", "digits-worker-0"]
    assert result["launcher"] == "torchrun" and result["world_size"] == 2
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "course_lib.train", "--steps", "4"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert json.loads(done.stdout.strip().splitlines()[-1])["params_sha256"] == \
        result["params_sha256"]
