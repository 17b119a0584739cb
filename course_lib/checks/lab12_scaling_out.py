"""Checks for labs/12_scaling_out.ipynb: a launcher's environment read right, and a PyTorchJob
that validates (notebook 12).

In the lab, under each exercise::

    from course_lib.checks import lab12_scaling_out as checks
    checks.check_init_from_launcher(init_from_launcher)   # faked environments, then real launchers
    checks.check_pytorch_job(pytorch_job)                 # the validator, then the description

``init_from_launcher(env)`` reads what a launcher wrote in the environment ``env`` and returns a
dict: ``launcher`` ("torchrun", "slurm", "mpiexec" or "single", as ``train.detect_launcher``
names them), ``rank``, ``world_size``, ``local_rank`` (ints), ``master_addr`` and
``master_port`` (an int, or None where the launcher gives none: MPI, a single process). It is
compared with :func:`reference_init_from_launcher` (``train.detect_launcher``,
``train.slurm_rendezvous``) on environments written as each launcher writes them (torchrun on
three nodes, torchrun started by srun, MPICH and Open MPI on two hosts, SLURM tasks on several
node lists and under a job script that exports MASTER_ADDR and MASTER_PORT, no launcher), then
on every rank of a real ``torchrun --nproc-per-node 2`` and a real
``mpiexec -n 2`` (a notice, not a failure, without mpiexec). The function reaches the ranks with
cloudpickle; each rank runs it and the reference on its own environment and writes both to a
file; both launchers run under a deadline. A wrong field is traced to the variable it was read
from ("you read local_rank from RANK"), and a wrong SLURM rendezvous to the way the node list
was cut ("node[01-03", "node1").

``pytorch_job(spec)`` returns a Kubeflow PyTorchJob (a dict) for a ``k8s.JobSpec``. The check runs
the course's validator (``k8s_validate.validate``) and quotes every problem with its field path,
then compares the manifest with ``k8s.pytorch_job(spec)``: world size, replicas of each type,
``nprocPerNode``, the container's name, image, command and resources, the restart policy.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import textwrap
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

from course_lib import k8s, train
from course_lib.checks.framework import CheckFailed, not_implemented, pack_function
from course_lib.k8s.validate import validate
from course_lib.runtime.launch import mpiexec_path, run_ranks

FIELDS = ("launcher", "rank", "world_size", "local_rank", "master_addr", "master_port")
LOCALHOST = "127.0.0.1"
MODULE = "course_lib.checks.lab12_scaling_out"  # what the ranks of the real launches run
LAUNCH_TIMEOUT = 60.0  # seconds for each real launch (a couple are enough on 2 cores)
MPI_VARIABLES = {"MPICH": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
                 "Open MPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                              "OMPI_COMM_WORLD_LOCAL_RANK")}
# what the launchers write: shown in messages, and removed from the environment the real
# launchers are started with (a notebook inside a SLURM job must not look like a SLURM task)
LAUNCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "HOSTNAME")
LAUNCH_PREFIXES = ("SLURM", "PMI", "OMPI", "MPI_LOCAL", "GROUP_", "ROLE_", "TORCHELASTIC")


def reference_init_from_launcher(env: Mapping[str, str] | None = None) -> dict:
    """The course's answer to exercise 1: the launcher as ``train.detect_launcher`` finds it,
    then its variables; SLURM's rendezvous as ``train.slurm_rendezvous`` computes it; under MPI
    ``MASTER_ADDR`` or loopback and no port (rank 0 picks one and MPI tells the others, as
    ``comm.init_torch_from_launcher`` does). Introduced in notebooks/12_scaling_out.ipynb."""
    env = os.environ if env is None else env
    launcher = train.detect_launcher(env)  # a mapping given: the cluster's engine is not asked
    if launcher == "torchrun":
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
        addr, port = env.get("MASTER_ADDR", LOCALHOST), int(env["MASTER_PORT"])
    elif launcher == "slurm":
        rank, world, addr, port = train.slurm_rendezvous(env)
        local = int(env.get("SLURM_LOCALID", 0))
    elif launcher == "mpiexec":
        names = MPI_VARIABLES[_mpi_flavour(env) or "MPICH"]
        rank, world, local = int(env[names[0]]), int(env[names[1]]), int(env.get(names[2], 0))
        addr = env.get("MASTER_ADDR", LOCALHOST)
        port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None
    else:
        rank, world, local, addr, port = 0, 1, 0, LOCALHOST, None
    return {"launcher": launcher, "rank": rank, "world_size": world, "local_rank": local,
            "master_addr": addr, "master_port": port}


def _mpi_flavour(env):
    return next((f for f, names in MPI_VARIABLES.items() if names[0] in env), None)


def launcher_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that a launcher writes (torchrun's, MPI's, SLURM's), sorted.
    Introduced in notebooks/12_scaling_out.ipynb."""
    return {k: env[k] for k in sorted(env) if k in LAUNCH_NAMES or k.startswith(LAUNCH_PREFIXES)}


