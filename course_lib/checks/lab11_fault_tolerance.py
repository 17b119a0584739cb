"""Lab 11 checks: the student's atomic save, killed half-way through its write, and their resume
from a directory of damaged checkpoints.

Introduced in labs/11_fault_tolerance.ipynb, on the framework of :mod:`course_lib.checks`::

    from course_lib.checks import lab11_fault_tolerance as checks
    checks.check_atomic_save(atomic_save)
    checks.check_resume(save_checkpoint, resume)
    checks.check_reshard_reads(reshard_reads)

``check_atomic_save`` first calls ``atomic_save(state, path)`` twice in this process (a new
file, then over it) and loads ``path`` back. Then it runs the function in a new Python process
whose writes it watches (:func:`run_watched`): ``open``/``io.open`` hand out files whose
``write`` counts the bytes, ``os.write``, ``os.fsync``, ``os.replace``/``os.rename`` and
``os.unlink`` are wrapped, and ``torch.save`` on a path goes through the watched ``open`` (torch
would otherwise write it from C++). There one save over an existing checkpoint runs to the end,
journaled, and the next one is SIGKILLed once half of the new checkpoint's bytes have reached one
file. The previous checkpoint must still be at ``path``; the journal of the complete save says
whether the new file was written beside ``path``, fsynced, then renamed over it, and what was
left behind. A wrong answer comes back as what the code did.

``check_reshard_reads`` gives the student's ``reshard_reads(saved, wanted)`` six layouts (1-D
and 2-D, a shard across a boundary, one that starts where a chunk ends, chunks of unequal size)
and compares its reads with ``course_lib.checkpoint.reshard_reads``; a wrong answer is filled
into the shard from a numbered tensor to say what it leaves unread or reads wrong, and named
(a touching chunk read, offsets counted in the full tensor, lengths of the chunk, a dimension
left out).

``check_resume`` trains a small float64 MLP with Adam for 12 steps, calling the student's
``save_checkpoint(directory, step, model, optimizer)`` every 4, damages the newest checkpoint
(cut short, one byte of a parameter flipped, deleted, its save killed half-way, all of them
damaged, no directory at all), and expects ``resume(directory, model, optimizer)`` on a fresh
model and optimizer to return the step of the newest whole checkpoint with both states bit for
bit as they were then; the resumed run then trains on and must end where the uninterrupted one
did.
"""

from __future__ import annotations

import copy
import errno
import io
import json
import numbers
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from course_lib.checks.framework import CheckFailed, not_implemented, pack_function

NUMBERS = 100_000          # float64 numbers in exercise 1's checkpoints: 800 kB each
CHILD_TIMEOUT = 120        # seconds a watched process may take (it imports torch)
SAVE_EVERY, LAST, FINAL = 4, 12, 16   # exercise 2: a checkpoint every 4 steps up to 12; 16 in all
LR = 0.05
RECIPE = ("An atomic save: serialise the state (torch.save into an io.BytesIO), write the bytes "
          "to a temporary file in the same directory as path (tmp = path.with_name('.' + "
          "path.name + '.tmp')), f.flush() and os.fsync(f.fileno()), then os.replace(tmp, "
          "path); finally fsync the directory.")
_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds course_lib


# ---------------------------------------------------------------- the watched process
class _Watched:
    """A file opened for writing in a watched process: ``write`` counts (and may kill), the
    rest is the real file's."""

    def __init__(self, f, watch, key, path):
        self.__dict__.update(_f=f, _watch=watch, _key=key, _path=path)

    def write(self, data):
        return self._watch.write(self._f.write, self._f.flush, self._key, self._path, data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __setattr__(self, name, value):
        setattr(self._f, name, value)


class _Watch:
    """Wraps the ways Python writes, renames and syncs files, journals what the student's code
    does with them (one JSON line each, written at once: the journal survives a SIGKILL), and
    SIGKILLs the process when ``kill_at`` bytes have been handed to one file, or fails every
    write with ENOSPC (a full disk) from the ``full_at``-th byte handed to one file on."""

    def __init__(self, journal):
        import builtins
        self.builtins, self.io = builtins, io
        self.real = {"open": builtins.open, "os.open": os.open, "write": os.write,
                     "fsync": os.fsync, "fdatasync": getattr(os, "fdatasync", None),
                     "replace": os.replace, "rename": os.rename, "unlink": os.unlink,
                     "save": torch.serialization.save}
        self.journal = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.kill_at, self.full_at, self.full = None, None, False
        self.handed, self.opened = {}, []

    def log(self, **event):
        self.real["write"](self.journal, (json.dumps(event) + "\n").encode())

    @staticmethod
    def where(fd, fallback):
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return str(fallback)

    @staticmethod
    def key(fd):
        import stat
        st = os.fstat(fd)
        return [st.st_dev, st.st_ino] if stat.S_ISREG(st.st_mode) else None

    def write(self, write, flush, key, path, data):
        n = len(data) if isinstance(data, str) else memoryview(data).nbytes
        done = self.handed.get(tuple(key), 0)
        if self.full_at is not None and (self.full or done + n >= self.full_at):  # disk full
            keep = 0 if self.full else max(self.full_at - done, 0)
            if keep:
                write(data[:keep] if isinstance(data, str) else memoryview(data).cast("B")[:keep])
                self.handed[tuple(key)] = done + keep
            if not self.full:
                self.log(ev="full", path=path, written=done + keep)
            self.full = True
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.kill_at is not None and done + n >= self.kill_at:
            keep = max(self.kill_at - done, 0)
            write(data[:keep] if isinstance(data, str) else memoryview(data).cast("B")[:keep])
            flush()
            self.log(ev="killed", path=path, written=done + keep)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)
        self.handed[tuple(key)] = done + n
        return write(data)

    def install(self):
        watch, real = self, self.real

        def open_(file, mode="r", *args, **kwargs):
            f = real["open"](file, mode, *args, **kwargs)
            if not any(c in mode for c in "wax+"):
                return f
            try:
                fd = f.fileno()
                key = watch.key(fd)
            except (OSError, ValueError, AttributeError):
                return f
            if key is None:
                return f
            path = watch.where(fd, file)
            watch.opened.append(path)
            watch.log(ev="open", path=path, mode=mode, key=key,
                      writes=any(c in mode for c in "wax"))
            return _Watched(f, watch, key, path)

        def os_open(path, flags, *args, **kwargs):
            fd = real["os.open"](path, flags, *args, **kwargs)
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
                key = watch.key(fd)
                if key is not None:
                    where = watch.where(fd, path)
                    watch.opened.append(where)
                    watch.log(ev="open", path=where, mode="os.open", key=key,
                              writes=bool(flags & (os.O_TRUNC | os.O_WRONLY | os.O_APPEND)))
            return fd

        def os_write(fd, data):
            key = watch.key(fd) if fd != watch.journal else None
            if key is None:
                return real["write"](fd, data)
            return watch.write(lambda d: real["write"](fd, d), lambda: None, key,
                               watch.where(fd, fd), data)

        def sync(name):
            def fsync(fd):
                fd = fd if isinstance(fd, int) else fd.fileno()
                import stat
                st = os.fstat(fd)
                watch.log(ev="fsync", key=[st.st_dev, st.st_ino], path=watch.where(fd, fd),
                          size=st.st_size, handed=watch.handed.get((st.st_dev, st.st_ino)),
                          dir=stat.S_ISDIR(st.st_mode))
                return real[name](fd)
            return fsync

        def move(name):
            def replace(src, dst, *args, **kwargs):
                try:
                    st = os.stat(src)
                    key = [st.st_dev, st.st_ino]
                except (OSError, TypeError, ValueError):
                    key = None
                s, d = (os.path.realpath(os.fsdecode(p)) for p in (src, dst))
                result = real[name](src, dst, *args, **kwargs)
                watch.log(ev="replace", fn=f"os.{name}", src=s, dst=d, key=key)
                return result
            return replace

        def unlink(path, *args, **kwargs):
            watch.log(ev="unlink", path=os.path.realpath(os.fsdecode(path)))
            return real["unlink"](path, *args, **kwargs)

        def save(obj, f, *args, **kwargs):
            if isinstance(f, (str, bytes, os.PathLike)):  # torch would write it from C++
                with open_(f, "wb") as handle:
                    return real["save"](obj, handle, *args, **kwargs)
            return real["save"](obj, f, *args, **kwargs)

        self.builtins.open = self.io.open = open_
        os.open, os.write, os.fsync = os_open, os_write, sync("fsync")
        if real["fdatasync"] is not None:
            os.fdatasync = sync("fdatasync")
        os.replace, os.rename = move("replace"), move("rename")
        os.unlink = os.remove = unlink
        torch.save = torch.serialization.save = save
        self.wrapped = {id(real["open"]): open_, id(real["os.open"]): os_open,
                        id(real["write"]): os_write, id(real["fsync"]): os.fsync,
                        id(real["replace"]): os.replace, id(real["rename"]): os.rename,
                        id(real["unlink"]): unlink, id(real["save"]): save}
        if real["fdatasync"] is not None:
            self.wrapped[id(real["fdatasync"])] = os.fdatasync

    def rebind(self, functions):
        """Point the names bound to the real functions before the watch was installed at the
        watched ones: in loaded modules (IPython's ``open`` is ``from io import open as
        io_open``) and in the globals of the student's functions, and of the functions they
        call (``from os import replace`` in a notebook cell)."""
        def swap(namespace):
            for name, value in list(namespace.items()):
                if id(value) in self.wrapped and value is not self.wrapped[id(value)]:
                    namespace[name] = self.wrapped[id(value)]
        for module in list(sys.modules.values()):
            if module is not None and module.__name__ not in ("builtins", "io", "os", "posix"):
                try:
                    swap(vars(module))
                except TypeError:
                    continue
        import types
        seen, todo = set(), list(functions)
        while todo:
            fn = todo.pop()
            if id(fn) in seen or not isinstance(fn, types.FunctionType):
                continue
            seen.add(id(fn))
            swap(fn.__globals__)
            todo += list(fn.__globals__.values())
            todo += [c.cell_contents for c in (fn.__closure__ or ()) if _filled(c)]


