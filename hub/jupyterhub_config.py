"""The class server: JupyterHub on one machine, for the students and instructors of one class.

Run as root (`make hub`; the accounts: `hub/users.sh`). Every setting an instructor may change is
an environment variable, read once here:

COURSE_HUB_IP, COURSE_HUB_PORT   where the hub listens (127.0.0.1:8000: only this machine; for a
                                 class, the machine's address behind HTTPS, see the README)
COURSE_HUB_INTERNAL_PORTS        the loopback ports of the hub's API and the proxy's (8081,8001)
COURSE_HUB_STATE                 the hub's database and cookie secret (/var/lib/course-hub)
COURSE_HUB_ENGINES               engines each student may start at once (4)
COURSE_HUB_MEMORY                memory of each student's server and all it starts (4G),
                                 enforced by a memory cgroup where root may create one
COURSE_HUB_IDLE                  seconds after which an idle server is stopped (3600; 0: never)
COURSE_HUB_AUTH                  "pam" (system passwords, the default) or "shared": one password
                                 for a demo, from COURSE_HUB_PASSWORD (never stored here)
COURSE_HUB_SHARED                what all users share (/srv/course-hub): nbgrader's exchange, where
                                 assignments are released and submitted, and the Jupyter config
                                 that tells every server where it is

Who may log in: the members of the groups course-students and course-instructors; instructors
are the hub's admins. Each user's server runs as that system user, from this checkout's
environment (.venv, shared read-only by all), and opens the user's own copy of the course,
~/course, made at the first start from notebooks/ and labs/ (never labs/solutions/). The
solutions, and the git history that holds them, are closed to every user but the checkout's
owner at each start; students get nbgrader's Assignment List, not its Formgrader.
"""

import grp
import json
import os
import pwd
import shutil
import sys
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner
from tornado.web import RedirectHandler

from course_lib.classroom import grading
from course_lib.runtime.launch import clean_stores

COURSE = Path(__file__).resolve().parent.parent  # this checkout: the shared install
VENV = Path(sys.prefix)  # the environment that runs the hub runs every user's server too
STATE = Path(os.environ.get("COURSE_HUB_STATE", "/var/lib/course-hub"))
GROUPS = {"course-students", "course-instructors"}
ENGINES = os.environ.get("COURSE_HUB_ENGINES", "4")
MEMORY = os.environ.get("COURSE_HUB_MEMORY", "4G")
IDLE = int(os.environ.get("COURSE_HUB_IDLE", "3600"))
COPIED = ["notebooks", "labs"]  # labs/solutions/ is left out below
SHARED = Path(os.environ.get("COURSE_HUB_SHARED", "/srv/course-hub"))


def _readable_by_all(path):
    """Whether every user may read ``path`` and enter each folder above it."""
    path = path.resolve()
    return all(p.stat().st_mode & 0o001 for p in path.parents) and path.stat().st_mode & 0o004


for needed in (COURSE / "course_lib", Path(sys.executable)):
    if not _readable_by_all(needed):
        sys.exit(f"{needed} is not readable by every user: students' servers run as them. "
                 f"Install the course where all may read it (e.g. /opt/course) and run `make hub` "
                 "there")

# the answers stay with the instructors: labs/solutions/ and the git history (which holds them
# too) are closed to all but the checkout's owner; an instructor finds them in ~/grading
for private in (COURSE / "labs" / "solutions", COURSE / ".git"):
    if private.is_dir() and not private.is_symlink():
        private.chmod(private.stat().st_mode & 0o700)

STATE.mkdir(mode=0o700, parents=True, exist_ok=True)

# nbgrader's exchange: every user may write in it, as in /tmp (the sticky bit: nobody renames or
# removes what another made, such as the course's folder); the folders nbgrader makes there say
# who may list what (a student cannot list the submissions)
for folder, mode in [(SHARED, 0o755), (SHARED / "exchange", 0o1777), (SHARED / "jupyter", 0o755),
                     (SHARED / "students", 0o755), (SHARED / "students" / "labconfig", 0o755)]:
    folder.mkdir(exist_ok=True)
    folder.chmod(mode)