# ---------------------------------------------------------------- environments as launchers write
def _slurm(nodelist, ntasks, per_node, procid, job_id, submit_host="login1"):
    node = procid // per_node
    host = train.hostnames(nodelist)[node]
    nnodes = len(train.hostnames(nodelist))
    return {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": nodelist,
            "SLURM_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
            "SLURM_NNODES": str(nnodes), "SLURM_JOB_NUM_NODES": str(nnodes),
            "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
            "SLURM_NTASKS_PER_NODE": str(per_node),
            "SLURM_TASKS_PER_NODE": f"{per_node}(x{nnodes})", "SLURM_PROCID": str(procid),
            "SLURM_LOCALID": str(procid % per_node), "SLURM_NODEID": str(node),
            "SLURMD_NODENAME": host, "SLURM_SUBMIT_HOST": submit_host, "HOSTNAME": host,
            "HOME": "/home/student", "PATH": "/usr/bin:/bin"}


def _torchrun(nodes, per_node, rank, master="node01", port=29500, host="node03"):
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node),
            "WORLD_SIZE": str(nodes * per_node), "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(rank // per_node), "GROUP_WORLD_SIZE": str(nodes),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nodes * per_node),
            "ROLE_NAME": "default", "MASTER_ADDR": master, "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "job42", "TORCHELASTIC_RESTART_COUNT": "0", "HOSTNAME": host,
            "HOME": "/home/student", "PATH": "/usr/bin:/bin"}


FAKED = (
    ("torchrun on 3 nodes x 4 processes, rank 9 (node 2, local rank 1)",
     _torchrun(3, 4, 9)),
    ("srun started one torchrun per node (2 nodes x 4 processes), rank 6",
     {**_slurm("node[01-02]", 2, 1, 1, 4242),
      **_torchrun(2, 4, 6, port=29400, host="node02")}),
    ("MPICH's mpiexec on 2 hosts x 4 (-genv MASTER_ADDR hostA), rank 5",
     {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4",
      "PMI_FD": "11", "PMI_HOSTNAME": "hostB", "MASTER_ADDR": "hostA", "HOSTNAME": "hostB",
      "HOME": "/home/student", "PATH": "/usr/bin:/bin"}),
    ("Open MPI's mpiexec on 2 hosts x 4 (-x MASTER_ADDR=hostA -x MASTER_PORT=29510), rank 6",
     {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
      "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_UNIVERSE_SIZE": "8", "PMIX_RANK": "6",
      "MASTER_ADDR": "hostA", "MASTER_PORT": "29510", "HOSTNAME": "hostB", "HOME": "/home/student",
      "PATH": "/usr/bin:/bin"}),
    # tasks whose own node is neither the first, the last nor the end of the first range
    ("SLURM, node[01-03,07], 3 tasks per node, task 5", _slurm("node[01-03,07]", 12, 3, 5, 4242)),
    ("SLURM, gpu-a[9-11],gpu-b1, 5 tasks per node, task 7",
     _slurm("gpu-a[9-11],gpu-b1", 20, 5, 7, 987654321)),
    ("SLURM, one host (cn7), 2 tasks, task 1", _slurm("cn7", 2, 2, 1, 77)),
    ("SLURM, node[01-02] x 2 tasks, a job script that exports MASTER_ADDR=node02 and "
     "MASTER_PORT=29512, task 3",
     {**_slurm("node[01-02]", 4, 2, 3, 5151), "MASTER_ADDR": "node02", "MASTER_PORT": "29512"}),
    ("no launcher: one process", {"HOSTNAME": "laptop", "HOME": "/home/student",
                                  "PATH": "/usr/bin:/bin"}),
)