def _filled(cell):
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def run_watched(payload_path):
    """The watched process (``python -c``): load the calls of ``payload_path`` (cloudpickled:
    journal path, then ``(label, packed function, args, at, target)`` each), install the watch,
    and run them in order, journaling every open for writing, fsync, rename and unlink, and
    after each call what it left behind beside its ``target`` and what ``target`` holds. ``at``
    is None, a number of bytes (the call is SIGKILLed once that many have been handed to one
    file) or ``("full", n)``: from the n-th byte handed to one file on, every write raises
    ``OSError(ENOSPC)``, as on a full disk, and the call may raise (it is journaled; the next
    call runs). Any other call that raises ends the process with exit code 1.
    Introduced in labs/11_fault_tolerance.ipynb."""
    import cloudpickle
    with open(payload_path, "rb") as f:
        payload = cloudpickle.load(f)
    calls = [(label, cloudpickle.loads(fn), args, at, target)
             for label, fn, args, at, target in payload["calls"]]
    watch = _Watch(payload["journal"])
    watch.install()
    watch.rebind([fn for _, fn, _, _, _ in calls])
    for label, fn, args, at, target in calls:
        watch.log(ev="call", label=label)
        full = isinstance(at, (tuple, list))
        watch.kill_at, watch.full_at = (None, at[1]) if full else (at, None)
        watch.full, watch.handed, watch.opened = False, {}, []
        try:
            fn(*args)
        except BaseException as err:  # noqa: BLE001 - every failure is the student's to see
            frames = traceback.extract_tb(err.__traceback__)
            inner = frames[-1] if frames else None
            watch.full_at = None
            watch.log(ev="raised", label=label, type=type(err).__name__, message=str(err),
                      where=(f"File {inner.filename}, line {inner.lineno}, in {inner.name}: "
                             f"{(inner.line or '').strip()}") if inner else "",
                      **_after(watch, target))
            if not full:
                os._exit(1)
            continue
        watch.full_at = None
        watch.log(ev="returned", label=label, **_after(watch, target))
    watch.log(ev="finished")
    sys.stdout.flush()
    os._exit(0)


def _after(watch, target):
    """What a call left: the files it opened for writing, other than ``target``, that are still
    there, and the step ``target`` holds (or why none)."""
    if target is None:
        return {"left": []}
    target = os.path.realpath(target)
    left = sorted({p for p in watch.opened if os.path.realpath(p) != target
                   and os.path.isfile(p)})
    try:
        obj = torch.load(target, weights_only=True)
        holds = obj["step"] if isinstance(obj, dict) and "step" in obj else "another object"
    except FileNotFoundError:
        holds = "no file"
    except Exception:  # noqa: BLE001 - any other failure: what cannot be read
        holds = "a file torch.load cannot read"
    return {"left": left, "holds": holds}