(SHARED / "jupyter" / "nbgrader_config.py").write_text(f"""\
import os
c = get_config()
c.CourseDirectory.course_id = {grading.COURSE_ID!r}
c.Exchange.root = {str(SHARED / "exchange")!r}
c.CourseDirectory.root = os.path.expanduser("~/grading")  # an instructor's assignments
""")
# what a student's server adds (see CourseSpawner.get_env): nbgrader's Assignment List (fetch,
# validate, submit) without the instructor's parts, in the server and in JupyterLab's menu
(SHARED / "students" / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": {
    "jpserver_extensions": {"nbgrader.server_extensions.formgrader": False,
                            "nbgrader.server_extensions.course_list": False}}}, indent=1))
(SHARED / "students" / "labconfig" / "page_config.json").write_text(json.dumps({
    "disabledExtensions": {f"@jupyter/nbgrader:{plugin}": True
                           for plugin in ("formgrader", "create-assignment", "course-list")}},
    indent=1))
c = get_config()  # noqa: F821 - JupyterHub's config loader defines it

c.JupyterHub.ip = os.environ.get("COURSE_HUB_IP", "127.0.0.1")
c.JupyterHub.port = int(os.environ.get("COURSE_HUB_PORT", "8000"))
# the hub's own API and the proxy's, on loopback (JupyterHub's 8081 and 8001 unless given)
hub_port, proxy_port = os.environ.get("COURSE_HUB_INTERNAL_PORTS", "8081,8001").split(",")
c.JupyterHub.hub_port = int(hub_port)
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{int(proxy_port)}"
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(STATE / "jupyterhub.pid")
proxy = COURSE / "hub" / "node_modules" / ".bin" / "configurable-http-proxy"
if proxy.exists():  # `make hub` installs it here with npm; else PATH's
    c.ConfigurableHTTPProxy.command = [str(proxy)]
c.ConfigurableHTTPProxy.pid_file = str(STATE / "proxy.pid")


# ---------------------------------------------------------------- who may log in
def _members(group):
    try:
        entry = grp.getgrnam(group)
    except KeyError:
        return set()
    primary = {u.pw_name for u in pwd.getpwall() if u.pw_gid == entry.gr_gid}
    return set(entry.gr_mem) | primary


if os.environ.get("COURSE_HUB_AUTH", "pam") == "shared":
    password = os.environ.get("COURSE_HUB_PASSWORD", "")
    if len(password) < 8:
        sys.exit("COURSE_HUB_AUTH=shared needs COURSE_HUB_PASSWORD, 8 characters or more")
    c.JupyterHub.authenticator_class = "shared-password"
    c.SharedPasswordAuthenticator.user_password = password
    c.Authenticator.allowed_users = _members("course-students") | _members("course-instructors")
    c.Authenticator.admin_users = _members("course-instructors")
else:
    c.JupyterHub.authenticator_class = "pam"
    c.PAMAuthenticator.allowed_groups = GROUPS
    c.PAMAuthenticator.admin_groups = {"course-instructors"}
    c.PAMAuthenticator.open_sessions = False  # no login session per server in a container


# ---------------------------------------------------------------- each user's server
def _give(path, user):
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, f) for f in dirs + files)]:
            os.chown(name, user.pw_uid, user.pw_gid)


def _copy_course(spawner):
    """At a user's first start: their own copy of the course, and for an instructor the labs as
    nbgrader assignments (~/grading, with the hidden tests), owned by them. Before every start:
    the rendezvous folders in /tmp whose owner process is gone, whoever's (a user's id may be an
    earlier user's: it inherits none of theirs)."""
    clean_stores()
    user = pwd.getpwnam(spawner.user.name)
    home = Path(user.pw_dir)
    home.chmod(0o700)  # their work is theirs alone, whatever the system's default
    target = home / "course"
    if not target.exists():
        for name in COPIED:
            shutil.copytree(COURSE / name, target / name,
                            ignore=shutil.ignore_patterns("solutions", ".ipynb_checkpoints", "log"))
        _give(target, user)
    grading_root = home / "grading"
    if spawner.user.name in _members("course-instructors") and not grading_root.exists():
        grading.write_course(grading_root, exchange=SHARED / "exchange", repo=COURSE)
        _give(grading_root, user)


