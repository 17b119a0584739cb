"""A class on one machine: two students and an instructor as real system users (hub/users.sh),
the students' clusters isolated from each other, and the class server (hub/) letting them in and
running each one's server as them. Every attempt of student B on student A's work must fail, and
the test shows the error it gets. Needs root and a course readable by every user (skipped
otherwise, saying why); the hub also needs Node.js and `npm install --prefix hub`."""

import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
PROXY = ROOT / "hub" / "node_modules" / ".bin" / "configurable-http-proxy"


def _unavailable():
    if os.geteuid() != 0:
        return "needs root (to create the class's system users)"
    if not shutil.which("useradd") or not shutil.which("runuser"):
        return "needs useradd and runuser (apt-get install passwd util-linux)"
    for path in (ROOT, Path(PYTHON)):
        for p in path.resolve().parents:
            if not p.stat().st_mode & 0o001:
                return (f"{p} is closed to other users: the students' processes cannot run the "
                        "course from here (install it where all may read it, e.g. /opt, or "
                        f"chmod o+x {p} as .ci/run does)")
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None,
                                reason=f"class server: {_unavailable()}")

# student A's side: a cluster of 2 engines, then one command per line on stdin
DRIVER = r"""
import json, sys
from course_lib.cluster import start_cluster

def allreduce():
    import torch, torch.distributed as dist
    t = torch.full((1000,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return float(t[0]), float(t[-1])

cluster = start_cluster(n=2, share=False, warm=False)
print(json.dumps({"pids": cluster.pids}), flush=True)
for line in sys.stdin:
    if line.strip() == "allreduce":
        print(json.dumps(cluster.run(allreduce, timeout=30)), flush=True)
cluster.stop()
"""


def as_user(user, code, timeout=60, env=None):
    """Run Python ``code`` as ``user`` in their home; the finished process."""
    home = pwd.getpwnam(user).pw_dir
    return subprocess.run(
        ["runuser", "-u", user, "--", PYTHON, "-c", code], cwd=home, capture_output=True,
        text=True, timeout=timeout,
        env={"HOME": home, "USER": user, "PATH": os.environ["PATH"], **(env or {})})


