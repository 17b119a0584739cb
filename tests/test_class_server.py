"""A class on one machine: two students and an instructor as real system users (hub/users.sh),
the students' clusters isolated from each other, the class server (started by `make hub`, as the
README says) letting them in, running each one's server as them and keeping the solutions from
them, and nbgrader's cycle on lab 05 through it, clicked in Chromium where a person clicks
(marked browser). Every attempt of student B on student A's work, or on the solutions, must
fail, and the test shows the error it gets. Needs root and a course readable by every user
(skipped otherwise, saying why); the hub also needs Node.js and `npm install --prefix hub`, the
class cycle Chromium and Playwright."""

import contextlib
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlencode, urljoin

import nbformat
import psutil
import pytest

from course_lib.classroom import grading
from course_lib.testing import timing

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


UNAVAILABLE = _unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"class server: {UNAVAILABLE}")

# student A's side: a cluster of 2 engines, then one command per line on stdin
DRIVER = r"""
import json, sys
from course_lib.runtime.cluster import start_cluster

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


def as_user(user, code, timeout=600, env=None, python_args=None):
    """Run Python ``code`` (or Python with ``python_args``) as ``user`` in their home; the
    finished process."""
    home = pwd.getpwnam(user).pw_dir
    return subprocess.run(
        ["runuser", "-u", user, "--", PYTHON, *(python_args or ["-c", code])], cwd=home,
        capture_output=True, text=True, timeout=timeout,
        env={"HOME": home, "USER": user, "PATH": os.environ["PATH"], **(env or {})})


@pytest.fixture(scope="module")
def people(tmp_path_factory):
    """An instructor and students A and B, removed afterwards with all their processes."""
    tag = secrets.token_hex(3)
    names = {"teacher": f"ct{tag}", "a": f"ca{tag}", "b": f"cb{tag}"}
    passwords = tmp_path_factory.mktemp("hub") / "passwords"
    script = [str(ROOT / "hub" / "users.sh"), "--passwords", str(passwords),
              "--instructors", names["teacher"], "--students", f"{names['a']} {names['b']}"]
    subprocess.run(script, check=True, capture_output=True, timeout=600)
    secret = dict(line.split(":", 1) for line in passwords.read_text().split())
    try:
        yield {role: (name, secret[name]) for role, name in names.items()}
    finally:
        subprocess.run([*script, "--remove"], capture_output=True, timeout=600)


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
""", timeout=600)
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
    cleaned = as_user(b, "from course_lib.runtime.launch import clean_clusters; "
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
    # the rendezvous folder of A's cluster, named after its owner
    store, = Path(tempfile.gettempdir()).glob(f"course_lib-pg-{driver.pid}-*")
    driver.kill()  # as a notebook kernel killed by its user
    a_cluster["proc"].wait(timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (any(map(_running, a_cluster["pids"]))
                                           or store.exists()):
        time.sleep(0.5)
    assert not any(map(_running, a_cluster["pids"])), "A's engines outlived A's kernel"
    assert not store.exists(), "A's rendezvous folder outlived A's kernel"


def test_engines_per_student_are_capped(people):
    tried = as_user(people["a"][0], "from course_lib.runtime.cluster import start_cluster; "
                                    "start_cluster(n=5)", env={"COURSE_LIB_MAX_ENGINES": "4"})
    assert "5 engines is more than each user of this machine may start" in tried.stderr


# ---------------------------------------------------------------- the hub itself
def _make_hub():
    """The README's command, `make hub`. Its install steps (the class extra, the proxy) are
    done where this test runs (it skips otherwise): when their stamps are older than the files
    they depend on, make is told not to redo them (-o), as it would with nothing to do."""
    stale = [stamp for stamp in (".venv/.installed", ".venv/.installed-class")
             if subprocess.run(["make", "-q", stamp], cwd=ROOT, capture_output=True).returncode]
    return ["make", "--no-print-directory", *(f"-o{stamp}" for stamp in stale), "hub"]


def stop_hub(make):
    """SIGTERM to `make hub` (make passes it on to the hub); the seconds until it ended, or
    None when it did not within 60 s (a hub then stopped by SIGKILL, its processes with it)."""
    start = time.monotonic()
    if make.poll() is None:
        make.send_signal(signal.SIGTERM)
    try:
        make.wait(timeout=60)
        return time.monotonic() - start
    except subprocess.TimeoutExpired:
        from course_lib.runtime.launch import kill_tree
        kill_tree([make.pid])
        return None


def _signals(pid, which):
    """The signals process ``pid`` ignores (``which="SigIgn"``) or handles (``"SigCgt"``)."""
    mask, = [line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
             if line.startswith(f"{which}:")]
    return {n for n in range(1, 65) if int(mask, 16) >> (n - 1) & 1}


@contextlib.contextmanager
def running_hub(state, **settings):
    """The class server started by `make hub` on free ports, state in ``state``, shared folder
    of its own, the ``COURSE_HUB_*`` settings given (e.g. ``IDLE="0"``): yields (url, shared
    folder, make's Popen). Started with SIGINT ignored, as a hub started in the background is
    (`make hub &`, nohup); stopped by SIGTERM (:func:`stop_hub`)."""
    if not PROXY.exists():
        pytest.skip(f"the hub's proxy is missing: npm install --prefix {ROOT / 'hub'}")
    if not shutil.which("make"):
        pytest.skip("needs make (apt-get install make)")
    requests = pytest.importorskip("requests")
    pytest.importorskip("jupyterhub", reason="pip install -c constraints.txt -e '.[class]'")
    shared = Path(tempfile.mkdtemp(prefix="course-hub-"))  # all users may enter it
    shared.chmod(0o755)
    port, hub_port, proxy_port = _free_ports(3)  # never a default that another hub holds
    env = dict(os.environ, COURSE_HUB_PORT=str(port), COURSE_HUB_STATE=str(state),
               COURSE_HUB_INTERNAL_PORTS=f"{hub_port},{proxy_port}",
               COURSE_HUB_SHARED=str(shared),
               **{f"COURSE_HUB_{key}": value for key, value in settings.items()})
    with open(state / "hub.log", "w") as log:
        proc = subprocess.Popen(["sh", "-c", 'trap "" INT && exec "$@"', "sh", *_make_hub()],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{url}/hub/api", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                lines = (state / "hub.log").read_text().splitlines()
                hub_lines = [line for line in lines if "ConfigProxy" not in line]  # its 404s
                pytest.fail(("the hub did not answer in 60 s" if proc.poll() is None else
                             f"the hub ended with exit code {proc.returncode}") + ":\n"
                            + "\n".join(hub_lines[-40:]))
            time.sleep(0.5)
        yield url, shared, proc
    finally:
        stop_hub(proc)
        shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture(scope="module")
def hub(people, tmp_path_factory):
    state = tmp_path_factory.mktemp("hub-state")
    with running_hub(state, IDLE="0", MEMORY="3G") as (url, shared, _):
        yield url, state, shared


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _login(url, name, password):
    import requests
    session = requests.Session()
    session.get(f"{url}/hub/login", timeout=10)
    answer = session.post(f"{url}/hub/login?next=", timeout=30, allow_redirects=False,
                          data={"username": name, "password": password,
                                "_xsrf": session.cookies.get("_xsrf", "")})
    return session, answer


def test_hub_runs_each_student_server_as_that_student(people, hub):
    url, state, _ = hub
    (a, a_password), (b, _) = people["a"], people["b"]
    _, refused = _login(url, a, "not-" + a_password)
    assert refused.status_code == 403, refused.status_code
    _, refused = _login(url, b, a_password)  # A's password opens nothing of B's
    assert refused.status_code == 403, refused.status_code
    session, answer = _login(url, a, a_password)
    assert answer.status_code == 302, answer.text[-500:]
    # a rendezvous folder of A's user id whose process is gone: left by a killed kernel, or by
    # an earlier user who had A's id; the hub removes it before A's server starts
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = Path(tempfile.gettempdir(), f"course_lib-pg-{gone.pid}-earlier")
    stale.mkdir(mode=0o700)
    os.chown(stale, pwd.getpwnam(a).pw_uid, pwd.getpwnam(a).pw_gid)
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
    listed = session.get(f"{url}/user/{a}/assignments?course_id={grading.COURSE_ID}",
                         timeout=30)
    assert listed.ok and listed.json()["success"], listed.text[-500:]  # nbgrader finds the course
    assert not stale.exists()
    # a student's nbgrader is the Assignment List: no Formgrader, no assignment creation
    assert session.get(f"{url}/user/{a}/formgrader", timeout=30).status_code == 404
    page = session.get(f"{url}/user/{a}/lab", timeout=30).text
    config = json.loads(re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', page,
                                  re.DOTALL).group(1))
    assert {f"@jupyter/nbgrader:{plugin}" for plugin in ("formgrader", "create-assignment")} <= \
        set(config["disabledExtensions"])
    session.delete(f"{url}/hub/api/users/{a}/server", headers=xsrf, timeout=60)


def test_b_cannot_list_or_read_the_solutions(people, hub):
    # the hub closed them at its start: the checkout all users read holds them, and its history
    b = people["b"][0]
    solution = ROOT / "labs" / "solutions" / NOTEBOOK
    tried = as_user(b, f"""
import os, subprocess
for what, attempt in [("list", lambda: os.listdir({str(solution.parent)!r})),
                      ("read", lambda: open({str(solution)!r}).read()),
                      ("list the history", lambda: os.listdir({str(ROOT / ".git")!r}))]:
    try:
        attempt()
        print(what, "worked")
    except OSError as err:
        print(what, "refused:", err)
try:
    git = subprocess.run(["git", "-C", {str(ROOT)!r}, "show",
                          "HEAD:labs/solutions/{NOTEBOOK}"], capture_output=True, text=True)
    print("git show exited", git.returncode, len(git.stdout), "characters")
except FileNotFoundError:
    print("no git here")
""")
    assert tried.returncode == 0, tried.stderr
    for what in ("list", "read", "list the history"):
        assert f"{what} refused: [Errno 13] Permission denied" in tried.stdout, tried.stdout
    assert "git show exited 0" not in tried.stdout, tried.stdout


def test_hub_stops_an_idle_server_and_stops_at_once(people, tmp_path):
    name, password = people["b"]
    with running_hub(tmp_path, IDLE="6") as (url, _, make):  # the culler looks every 3 s
        session, answer = _login(url, name, password)
        assert answer.status_code == 302
        xsrf = {"X-XSRFToken": session.cookies.get("_xsrf", "")}
        started = session.post(f"{url}/hub/api/users/{name}/server", headers=xsrf, timeout=60)
        assert started.status_code in (201, 202), started.text
        deadline, seen = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            servers = session.get(f"{url}/hub/api/users/{name}", headers=xsrf,
                                  timeout=10).json().get("servers", {})
            seen.append(bool(servers))
            if seen[0] and not servers:
                break
            time.sleep(1)
        assert seen[0] and not seen[-1], f"B's idle server was not stopped: {seen}"
        assert "Culling server" in (tmp_path / "hub.log").read_text()
        culler, = [p for p in psutil.Process(make.pid).children(recursive=True)
                   if "jupyterhub_idle_culler" in " ".join(p.cmdline())]
        # the hub stops the culler with SIGINT, then waits 30 s before a SIGTERM: a culler
        # that ignores SIGINT, as the hub started in the background does, holds it that long
        assert signal.SIGINT in _signals(make.pid, "SigIgn") & _signals(culler.pid, "SigCgt")
        seconds = stop_hub(make)
        assert seconds is not None, "make hub was still running 60 s after its SIGTERM"
        print(f"make hub stopped {seconds:.1f} s after its SIGTERM")
        # a second or two here: 3 s as its deadline puts the bound (29 s) below the wrong wait
        timing.assert_no_hang(seconds, deadline=3, instead=30)
        assert not _running(culler.pid)


# ---------------------------------------------------------------- a class cycle, in the browser
# The instructor generates and releases lab 05 in nbgrader's Formgrader, students A and B fetch
# and submit it in JupyterLab's Assignment List (A with the solutions, B untouched), all by
# clicks in Chromium; the instructor then grades on the command line, as their own system user,
# with no student's password. Screenshots of each step go to the artifacts folder.
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = ("class-server", "class server: screenshots of the class cycle")
LAB, NOTEBOOK = "lab05", "05_allreduce.ipynb"
CHECKS = ["check_ring_reduce_scatter", "check_ring_allgather", "check_ring_allreduce",
          "check_bidirectional_ring_allreduce"]  # lab 05's autograded tests, 1 point each
PAGE_TIMEOUT_MS = 30_000   # any one click or wait in a page
SPAWN_TIMEOUT_MS = 120_000  # a login, until the user's server has started and answers
DIALOG_TIMEOUT_MS = 60_000  # a Formgrader button, until its dialog says how it went
NBGRADER_TIMEOUT = 600     # a hang guard for one nbgrader command (autograde runs lab 05 twice)

no_chromium = pytest.mark.skipif(CHROMIUM is None,
                                 reason="needs Chromium: apt-get install -y chromium")


@pytest.fixture(scope="module")
def cycle(request, hub, people, chromium, artifacts):
    """What the class cycle's steps hand each other, and their timings (printed at the end)."""
    pytest.importorskip("nbgrader", reason="pip install -c constraints.txt -e '.[class]'")
    url, _, shared = hub
    done = {"url": url, "exchange": shared / "exchange" / grading.COURSE_ID, "timings": {},
            "grading": Path(pwd.getpwnam(people["teacher"][0]).pw_dir, "grading")}
    yield done
    timings = done["timings"]
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if timings and capture is not None:
        in_browser = sum(v for k, v in timings.items() if k[0].isdigit())
        with capture.global_and_fixture_disabled():  # shown even when pytest captures
            print(f"\nclass cycle, seconds: in the browser {in_browser:.1f} (",
                  ", ".join(f"{k} {v:.1f}" for k, v in timings.items()), ")")


def _needs(cycle, step):
    if step not in cycle:
        pytest.skip(f"the class cycle stopped before: {step}")


@contextlib.contextmanager
def _step(cycle, page, name, artifacts):
    """Time a step and screenshot its page at the end, whether it succeeded or not."""
    start = time.monotonic()
    try:
        yield
    finally:
        cycle["timings"][name] = time.monotonic() - start
        page.screenshot(path=artifacts / f"{name}.png")


def _new_browser(browser):
    """A browser of a person's own (its cookies apart), with deadlines on every action."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    return context, context.new_page()


def _sign_in(page, url, name, password, landing):
    """The hub's login form; the hub then starts the user's server and opens ``landing``, a
    path in it."""
    after_spawn = urlencode({"next": f"/user/{name}/{landing}"})
    page.goto(f"{url}/hub/login?{urlencode({'next': f'/hub/spawn?{after_spawn}'})}")
    page.fill("#username_input", name)
    page.fill("#password_input", password)
    page.click("#login_submit")
    page.wait_for_url(f"**/user/{name}/{landing.split('?')[0]}**", timeout=SPAWN_TIMEOUT_MS)


def _formgrader_click(page, lab, column, expected):
    """Click ``column``'s button in ``lab``'s row of the Formgrader, wait for the dialog it opens
    and check it says ``expected``."""
    row = page.locator("#main-table tr", has=page.locator("td.name", has_text=lab))
    row.locator(f"td.{column} a").click()
    dialog = page.locator("#success-modal, #error-modal")
    dialog.wait_for(timeout=DIALOG_TIMEOUT_MS)
    from playwright.sync_api import expect  # only where the browser tests run
    expect(dialog).to_have_css("opacity", "1")  # faded in: the screenshot shows it
    text = dialog.inner_text()
    assert dialog.get_attribute("id") == "success-modal" and expected in text, text


def _close_dialog(page):
    page.locator("#success-modal .modal-footer button").click()
    page.locator("#success-modal").wait_for(state="detached")


def _assignment_list(page):
    """Nbgrader > Assignment List, in JupyterLab's menu; returns the commands the menu showed."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Nbgrader$")).click()
    item = page.locator("#jp-mainmenu-nbgrader li[data-command='nbgrader:open-assignment-list']")
    item.wait_for()
    shown = [li.get_attribute("data-command")
             for li in page.locator("#jp-mainmenu-nbgrader li.lm-Menu-item:visible").all()]
    item.click()
    return shown


def _list_row(page, section, lab):
    return page.locator(f"#{section}_assignments_list > .list_item", has_text=lab)


def _answers(solution):
    """{grade_id: source} of the solution cells of the lab's nbgrader source notebook."""
    return {c.metadata.nbgrader["grade_id"]: c.source
            for c in grading.assignment_source(solution).cells
            if c.cell_type == "code" and c.metadata.nbgrader.get("solution")}


def _write_answers(context, url, user, path, answers):
    """Fill in the answer cells of ``path`` through the user's Jupyter contents API, with the
    session of their browser (its cookies and XSRF token), as JupyterLab saves a notebook."""
    api = f"{url}/user/{user}/api/contents/{path}"
    xsrf, = [c["value"] for c in context.cookies(f"{url}/user/{user}/") if c["name"] == "_xsrf"]
    got = context.request.get(api, params={"content": "1"})
    assert got.ok, got.text()
    notebook = got.json()["content"]
    filled = 0
    for cell in notebook["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            assert "raise NotImplementedError()" in cell["source"]  # released without solutions
            cell["source"], filled = answers[grade_id], filled + 1
    assert filled == len(answers)
    saved = context.request.put(api, headers={"X-XSRFToken": xsrf},
                                data={"type": "notebook", "format": "json", "content": notebook})
    assert saved.ok, saved.text()


def _nbgrader_as(user, args, timeout=NBGRADER_TIMEOUT):
    """``nbgrader <args>`` run by ``user`` (their system user, no password) in ~/grading, through
    grading.run_nbgrader: a step that fails or passes its deadline raises, naming itself."""
    return as_user(user, "from course_lib.classroom.grading import run_nbgrader\n"
                         f"print(run_nbgrader({args!r}, cwd='grading', timeout={timeout}).stdout)",
                   timeout=timeout + 30)


@pytest.mark.browser
@no_chromium
def test_instructor_generates_and_releases_lab05_in_the_formgrader(people, cycle, chromium,
                                                                      artifacts):
    url, (teacher, password) = cycle["url"], people["teacher"]
    # JupyterHub forbids framing any user's pages (all users share one origin here), so the
    # Formgrader's panel in JupyterLab, an iframe, stays blank: an instructor opens it in a
    # browser tab of its own, as nbgrader's documentation advises for JupyterHub >= 4.1
    context, page = _new_browser(chromium)
    try:
        with _step(cycle, page, "1_instructor_formgrader", artifacts):
            _sign_in(page, url, teacher, password, "formgrader")
            page.locator("#main-table td.name", has_text=LAB).wait_for()
        headers = context.request.get(page.url).headers
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        # the assignment's name links to its folder: nbgrader writes /tree/grading/source/lab05,
        # without the /user/<name>/ of this server; the hub takes it there
        link = page.locator("#main-table td.name a", has_text=LAB).get_attribute("href")
        opened = context.request.get(urljoin(page.url, link))
        assert opened.ok and opened.url.endswith(f"/user/{teacher}/tree/grading/source/{LAB}"), \
            (link, opened.status, opened.url)
        with _step(cycle, page, "2_instructor_generated", artifacts):
            _formgrader_click(page, LAB, "assign",
                              f"Successfully created the student version of '{LAB}'")
        _close_dialog(page)
        with _step(cycle, page, "3_instructor_released", artifacts):
            _formgrader_click(page, LAB, "release", f"Successfully released '{LAB}'")
        _close_dialog(page)
        row = page.locator("#main-table tr", has=page.locator("td.name", has_text=LAB))
        row.locator("td.status", has_text="released").wait_for()
    finally:
        context.close()
    released = (cycle["exchange"] / "outbound" / LAB / NOTEBOOK).read_text()
    for secret in ("### BEGIN SOLUTION", grading.BEGIN_HIDDEN, f"seed={grading.HIDDEN_SEED}"):
        assert secret not in released
    cycle["released"] = True


@pytest.mark.browser
@no_chromium
def test_students_fetch_and_submit_in_the_assignment_list(people, cycle, chromium, artifacts):
    """A fetches, gets the solutions written into the fetched notebook through A's own Jupyter
    (contents API, A's browser session) and submits; B fetches and submits the stubs."""
    _needs(cycle, "released")
    url, answers = cycle["url"], _answers(ROOT / "labs" / "solutions" / NOTEBOOK)
    for n, who in enumerate(["a", "b"], start=4):
        name, password = people[who]
        context, page = _new_browser(chromium)
        try:
            with _step(cycle, page, f"{n}{who}_student_{who}_assignment_list", artifacts):
                _sign_in(page, url, name, password, "lab?reset")
                # a student's: no Formgrader, no "Create Assignment", no instructor's course list
                assert _assignment_list(page) == ["nbgrader:open-assignment-list"]
                _list_row(page, "released", LAB).wait_for()
            with _step(cycle, page, f"{n}{who}_student_{who}_fetched", artifacts):
                _list_row(page, "released", LAB).get_by_role("button", name="Fetch").click()
                _list_row(page, "fetched", LAB).wait_for()
            if who == "a":
                start = time.monotonic()
                _write_answers(context, url, name, f"{LAB}/{NOTEBOOK}", answers)
                cycle["timings"]["4a_answers_written"] = time.monotonic() - start
            with _step(cycle, page, f"{n}{who}_student_{who}_submitted", artifacts):
                _list_row(page, "fetched", LAB).get_by_role("button", name="Submit").click()
                error = page.locator(".nbgrader-ErrorDialog")
                error.or_(_list_row(page, "submitted", LAB)).first.wait_for()
                assert not error.count(), error.inner_text()
        finally:
            context.close()
    inbound = cycle["exchange"] / "inbound"  # root looks; the students cannot (see below)
    submitted = {who: [p for p in inbound.iterdir() if p.name.startswith(f"{name}+{LAB}+")]
                 for who, (name, _) in people.items()}
    assert len(submitted["a"]) == len(submitted["b"]) == 1 and not submitted["teacher"]
    work = {who: {c.metadata.get("nbgrader", {}).get("grade_id"): c.source
                  for c in nbformat.read(paths[0] / NOTEBOOK, as_version=4).cells}
            for who, paths in submitted.items() if paths}
    assert all(work["a"][grade_id] == source for grade_id, source in answers.items())
    assert all("raise NotImplementedError()" in work["b"][grade_id] for grade_id in answers)
    cycle["submitted"] = {who: paths[0] for who, paths in submitted.items() if paths}


@pytest.mark.browser  # grades what the browser steps submitted
@no_chromium
def test_instructor_grades_on_the_command_line_without_any_student_password(people, cycle,
                                                                            tmp_path):
    _needs(cycle, "submitted")
    from nbgrader.api import Gradebook  # the class extra: the cycle fixture skipped without it

    teacher, a, b = people["teacher"][0], people["a"][0], people["b"][0]
    for step in ("collect", "autograde", "generate_feedback"):
        start = time.monotonic()
        done = _nbgrader_as(teacher, [step, LAB])
        cycle["timings"][f"nbgrader {step}"] = time.monotonic() - start
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]

    course = cycle["grading"]
    shutil.copy(course / "gradebook.db", tmp_path / "gradebook.db")  # root reads a copy
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gradebook:
        assert sorted(s.id for s in gradebook.students) == sorted([a, b])
        scores = {s: gradebook.find_submission(LAB, s) for s in (a, b)}
        assert {s: (sub.code_score, sub.max_code_score) for s, sub in scores.items()} == {
            a: (len(CHECKS), len(CHECKS)), b: (0, len(CHECKS))}

    feedback = {s: (course / "feedback" / s / LAB / NOTEBOOK.replace(".ipynb", ".html"))
                .read_text(encoding="utf-8") for s in (a, b)}
    for check in CHECKS:  # what B saw in the lab: the stub's notice under every check
        assert f"{check}: not implemented yet" in feedback[b], check
        assert f"✓ {check}" in feedback[a] and f"✓ {check}" not in feedback[b], check
    assert "Finish exercises 1 to 3" in feedback[b]
    assert "not implemented yet" not in feedback[a]

    report = as_user(teacher, None, timeout=600,
                     python_args=["-m", "course_lib", "class", "report", "--root", "grading"])
    assert report.returncode == 0, report.stderr[-3000:]
    n = len(CHECKS)
    assert f"{a} {LAB}: {n}/{n} autograded, 2 criteria not gradable here" in report.stdout
    assert f"{b} {LAB}: 0/{n} autograded, 2 criteria not gradable here" in report.stdout
    written = json.loads((course / "grading_report.json").read_text())
    tiers = {s: written["students"][s][LAB] for s in (a, b)}
    assert {s: lab["tier1"]["score"] for s, lab in tiers.items()} == {a: n, b: 0}
    assert [c["status"] for c in tiers[b]["tier2"]] == [
        "not gradable here: needs CUDA GPUs and NCCL", "not gradable here: needs two hosts"]


@pytest.mark.browser  # tries what the browser steps submitted
@no_chromium
def test_b_cannot_list_or_read_a_submission(people, cycle):
    _needs(cycle, "submitted")
    a, b = people["a"][0], people["b"][0]
    inbound, a_submission = cycle["exchange"] / "inbound", cycle["submitted"]["a"]
    a_fetched = Path(pwd.getpwnam(a).pw_dir, LAB, NOTEBOOK)
    tried = as_user(b, f"""
import glob, os
course = {str(cycle["exchange"])!r}
for what, attempt in [("list the submissions", lambda: os.listdir({str(inbound)!r})),
                      ("read A's fetched copy", lambda: open({str(a_fetched)!r}).read()),
                      ("move the course away", lambda: os.rename(course, course + "-gone"))]:
    try:
        attempt()
        print(what, "worked")
    except OSError as err:
        print(what, "refused:", err)
print("A's submissions found:", glob.glob(os.path.join({str(inbound)!r}, {a + "+*"!r})))
""")
    assert tried.returncode == 0, tried.stderr
    assert "list the submissions refused: [Errno 13] Permission denied" in tried.stdout, \
        tried.stdout
    assert "read A's fetched copy refused: [Errno 13] Permission denied" in tried.stdout
    assert "move the course away refused: [Errno 1] Operation not permitted" in tried.stdout
    assert "A's submissions found: []" in tried.stdout  # the folder's name holds 72 random bits
    # the instructor's command, tried by B with his own course folder, reads nothing either
    collect = as_user(b, "from course_lib.classroom.grading import run_nbgrader\n"
                         f"run_nbgrader(['collect', {LAB!r}, '--CourseDirectory.course_id="
                         f"{grading.COURSE_ID}', '--Exchange.root={inbound.parent.parent}'], "
                         "cwd='.', timeout=60)", timeout=600)
    assert collect.returncode != 0 and "You don't have read permissions for the directory: " \
        f"{inbound}" in collect.stderr, collect.stdout + collect.stderr[-2000:]
    assert a_submission.exists() and not Path(pwd.getpwnam(b).pw_dir, "submitted").exists()