# ---------------------------------------------------------------- what a wrong answer did
def _who(env, launcher):
    """The launcher in words, and where it puts each field."""
    if launcher == "torchrun":
        return "torchrun", {"rank": "RANK", "world_size": "WORLD_SIZE",
                            "local_rank": "LOCAL_RANK", "master_addr": "MASTER_ADDR",
                            "master_port": "MASTER_PORT"}
    if launcher == "slurm":
        return "SLURM", {"rank": "SLURM_PROCID", "world_size": "SLURM_NTASKS",
                         "local_rank": "SLURM_LOCALID",
                         "master_addr": "MASTER_ADDR" if "MASTER_ADDR" in env
                         else "the first host of SLURM_JOB_NODELIST",
                         "master_port": "MASTER_PORT" if "MASTER_PORT" in env
                         else "10000 + SLURM_JOB_ID % 10000"}
    if launcher == "mpiexec":
        flavour = _mpi_flavour(env) or "MPICH"
        rank, size, local = MPI_VARIABLES[flavour]
        return f"{flavour}'s mpiexec", {
            "rank": rank, "world_size": size, "local_rank": local,
            "master_addr": "MASTER_ADDR" if "MASTER_ADDR" in env else f"{LOCALHOST} (MASTER_ADDR "
            "is not set)",
            "master_port": "MASTER_PORT" if "MASTER_PORT" in env else "None: MPI gives no port "
            "(rank 0 picks a free one and MPI tells the others)"}
    return "no launcher", {"rank": "0", "world_size": "1", "local_rank": "0",
                           "master_addr": LOCALHOST, "master_port": "None"}


def _read_from(env, value):
    """The variables of ``env`` that hold ``value`` (as text)."""
    return [k for k, v in launcher_variables(env).items() if v == str(value)]


def _nodelist_hint(env, got):
    """What cutting the SLURM node list some usual wrong way gives, if ``got`` is one of them."""
    nodelist = env.get("SLURM_JOB_NODELIST", "")
    names = train.hostnames(nodelist)
    first = names[0]
    prefix, _, ranges = nodelist.partition(",")[0].partition("[")
    digits = first[len(prefix):]
    ways = {nodelist: "you returned the whole node list",
            nodelist.split(",")[0]: "you cut the list at its first comma, which here is inside "
                                    "the brackets",
            nodelist.partition("[")[0]: "you kept the prefix and dropped the bracket's numbers",
            names[-1]: "that is the last host of the list",
            env.get("SLURMD_NODENAME"): "that is this task's own node (SLURMD_NODENAME): every "
                                        "task must name the same host",
            env.get("SLURM_SUBMIT_HOST"): "that is the host the job was submitted from "
                                          "(SLURM_SUBMIT_HOST), not one of the job's nodes"}
    if digits.isdigit() and str(int(digits)) != digits:
        ways[prefix + str(int(digits))] = (f"the zero padding was lost: {prefix}{int(digits)}, "
                                           f"but the host is {first} (keep the digits as text)")
    if ranges and "-" in ranges:
        end = ranges.split(",")[0].split("-")[1].rstrip("]")
        ways.setdefault(prefix + end, "that is the end of the first range, not its start")
    said = ways.get(got, "")
    return (f"{said}. " if said else "") + (
        f"For SLURM the rendezvous is the FIRST host of the expanded node list: {nodelist} -> "
        f"{first} (it expands to {', '.join(names)}), you returned {got!r}.")


