"""Lab 11's checks (course_lib/checks/lab11_fault_tolerance.py): the reference answers pass (and
other right ways to write them), typical mistakes fail with their hint."""

import hashlib
import io
import os
import shutil
import tempfile
import warnings
from io import open as io_open  # as IPython binds a notebook's open: before any watch
from os import fsync as os_fsync
from os import replace as os_replace
from pathlib import Path

import pytest
import torch

from course_lib import checkpoint
from course_lib.checks import CheckFailed
from course_lib.checks import lab11_fault_tolerance as checks


# ---------------------------------------------------------------- exercise 1
def atomic_save(state, path):
    """The lab's answer: bytes first, a temporary file beside path, flush, fsync, replace,
    fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_directory(path, fsync=None):
    fd = os.open(Path(path).parent, os.O_RDONLY)
    try:
        (fsync or os.fsync)(fd)
    finally:
        os.close(fd)


def named_temporary_file(state, path):
    """Right too: tempfile beside path, torch.save on the open file."""
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
        try:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            os.unlink(f.name)
            raise
    os.replace(f.name, path)
    sync_directory(path)


def torch_save_on_a_path(state, path):
    """Right too: torch.save writes the temporary file by its path; fsync through os.open."""
    tmp = str(path) + ".tmp"
    try:
        torch.save(state, tmp)
    except Exception:
        os.remove(tmp)
        raise
    fd = os.open(tmp, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    os.rename(tmp, path)
    sync_directory(path)


def mkstemp_and_os_write(state, path):
    """Right too: a file descriptor and os.write."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    data = memoryview(buffer.getvalue())
    try:
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except OSError:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    Path(tmp).replace(path)
    sync_directory(path)


def names_bound_early(state, path):
    """Right too: open, fsync and replace bound to other names before the check's watch."""
    tmp = path.with_name(path.name + ".tmp")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        with io_open(tmp, "wb") as f:  # noqa: UP020 - the point: a name bound before the watch
            f.write(buffer.getvalue())
            f.flush()
            os_fsync(f.fileno())
    except BaseException:
        tmp.unlink()
        raise
    os_replace(tmp, path)
    sync_directory(path, fsync=os_fsync)