c.Spawner.pre_spawn_hook = _copy_course
c.Spawner.cmd = [str(VENV / "bin" / "jupyterhub-singleuser")]
c.Spawner.notebook_dir = "~"
c.Spawner.default_url = "/lab/tree/course/notebooks/00_welcome_and_cluster.ipynb"
c.Spawner.environment = {
    "COURSE_LIB_MAX_ENGINES": ENGINES,  # start_cluster refuses more (course_lib.runtime.cluster)
    "JUPYTER_CONFIG_PATH": str(SHARED / "jupyter"),  # nbgrader's course and exchange
    "PATH": f"{VENV / 'bin'}:/usr/local/bin:/usr/bin:/bin",
}
c.Spawner.mem_limit = MEMORY
c.Spawner.http_timeout = 60
c.Spawner.start_timeout = 120


def memory_cgroup(user, limit):
    """A memory cgroup of ``user``'s with ``limit`` bytes for all its processes, as a folder
    to write pids into, or None where this machine has none that root may create."""
    for base, limit_file in [("/sys/fs/cgroup", "memory.max"),                   # cgroup v2
                             ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")]:  # v1
        if not os.path.exists(os.path.join(base, "cgroup.procs")):
            continue
        parent, path = os.path.join(base, "course-hub"), os.path.join(base, "course-hub", user)
        try:
            os.makedirs(path, exist_ok=True)
            if limit_file == "memory.max":  # v2: children get a memory controller if asked
                for folder in (base, parent):
                    with open(os.path.join(folder, "cgroup.subtree_control"), "w") as f:
                        f.write("+memory")
            with open(os.path.join(path, limit_file), "w") as f:
                f.write(str(limit))
        except OSError:
            return None
        return path
    return None


class CourseSpawner(LocalProcessSpawner):
    """Each user's server as that system user; its memory and everything it starts (kernels,
    engines) capped together by a cgroup, where the machine lets root make one. Everyone but
    an instructor gets the students' Jupyter config: no Formgrader, no assignment creation."""

    def get_env(self):
        env = super().get_env()
        if self.user.name not in _members("course-instructors"):
            env["JUPYTER_CONFIG_PATH"] = os.pathsep.join([str(SHARED / "students"),
                                                          env["JUPYTER_CONFIG_PATH"]])
        return env

    async def start(self):
        url = await super().start()
        group = memory_cgroup(self.user.name, self.mem_limit) if self.mem_limit else None
        if group is None:
            self.log.warning("%s: memory not enforced (no writable memory cgroup)",
                             self.user.name)
        else:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(self.pid))  # its children start inside it
        return url

    async def stop(self, now=False):
        await super().stop(now=now)
        for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/memory"):
            try:  # empty once every process of the user's server has ended
                os.rmdir(os.path.join(base, "course-hub", self.user.name))
            except OSError:
                pass

c.JupyterHub.spawner_class = CourseSpawner

# nbgrader's Formgrader, in a tab of its own, links an assignment's folder to /tree/<path> (and a
# notebook to /notebooks/, a file to /edit/), without the /user/<name>/ of the server it is on:
# the hub takes these (as /hub/tree/...) to the same path on the user's own server
c.JupyterHub.extra_handlers = [(r"/(tree|notebooks|edit)/(.*)", RedirectHandler,
                                {"url": "/hub/user-redirect/{0}/{1}", "permanent": False})]

# ---------------------------------------------------------------- idle servers
if IDLE > 0:
    c.JupyterHub.load_roles = [{
        "name": "idle-culler",
        "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
        "services": ["idle-culler"],
    }]
    # The hub stops it with SIGINT and waits 30 s before a SIGTERM: a hub started where SIGINT
    # is ignored (in the background: `make hub &`, nohup) passes that on to its children, so
    # the culler listens to SIGINT again, and stopping the hub takes a second, not 30
    c.JupyterHub.services = [{
        "name": "idle-culler",
        "command": [sys.executable, "-c", "import signal; signal.signal(signal.SIGINT, "
                    "signal.default_int_handler); from jupyterhub_idle_culler import main; main()",
                    f"--timeout={IDLE}"],
    }]