def _field_hint(env, launcher, field, expected, got):
    name, where = _who(env, launcher)
    if isinstance(expected, int) and isinstance(got, str) and got == str(expected):
        return (f"you returned {field} {got!r}, a str: environment variables are text, "
                f"convert with int(...)")
    if field in ("master_addr", "master_port") and launcher == "slurm" and \
            field.upper() in env:
        return (f"the job script exported {field.upper()}={env[field.upper()]}: an exported "
                f"value overrides what SLURM's variables give (as in train.slurm_rendezvous); "
                f"you returned {got!r}.")
    if field == "master_addr" and launcher == "slurm" and "MASTER_ADDR" not in env:
        return _nodelist_hint(env, got)
    if field == "master_port" and launcher == "slurm" and "MASTER_PORT" not in env:
        job = env.get("SLURM_JOB_ID", "0")
        said = {int(job): "you returned the job id itself, which may be beyond 65535",
                10000 + int(job): "you added the whole job id, not its last four digits (% "
                                  "10000): beyond 65535 for a large job id",
                29500: "that is torchrun's default port; SLURM writes no port"}.get(got, "")
        return (f"{said + '. ' if said else ''}SLURM gives no port: every task computes the "
                f"same one from the job id, 10000 + SLURM_JOB_ID % 10000 = {expected} (below "
                "the ports Linux hands out to outgoing connections), as "
                "train.slurm_rendezvous does.")
    if launcher == "single":
        return ("with no launcher this is a world of one: rank 0, world size 1, local rank 0, "
                f"master_addr {LOCALHOST!r} and no port (None).")
    if field == "master_port" and expected is None:
        return (f"{name} writes no rendezvous port: return None (rank 0 picks a free port and "
                "MPI tells the others, as comm.init_torch_from_launcher does).")
    wrong = [k for k in _read_from(env, got) if k != where[field]]
    source = f"you read {field} from {' or '.join(wrong)} ({got!r}); " if wrong else ""
    return f"{source}{name}'s {field.replace('_', ' ')} is {where[field]} ({expected!r} here)."


def _launcher_hint(env, expected, got):
    if got not in train.LAUNCHERS:
        return (f"name the launcher as train.detect_launcher does: 'torchrun', 'slurm', "
                f"'mpiexec' or 'single', not {got!r}.")
    if expected == "torchrun" and got == "slurm":
        return ("torchrun's variables (RANK, MASTER_PORT) and SLURM's are both set: srun started "
                "one torchrun per node, and torchrun started this process. The process's rank "
                "is torchrun's (SLURM_PROCID counts the torchruns): look for torchrun first, "
                "as train.detect_launcher does.")
    if expected == "mpiexec":
        name, where = _who(env, expected)
        return (f"this is {name}: it writes {where['rank']}, {where['world_size']} and "
                f"{where['local_rank']}. Look for both MPIs: MPICH's PMI_RANK, PMI_SIZE, "
                "MPI_LOCALRANKID and Open MPI's OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK.")
    if got == "single":
        return (f"the environment holds {', '.join(launcher_variables(env))}: read them from "
                "env, the argument (not os.environ), in train.detect_launcher's order: torchrun "
                "(RANK and MASTER_PORT), SLURM (SLURM_PROCID and SLURM_NTASKS), MPI (PMI_RANK "
                "or OMPI_COMM_WORLD_RANK), else a single process.")
    return ("train.detect_launcher's order: torchrun (RANK and MASTER_PORT), SLURM (SLURM_PROCID "
            "and SLURM_NTASKS), MPI (PMI_RANK or OMPI_COMM_WORLD_RANK), else \"single\".")