def run_calls_watched(calls, workdir):
    """Run ``calls`` (label, function, args, at, target) in a watched process (see
    :func:`run_watched`); returns its exit code, the journal's events and the tail of its
    stderr."""
    import cloudpickle
    workdir = Path(workdir)
    journal, payload = workdir / "journal.jsonl", workdir / "payload.pkl"
    journal.unlink(missing_ok=True)
    packed = [(label, pack_function(fn), args, at, None if target is None else str(target))
              for label, fn, args, at, target in calls]
    payload.write_bytes(cloudpickle.dumps({"journal": str(journal), "calls": packed}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_ROOT,
                                                                  os.environ.get("PYTHONPATH")])))
    code = ("import sys\nfrom course_lib.checks.lab11_fault_tolerance import run_watched\n"
            "run_watched(sys.argv[1])\n")
    proc = subprocess.run([sys.executable, "-c", code, str(payload)], capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT, cwd=workdir, env=env)
    events = ([json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
              if journal.exists() else [])
    return proc.returncode, events, proc.stderr[-2000:]


def _of_call(events, label):
    """The events of call ``label`` (between its "call" event and the next one)."""
    out, inside = [], False
    for e in events:
        if e["ev"] == "call":
            inside = e["label"] == label
        elif inside:
            out.append(e)
    return out


def _raised(where, fn_name, events, code=0, stderr=""):
    """A CheckFailed for a call that raised in the watched process (or for a process that
    failed before it could run the call), or None."""
    raised = [e for e in events if e["ev"] == "raised"]
    if not raised and code not in (0, -signal.SIGKILL):
        tail = "\n  ".join(stderr.strip().splitlines()[-3:])
        return CheckFailed(f"{where}\n  the watched process failed (exit code {code}) before "
                           f"it ran your {fn_name}:\n  {tail}\nHint: can your function be "
                           f"pickled (cloudpickle) and run in a new Python process?")
    if not raised:
        return None
    r = raised[0]
    return CheckFailed(f"{where}\n  your {fn_name} raised {r['type']}: {r['message']} (in a new "
                       f"Python process where the check watches its writes)\n  {r['where']}\n"
                       f"Hint: it ran in this notebook's process; does it use something that "
                       f"does not travel with it (an open file, a global set in another cell)?")


# ---------------------------------------------------------------- exercise 1: the atomic save
def case_state(step):
    """Exercise 1's checkpoint number ``step``: ``NUMBERS`` float64 (different for every step)
    and the step. Introduced in labs/11_fault_tolerance.ipynb."""
    return {"w": torch.linspace(0, 1, NUMBERS, dtype=torch.float64) + step, "step": step}


def _same(obj, state):
    return (isinstance(obj, dict) and set(obj) == set(state) and obj["step"] == state["step"]
            and torch.is_tensor(obj["w"]) and torch.equal(obj["w"], state["w"]))


def _identify(path, states):
    """What ``path`` holds: ("step", n) for one of ``states``, else ("missing" | "unreadable" |
    "other", a description)."""
    path = Path(path)
    if not path.exists():
        return "missing", "path does not exist"
    size = path.stat().st_size
    try:
        obj = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - what torch.load says is the message
        first = (str(e).splitlines() or [""])[0].split(". ")[0][:120]
        return "unreadable", (f"path holds {size:,} bytes that torch.load(path, "
                              f"weights_only=True) cannot read ({type(e).__name__}: {first})")
    for step, state in states.items():
        if _same(obj, state):
            return "step", step
    what = (f"a dict with keys {sorted(map(str, obj))}" if isinstance(obj, dict)
            else f"a {type(obj).__name__}")
    return "other", f"path holds {what}, not a state that the check saved"


def _listing(folder, but=()):
    return sorted(p.name for p in Path(folder).iterdir() if p.name not in but)


def check_atomic_save(atomic_save) -> bool:
    """Lab 11, exercise 1: ``atomic_save(state, path)`` (``path`` a ``pathlib.Path``) must leave
    ``path`` holding either the previous checkpoint or the whole new one, whenever the process
    dies. Two saves in this process, loaded back; then, in a watched process, a save over an
    existing checkpoint run to the end and journaled, and one SIGKILLed half-way through its
    bytes, after which ``path`` must still hold the previous checkpoint. The complete save must
    have written its new file in ``path``'s directory, fsynced it (after flushing) before
    ``os.replace``/``os.rename`` put it over ``path``, and left nothing else behind. Prints a
    pass line and returns True; returns False while the function raises NotImplementedError;
    raises CheckFailed with what the code did otherwise.
    Introduced in labs/11_fault_tolerance.ipynb."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_atomic_save"
    states = {step: case_state(step) for step in (1, 2, 3)}
    with tempfile.TemporaryDirectory(prefix="lab11-atomic-") as tmp:
        tmp = Path(tmp)
        folder = tmp / "here"
        folder.mkdir()
        path = folder / "checkpoint.pt"
        for step, label in ((1, "a first save, into an empty directory"),
                            (2, "a second save, over the first")):
            where = f"{name}: {label} (in this process)"
            try:
                atomic_save(states[step], path)
            except NotImplementedError:
                return not_implemented(name)
            except Exception as err:
                raise CheckFailed(f"{where}\n  your atomic_save raised {type(err).__name__}: "
                                  f"{err}\nHint: see where it raised (in a notebook: under "
                                  f"'Your code', below). {RECIPE}") from err
            kind, what = _identify(path, states)
            if kind != "step" or what != step:
                said = f"path holds the state of step {what}" if kind == "step" else what
                raise CheckFailed(f"{where}\n  after atomic_save returned, {said}; expected the "
                                  f"state it was given (step {step})\nHint: when atomic_save "
                                  f"returns, torch.load(path, weights_only=True) must give the "
                                  f"new state. {RECIPE}")
        left = _listing(folder, but=(path.name,))
        passed = _killed_half_way(name, atomic_save, states, tmp)
        if left:
            raise CheckFailed(_left_behind(f"{name}: two saves (in this process)",
                                           [f"{folder.name}/{n}" for n in left]))
    print(passed)
    return True


def _left_behind(where, left):
    return (f"{where}\n  after a save that returned, it left behind {left}\nHint: "
            f"a save that returns must leave path alone: rename the temporary file over path "
            f"(os.replace(tmp, path), which removes its old name) and do not keep copies. Every "
            f"save would leave one more file, and a directory of checkpoints fills the disk "
            f"(only a save killed half-way may leave a temporary file, which the next save can "
            f"remove).")


def _killed_half_way(name, atomic_save, states, tmp):
    """The watched process: a save over an existing checkpoint, one on a disk that fills up
    half-way, then one killed half-way."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    folder = tmp / "watched"
    folder.mkdir()
    path = folder / "checkpoint.pt"
    torch.save(states[1], path)
    buffer = io.BytesIO()
    torch.save(states[3], buffer)
    size = len(buffer.getvalue())
    calls = [("complete", atomic_save, (states[2], path), None, path),
             ("full", atomic_save, (states[3], path), ("full", size // 2), path),
             ("killed", atomic_save, (states[3], path), size // 2, path)]
    where = (f"{name}: a save over a checkpoint, one on a disk that fills up half-way, then one "
             f"SIGKILLed half-way")
    try:
        code, events, stderr = run_calls_watched(calls, tmp)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{where}\n  the process did not end in {CHILD_TIMEOUT} s\nHint: does "
                          f"your atomic_save wait for something?") from None
    error = _raised(where, "atomic_save", [e for e in events if e.get("label") != "full"], code,
                    stderr)
    if error:
        raise error
    target = os.path.realpath(path)
    complete, full, killed = (_of_call(events, label) for label in ("complete", "full", "killed"))
    for e in full:  # what the failed save left outside the check's directory (/tmp): removed
        for left in e.get("left", []) if e["ev"] in ("raised", "returned") else []:
            _remove_orphan(left, tmp, target)
    death = [e for e in killed if e["ev"] == "killed"]
    if not death:
        tail = stderr.strip().splitlines()[-1:] or [f"exit code {code}"]
        raise CheckFailed(f"{where}\n  the save was never killed: it finished without handing "
                          f"{size // 2:,} bytes (half of the checkpoint) to one file ({tail[0]})"
                          f"\nHint: write the checkpoint with open() (or torch.save on a file or "
                          f"a path): the check counts the bytes that pass through them. {RECIPE}")
    death = death[0]
    _remove_orphan(death["path"], tmp, target)
    in_place = any(e["ev"] == "open" and e["path"] == target and e["writes"]
                   for e in complete + full + killed)
    if not in_place:
        _full_lost_it(f"{name}: a save on a disk that fills up half-way", full, target)
    kind, what = _identify(path, states)
    if not (kind == "step" and what == 2):
        _kill_lost_it(where, kind, what, death, target, complete + killed, size)
    _journal_problems(f"{name}: a save over a checkpoint, then the next one SIGKILLed half-way",
                      complete, target, folder)
    _full_problems(f"{name}: a save on a disk that fills up half-way", full, target)
    moved = [i for i, e in enumerate(complete) if e["ev"] == "replace" and e["dst"] == target]
    return (f"✓ {name}: SIGKILLed after {death['written']:,} of {size:,} bytes "
            f"({Path(death['path']).name}), path still held the previous checkpoint; a complete "
            f"save wrote beside path, fsynced, then {complete[moved[-1]]['fn']}(), then fsynced "
            f"the directory; a save on a full disk raised and left path and the directory as "
            f"they were")


FULL = ("(the check made every write fail with OSError: [Errno 28] No space left on device once "
        "half of the new checkpoint's bytes had gone to one file, as on a full disk)")


def _full_lost_it(where, events, target):
    """The save on a full disk did not leave the previous checkpoint at path."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    end = next((e for e in events if e["ev"] in ("raised", "returned")), None)
    if end is None or end.get("holds") == 2:
        return
    holds = end["holds"]
    said = (f"path holds the state of step {holds}" if isinstance(holds, int) else
            "path does not exist" if holds == "no file" else f"path holds {holds}")
    if any(e["ev"] == "unlink" and e["path"] == target for e in events) or holds == "no file":
        hint = ("when the write failed, your atomic_save removed path, which still held the "
                "previous checkpoint (the only good one). A failed save must leave path as it "
                "was: clean up only what this save created.")
    else:
        hint = ("a failed save must leave path as it was: the previous checkpoint. Nothing may "
                "touch path before the new file is whole.")
    raise CheckFailed(f"{where}\n  after the failed save, {said}; expected the previous "
                      f"checkpoint (step 2) {FULL}\nHint: {hint}")


def _full_problems(where, events, target):
    """The save on a full disk must raise and leave nothing behind."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    end = next((e for e in events if e["ev"] in ("raised", "returned")), None)
    if end is None:
        return
    if end["ev"] == "returned":
        raise CheckFailed(
            f"{where}\n  your atomic_save returned as if the checkpoint were saved, although its "
            f"write raised {FULL}\nHint: the caller (the training loop) now believes the new "
            f"checkpoint is on disk, and may delete the older ones: an error that is caught "
            f"must be raised again once the clean-up is done.")
    if end["left"]:
        names = [os.path.relpath(p, os.path.dirname(target)) if
                 os.path.dirname(os.path.realpath(p)) == os.path.dirname(target) else p
                 for p in end["left"]]
        raise CheckFailed(
            f"{where}\n  your atomic_save raised {end['type']} (good), but left behind {names} "
            f"{FULL}\nHint: every failed save then leaves one more half-written file, on a disk "
            f"that is already full; nothing else ever removes it. When anything raises between "
            f"the open and the rename (BaseException: Ctrl-C too), remove the temporary file, "
            f"then let the error go on.")


def _remove_orphan(path, tmp, target):
    """The killed save's half-written file, when it is outside the check's own temporary
    directory (a temporary file in /tmp): removed, as a next save would remove it."""
    path = os.path.realpath(path)
    if path != target and not path.startswith(os.path.realpath(tmp) + os.sep):
        Path(path).unlink(missing_ok=True)


def _kill_lost_it(where, kind, what, death, target, events, size):
    """The previous checkpoint did not survive the kill: say what the save did to it."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    said = {"step": f"path holds the state of step {what}"}.get(kind, what)
    at = (f"\n  the check killed the process after {death['written']:,} of the new checkpoint's "
          f"{size:,} bytes had gone to {death['path']}")
    if os.path.realpath(death["path"]) == target:
        hint = ("your atomic_save wrote straight into path: opening it for writing emptied the "
                "previous checkpoint at once, and a process killed half-way leaves half a "
                "file (that is what torch.save(state, path) does). Write the new file under "
                "another name, then rename it over path. " + RECIPE)
    elif any(e["ev"] == "unlink" and e["path"] == target for e in events):
        hint = ("your atomic_save removed path before the new file was in place: killed in "
                "between, it leaves no checkpoint at all. os.replace(tmp, path) replaces path "
                "in one step: remove nothing. " + RECIPE)
    elif any(e["ev"] == "replace" and e["src"] == target for e in events):
        hint = ("your atomic_save renamed the previous checkpoint away before the new one was "
                "in place: killed in between, path does not exist. os.replace(tmp, path) "
                "replaces path in one step. " + RECIPE)
    else:
        hint = RECIPE
    raise CheckFailed(f"{where}\n  after the kill, {said}; expected the previous checkpoint "
                      f"(step 2){at}\nHint: {hint}")


def _journal_problems(where, events, target, folder):
    """What the journal of a complete save says is not atomic or not durable, as a
    CheckFailed."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    where = f"{where}\n  the previous checkpoint survived the kill, but in the complete save"
    if any(e["ev"] == "open" and e["path"] == target and e["writes"] for e in events):
        raise CheckFailed(f"{where} your atomic_save opened path itself for writing\nHint: "
                          f"anything written into path in place (torch.save(state, path), "
                          f"shutil.copy(tmp, path)) is half a file if the process dies during "
                          f"it; only a rename over path is atomic. {RECIPE}")
    moved = [i for i, e in enumerate(events) if e["ev"] == "replace" and e["dst"] == target]
    if not moved:
        raise CheckFailed(f"{where} no file was renamed over path (os.replace or os.rename)\n"
                          f"Hint: {RECIPE}")
    i = moved[-1]
    first = min(moved)
    gone = [e for e in events[:first] if (e["ev"] == "unlink" and e["path"] == target)
            or (e["ev"] == "replace" and e["src"] == target)]
    if gone:
        how = ("removed path" if gone[0]["ev"] == "unlink" else
               f"renamed path away ({gone[0]['fn']}(path, {Path(gone[0]['dst']).name!r}))")
        raise CheckFailed(f"{where} your atomic_save {how} before it renamed the new file "
                          f"over it\nHint: between the two there is no checkpoint at path: a "
                          f"crash there loses it. os.replace(tmp, path) replaces path in one "
                          f"atomic step; remove nothing first.")
    move = events[i]
    src = Path(move["src"])
    if src.parent != Path(target).parent:
        raise CheckFailed(
            f"{where} the new file was written in {src.parent}, then {move['fn']}() put it "
            f"over path, in {Path(target).parent}\nHint: write the temporary file in the same "
            f"directory as path. A rename is atomic only within one file system: checkpoints "
            f"usually go to another disk (a shared or network file system) than {src.parent}, "
            f"and there os.replace fails (OSError: Invalid cross-device link) while "
            f"shutil.move falls back to a copy into path, written in place. "
            f"tmp = path.with_name('.' + path.name + '.tmp').")
    syncs = [e for e in events[:i] if e["ev"] == "fsync" and e["key"] == move["key"]]
    later = [e for e in events[i:] if e["ev"] == "fsync" and e["key"] == move["key"]]
    if not syncs:
        when = (" (you fsynced it after the rename: too late)" if later else "")
        raise CheckFailed(
            f"{where} the new file was not fsynced before {move['fn']}() put it over path{when}"
            f"\nHint: a killed process loses nothing the kernel has, which is why the kill "
            f"passed, but a power cut or a kernel crash loses what is still in memory, and the "
            f"disk may record the rename before the data: after the reboot path names an empty "
            f"or half-written file, and the previous checkpoint is gone. f.flush(), then "
            f"os.fsync(f.fileno()), then os.replace(tmp, path).")
    last = syncs[-1]
    if last["handed"] is not None and last["size"] < last["handed"]:
        raise CheckFailed(
            f"{where} the file was fsynced when only {last['size']:,} of the "
            f"{last['handed']:,} bytes written to it had left Python's buffer\nHint: call "
            f"f.flush() before os.fsync(f.fileno()): fsync makes durable what the kernel has, "
            f"and the rest was still in the file object's buffer.")
    left = [e for e in events if e["ev"] == "returned"]
    if left and left[0]["left"]:
        raise CheckFailed(_left_behind(where.split("\n")[0], left[0]["left"]))
    _directory_synced(where, events, i, folder)


def _directory_synced(where, events, moved, folder):
    """The directory must be fsynced after the rename (event ``moved``)."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    key = [folder.stat().st_dev, folder.stat().st_ino]
    syncs = [j for j, e in enumerate(events) if e["ev"] == "fsync" and e["key"] == key]
    if any(j > moved for j in syncs):
        return
    why = ("\nHint: the rename is a change to the directory (the entry path now names the new "
           "file), and a change to a directory reaches the disk only when the directory itself "
           "is fsynced. Until then a power cut can undo the rename: after the reboot path names "
           "the previous checkpoint although atomic_save returned, and the training loop, "
           "which went on (and may have deleted older checkpoints), counts on a save that is "
           "not there.")
    if syncs:
        raise CheckFailed(f"{where} path's directory was fsynced before {events[moved]['fn']}() "
                          f"put the new file over path, not after{why} An fsync before the "
                          f"rename makes durable the directory as it was before it.")
    others = sorted({e["path"] for e in events[moved:] if e["ev"] == "fsync" and e.get("dir")})
    if others:
        raise CheckFailed(f"{where} the directory fsynced after {events[moved]['fn']}() was "
                          f"{others[0]}, not path's directory ({folder}){why}")
    raise CheckFailed(f"{where} path's directory was not fsynced after {events[moved]['fn']}() "
                      f"put the new file over path{why} (Step 5 of the exercise.)")


# ---------------------------------------------------------------- exercise 2: resume
def checkpoint_name(step):
    """The file of the checkpoint of ``step`` in its directory: ``step-00000012.pt``.
    Introduced in labs/11_fault_tolerance.ipynb."""
    return f"step-{step:08d}.pt"


def make_model(seed=0):
    """Exercise 2's model: a float64 MLP 6 -> 16 -> 1, initialised from ``seed`` (the global
    generators are left as they were). Introduced in labs/11_fault_tolerance.ipynb."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return model


def make_optimizer(model):
    """Exercise 2's optimizer: Adam (two moments and a step count per parameter).
    Introduced in labs/11_fault_tolerance.ipynb."""
    return torch.optim.Adam(model.parameters(), lr=LR)


def train_step(model, optimizer, step):
    """One step of training on the batch of ``step`` (a function of ``step`` alone, so a resumed
    run sees what the uninterrupted one saw); returns the loss.
    Introduced in labs/11_fault_tolerance.ipynb."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 6, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def snapshot(model, optimizer):
    """Copies of the model's and the optimizer's state dicts.
    Introduced in labs/11_fault_tolerance.ipynb."""
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict())}


def reference_run(steps=FINAL):
    """The uninterrupted run: ``snapshot`` after every step, from 0 (the initialisation).
    Introduced in labs/11_fault_tolerance.ipynb."""
    model = make_model(0)
    optimizer = make_optimizer(model)
    snaps = {0: snapshot(model, optimizer)}
    for s in range(steps):
        train_step(model, optimizer, s)
        snaps[s + 1] = snapshot(model, optimizer)
    return snaps


def _difference(expected, got, name):
    """The first difference between two (nested) states, bit for bit, or None."""
    if torch.is_tensor(expected):
        if not torch.is_tensor(got):
            return f"{name}: expected a tensor, got {type(got).__name__}"
        if expected.shape != got.shape or expected.dtype != got.dtype:
            return (f"{name}: expected {expected.dtype} of shape {tuple(expected.shape)}, got "
                    f"{got.dtype} of shape {tuple(got.shape)}")
        if not torch.equal(expected, got):
            diff = (expected.double() - got.double()).abs().flatten()
            i = int(diff.argmax())
            return (f"{name}: {int((diff > 0).sum())} of {diff.numel()} numbers differ (at index "
                    f"{i}: expected {expected.flatten()[i].item():.6g}, got "
                    f"{got.flatten()[i].item():.6g})")
        return None
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(expected) != set(got):
            keys = sorted(map(str, got)) if isinstance(got, dict) else type(got).__name__
            return f"{name}: expected keys {sorted(map(str, expected))}, got {keys}"
        for k in expected:
            problem = _difference(expected[k], got[k], f"{name}[{k!r}]")
            if problem:
                return problem
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return f"{name}: expected {len(expected)} items, got {got!r:.60}"
        for k, (e, g) in enumerate(zip(expected, got, strict=True)):
            problem = _difference(e, g, f"{name}[{k}]")
            if problem:
                return problem
        return None
    return None if expected == got else f"{name}: expected {expected!r}, got {got!r}"


def _model_holds(model, snaps, initial, flipped):
    """Which state the model's parameters are: 'step N', 'step 12 as damaged', 'its own
    initialisation', or None."""
    got = model.state_dict()
    if flipped is not None and _difference(flipped, got, "") is None:
        return f"step {LAST}'s parameters with the flipped byte"
    if _difference(initial, got, "") is None:
        return "its own initialisation (unchanged)"
    for step in sorted(snaps, reverse=True):
        if _difference(snaps[step]["model"], got, "") is None:
            return f"step {step}'s parameters"
    return None


def _flip(file, param):
    """Flip one bit of the middle number of ``param`` where its bytes sit in ``file`` (the top
    bit of its mantissa); returns (index, the damaged state of that parameter) or None when the
    bytes are not found (then a byte in the middle of the file is flipped)."""
    data = bytearray(file.read_bytes())
    raw = param.detach().contiguous().numpy().tobytes()
    at = data.find(raw)
    if at < 0:
        data[len(data) // 2] ^= 0x08
        file.write_bytes(bytes(data))
        return None
    k = param.numel() // 2
    data[at + 8 * k + 6] ^= 0x08
    file.write_bytes(bytes(data))
    damaged = param.detach().clone().flatten()
    damaged[k] = torch.frombuffer(bytearray(data[at + 8 * k: at + 8 * k + 8]),
                                  dtype=torch.float64)[0]
    return k, damaged.reshape(param.shape)


RESUME_CASES = [  # (label, damage, the step resume must return)
    ("nothing damaged", None, 12),
    ("step 12's checkpoint cut to half its bytes", "cut", 8),
    ("one bit flipped in a parameter inside step 12's checkpoint", "flip", 8),
    ("step 12's checkpoint deleted", "delete", 8),
    ("every checkpoint damaged: 12 flipped, 8 cut short, 4 deleted", "all", 0),
    ("a directory that does not exist (a first start)", "missing", 0),
    ("step 12's checkpoint whole, but every other file its save wrote (its checksum) deleted",
     "beside", None),  # 8, or 12 when the save wrote nothing but the .pt (a checksum inside)
    ("the save of step 12 SIGKILLed half-way (in a new process)", "kill", 8),  # last: slowest
]


def _unfinished(name, err, fns):
    """False after the not-implemented notice, naming exercise 1 if that is where it came
    from."""
    frames = traceback.extract_tb(err.__traceback__)
    innermost = frames[-1].name if frames else ""
    if innermost not in {getattr(f, "__name__", "") for f in fns} and innermost != "<module>":
        print(f"… {name}: your {innermost} (exercise 1?) is not implemented yet — finish it, "
              f"then run this check again.")
        return False
    return not_implemented(name)


def _save_all(name, where, save_checkpoint, directory, kind, workdir):
    """Train to step 12, saving every 4 steps (the save of 12 killed for ``kind`` "kill");
    returns the model and optimizer, or False while something is not implemented."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    model = make_model(0)
    optimizer = make_optimizer(model)
    for s in range(LAST):
        train_step(model, optimizer, s)
        step = s + 1
        if step % SAVE_EVERY:
            continue
        if kind == "kill" and step == LAST:
            _kill_save(where, save_checkpoint, directory, step, model, optimizer, workdir)
            continue
        before = set(_listing(directory)) if directory.is_dir() else set()
        try:
            save_checkpoint(directory, step, model, optimizer)
        except NotImplementedError as err:
            return _unfinished(name, err, [save_checkpoint])
        except Exception as err:
            hint = "see where it raised (in a notebook: under 'Your code', below)."
            if isinstance(err, FileNotFoundError) and not directory.exists():
                hint = ("the directory does not exist before the first save: create it "
                        "(Path(directory).mkdir(parents=True, exist_ok=True)).")
            raise CheckFailed(f"{where}\n  save_checkpoint(directory, {step}, model, optimizer) "
                              f"raised {type(err).__name__}: {err}\nHint: {hint}") from err
        file = directory / checkpoint_name(step)
        if not file.is_file():
            there = _listing(directory) if directory.is_dir() else "no directory"
            raise CheckFailed(f"{where}\n  after save_checkpoint(directory, {step}, model, "
                              f"optimizer) returned, there is no {file.name} (the directory "
                              f"holds {there})\nHint: save the checkpoint of step {step} as "
                              f"directory / f'step-{{step:08d}}.pt' = {file.name}, with your "
                              f"atomic_save.")
        beside = sorted(set(_listing(directory)) - before - {file.name})
    older = directory / checkpoint_name(LAST - SAVE_EVERY)
    if not older.is_file():
        raise CheckFailed(f"{where}\n  after the saves of steps 4, 8 and 12, there is no "
                          f"{older.name} (the directory holds {_listing(directory)})\nHint: "
                          f"your save_checkpoint removed the older checkpoints. When the newest "
                          f"one turns out damaged, resume needs an older one to fall back on: "
                          f"remove old checkpoints only beyond the last few, never down to one.")
    return model, optimizer, beside


def _kill_save(where, save_checkpoint, directory, step, model, optimizer, workdir):
    """The save of ``step`` in a watched process, SIGKILLed half-way through its bytes."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    size = (directory / checkpoint_name(step - SAVE_EVERY)).stat().st_size
    calls = [("killed", save_checkpoint, (directory, step, model, optimizer), size // 2, None)]
    try:
        code, events, stderr = run_calls_watched(calls, workdir)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{where}\n  the process did not end in {CHILD_TIMEOUT} s") from None
    error = _raised(where, "save_checkpoint", events, code, stderr)
    if error:
        raise error
    if not any(e["ev"] == "killed" for e in events):
        tail = stderr.strip().splitlines()[-1:] or [f"exit code {code}"]
        raise CheckFailed(f"{where}\n  the save of step {step} was never killed: it finished "
                          f"without handing {size // 2:,} bytes (half of step "
                          f"{step - SAVE_EVERY}'s file) to one file ({tail[0]})\nHint: write "
                          f"the checkpoint with your atomic_save, through open() or torch.save.")


def _damage(kind, directory, model, beside):
    """Damage the checkpoints as ``kind`` says (``beside``: what the save of step 12 wrote
    beside its file); returns the flipped parameter's damaged state dict (or None)."""
    newest = directory / checkpoint_name(LAST)
    flipped = None
    if kind == "beside":
        for other in beside:
            (directory / other).unlink()
    if kind in ("flip", "all"):
        name = next(k for k, v in model.state_dict().items() if v.dim() == 2)  # '0.weight'
        done = _flip(newest, model.state_dict()[name])
        if done is not None:
            flipped = {k: v.detach().clone() for k, v in model.state_dict().items()}
            flipped[name] = done[1]
    if kind == "cut":
        data = newest.read_bytes()
        newest.write_bytes(data[:len(data) // 2])
    if kind == "delete":
        newest.unlink()
    if kind == "all":
        older = directory / checkpoint_name(LAST - SAVE_EVERY)
        data = older.read_bytes()
        older.write_bytes(data[:len(data) // 2])
        (directory / checkpoint_name(LAST - 2 * SAVE_EVERY)).unlink()
    return flipped


def _wrong_step(kind, step, expected, held):
    """The hint when resume returned ``step`` instead of ``expected``."""
    if step not in (0, *range(SAVE_EVERY, LAST + 1, SAVE_EVERY)):
        also = f" (the model holds {held})" if held else ""
        return (f"there is no checkpoint of step {step}: the check saved steps 4, 8 and 12. "
                f"Return the step that the checkpoint you loaded holds{also}, not a number "
                f"worked out from it.")
    if kind in ("flip", "all") and (step == LAST or (held or "").endswith("flipped byte")):
        return FLIP_HINT
    if kind == "beside" and step == LAST:
        return ("step 12's file is whole, but nothing is left to check it against (what its "
                "save wrote beside it is gone): a checkpoint that cannot be checked is not a "
                "good one. Skip it as you skip a damaged file.")
    if kind is None and step == 0:
        return ("nothing is damaged in this case, yet your resume found no checkpoint it "
                "could use: what did it print about each file it skipped (above)? Does "
                "resume read back what save_checkpoint wrote?")
    damaged = {"cut": "cut to half its bytes", "delete": "deleted",
               "kill": "never written (its save was killed half-way)"}
    if step > expected:
        what = ("it is damaged" if kind == "all" else
                f"that checkpoint is {damaged.get(kind, 'damaged')}")
        return (f"resume returned step {step}, but {what}: return the step of the checkpoint "
                f"you loaded (state['step']), 0 when none is whole.")
    if step == 0:
        return (f"resume found nothing to resume from, but step {expected}'s checkpoint is "
                f"whole. Does it give up at the first damaged file instead of trying the one "
                f"before? Look at the directory's step-*.pt files, newest first, and take the "
                f"first one that loads and checks.")
    return (f"resume went back to step {step}, but step {expected}'s checkpoint is whole: try "
            f"the checkpoints newest first (sorted by step) and stop at the first that loads "
            f"and checks.")


FLIP_HINT = ("the check flipped one bit of a parameter inside step 12's file, and torch.load "
             "read it without a complaint: the numbers are simply wrong (a zip of tensors "
             "carries checksums, but torch.load does not check them). Only a checksum written "
             "with the file finds this: in save_checkpoint, after atomic_save, save "
             "hashlib.sha256(path.read_bytes()).hexdigest() beside it (atomic_save(digest, "
             "path.with_suffix('.sha256')), written last), or keep the state's bytes and their "
             "digest together in the file; in resume, compare the digest of the bytes with it "
             "before loading anything.")


def _raise_hint(kind, err):
    if kind == "missing":
        return ("a directory that does not exist is a first start: return 0. "
                "(Path(directory).glob('step-*.pt') finds nothing there; os.listdir raises.)")
    if kind == "delete":
        return ("step 12's file is gone (deleted, or its save never finished): look only at "
                "the files that are there, Path(directory).glob('step-*.pt'), newest first.")
    if kind is None:
        if isinstance(err, KeyError):
            return ("a key your resume reads is not in what your save_checkpoint wrote: save "
                    "everything resume loads, under the names it reads them by.")
        return "see where it raised (in a notebook: under 'Your code', below)."
    if kind == "beside":
        return ("step 12's checkpoint is whole, but what its save wrote beside it (the "
                "checksum) is gone, and your resume stopped on the error that raised. A "
                "checkpoint that cannot be checked is skipped like a damaged one: does your "
                "except catch every way the check of a file can fail?")
    hint = ("a damaged or half-written file must not stop the resume: catch the error of each "
            "checkpoint you try (except Exception as e), print its name and why, and try the "
            "one before.")
    if kind == "kill":
        hint += (" And only the step-*.pt files are checkpoints, not the temporary file that "
                 "the killed save left behind (the next save may remove it).")
    return hint


def check_resume(save_checkpoint, resume) -> bool:
    """Lab 11, exercise 2: ``save_checkpoint(directory, step, model, optimizer)`` saves
    ``directory/step-{step:08d}.pt`` (the check trains 12 steps and saves every 4), and
    ``resume(directory, model, optimizer)`` loads the newest whole checkpoint into a fresh model
    and optimizer and returns its step (0 when there is none). Each case of ``RESUME_CASES``
    damages the checkpoints first; the model and the optimizer must then hold, bit for bit, what
    they held at the returned step (or be left alone at 0), and the resumed run must end at step
    16 where the uninterrupted one does. Prints a pass line and returns True; returns False while
    a function raises NotImplementedError; raises CheckFailed with what the code did otherwise.
    Introduced in labs/11_fault_tolerance.ipynb."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_resume"
    snaps = reference_run()
    for number, (label, kind, expected) in enumerate(RESUME_CASES, start=1):
        where = f"{name}: case {number}/{len(RESUME_CASES)} ({label})"
        with tempfile.TemporaryDirectory(prefix="lab11-resume-") as tmp:
            directory = Path(tmp) / "checkpoints"
            flipped, left = None, None
            if kind != "missing":
                saved = _save_all(name, where, save_checkpoint, directory, kind, tmp)
                if saved is False:
                    return False
                if kind == "beside":
                    expected = LAST - SAVE_EVERY if saved[2] else LAST
                flipped = _damage(kind, directory, saved[0], saved[2])
                left = _listing(directory)
            model = make_model(1)  # not the run's initialisation: resume must load it
            optimizer = make_optimizer(model)
            initial = snapshot(model, optimizer)
            heard = _Heard()
            try:
                with heard:
                    got = resume(directory, model, optimizer)
            except NotImplementedError as err:
                return _unfinished(name, err, [resume])
            except Exception as err:
                there = f"\n  the directory held {left}" if left is not None else ""
                raise CheckFailed(f"{where}\n  your resume raised {type(err).__name__}: {err}"
                                  f"{there}{heard.said()}\nHint: {_raise_hint(kind, err)}"
                                  ) from err
        _check_resumed(where, kind, expected, got, model, optimizer, snaps, initial, flipped,
                       heard)
        _check_heard(where, kind, expected, left or [], heard)
    print(f"✓ {name}: {len(RESUME_CASES)}/{len(RESUME_CASES)} cases: the newest whole checkpoint "
          f"every time (cut short, a flipped bit, deleted, nothing whole, no directory, no "
          f"checksum, a killed save), each damaged one reported, and every resumed run ends at "
          f"step {FINAL} bit for bit where the uninterrupted one does")
    return True


class _Heard:
    """What a call printed (stdout, stderr: shown as it comes, and kept), warned or logged."""

    def __init__(self):
        self.text = io.StringIO()

    def __enter__(self):
        import contextlib
        import logging
        import warnings
        heard = self

        class Tee(io.TextIOBase):
            def __init__(self, stream):
                self.stream = stream

            def write(self, text):
                heard.text.write(text)
                return self.stream.write(text)

            def flush(self):
                self.stream.flush()

        class Handler(logging.Handler):
            def emit(self, record):
                heard.text.write(self.format(record) + "\n")

        self.stack = contextlib.ExitStack()
        self.stack.enter_context(contextlib.redirect_stdout(Tee(sys.stdout)))
        self.stack.enter_context(contextlib.redirect_stderr(Tee(sys.stderr)))
        self.warned = self.stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        handler, root = Handler(), logging.getLogger()
        root.addHandler(handler)
        self.stack.callback(root.removeHandler, handler)
        return self

    def __exit__(self, *exc):
        self.stack.close()
        for w in self.warned:
            self.text.write(f"{w.category.__name__}: {w.message}\n")
        return False

    def names(self, step):
        """Whether what was heard names the checkpoint of ``step`` (its file, or its step)."""
        import re
        return re.search(rf"(?<![\d.]){step}(?!\d)|(?<!\d)0+{step}(?!\d)",
                         self.text.getvalue()) is not None

    def said(self, lines=3, silence=""):
        """The first ``lines`` lines heard, for a message (``silence`` when nothing)."""
        heard = [line for line in self.text.getvalue().splitlines() if line.strip()]
        if not heard:
            return silence
        more = f" (and {len(heard) - lines} more lines)" if len(heard) > lines else ""
        return "\n  it printed: " + "\n              ".join(h[:100] for h in heard[:lines]) + more


def _check_heard(where, kind, expected, left, heard):
    """Every damaged checkpoint newer than the one resumed must have been reported."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    skipped = [s for s in range(LAST, expected, -SAVE_EVERY) if checkpoint_name(s) in left]
    silent = [s for s in skipped if not heard.names(s)]
    if kind in (None, "kill", "delete", "missing") or not silent:
        return
    said = heard.said(silence="\n  it printed nothing")
    raise CheckFailed(
        f"{where}\n  resume returned step {expected} (right), but it skipped "
        f"{checkpoint_name(silent[0])} without a word: nothing it printed, logged or warned "
        f"names it{said}\nHint: a damaged checkpoint is news. The disk that cut it short "
        f"or flipped its bit will do it again, and whoever restarts the job must know it went "
        f"back further than the newest file. Print each checkpoint you skip: its name and why.")


def _check_resumed(where, kind, expected, got, model, optimizer, snaps, initial, flipped,
                   heard):
    """The returned step, then the model's and the optimizer's state, then the run resumed."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    step = got.item() if torch.is_tensor(got) and got.numel() == 1 else got
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        step = int(step)
    else:
        raise CheckFailed(f"{where}\n  resume returned {got!r:.80}, expected the step "
                          f"{expected}\nHint: return the step of the checkpoint you loaded "
                          f"(an int: state['step']), or 0 when there is none.")
    held = _model_holds(model, snaps, initial["model"], flipped)
    holds = f"; the model holds {held}" if held else ""
    if step != expected:
        raise CheckFailed(f"{where}\n  resume returned step {step}, expected {expected}{holds}"
                          f"{heard.said()}\nHint: {_wrong_step(kind, step, expected, held)}")
    if expected == 0:
        problem = (_difference(initial["model"], model.state_dict(), "model")
                   or _difference(initial["optimizer"], optimizer.state_dict(), "optimizer"))
        if problem:
            raise CheckFailed(
                f"{where}\n  resume returned 0, but it changed the model or the optimizer "
                f"({problem}){holds}\nHint: nothing is whole, so the run starts afresh and the "
                f"model must stay as it was: check a checkpoint completely (the checksum, "
                f"torch.load) before loading anything from it into the model or optimizer.")
        return
    problem = _difference(snaps[expected]["model"], model.state_dict(), "model")
    if problem:
        if held and held.endswith("flipped byte"):
            hint = FLIP_HINT
        else:
            hint = ("load the checkpoint's model state into the model you were given: "
                    "model.load_state_dict(state['model']).")
        raise CheckFailed(f"{where}\n  resume returned step {step}, but the model's state is "
                          f"not step {step}'s: {problem}{holds}\nHint: {hint}")
    problem = _difference(snaps[expected]["optimizer"], optimizer.state_dict(), "optimizer")
    if problem:
        fresh = " (it is still a fresh optimizer)" if not optimizer.state_dict()["state"] else ""
        raise CheckFailed(f"{where}\n  the model is step {step}'s, but the optimizer's state is "
                          f"not{fresh}: {problem}\nHint: Adam keeps two moments and a step "
                          f"count for every parameter, and the next step depends on them: save "
                          f"optimizer.state_dict() in save_checkpoint and load it in resume "
                          f"with optimizer.load_state_dict(state['optimizer']).")
    for s in range(step, FINAL):
        train_step(model, optimizer, s)
    problem = _difference(snaps[FINAL]["model"], model.state_dict(), "model")
    if problem:
        raise CheckFailed(f"{where}\n  resumed at step {step} with its model and optimizer, "
                          f"the run did not end at step {FINAL} where the uninterrupted one did: "
                          f"{problem}\nHint: restore everything the next steps read: the "
                          f"model, the optimizer (state and param_groups), the step.")


# ---------------------------------------------------------------- exercise 3: resharding
def _reshard_cases():
    """(label, saved chunks, the shard wanted), each a mistake's trap."""
    rows4 = [((16 * r, 0), (16, 256)) for r in range(4)]
    return [
        ("1-D, 4 chunks of 16 loaded as 2 of 32", [((16 * r,), (16,)) for r in range(4)],
         ((32,), (32,))),
        ("1-D, a shard across a boundary", [((0,), (10,)), ((10,), (10,))], ((7,), (5,))),
        ("1-D, a shard that starts where a chunk ends", [((0,), (10,)), ((10,), (10,))],
         ((10,), (10,))),
        ("1-D, chunks of unequal sizes", [((0,), (4,)), ((4,), (3,)), ((7,), (3,))],
         ((3,), (5,))),
        ("2-D, dp4 rows loaded as dp2 x tp2's rank 1", rows4, ((0, 128), (32, 128))),
        ("2-D, dp2 x tp2 blocks loaded as dp4's rank 1",
         [((0, 0), (32, 128)), ((0, 128), (32, 128)), ((32, 0), (32, 128)),
          ((32, 128), (32, 128))], ((16, 0), (16, 256))),
    ]


def _read_key(read):
    return (int(read["chunk"]), tuple(int(x) for x in read["storage_offsets"]),
            tuple(int(x) for x in read["dest_offsets"]), tuple(int(x) for x in read["lengths"]))


def _fill(saved, wanted, reads):
    """The shard filled by ``reads`` from the chunks of a tensor numbered 0, 1, 2, ... (-1
    where unread), the shard it should be, and how many elements were written more than once."""
    shape = [max(o[d] + s[d] for o, s in saved) for d in range(len(wanted[0]))]
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    shard = torch.full(tuple(wanted[1]), -1, dtype=full.dtype)
    hits = torch.zeros(tuple(wanted[1]), dtype=torch.int64)
    for chunk, storage, dest, lengths in reads:
        offsets, sizes = saved[chunk]
        part = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=False))]
        where = tuple(slice(a, a + n) for a, n in zip(dest, lengths, strict=False))
        shard[where] = part[tuple(slice(a, a + n) for a, n in zip(storage, lengths, strict=False))]
        hits[where] += 1
    want = full[tuple(slice(o, o + s) for o, s in zip(*wanted, strict=False))]
    return shard, want, int((hits > 1).sum())


def _reshard_hint(saved, wanted, got, want):
    """What the student's reads got wrong, from how they differ from the right ones."""
    right = {r[0]: r for r in want}
    if any(min(storage + dest) < 0 for _, storage, dest, _ in got):
        return ("an offset below 0: the overlap starts at max(shard's start, chunk's start) "
                "and ends at min(their ends) in every dimension, not only the first.")
    for chunk, storage, dest, lengths in got:
        if any(n <= 0 for n in lengths):
            return ("a read of length 0 (or less): a chunk that only touches the shard shares "
                    "nothing with it. Ends are exclusive: chunk [0, 10) and shard [10, 20) do "
                    "not overlap, so keep a chunk only when start < end in every dimension.")
        if chunk not in right:
            return (f"you read chunk {chunk}, which the shard does not overlap: keep a chunk "
                    f"only when max(starts) < min(ends) in every dimension.")
        r = right[chunk]
        if storage != r[1]:
            glob = tuple(a + o for a, o in zip(r[1], saved[chunk][0], strict=False))
            if storage == glob:
                return ("storage_offsets are counted from the saved chunk's first element, not "
                        "the full tensor's: subtract the chunk's offsets from the overlap's "
                        "start.")
            return "storage_offsets: the overlap's start minus the saved chunk's offsets."
        if dest != r[2]:
            glob = tuple(a + o for a, o in zip(r[2], wanted[0], strict=False))
            if dest == glob:
                return ("dest_offsets are counted inside your shard, not the full tensor: "
                        "subtract the shard's offsets from the overlap's start.")
            return "dest_offsets: the overlap's start minus the shard's offsets."
        if lengths != r[3]:
            return ("lengths: the overlap's size in each dimension, min(ends) - max(starts), "
                    "not the chunk's or the shard's size.")
    missing = sorted(set(right) - {g[0] for g in got})
    if missing:
        return (f"chunk(s) {missing} overlap the shard too and were not read: go through every "
                f"saved chunk, in every dimension.")
    return "each read must appear once."


def check_reshard_reads(student_fn) -> bool:
    """Lab 11, exercise 3: ``reshard_reads(saved, wanted)`` returns, for each saved chunk that
    overlaps the shard ``wanted``, the read DCP would make (chunk, storage_offsets,
    dest_offsets, lengths); checked against ``course_lib.checkpoint.reshard_reads`` and by
    filling the shard from a numbered tensor with the student's reads."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.checkpoint import reshard_reads
    name = "check_reshard_reads"
    cases = _reshard_cases()
    for number, (label, saved, wanted) in enumerate(cases, start=1):
        where = f"{name}: case {number}/{len(cases)} ({label}), shard {wanted}"
        try:
            got = student_fn([tuple(map(tuple, c)) for c in saved], tuple(map(tuple, wanted)))
        except NotImplementedError:
            return not_implemented(name)
        except Exception as err:
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}\n"
                              "Hint: saved is a list of (offsets, sizes) tuples, wanted one "
                              "(offsets, sizes); return a list of dicts.") from err
        try:
            got_keys = sorted(_read_key(r) for r in got)
        except (TypeError, KeyError, ValueError) as err:
            raise CheckFailed(f"{where}\n  your function returned {got!r:.200}\nHint: return "
                              "a list of dicts with the keys chunk, storage_offsets, "
                              "dest_offsets and lengths (tuples of ints).") from err
        want_keys = sorted(_read_key(r) for r in reshard_reads(saved, wanted))
        if got_keys == want_keys:
            continue
        lines = "\n".join(f"    {k}" for k in got_keys) or "    (none)"
        expected = "\n".join(f"    {k}" for k in want_keys)
        unread = ""
        if all(all(n > 0 for n in k[3]) and k[0] < len(saved) for k in got_keys):
            try:
                shard, want, twice = _fill(saved, wanted, got_keys)
                left = int((shard == -1).sum())
                wrong = int(((shard != want) & (shard != -1)).sum())
                unread = (f"\n  filled from your reads, the shard has {left} element(s) unread, "
                          f"{wrong} wrong, {twice} written twice")
            except (IndexError, RuntimeError):
                unread = "\n  your reads fall outside their chunk or the shard"
        raise CheckFailed(f"{where}\n  your reads (chunk, storage_offsets, dest_offsets, "
                          f"lengths):\n{lines}\n  expected:\n{expected}{unread}\nHint: "
                          f"{_reshard_hint(saved, wanted, got_keys, want_keys)}")
    print(f"✓ {name}: {len(cases)}/{len(cases)} layouts read as course_lib.checkpoint "
          f"(and DCP's load planner) reads them")
    return True