@pytest.fixture(scope="module")
def people(tmp_path_factory):
    """An instructor and students A and B, removed afterwards with all their processes."""
    tag = secrets.token_hex(3)
    names = {"teacher": f"ct{tag}", "a": f"ca{tag}", "b": f"cb{tag}"}
    passwords = tmp_path_factory.mktemp("hub") / "passwords"
    script = [str(ROOT / "hub" / "users.sh"), "--passwords", str(passwords),
              "--instructors", names["teacher"], "--students", f"{names['a']} {names['b']}"]
    subprocess.run(script, check=True, capture_output=True, timeout=60)
    secret = dict(line.split(":", 1) for line in passwords.read_text().split())
    try:
        yield {role: (name, secret[name]) for role, name in names.items()}
    finally:
        subprocess.run([*script, "--remove"], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def a_cluster(people):
    """Student A's cluster, running; what B tries is tried on it."""
    a = people["a"][0]
    home = pwd.getpwnam(a).pw_dir
    proc = subprocess.Popen(["runuser", "-u", a, "--", PYTHON, "-c", DRIVER], cwd=home,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={"HOME": home, "USER": a, "PATH": os.environ["PATH"]})
    info = json.loads(proc.stdout.readline() or "{}")
    assert info, "student A's cluster did not start"

    def allreduce():
        proc.stdin.write("allreduce\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    info.update(proc=proc, allreduce=allreduce, home=Path(home))
    yield info
    if proc.poll() is None:
        proc.stdin.close()
        proc.wait(timeout=30)


def _listening_ports(pids):
    ports = set()
    for pid in pids:
        with psutil.Process(pid).oneshot():
            ports |= {c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
                      if c.status == psutil.CONN_LISTEN}
    return sorted(ports)


def test_homes_and_passwords_are_private(people):
    for name, _ in people.values():
        assert Path(pwd.getpwnam(name).pw_dir).stat().st_mode & 0o777 == 0o700
    a, b = people["a"][0], people["b"][0]
    wrote = as_user(a, "open('answers.txt', 'w').write('42')")
    assert wrote.returncode == 0, wrote.stderr
    read = as_user(b, f"open({str(Path(pwd.getpwnam(a).pw_dir, 'answers.txt'))!r}).read()")
    assert read.returncode != 0 and "PermissionError" in read.stderr


def test_b_cannot_read_or_use_a_controller(people, a_cluster):
    b = people["b"][0]
    security = a_cluster["home"] / ".ipython" / "profile_course_lib" / "security"
    client_file, = security.glob("ipcontroller-*-client.json")  # A's one cluster
    connection = json.loads(client_file.read_text())  # root reads it; B may not
    read = as_user(b, f"open({str(client_file)!r}).read()")
    assert read.returncode != 0 and "PermissionError" in read.stderr, read.stderr
    # B knows the ports (any user can list them) but not the key: nothing runs
    forged = dict(connection, key=secrets.token_hex(16))
    marker = Path(a_cluster["home"], "b-was-here")
    tried = as_user(b, f"""
import ipyparallel as ipp, json, os
json.dump({forged!r}, open("forged.json", "w"))
try:
    rc = ipp.Client("forged.json", timeout=5)
    rc[:].apply_sync(lambda: open({str(marker)!r}, "w").write("x"))
except Exception as err:
    raise SystemExit(f"refused: {{type(err).__name__}}: {{err}}")
""", timeout=60)
    assert tried.returncode != 0 and "refused" in tried.stderr, tried.stdout + tried.stderr
    assert not marker.exists()
    assert a_cluster["allreduce"]() == [[3.0, 3.0], [3.0, 3.0]]


def test_b_cannot_join_or_disturb_a_collectives(people, a_cluster):
    b = people["b"][0]
    stores = [p for p in Path(tempfile.gettempdir()).glob("course_lib-pg-*") if p.stat().st_uid ==
              pwd.getpwnam(people["a"][0]).pw_uid]
    assert stores and all(p.stat().st_mode & 0o777 == 0o700 for p in stores)
    joined = as_user(b, f"""
import datetime, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"file://{stores[0]}/store-x", rank=1,
                        world_size=2, timeout=datetime.timedelta(seconds=5))
""")
    assert joined.returncode != 0 and ("Permission" in joined.stderr or "denied" in
                                       joined.stderr), joined.stderr[-800:]
    ports = _listening_ports(a_cluster["pids"])
    assert ports  # Gloo's pair listeners (and the engines' own): reachable on loopback
    noise = as_user(b, f"""
import socket
for port in {ports!r}:
    for _ in range(3):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"\\xff" * 4096)
        except OSError:
            pass
print("sent")
""")
    assert "sent" in noise.stdout, noise.stderr
    assert a_cluster["allreduce"]() == [[3.0, 3.0], [3.0, 3.0]]  # A's sums are still right


def test_b_cannot_stop_a_clusters(people, a_cluster):
    b = people["b"][0]
    cleaned = as_user(b, "from course_lib.launch import clean_clusters; "
                         "print(clean_clusters(all=True))")
    assert cleaned.returncode == 0, cleaned.stderr
    assert all(psutil.pid_exists(pid) for pid in a_cluster["pids"])
    killed = as_user(b, f"import os, signal; os.kill({a_cluster['pids'][0]}, signal.SIGKILL)")
    assert killed.returncode != 0 and "PermissionError" in killed.stderr
    assert a_cluster["allreduce"]() == [[3.0, 3.0], [3.0, 3.0]]


def _running(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_kernel_leaves_no_engines(people, a_cluster):
    # last of the module's tests on A's cluster: A's own watchdog stops what is left
    driver, = psutil.Process(a_cluster["proc"].pid).children()  # under runuser
    driver.kill()  # as a notebook kernel killed by its user
    a_cluster["proc"].wait(timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(map(_running, a_cluster["pids"])):
        time.sleep(0.5)
    assert not any(map(_running, a_cluster["pids"])), "A's engines outlived A's kernel"


def test_engines_per_student_are_capped(people):
    tried = as_user(people["a"][0], "from course_lib.cluster import start_cluster; "
                                    "start_cluster(n=5)", env={"COURSE_LIB_MAX_ENGINES": "4"})
    assert "5 engines is more than each user of this machine may start" in tried.stderr


# ---------------------------------------------------------------- the hub itself
@pytest.fixture(scope="module")
def hub(people, tmp_path_factory):
    if not PROXY.exists():
        pytest.skip(f"the hub's proxy is missing: npm install --prefix {ROOT / 'hub'}")
    requests = pytest.importorskip("requests")
    pytest.importorskip("jupyterhub", reason="pip install -c constraints.txt -e '.[class]'")
    state = tmp_path_factory.mktemp("hub-state")
    shared = Path(tempfile.mkdtemp(prefix="course-hub-"))  # all users may enter it
    shared.chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(state / "hub.log", "w")
    proc = subprocess.Popen(
        [str(Path(PYTHON).parent / "jupyterhub"), "-f", str(ROOT / "hub" / "jupyterhub_config.py")],
        cwd=state, stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, COURSE_HUB_PORT=str(port), COURSE_HUB_STATE=str(state),
                 COURSE_HUB_IDLE="0", COURSE_HUB_MEMORY="3G", COURSE_HUB_SHARED=str(shared)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/hub/api", timeout=2).ok:
                break
        except requests.ConnectionError:
            assert proc.poll() is None, (state / "hub.log").read_text()[-3000:]
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the hub did not answer in 60 s:\n" + (state / "hub.log").read_text()[-3000:])
    yield url, state
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
    shutil.rmtree(shared, ignore_errors=True)


def _login(url, name, password):
    import requests
    session = requests.Session()
    session.get(f"{url}/hub/login", timeout=10)
    answer = session.post(f"{url}/hub/login?next=", timeout=30, allow_redirects=False,
                          data={"username": name, "password": password,
                                "_xsrf": session.cookies.get("_xsrf", "")})
    return session, answer


def test_hub_runs_each_student_server_as_that_student(people, hub):
    url, state = hub
    (a, a_password), (b, _) = people["a"], people["b"]
    _, refused = _login(url, a, "not-" + a_password)
    assert refused.status_code == 403, refused.status_code
    _, refused = _login(url, b, a_password)  # A's password opens nothing of B's
    assert refused.status_code == 403, refused.status_code
    session, answer = _login(url, a, a_password)
    assert answer.status_code == 302, answer.text[-500:]
    xsrf = {"X-XSRFToken": session.cookies.get("_xsrf", "")}
    started = session.post(f"{url}/hub/api/users/{a}/server", headers=xsrf, timeout=60)
    assert started.status_code in (201, 202), started.text
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        # the hub's OAuth redirects end at A's JupyterLab once A's server answers
        lab = session.get(f"{url}/user/{a}/lab/tree/course", timeout=30)
        if lab.ok and lab.url.startswith(f"{url}/user/{a}/lab"):
            break
        time.sleep(1)
    else:
        pytest.fail("A's server did not start:\n" + (state / "hub.log").read_text()[-3000:])
    servers = [p for p in psutil.process_iter(["username", "cmdline"])
               if "jupyterhub-singleuser" in " ".join(p.info["cmdline"] or [])]
    assert servers and {p.info["username"] for p in servers} == {a}
    for base, limit in [("/sys/fs/cgroup", "memory.max"),
                        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")]:
        group = Path(base, "course-hub", a)
        if group.exists():  # where root may make a memory cgroup, A's server runs in one
            assert {p.pid for p in servers} <= set(map(int, (group / "cgroup.procs").read_text()
                                                       .split()))
            assert int((group / limit).read_text()) == 3 * 1024**3
    course = Path(pwd.getpwnam(a).pw_dir, "course")
    assert (course / "labs" / "05_allreduce.ipynb").exists()
    assert not (course / "labs" / "solutions").exists()  # the answers stay with the teacher
    assert course.stat().st_uid == pwd.getpwnam(a).pw_uid
    listed = session.get(f"{url}/user/{a}/assignments?course_id=dist-dl", timeout=30)
    assert listed.ok and listed.json()["success"], listed.text[-500:]  # nbgrader finds the course
    session.delete(f"{url}/hub/api/users/{a}/server", headers=xsrf, timeout=60)