def _mismatch(env, expected, got):
    """``(what differs, hint)`` for a wrong answer, or None when it is right."""
    if not isinstance(got, Mapping):
        return (f"your function returned {type(got).__name__} {got!r:.80}",
                f"return a dict with the keys {', '.join(FIELDS)}")
    missing = [f for f in FIELDS if f not in got]
    if missing:
        return (f"your dict has no {', '.join(map(repr, missing))}",
                f"return a dict with the keys {', '.join(FIELDS)}")
    if got["launcher"] != expected["launcher"]:
        return (f"launcher: expected {expected['launcher']!r}, got {got['launcher']!r}",
                _launcher_hint(env, expected["launcher"], got["launcher"]))
    wrong = [f for f in FIELDS[1:] if got[f] != expected[f]
             or type(got[f]) is not type(expected[f])]
    if not wrong:
        return None
    lines = "\n  ".join(f"{f}: expected {expected[f]!r}, got {got[f]!r}" for f in wrong)
    return lines, _field_hint(env, expected["launcher"], wrong[0], expected[wrong[0]],
                              got[wrong[0]])


def _environment(env):
    shown = " ".join(f"{k}={v}" for k, v in launcher_variables(env).items()
                     if not k.startswith("TORCHELASTIC"))  # torchrun's own bookkeeping
    return textwrap.fill(f"the environment: {shown or '(no launcher variables)'}", 96,
                         initial_indent="  ", subsequent_indent="    ", break_long_words=False,
                         break_on_hyphens=False)


def _error_hint(env, launcher, error):
    if isinstance(error, KeyError) or str(error).startswith("KeyError"):
        name, where = _who(env, launcher)
        return (f"a variable your function read is not set here. This is {name}: rank "
                f"{where['rank']}, world size {where['world_size']}, local rank "
                f"{where['local_rank']}; look for each launcher's variables before reading them.")
    return "read the variables of the launcher that wrote them (the table above the exercise)."


