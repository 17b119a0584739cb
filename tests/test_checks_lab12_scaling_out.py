"""Lab 12's checks: the right answers pass (exercise 1 also under a real torchrun and mpiexec);
every usual mistake of reading a launcher's environment (local rank from RANK, world size from
SLURM_NNODES, MPICH only, SLURM before torchrun, the node list cut wrong or its zero padding
lost, the job id as port, text for numbers) and of writing a PyTorchJob (a Worker too many,
nprocPerNode as a number, the wrong container name, GPUs in requests, python instead of
torchrun) is caught with a hint that says what the code did; a stub is a notice, not a failure."""

import copy
import os
import re

import pytest

from course_lib import k8s
from course_lib.checks import lab12_scaling_out as checks
from course_lib.checks.framework import CheckFailed
from course_lib.runtime.launch import mpiexec_path

MPI = (("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
       ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"))


def first_host(nodelist):
    head = re.match(r"[^,\[]+(\[[^\]]*\])?", nodelist).group(0)
    prefix, _, ranges = head.partition("[")
    return prefix + re.split(r"[-,\]]", ranges)[0]


def launch_info(env=None, *, torchrun_first=True, local=("LOCAL_RANK", "SLURM_LOCALID"),
                slurm_world="SLURM_NTASKS", mpis=MPI, host=first_host,
                port=lambda job: 10000 + int(job) % 10000, as_text=False,
                exported=("MASTER_ADDR", "MASTER_PORT"), mpi_port=int, slurm_rank="SLURM_PROCID",
                world="WORLD_SIZE"):
    """The lab's answer, with knobs for the usual mistakes."""
    env = os.environ if env is None else env
    number = str if as_text else int

    def result(launcher, rank, world, local_rank, addr, master_port):
        return {"launcher": launcher, "rank": number(rank), "world_size": number(world),
                "local_rank": number(local_rank), "master_addr": addr,
                "master_port": master_port}

    torchrun = "RANK" in env and "MASTER_PORT" in env
    slurm = "SLURM_PROCID" in env and "SLURM_NTASKS" in env
    if torchrun and (torchrun_first or not slurm):
        return result("torchrun", env["RANK"], env[world], env[local[0]],
                      env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    if slurm:
        addr = env["MASTER_ADDR"] if "MASTER_ADDR" in exported and "MASTER_ADDR" in env \
            else host(env["SLURM_JOB_NODELIST"])
        master_port = int(env["MASTER_PORT"]) if "MASTER_PORT" in exported and \
            "MASTER_PORT" in env else port(env["SLURM_JOB_ID"])
        return result("slurm", env[slurm_rank], env[slurm_world], env[local[1]], addr,
                      master_port)
    for rank, size, local_rank in mpis:
        if rank in env:
            return result("mpiexec", env[rank], env[size], env[local_rank],
                          env.get("MASTER_ADDR", "127.0.0.1"),
                          mpi_port(env["MASTER_PORT"]) if "MASTER_PORT" in env and mpi_port
                          else None)
    return result("single", 0, 1, 0, "127.0.0.1", None)


def mistake(**knobs):
    return lambda env=None: launch_info(env, **knobs)


def test_the_answer_passes_on_faked_and_real_launchers(capsys):
    assert checks.check_init_from_launcher(launch_info)
    out = capsys.readouterr().out
    assert "match the reference" in out and "torchrun rank 1" in out
    if mpiexec_path() is not None:
        assert "mpiexec rank 1" in out and "'master_port': None" in out


def test_the_reference_is_the_answer():
    for _, env in checks.FAKED:
        assert launch_info(env) == checks.reference_init_from_launcher(env)


@pytest.mark.parametrize("function, said", [
    (mistake(local=("RANK", "SLURM_LOCALID")),
     "you read local_rank from RANK or ROLE_RANK (9); torchrun's local rank is LOCAL_RANK"),
    (mistake(torchrun_first=False), "srun started one torchrun per node"),
    (mistake(mpis=MPI[:1]), "Look for both MPIs"),
    (mistake(mpis=(("PMI_RANK", "PMI_SIZE", "PMI_RANK"),)),
     "you read local_rank from PMI_RANK (5); MPICH's mpiexec's local rank is MPI_LOCALRANKID"),
    (mistake(slurm_world="SLURM_NNODES"), "from SLURM_JOB_NUM_NODES or SLURM_NNODES (4); "
                                          "SLURM's world size is SLURM_NTASKS (12 here)"),
    (mistake(local=("LOCAL_RANK", "SLURM_NODEID")), "SLURM's local rank is SLURM_LOCALID"),
    (mistake(host=lambda nodelist: nodelist.split(",")[0]),
     "you cut the list at its first comma, which here is inside the brackets. For SLURM the "
     "rendezvous is the FIRST host of the expanded node list: node[01-03,07] -> node01"),
    (mistake(host=lambda nodelist: re.sub(r"\[0*(\d+).*", r"\1", nodelist)),
     "the zero padding was lost: node1, but the host is node01"),
    (mistake(host=lambda nodelist: nodelist.partition("[")[0]),
     "you kept the prefix and dropped the bracket's numbers"),
    (mistake(host=lambda nodelist: nodelist),
     "you returned the whole node list"),
    (lambda env: {**launch_info(env), "master_addr": env["SLURMD_NODENAME"]}
     if launch_info(env)["launcher"] == "slurm" else launch_info(env),
     "this task's own node (SLURMD_NODENAME)"),
    (mistake(port=int), "you returned the job id itself"),
    (mistake(port=lambda job: 29500), "that is torchrun's default port"),
    (mistake(as_text=True), "a str: environment variables are text"),
    (lambda env: launch_info(), "read them from env, the argument (not os.environ)"),
    (lambda env: {**launch_info(env), "master_port": launch_info(env)["master_port"] or 29500},
     "writes no rendezvous port: return None"),
    (lambda env: {**launch_info(env), "master_addr": "localhost"}
     if launch_info(env)["launcher"] == "single" else launch_info(env),
     "with no launcher this is a world of one"),
    (lambda env: tuple(launch_info(env).values()), "return a dict with the keys"),
    (lambda env: {**launch_info(env), "launcher": "mpi"} if "PMI_RANK" in env
     else launch_info(env), "name the launcher as train.detect_launcher does"),
    (mistake(exported=("MASTER_PORT",)),
     "master_addr: expected 'node02', got 'node01'\nHint: the job script exported "
     "MASTER_ADDR=node02: an exported value overrides what SLURM's variables give"),
    (mistake(exported=("MASTER_ADDR",)), "Hint: the job script exported MASTER_PORT=29512"),
    (mistake(mpi_port=None), "master_port: expected 29510, got None"),
    (mistake(mpi_port=str), "you returned master_port '29510', a str"),
    (mistake(port=lambda job: 10000 + int(job)), "you added the whole job id, not its last four "
                                                 "digits"),
    (mistake(world="LOCAL_WORLD_SIZE"), "you read world_size from LOCAL_WORLD_SIZE (4); "
                                        "torchrun's world size is WORLD_SIZE (12 here)"),
    (mistake(slurm_rank="SLURM_NODEID"), "SLURM's rank is SLURM_PROCID (5 here)"),
])
def test_every_usual_mistake_is_named(function, said):
    with pytest.raises(CheckFailed) as failed:
        checks.check_init_from_launcher(function, launchers=())
    assert said in str(failed.value), str(failed.value)


def test_a_crash_names_the_launcher_and_its_variables():
    def mpich_only(env):
        if "RANK" in env or "PMI_RANK" in env:
            return launch_info(env)
        return {"rank": int(env["PMI_RANK"])}
    with pytest.raises(CheckFailed) as failed:
        checks.check_init_from_launcher(mpich_only, launchers=())
    message = str(failed.value)
    assert "Open MPI's mpiexec" in message and "KeyError: 'PMI_RANK'" in message
    assert "This is Open MPI's mpiexec: rank OMPI_COMM_WORLD_RANK" in message, message


def test_a_mistake_on_a_real_torchrun_rank_is_named(monkeypatch):
    """Without the faked environments the real torchrun's ranks catch it (one node: the world
    size is not GROUP_WORLD_SIZE, the number of nodes)."""
    monkeypatch.setattr(checks, "FAKED", ())

    def group_world(env):
        return {**launch_info(env), "world_size": int(env["GROUP_WORLD_SIZE"])}
    with pytest.raises(CheckFailed) as failed:
        checks.check_init_from_launcher(group_world, launchers=("torchrun",))
    message = str(failed.value)
    assert "rank 0 of a real torchrun of 2 ranks" in message
    assert "you read world_size from GROUP_WORLD_SIZE" in message, message


def test_no_mpiexec_is_a_notice(monkeypatch, capsys):
    monkeypatch.setattr(checks, "mpiexec_path", lambda: None)
    assert checks.check_init_from_launcher(launch_info, launchers=("mpiexec",))
    assert "no mpiexec here" in capsys.readouterr().out


# ---------------------------------------------------------------- exercise 2
def pytorch_job(spec, *, workers=lambda n: n - 1, nproc=str, name="pytorch", gpus_in="limits",
               gpus=lambda spec: spec.resources.gpu, launcher=("torchrun",),
               always_a_worker=False):
    """The lab's answer, with knobs for the usual mistakes."""
    limits = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    requests = dict(limits)
    if spec.resources.gpu:
        (limits if gpus_in == "limits" else requests)[spec.resources.gpu_resource] = gpus(spec)
    container = {"name": name, "image": spec.image, "command": [*launcher, *spec.command],
                 "resources": {"limits": limits, "requests": requests}}

    def replica(count):
        return {"replicas": count, "restartPolicy": spec.restart_policy,
                "template": {"spec": {"containers": [copy.deepcopy(container)]}}}
    replicas = {"Master": replica(1)}
    if spec.nodes > 1 or always_a_worker:
        replicas["Worker"] = replica(workers(spec.nodes))
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": spec.name, "namespace": spec.namespace,
                         "annotations": {k8s.WORLD_SIZE_ANNOTATION: str(spec.world_size)}},
            "spec": {"nprocPerNode": nproc(spec.processes_per_node),
                     "pytorchReplicaSpecs": replicas}}


def job_mistake(**knobs):
    return lambda spec: pytorch_job(spec, **knobs)


def test_the_manifest_passes(capsys):
    assert checks.check_pytorch_job(pytorch_job)
    assert "passes the four layers" in capsys.readouterr().out


def tweaked(change):
    """The lab's manifest, then ``change(manifest, spec)`` made to it."""
    def fn(spec):
        manifest = pytorch_job(spec)
        change(manifest, spec)
        return manifest
    return fn


def each_replica(manifest):
    return manifest["spec"]["pytorchReplicaSpecs"].values()


def each_container(manifest):
    return [r["template"]["spec"]["containers"][0] for r in each_replica(manifest)]


def restart_on_failure(manifest, spec):
    for replica in each_replica(manifest):
        replica["restartPolicy"] = "OnFailure"


def latest_image(manifest, spec):
    for container in each_container(manifest):
        container["image"] = "pytorch/pytorch:latest"


def zero_gpus(manifest, spec):
    for container in each_container(manifest):
        container["resources"]["limits"]["nvidia.com/gpu"] = spec.resources.gpu


def torchrun_alone(manifest, spec):
    for container in each_container(manifest):
        container["command"] = ["torchrun"]


def nproc_is_the_world(manifest, spec):
    manifest["spec"]["nprocPerNode"] = str(spec.world_size)


def cpu_as_a_number(manifest, spec):
    for container in each_container(manifest):
        for part in container["resources"].values():
            part["cpu"] = int(part["cpu"])


def replicas_as_text(manifest, spec):
    for replica in each_replica(manifest):
        replica["replicas"] = str(replica["replicas"])


def kind_misspelled(manifest, spec):
    manifest["kind"] = "PytorchJob"


@pytest.mark.parametrize("change, said", [
    (restart_on_failure, "Master: restartPolicy expected 'Never', got 'OnFailure'"),
    (latest_image, "got 'pytorch/pytorch:latest'\nHint: the image is spec.image"),
    (zero_gpus, "case 3/3 (4 nodes x 1 process, CPUs only: digits-cpu)"),
    (zero_gpus, "the description asks for no GPUs: leave the GPU resource out"),
    (torchrun_alone, "got ['torchrun']\nHint: the program and its arguments are spec.command"),
    (nproc_is_the_world, "nprocPerNode counts the processes of one pod"),
    (cpu_as_a_number, "Hint: a cpu or memory quantity is a number in yours"),
    (replicas_as_text, "Master.replicas: '1' is not of type 'integer' [crd]"),
    (replicas_as_text, "a number of replicas is an int in the manifest, not text"),
    (kind_misspelled, "Hint: the kind is the CRD's name, letter for letter: PyTorchJob."),
])
def test_more_manifest_mistakes_are_named(change, said):
    with pytest.raises(CheckFailed) as failed:
        checks.check_pytorch_job(tweaked(change))
    assert said in str(failed.value), str(failed.value)
    assert "it starts None processes" not in str(failed.value)


@pytest.mark.parametrize("function, said", [
    (job_mistake(workers=lambda n: n), "the job was described with 8 processes but its replicas "
                                       "x processes per pod give 12 [rules]"),
    (job_mistake(workers=lambda n: n), "Worker replicas = nodes - 1"),
    (job_mistake(nproc=int), "spec.nprocPerNode: 4 is not of type 'string' [crd]"),
    (job_mistake(nproc=int), "nprocPerNode is a string in the CRD"),
    (job_mistake(name="trainer"), "no container named 'pytorch' in Master"),
    (job_mistake(gpus_in="requests"), "GPUs go in limits"),
    (job_mistake(gpus=lambda spec: spec.world_size), "is per pod: spec.resources.gpu (4)"),
    (job_mistake(launcher=("python",)), "torchrun starts nprocPerNode processes"),
    (job_mistake(always_a_worker=True), "Worker.replicas: 0: a PyTorchJob's Worker replicas "
                                        "must be at least 1"),
    (job_mistake(always_a_worker=True), "with one node the Master is the whole job"),
    (lambda spec: {**pytorch_job(spec), "apiVersion": "kubeflow.org/v2"},
     "apiVersion: 'kubeflow.org/v2': a PyTorchJob here is 'kubeflow.org/v1' [crd]"),
])
def test_every_usual_manifest_mistake_is_named(function, said):
    with pytest.raises(CheckFailed) as failed:
        checks.check_pytorch_job(function)
    assert said in str(failed.value), str(failed.value)


def test_stubs_are_a_notice():
    def stub(*args):
        raise NotImplementedError("exercise 1: fill in init_from_launcher")
    assert checks.check_init_from_launcher(stub) is False
    assert checks.check_pytorch_job(stub) is False