def library_atomic_write(state, path):
    """Right too: the library's own write."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    checkpoint.atomic_write(path, buffer.getvalue())


@pytest.mark.parametrize("fn", [atomic_save, named_temporary_file, torch_save_on_a_path,
                                mkstemp_and_os_write, names_bound_early,
                                library_atomic_write],
                         ids=lambda f: f.__name__)
def test_atomic_save_check_passes_right_answers(fn, capsys):
    assert checks.check_atomic_save(fn) is True
    out = capsys.readouterr().out
    assert "✓ check_atomic_save: SIGKILLed after 4" in out and "previous checkpoint" in out
    assert "then fsynced the directory; a save on a full disk raised" in out


def test_atomic_save_check_returns_false_until_implemented(capsys):
    def unfinished(state, path):
        raise NotImplementedError
    assert checks.check_atomic_save(unfinished) is False
    assert "not implemented yet" in capsys.readouterr().out


def make_save(mistake):
    """A save with one typical mistake."""
    def save(state, path):
        path = Path(path)
        if mistake == "in place":
            torch.save(state, path)
            return
        if mistake == "in place through open":
            with open(path, "wb") as f:
                torch.save(state, f)
            return
        if mistake == "does nothing":
            return
        if mistake == "saves the tensor only":
            state = state["w"]
        if mistake == "backup copy left" and path.exists():
            shutil.copy2(path, path.with_suffix(".bak"))
        if mistake in ("tmp in /tmp", "shutil.move from /tmp"):
            with tempfile.NamedTemporaryFile(delete=False) as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            if mistake == "tmp in /tmp":
                os.replace(f.name, path)
            else:
                shutil.move(f.name, path)
            return
        tmp = path.with_name(path.name + ".tmp")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        with open(tmp, "wb") as f:
            if mistake == "fsync before flush":  # small writes: the tail is still buffered
                for i in range(0, len(data), 4096):
                    f.write(data[i:i + 4096])
            else:
                f.write(data)
            if mistake not in ("no fsync", "fsync after the replace", "fsync before flush"):
                f.flush()
            if mistake not in ("no fsync", "fsync after the replace"):
                os.fsync(f.fileno())
        if mistake == "copy into path":
            shutil.copyfile(tmp, path)
            os.remove(tmp)
            return
        if mistake == "unlink first" and path.exists():
            os.remove(path)
        if mistake == "rename the old one away" and path.exists():
            os.replace(path, path.with_suffix(".old"))
        os.replace(tmp, path)
        if mistake == "fsync after the replace":
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        if mistake == "raises":
            raise ValueError("something went wrong on purpose")
    return save


@pytest.mark.parametrize("mistake,hint", [
    ("in place", r"after the kill, path holds 4\d\d,\d\d\d bytes that torch.load\(path, "
                 r"weights_only=True\) cannot read.*\n.*killed the process after 4[\d,]+ of .*"
                 r"\nHint: your atomic_save wrote straight into path: opening it for writing "
                 r"emptied the previous checkpoint at once"),
    ("in place through open", r"Hint: your atomic_save wrote straight into path"),
    ("tmp in /tmp", r"the new file was written in /tmp, then os.replace\(\) put it over path.*"
                    r"\nHint: write the temporary file in the same directory as path\. A rename "
                    r"is atomic only within one file system"),
    ("shutil.move from /tmp", r"written in /tmp, then os.rename\(\) put it over path"),
    ("no fsync", r"the new file was not fsynced before os.replace\(\) put it over path\nHint: "
                 r"a killed process loses nothing the kernel has.*power cut"),
    ("fsync after the replace", r"not fsynced before os.replace\(\) put it over path \(you "
                                r"fsynced it after the rename: too late\)"),
    ("fsync before flush", r"fsynced when only [\d,]+ of the [\d,]+ bytes written to it had left "
                           r"Python's buffer\nHint: call f.flush\(\) before os.fsync"),
    ("unlink first", r"your atomic_save removed path before it renamed the new file over it\n"
                     r"Hint: between the two there is no checkpoint at path"),
    ("rename the old one away", r"renamed path away \(os.replace\(path, 'checkpoint.old'\)\) "
                                r"before it renamed the new file over it"),
    ("copy into path", r"your atomic_save opened path itself for writing\nHint: anything "
                       r"written into path in place"),
    ("backup copy left", r"after a save that returned, it left behind "
                         r"\['.*checkpoint.bak'\]\nHint: a save that returns must leave path "
                         r"alone"),
    ("raises", r"a first save, into an empty directory \(in this process\)\n  your atomic_save "
               r"raised ValueError: something went wrong on purpose"),
    ("does nothing", r"after atomic_save returned, path does not exist; expected the state it "
                     r"was given \(step 1\)"),
    ("saves the tensor only", r"path holds a Tensor, not a state that the check saved"),
])
def test_atomic_save_check_names_the_mistake(mistake, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_atomic_save(make_save(mistake))


def make_careful_save(mistake):
    """The lab's answer with one mistake in its clean-up or its fsync of the directory."""
    def save(state, path):
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        if mistake == "directory fsynced before the rename":
            sync_directory(path)
        try:
            with open(tmp, "wb") as f:
                f.write(buffer.getvalue())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if mistake == "temporary file left when a write fails":
                raise
            if mistake == "removes path when a write fails":
                path.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
            if mistake == "error swallowed":
                print("could not save the checkpoint")
                return
            raise
        if mistake == "another directory fsynced":
            fd = os.open(".", os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        elif mistake not in ("no directory fsync", "directory fsynced before the rename"):
            sync_directory(path)
    return save


@pytest.mark.parametrize("mistake,hint", [
    ("no directory fsync", r"in the complete save path's directory was not fsynced after "
                           r"os.replace\(\) put the new file over path\nHint: the rename is a "
                           r"change to the directory"),
    ("directory fsynced before the rename", r"path's directory was fsynced before os.replace\(\) "
                                            r"put the new file over path, not after\nHint:.*An "
                                            r"fsync before the rename"),
    ("another directory fsynced", r"the directory fsynced after os.replace\(\) was .*lab11-"
                                  r"atomic-\w+, not path's directory"),
    ("temporary file left when a write fails",
     r"a save on a disk that fills up half-way\n  your atomic_save raised OSError \(good\), but "
     r"left behind \['.checkpoint.pt.tmp-\d+'\] \(the check made every write fail.*\nHint: every "
     r"failed save then leaves one more half-written file"),
    ("error swallowed", r"your atomic_save returned as if the checkpoint were saved, although its "
                        r"write raised \(the check made every write fail with OSError: \[Errno "
                        r"28\].*\nHint: the caller \(the training loop\) now believes"),
    ("removes path when a write fails", r"after the failed save, path does not exist; expected "
                                        r"the previous checkpoint \(step 2\).*\nHint: when the "
                                        r"write failed, your atomic_save removed path"),
])
def test_atomic_save_check_names_a_careless_clean_up_or_sync(mistake, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_atomic_save(make_careful_save(mistake))


def test_the_killed_save_in_place_leaves_half_a_file(tmp_path):
    """The watched process itself: killed at half of the bytes, the journal says where."""
    path = tmp_path / "c.pt"
    torch.save(checks.case_state(1), path)
    calls = [("killed", make_save("in place"), (checks.case_state(2), path), 1000, path)]
    code, events, _ = checks.run_calls_watched(calls, tmp_path)
    assert code == -9
    killed = [e for e in events if e["ev"] == "killed"]
    assert killed and killed[0]["written"] == 1000 and Path(killed[0]["path"]) == path
    assert path.stat().st_size == 1000


# ---------------------------------------------------------------- exercise 2
def save_checkpoint(directory, step, model, optimizer):
    """The lab's answer: the checkpoint, then its SHA-256 beside it, written last."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{step:08d}.pt"
    atomic_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "step": step}, path)
    atomic_save(hashlib.sha256(path.read_bytes()).hexdigest(), path.with_suffix(".sha256"))


def resume(directory, model, optimizer):
    """The lab's answer: newest first, the checksum checked before anything is loaded."""
    for path in sorted(Path(directory).glob("step-*.pt"), reverse=True):
        try:
            expected = torch.load(path.with_suffix(".sha256"), weights_only=True)
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != expected:
                raise ValueError("checksum mismatch")
            state = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            print(f"skipping {path.name}: {type(e).__name__}: {e}")
            continue
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return state["step"]
    return 0


def save_inside(directory, step, model, optimizer):
    """Right too: the state's bytes and their SHA-256 together in one file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
               buffer)
    payload = buffer.getvalue()
    atomic_save({"sha256": hashlib.sha256(payload).hexdigest(),
                 "payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8)},
                directory / f"step-{step:08d}.pt")


def resume_inside(directory, model, optimizer):
    for path in sorted(Path(directory).glob("step-*.pt"), reverse=True):
        try:
            saved = torch.load(path, weights_only=True)
            payload = saved["payload"].numpy().tobytes()
            if hashlib.sha256(payload).hexdigest() != saved["sha256"]:
                raise ValueError("checksum mismatch")
            state = torch.load(io.BytesIO(payload), weights_only=True)
        except Exception as e:
            warnings.warn(f"{path}: {e}", stacklevel=1)
            continue
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return state["step"]
    return 0


def save_with_the_library(directory, step, model, optimizer):
    Path(directory).mkdir(parents=True, exist_ok=True)
    checkpoint.save_file({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "step": step}, Path(directory, f"step-{step:08d}.pt"))


def resume_with_the_library(directory, model, optimizer):
    state, _ = checkpoint.load_latest(directory)
    if state is None:
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


@pytest.mark.parametrize("save,load", [(save_checkpoint, resume),
                                       (save_inside, resume_inside),
                                       (save_with_the_library, resume_with_the_library)],
                         ids=["checksum beside", "checksum inside", "the library's"])
def test_resume_check_passes_right_answers(save, load, capsys):
    assert checks.check_resume(save, load) is True
    out = capsys.readouterr().out
    assert "✓ check_resume: 8/8 cases" in out and "bit for bit" in out


def test_resume_check_returns_false_until_implemented(capsys):
    def unfinished_save(directory, step, model, optimizer):
        raise NotImplementedError

    def unfinished_resume(directory, model, optimizer):
        raise NotImplementedError
    assert checks.check_resume(unfinished_save, resume) is False
    assert "check_resume: not implemented yet" in capsys.readouterr().out
    assert checks.check_resume(save_checkpoint, unfinished_resume) is False
    assert "check_resume: not implemented yet" in capsys.readouterr().out

    def atomic_save_unfinished(state, path):
        raise NotImplementedError

    def save_on_it(directory, step, model, optimizer):
        Path(directory).mkdir(parents=True, exist_ok=True)
        atomic_save_unfinished({"step": step}, Path(directory) / f"step-{step:08d}.pt")
    assert checks.check_resume(save_on_it, resume) is False
    assert "your atomic_save_unfinished (exercise 1?) is not implemented" in \
        capsys.readouterr().out


def plain_save(directory, step, model, optimizer):
    """No checksum."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "step": step}, directory / f"step-{step:08d}.pt")


def make_resume(mistake):
    """A resume with one typical mistake: on plain checkpoints for the mistakes named "no
    checksum...", else on the lab's (the checksum beside the file)."""
    def load(directory, model, optimizer):
        directory = Path(directory)
        names = (os.listdir(directory) if mistake == "os.listdir" else
                 [p.name for p in directory.glob("*.pt")])
        paths = sorted((directory / n for n in names if n.endswith(".pt")),
                       reverse=mistake != "oldest first")
        for path in paths:
            if mistake == "step from the name":
                step = int(path.stem.split("-")[1])
            if mistake == "no checksum, no try":
                state = torch.load(path, weights_only=True)
            else:
                try:
                    data = path.read_bytes()
                    if mistake == "no checksum":
                        state = torch.load(io.BytesIO(data), weights_only=True)
                    else:
                        if mistake == "loads before checking":
                            state = torch.load(io.BytesIO(data), weights_only=True)
                            model.load_state_dict(state["model"])
                        expected = torch.load(path.with_suffix(".sha256"), weights_only=True)
                        if hashlib.sha256(data).hexdigest() != expected:
                            raise ValueError("checksum mismatch")
                        state = torch.load(io.BytesIO(data), weights_only=True)
                except Exception as e:
                    if mistake == "gives up":
                        return 0
                    print(f"skipping {path.name}: {e}")
                    continue
            if mistake == "step from the newest name":
                state["step"] = int(paths[0].name[5:13])
            if mistake == "step from the name":
                state["step"] = step
            if mistake != "model not loaded":
                model.load_state_dict(state["model"])
            if mistake != "optimizer not loaded":
                optimizer.load_state_dict(state["optimizer"])
            return None if mistake == "returns None" else state["step"]
        return 0
    return load


def save_named(directory, step, model, optimizer):
    Path(directory).mkdir(parents=True, exist_ok=True)
    atomic_save({"step": step}, Path(directory) / f"ckpt-{step}.pt")


def save_without_mkdir(directory, step, model, optimizer):
    atomic_save({"step": step}, Path(directory) / f"step-{step:08d}.pt")


def temporary_named_pt(state, path):
    """An atomic save whose temporary file ends in .pt too."""
    tmp = path.with_name(path.stem + ".tmp.pt")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with open(tmp, "wb") as f:
        f.write(buffer.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_tmp_pt(directory, step, model, optimizer):
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = Path(directory) / f"step-{step:08d}.pt"
    temporary_named_pt({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step}, path)
    temporary_named_pt(hashlib.sha256(path.read_bytes()).hexdigest(),
                       path.with_suffix(".sha256"))


@pytest.mark.parametrize("save,load,hint", [
    (plain_save, make_resume("no checksum"),
     r"case 3/8 \(one bit flipped in a parameter inside step 12's checkpoint\)\n  resume "
     r"returned step 12, expected 8; the model holds step 12's parameters with the flipped "
     r"byte\nHint: the check flipped one bit of a parameter inside step 12's file, and "
     r"torch.load read it without a complaint"),
    (plain_save, make_resume("no checksum, no try"),
     r"case 2/8 .*\n  your resume raised \w+Error: .*\n  the directory held "
     r"\['step-00000004.pt', 'step-00000008.pt', 'step-00000012.pt'\]\nHint: a damaged or "
     r"half-written file must not stop the resume"),
    (save_checkpoint, make_resume("gives up"),
     r"case 2/8 .*\n  resume returned step 0, expected 8.*\nHint: resume found nothing to "
     r"resume from, but step 8's checkpoint is whole\. Does it give up"),
    (save_checkpoint, make_resume("oldest first"),
     r"case 1/8 \(nothing damaged\)\n  resume returned step 4, expected 12; the model holds "
     r"step 4's parameters\nHint: resume went back to step 4, but step 12's checkpoint is whole"),
    (save_checkpoint, make_resume("optimizer not loaded"),
     r"the model is step 12's, but the optimizer's state is not \(it is still a fresh "
     r"optimizer\).*\nHint: Adam keeps two moments"),
    (save_checkpoint, make_resume("model not loaded"),
     r"resume returned step 12, but the model's state is not step 12's: .*; the model holds "
     r"its own initialisation \(unchanged\)\nHint: load the checkpoint's model state"),
    (save_checkpoint, make_resume("returns None"),
     r"resume returned None, expected the step 12\nHint: return the step"),
    (save_checkpoint, make_resume("step from the newest name"),
     r"case 2/8 .*\n  resume returned step 12, expected 8; the model holds step 8's "
     r"parameters\n  it printed: skipping step-00000012.pt: checksum mismatch\nHint: resume "
     r"returned step 12, but that checkpoint is cut to half its bytes"),
    (save_checkpoint, make_resume("loads before checking"),
     r"case 5/8 .*\n  resume returned 0, but it changed the model or the optimizer .*; the model "
     r"holds step 12's parameters with the flipped byte\nHint: nothing is whole"),
    (save_checkpoint, make_resume("os.listdir"),
     r"case 6/8 \(a directory that does not exist \(a first start\)\)\n  your resume raised "
     r"FileNotFoundError.*\nHint: a directory that does not exist is a first start: return 0"),
    (save_named, resume, r"there is no step-00000004.pt \(the directory holds "
                         r"\['ckpt-4.pt'\]\)\nHint: save the checkpoint of step 4 as"),
    (save_without_mkdir, resume, r"raised FileNotFoundError: .*\nHint: the directory does not "
                                 r"exist before the first save: create it"),
    (save_tmp_pt, make_resume("step from the name"),
     r"case 8/8 .*\n  your resume raised ValueError: .*\n  the directory held "
     r"\['step-00000004.pt', 'step-00000004.sha256', 'step-00000008.pt', "
     r"'step-00000008.sha256', 'step-00000012.tmp.pt'\]\nHint: .*not the temporary file that "
     r"the killed save left behind"),
], ids=["no checksum", "no try", "gives up", "oldest first", "optimizer not loaded",
        "model not loaded", "returns None", "step from the newest name", "loads before checking",
        "os.listdir", "wrong name", "no mkdir", "temporary file read"])
def test_resume_check_names_the_mistake(save, load, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_resume(save, load)


def make_resume_2(mistake):
    """The lab's resume with one more of the usual mistakes."""
    def load(directory, model, optimizer):
        for path in sorted(Path(directory).glob("step-*.pt"), reverse=True):
            try:
                data = path.read_bytes()
                digest = path.with_suffix(".sha256")
                if mistake != "no checksum, no check" or digest.exists():
                    expected = torch.load(digest, weights_only=True)
                    if hashlib.sha256(data).hexdigest() != expected:
                        raise ValueError("checksum mismatch")
                state = torch.load(io.BytesIO(data), weights_only=True)
            except (ValueError if mistake == "catches only ValueError" else Exception) as e:  # noqa: B030
                if mistake != "silent":
                    print(f"skipping {path.name}: {e}")
                continue
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            if mistake == "the next step":
                return state["step"] + 1
            return str(state["step"]) if mistake == "a string" else state["step"]
        return 0
    return load


def make_save_2(mistake):
    """The lab's save_checkpoint with one of the usual mistakes."""
    def save(directory, step, model, optimizer):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"step-{step:08d}.pt"
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        if mistake == "the model object":
            state["model"] = model
        if mistake == "no optimizer":
            del state["optimizer"]
        atomic_save(state, path)
        atomic_save(hashlib.sha256(path.read_bytes()).hexdigest(), path.with_suffix(".sha256"))
        if mistake == "keeps only the newest":
            for old in directory.glob("step-*"):
                if old.stem != path.stem:
                    old.unlink()
    return save


@pytest.mark.parametrize("save,load,hint", [
    (save_checkpoint, make_resume_2("catches only ValueError"),
     r"case 7/8 \(step 12's checkpoint whole, but every other file its save wrote \(its checksum\) "
     r"deleted\)\n  your resume raised FileNotFoundError: .*\n  the directory held .*\nHint: step "
     r"12's checkpoint is whole, but what its save wrote beside it \(the checksum\) is gone"),
    (save_checkpoint, make_resume_2("no checksum, no check"),
     r"case 7/8 .*\n  resume returned step 12, expected 8.*\nHint: step 12's file is whole, but "
     r"nothing is left to check it against"),
    (save_checkpoint, make_resume_2("silent"),
     r"case 2/8 .*\n  resume returned step 8 \(right\), but it skipped step-00000012.pt without a "
     r"word: nothing it printed, logged or warned names it\n  it printed nothing\nHint: a damaged "
     r"checkpoint is news"),
    (save_checkpoint, make_resume_2("the next step"),
     r"case 1/8 .*\n  resume returned step 13, expected 12; the model holds step 12's parameters"
     r"\nHint: there is no checkpoint of step 13: the check saved steps 4, 8 and 12"),
    (save_checkpoint, make_resume_2("a string"),
     r"resume returned '12', expected the step 12\nHint: return the step of the checkpoint you "
     r"loaded \(an int"),
    (make_save_2("keeps only the newest"), resume,
     r"case 1/8 .*\n  after the saves of steps 4, 8 and 12, there is no step-00000008.pt \(the "
     r"directory holds \['step-00000012.pt', 'step-00000012.sha256'\]\)\nHint: your "
     r"save_checkpoint removed the older checkpoints"),
    (make_save_2("the model object"), resume,
     r"case 1/8 \(nothing damaged\)\n  resume returned step 0, expected 12; .*\n  it printed: "
     r"skipping step-00000012.pt: UnpicklingError: Weights only load failed[\s\S]*\nHint: nothing "
     r"is damaged in this "
     r"case, yet your resume found no checkpoint it could use"),
    (make_save_2("no optimizer"), resume,
     r"case 1/8 .*\n  your resume raised KeyError: 'optimizer'[\s\S]*\nHint: a key your resume "
     r"reads is not in what your save_checkpoint wrote"),
], ids=["catches only ValueError", "no checksum no check", "silent", "the next step", "a string",
        "keeps only the newest", "the model object", "no optimizer"])
def test_resume_check_names_more_mistakes(save, load, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_resume(save, load)


def test_reference_run_is_reproducible_and_leaves_the_generators_alone():
    before = torch.get_rng_state()
    a, b = checks.reference_run(), checks.reference_run()
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a[16]["model"][k], b[16]["model"][k]) for k in a[16]["model"])
    assert not torch.equal(a[8]["model"]["0.weight"], a[12]["model"]["0.weight"])


# ---------------------------------------------------------------- exercise 3
def _reads(kind="right"):
    """reshard_reads as the lab asks, or with one named mistake."""
    def reshard_reads(saved, wanted):
        offsets, sizes = wanted
        out = []
        for index, (chunk_offsets, chunk_sizes) in enumerate(saved):
            dims = 1 if kind == "first-dimension-only" else len(offsets)
            start = [max(a, b) for a, b in zip(offsets[:dims], chunk_offsets[:dims], strict=False)]
            start += list(offsets[dims:])
            end = [min(a + n, b + m) for a, n, b, m in zip(
                offsets[:dims], sizes[:dims], chunk_offsets[:dims], chunk_sizes[:dims],
                strict=False)]
            end += [a + n for a, n in zip(offsets[dims:], sizes[dims:], strict=False)]
            pairs = list(zip(start, end, strict=True))
            shares = (all(s <= e for s, e in pairs) if kind == "touching-counts"
                      else all(s < e for s, e in pairs))
            if not shares:
                continue
            out.append({
                "chunk": index,
                "storage_offsets": tuple(start) if kind == "global-storage-offsets"
                else tuple(s - b for s, b in zip(start, chunk_offsets, strict=False)),
                "dest_offsets": tuple(start) if kind == "global-dest-offsets"
                else tuple(s - a for s, a in zip(start, offsets, strict=False)),
                "lengths": tuple(chunk_sizes) if kind == "chunk-lengths"
                else tuple(e - s for s, e in zip(start, end, strict=False))})
        return out[:1] if kind == "first-chunk-only" else out
    return reshard_reads


def test_reshard_check_passes_the_answer_and_the_library(capsys):
    from course_lib.checkpoint import reshard_reads
    assert checks.check_reshard_reads(_reads())
    assert checks.check_reshard_reads(reshard_reads)
    assert "6/6 layouts" in capsys.readouterr().out


def test_reshard_check_returns_false_until_implemented(capsys):
    def reshard_reads(saved, wanted):
        raise NotImplementedError
    assert checks.check_reshard_reads(reshard_reads) is False


@pytest.mark.parametrize("mistake, hint", [
    ("touching-counts", "Ends are exclusive"),
    ("global-storage-offsets", "counted from the saved chunk's first element"),
    ("global-dest-offsets", "counted inside your shard"),
    ("chunk-lengths", "min(ends) - max(starts)"),
    ("first-chunk-only", "overlap the shard too and were not read"),
    ("first-dimension-only", "in every dimension, not only the first"),
])
def test_reshard_check_names_the_mistake(mistake, hint):
    with pytest.raises(CheckFailed, match="your reads") as failed:
        checks.check_reshard_reads(_reads(mistake))
    assert hint in str(failed.value)
    if mistake == "first-chunk-only":
        assert "16 element(s) unread, 0 wrong, 0 written twice" in str(failed.value)