# ---------------------------------------------------------------- on every rank of a real launch
def rank_main(function_file: str, out_dir: str) -> None:
    """What each rank of the real launches runs (``python -m course_lib.checks.lab12_scaling_out
    FUNCTION_FILE OUT_DIR``): the student's function (cloudpickled) and the reference on this
    process's environment, written to ``OUT_DIR/rank<N>.json``.
    Introduced in notebooks/12_scaling_out.ipynb."""
    import cloudpickle
    env = dict(os.environ)
    expected = reference_init_from_launcher(env)
    record = {"env": launcher_variables(env), "expected": expected}
    try:
        with open(function_file, "rb") as f:
            got = cloudpickle.load(f)(dict(env))
        record["got"] = got if isinstance(got, dict) else repr(got)
    except Exception as error:  # noqa: BLE001 - the student's error goes back to the notebook
        record["got"] = None
        record["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
    with open(Path(out_dir, f"rank{expected['rank']}.json"), "w") as f:
        json.dump(record, f, default=repr)  # what JSON cannot carry comes back as text


def launch_environment() -> dict[str, str]:
    """This process's environment without any launcher's variables, and with the repository on
    PYTHONPATH: what the real launches of the check start from.
    Introduced in notebooks/12_scaling_out.ipynb."""
    env = {k: v for k, v in os.environ.items() if k not in launcher_variables(os.environ)}
    root = str(Path(train.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _run_real(fn, launcher, world_size, timeout):
    """Every rank's record of a real launch, in rank order; CheckFailed if the launch fails."""
    with tempfile.TemporaryDirectory(prefix="course-lab12-") as tmp:
        function_file = Path(tmp, "function.pkl")
        function_file.write_bytes(pack_function(fn))
        args = ["-m", MODULE, str(function_file), tmp]
        try:
            run_ranks(launcher, world_size, args, env=launch_environment(), timeout=timeout)
        except RuntimeError as error:
            raise CheckFailed(f"check_init_from_launcher: under a real {launcher} of "
                              f"{world_size} ranks:\n  {error}\nHint: each rank runs your "
                              "function on its own environment; it must return, not wait "
                              "or exit.") from None
        records = [json.loads(Path(tmp, f"rank{r}.json").read_text())
                   for r in range(world_size) if Path(tmp, f"rank{r}.json").exists()]
    if len(records) != world_size:
        raise CheckFailed(f"check_init_from_launcher: under {launcher}, {len(records)} of "
                          f"{world_size} ranks reported back")
    return records


def check_init_from_launcher(init_from_launcher: Callable, launchers: tuple[str, ...] = (
        "torchrun", "mpiexec"), world_size: int = 2, timeout: float = LAUNCH_TIMEOUT) -> bool:
    """``init_from_launcher(env)`` against the reference on the faked environments of
    :data:`FAKED`, then on every rank of real ``launchers`` of ``world_size`` ranks (mpiexec:
    skipped with a notice where there is none). Introduced in notebooks/12_scaling_out.ipynb."""
    __tracebackhide__ = True
    name = "check_init_from_launcher"
    for number, (label, env) in enumerate(FAKED, start=1):
        where = f"{name}: case {number}/{len(FAKED)} ({label})"
        expected = reference_init_from_launcher(env)
        try:
            got = init_from_launcher(dict(env))
        except NotImplementedError:
            return not_implemented(name)
        except Exception as error:
            raise CheckFailed(f"{where}\n{_environment(env)}\n  your function raised "
                              f"{type(error).__name__}: {error}\nHint: "
                              f"{_error_hint(env, expected['launcher'], error)}") from error
        problem = _mismatch(env, expected, got)
        if problem:
            raise CheckFailed(f"{where}\n{_environment(env)}\n  {problem[0]}\n"
                              f"Hint: {problem[1]}")
    shown = []
    for launcher in launchers:
        if launcher == "mpiexec" and mpiexec_path() is None:
            print(f"… {name}: no mpiexec here (pip install mpich): the real mpiexec run was "
                  "skipped")
            continue
        for record in _run_real(init_from_launcher, launcher, world_size, timeout):
            env, expected = record["env"], record["expected"]
            where = f"{name}: rank {expected['rank']} of a real {launcher} of {world_size} ranks"
            if "error" in record:
                raise CheckFailed(f"{where}\n{_environment(env)}\n  your function raised "
                                  f"{record['error']}\nHint: "
                                  f"{_error_hint(env, launcher, record['error'])}")
            problem = _mismatch(env, expected, record["got"])
            if problem:
                raise CheckFailed(f"{where}\n{_environment(env)}\n  {problem[0]}\n"
                                  f"Hint: {problem[1]}")
            shown.append(f"  {launcher:>8} rank {expected['rank']}: {record['got']}")
    print(f"✓ {name}: {len(FAKED)} launchers' environments match the reference"
          + (", and every rank of the real launches:\n" + "\n".join(shown) if shown else ""))
    return True


# ---------------------------------------------------------------- exercise 2: a PyTorchJob
IMAGE = "pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime"
JOBS = (
    ("2 nodes x 4 GPUs", k8s.JobSpec(
        "digits-ddp", image=IMAGE, command=["-m", "course_lib.train", "--steps", "200"],
        nodes=2, processes_per_node=4, resources=k8s.Resources(cpu="8", memory="32Gi", gpu=4))),
    ("1 node x 2 GPUs, never restarted", k8s.JobSpec(
        "digits-one", image=IMAGE, command=["train.py", "--epochs", "3"], nodes=1,
        processes_per_node=2, resources=k8s.Resources(cpu="4", memory="16Gi", gpu=2),
        restart_policy="Never")),
    ("4 nodes x 1 process, CPUs only", k8s.JobSpec(
        "digits-cpu", image="python:3.12-slim", command=["-m", "course_lib.train"], nodes=4,
        processes_per_node=1, resources=k8s.Resources(cpu="2", memory="4Gi"),
        restart_policy="ExitCode")),
)

# the validator's problems that have a usual cause: (text in the problem, what to do)
PROBLEM_HINTS = (
    ("nprocPerNode: ", "nprocPerNode is a string in the CRD (it may also be 'auto', 'cpu' or "
                       "'gpu'): str(spec.processes_per_node)"),
    ("no container named 'pytorch'", "the operator finds the training container by its name, "
                                     "'pytorch', and sets its port and environment only there"),
    ("Worker replicas must be at least 1", "with one node the Master is the whole job: leave "
                                           "the Worker replica spec out"),
    ("unknown replica type", "a PyTorchJob's replica types are Master and Worker"),
    ("is not a restart policy", "the restart policy is the description's: spec.restart_policy"),
    ("is not a Kubernetes quantity", "copy the description's quantities as they are "
                                     "(spec.resources.cpu, .memory: 8, 32Gi)"),
    ("is not of type 'array'", "a container's command is a list: ['torchrun', *spec.command]"),
    ("a PyTorchJob has exactly one Master", "one Master pod (its name is MASTER_ADDR), the other "
                                            "nodes - 1 pods are Workers"),
    ("replicas: ", "a number of replicas is an int in the manifest, not text"),
    ("unknown kind", "the kind is the CRD's name, letter for letter: PyTorchJob"),
)


def _container(manifest, rtype):
    containers = k8s.lookup(manifest, "spec", "pytorchReplicaSpecs", rtype, "template", "spec",
                            "containers", default=[])
    named = [c for c in containers if isinstance(c, dict) and c.get("name") == "pytorch"]
    return named[0] if named else (containers[0] if containers else {})


def _replicas(manifest):
    specs = k8s.lookup(manifest, "spec", "pytorchReplicaSpecs", default={})
    return {t: k8s.replica_count(r) for t, r in specs.items()} if isinstance(specs, dict) else {}


def _job_differences(spec, expected, got):
    """``[(what differs, hint)]`` between the student's manifest and the reference's."""
    found = []
    world, want = k8s.world_size(got), spec.world_size
    replicas, nproc = _replicas(got), k8s.as_int(k8s.lookup(got, "spec", "nprocPerNode"))
    if (world is not None and world != want) or replicas != _replicas(expected):
        pods = " + ".join(f"{t} {n}" for t, n in replicas.items())
        if replicas.get("Worker") == spec.nodes:
            hint = ("the Master pod is one of the nodes: Worker replicas = nodes - 1 (no Worker "
                    "spec at all for one node)")
        elif nproc == spec.world_size and spec.nodes > 1:
            hint = "nprocPerNode counts the processes of one pod: spec.processes_per_node"
        else:
            hint = ("one Master pod and nodes - 1 Worker pods, each running nprocPerNode = "
                    "processes_per_node processes")
        found.append((f"it starts {world} processes ({pods} pods x nprocPerNode {nproc}); the "
                      f"description asks for {spec.nodes} nodes x {spec.processes_per_node} = "
                      f"{want} (replicas expected {_replicas(expected)}, got {replicas})", hint))
    for rtype in _replicas(expected):
        mine, theirs = _container(got, rtype), _container(expected, rtype)
        if not mine:
            continue
        at = f"{rtype}'s container"
        command = mine.get("command")
        if command != theirs["command"]:
            hint = ("torchrun starts nprocPerNode processes of the program in each pod (it "
                    "reads PET_NPROC_PER_NODE): ['torchrun', *spec.command]"
                    if not command or command[0] != "torchrun"
                    else "the program and its arguments are spec.command, after 'torchrun'")
            found.append((f"{at}: command expected {theirs['command']}, got {command}", hint))
        if mine.get("image") != spec.image:
            found.append((f"{at}: image expected {spec.image!r}, got {mine.get('image')!r}",
                          "the image is spec.image"))
        res, want_res = mine.get("resources", {}), theirs["resources"]
        if res != want_res:
            gpu = spec.resources.gpu_resource
            limits, requests = res.get("limits") or {}, res.get("requests") or {}
            if spec.resources.gpu and gpu not in limits and gpu in requests:
                hint = (f"GPUs go in limits: {gpu} is an extended resource, which cannot be "
                        "overcommitted, and Kubernetes refuses a request for one without a limit")
            elif spec.resources.gpu and limits.get(gpu) == spec.world_size:
                hint = (f"{gpu} is per pod: spec.resources.gpu ({spec.resources.gpu}), not the "
                        f"job's {spec.world_size}")
            elif not spec.resources.gpu and (gpu in limits or gpu in requests):
                hint = "the description asks for no GPUs: leave the GPU resource out"
            elif any(not isinstance(v, str) for part in (limits, requests)
                     for k, v in part.items() if k in ("cpu", "memory")):
                hint = ("a cpu or memory quantity is a number in yours: Kubernetes quantities "
                        "are written as text ('8', '32Gi'), as the description holds them")
            else:
                hint = ("requests equal to limits for cpu and memory (spec.resources.cpu, "
                        ".memory), the GPUs (spec.resources.gpu_resource) in limits only, when "
                        "there are any")
            found.append((f"{at}: resources expected {want_res}, got {res}", hint))
        policy = k8s.lookup(got, "spec", "pytorchReplicaSpecs", rtype, "restartPolicy")
        if policy != spec.restart_policy:
            found.append((f"{rtype}: restartPolicy expected {spec.restart_policy!r}, got "
                          f"{policy!r}", "the restart policy is the description's: "
                                         "spec.restart_policy"))
    return found


def check_pytorch_job(pytorch_job: Callable) -> bool:
    """``pytorch_job(spec)`` passes the course's validator and matches ``k8s.pytorch_job(spec)``
    on every description of :data:`JOBS`. Introduced in notebooks/12_scaling_out.ipynb."""
    __tracebackhide__ = True
    name = "check_pytorch_job"
    for number, (label, spec) in enumerate(JOBS, start=1):
        where = f"{name}: case {number}/{len(JOBS)} ({label}: {spec.name})"
        try:
            got = pytorch_job(copy.deepcopy(spec))
        except NotImplementedError:
            return not_implemented(name)
        except Exception as error:
            raise CheckFailed(f"{where}\n  your function raised {type(error).__name__}: "
                              f"{error}\nHint: build the dict from spec's fields") from error
        if not isinstance(got, dict):
            raise CheckFailed(f"{where}\n  your function returned {type(got).__name__}, not a "
                              "dict\nHint: return the manifest as a dict")
        problems = validate(got)
        differences = _job_differences(spec, k8s.pytorch_job(spec), got)
        if not problems and not differences:
            continue
        lines, hints = [], []
        if problems:
            lines.append(f"the validator finds {len(problems)} problem(s):")
            lines += [f"  - {p.path or '(top)'}: {p.message} [{p.layer}]" for p in problems]
            hints += [h for text, h in PROBLEM_HINTS if any(text in str(p) for p in problems)]
        if differences:
            lines.append("against the description:" if problems else
                         "it validates, but against the description:")
            lines += [f"  - {what}" for what, _ in differences]
            hints += [h for _, h in differences]
        hints = list(dict.fromkeys(hints)) or ["each problem names the field (its path) and "
                                               "what Kubernetes or the operator says of it"]
        body = "\n  ".join(lines)
        raise CheckFailed(f"{where}\n  {body}\nHint: " + "; ".join(hints) + ".")
    print(f"✓ {name}: {len(JOBS)} descriptions, each manifest passes the four layers of "
          "k8s_validate and matches k8s.pytorch_job")
    return True


if __name__ == "__main__":  # a rank of the real launches: see rank_main
    rank_main(*sys.argv[1:3])
