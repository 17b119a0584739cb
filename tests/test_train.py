"""One training script under every launcher: the same losses and parameters, bit for bit, from
the local cluster, torchrun, mpiexec, the environment srun gives its tasks, and two hosts."""

import json
import os
import subprocess
import sys

import pytest

from course_lib import train
from course_lib.runtime import hosts
from course_lib.runtime.launch import mpiexec_path

STEPS = 6


@pytest.fixture(scope="module")
def reference(cluster):
    return cluster.run(train.train, STEPS)[0]


def test_detect_launcher_and_slurm_rendezvous():
    assert train.detect_launcher({"RANK": "1", "MASTER_PORT": "29500"}) == "torchrun"
    assert train.detect_launcher({"PMI_RANK": "0"}) == "mpiexec"
    assert train.detect_launcher({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}) == "slurm"
    assert train.detect_launcher({}) == "single"
    assert train.first_host("node[03-05,09],gpu1") == "node03"
    assert train.first_host("login7") == "login7"
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[12-13]",
           "SLURM_JOB_ID": "123456"}
    assert train.slurm_rendezvous(env) == (3, 8, "gpu12", 10000 + 123456 % 10000)


def test_hostnames_expand_a_node_list_as_scontrol_does():
    assert train.hostnames("node[01-03,07],gpu1") == ["node01", "node02", "node03", "node07",
                                                      "gpu1"]
    assert train.hostnames("gpu-a[9-11],gpu-b1") == ["gpu-a9", "gpu-a10", "gpu-a11", "gpu-b1"]
    assert train.hostnames("n[08-10]") == ["n08", "n09", "n10"]
    assert train.hostnames("login7") == ["login7"]
    for nodelist in ("node[03-05,09],gpu1", "a[1-2],b[3-4]", "x"):
        assert train.hostnames(nodelist)[0] == train.first_host(nodelist)


def test_the_cluster_trains(reference):
    assert reference["launcher"] == "cluster" and reference["world_size"] == 2
    assert reference["losses"][-1] < reference["losses"][0]


@pytest.mark.parametrize("way", ["torchrun", "mpiexec"])
def test_launchers_give_the_same_run(reference, way):
    if way == "mpiexec" and mpiexec_path() is None:
        pytest.skip("no mpiexec: pip install -c constraints.txt mpich mpi4py")
    result = train.launch(way, 2, STEPS, timeout=120)
    assert result["launcher"] == way and result["world_size"] == 2
    assert (result["losses"], result["params_sha256"]) == (reference["losses"],
                                                           reference["params_sha256"])


def test_the_environment_srun_gives_its_tasks(reference, tmp_path):
    out = tmp_path / "run.json"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "course_lib.train", "--steps", str(STEPS), "--out", str(out)],
        env={**os.environ, "SLURM_PROCID": str(r), "SLURM_NTASKS": "2",
             "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": str(os.getpid())},
        stdout=subprocess.DEVNULL) for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    result = json.loads(out.read_text())
    assert result["launcher"] == "slurm" and result["params_sha256"] == \
        reference["params_sha256"]


def test_make_hosts_torchrun_across_namespaces(reference):
    reason = hosts.unavailable_reason()
    if reason:
        pytest.skip(f"two hosts: {reason}")
    with hosts.make_hosts() as (a, b):
        assert a.run(["hostname"]).stdout.strip() == "hostA" and b.address.endswith(".2")
        assert f"{b.address} hostB" in a.run(["cat", "/etc/hosts"]).stdout
        sleeper = b.popen(["sleep", "60"])
    assert sleeper.wait(timeout=10) != 0  # killed with its host
    assert not os.path.exists(f"/var/run/netns/{a.netns}")  # and the host removed
    result = train.launch("two hosts", 2, STEPS, timeout=120)
    assert sorted(result["hosts"]) == ["hostA", "hostB"]
    assert result["params_sha256"] == reference["params_sha256"]
    with pytest.raises(ValueError, match="world_size must be 2"):
        train.launch("two hosts", 3)
    if mpiexec_path() is not None:  # MPICH's launcher reaches hostB through an rsh of hosts.py
        result = train.launch("mpiexec, two hosts", 2, STEPS, timeout=120)
        assert result["launcher"] == "mpiexec" and result["hosts"] == ["hostA", "hostB"]
        assert result["params_sha256"] == reference["params_sha256"]


def _slurm_reason():
    import shutil
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return "no SLURM here: run `sudo scripts/slurm-single-node.sh` (a one-node SLURM)"
    state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                           timeout=600)
    if state.returncode != 0 or not state.stdout.strip():
        return f"SLURM does not answer ({state.stderr.strip()}): scripts/slurm-single-node.sh"
    return None


def test_srun_and_slurm_engines_give_the_same_run(reference):
    reason = _slurm_reason()
    if reason:
        pytest.skip(reason)
    result = train.launch("srun", 2, STEPS, timeout=120)
    assert result["launcher"] == "slurm" and result["params_sha256"] == \
        reference["params_sha256"]
    from course_lib.runtime.cluster import start_cluster
    with start_cluster(n=2, engines="slurm", partition="debug", time_limit="00:10:00") as c:
        jobs = c.run(os.getenv, "SLURM_JOB_ID")
        assert jobs[0] and len(set(jobs)) == 1  # both engines in one sbatch job
        assert c.run(train.train, STEPS)[0]["params_sha256"] == reference["params_sha256"]


def test_the_slurm_daemons_close_what_their_caller_had_open(tmp_path):
    """scripts/slurm-single-node.sh starts munged, slurmctld and slurmd with only stdin, stdout
    and stderr (on /dev/null): a daemon once held a lock of its caller's for an hour."""
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "slurm-single-node.sh")
    marker = tmp_path / "held"
    shell = (f"source <(sed -n '/^start_daemon() {{/,/^}}/p' {script})\n"
             f"exec 7>{marker}\n"
             "start_daemon python3 -c 'import os; print(sorted(os.listdir(\"/proc/self/fd\")),"
             f" file=open(\"{marker}.fds\", \"w\"), flush=True)'\n")
    subprocess.run(["bash", "-c", shell], check=True, timeout=600)
    fds = (tmp_path / "held.fds").read_text().strip()
    assert fds == "['0', '1', '2', '3']", fds  # 3: the listing's own; the caller's 7 is gone
