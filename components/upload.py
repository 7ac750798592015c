"""Files to fimfleet's hosts over a verified SSH session's SFTP: atomic, with their modes, and
untouched when already as wanted (a rewritten unit file costs a daemon-reload). A failed write
says which path on which host, and leaves no partial file behind."""

from __future__ import annotations

import hashlib
import shlex
import stat
import uuid

from components.errors import Error
from components.ssh import run


def _is_dir(sftp, path: str) -> bool:
    try:
        return stat.S_ISDIR(sftp.stat(path).st_mode)
    except FileNotFoundError:
        return False


def sftp_makedirs(sftp, path: str) -> None:
    """`mkdir -p` over SFTP: a shell for it costs about 0.3 s on an emulated host, a stat 20 ms.
    A directory that another step made meanwhile is no error."""
    if _is_dir(sftp, path):
        return
    parent = path.rsplit("/", 1)[0]
    if parent:
        sftp_makedirs(sftp, parent)
    try:
        sftp.mkdir(path)
    except OSError as e:
        if not _is_dir(sftp, path):
            raise Error(f"mkdir {path}: {e}") from None


def parents(files: list[dict]) -> list[str]:
    return sorted({f["path"].rsplit("/", 1)[0] or "/" for f in files})


def _unchanged(sftp, path: str, mode: int, data: bytes) -> bool:
    """`path` is already root's regular file with this mode and content. Rewriting it would only
    move its mtime, which systemd takes for a changed unit (a daemon-reload: 2-4 s emulated)."""
    try:
        st = sftp.lstat(path)
    except OSError:
        return False
    if (not stat.S_ISREG(st.st_mode) or stat.S_IMODE(st.st_mode) != mode or st.st_size != len(data)
            or (st.st_uid, st.st_gid) != (0, 0)):
        return False
    with sftp.open(path, "r") as fh:
        return fh.read() == data


def _failed(path: str, e: Exception) -> Error:
    return Error(f"cannot write {path} on the host ({e or type(e).__name__}): is its disk full or read-only? "
                 f"Check with `df -h {shlex.quote(path.rsplit('/', 1)[0] or '/')}` there, then rerun `pulumi up`")


def write_files(sftp, files: list[dict]) -> None:
    """Each file atomically (tmp + rename) with its mode, into directories that exist; one that is
    already as wanted is left untouched."""
    import paramiko

    for f in files:
        path, mode, data = f["path"], int(str(f.get("mode", "0644")), 8), f["content"].encode()
        if _unchanged(sftp, path, mode, data):
            continue
        tmp = f"{path}.fimfleet-{uuid.uuid4().hex[:8]}"
        try:
            with sftp.open(tmp, "w") as fh:
                sftp.chmod(tmp, mode)
                fh.write(data)
            sftp.posix_rename(tmp, path)
        except (OSError, paramiko.SSHException) as e:
            try:
                sftp.remove(tmp)
            except (OSError, paramiko.SSHException):
                pass  # never made, or the session is gone: the next write replaces it anyway
            raise _failed(path, e) from None


def put_files(client, files: list[dict]) -> None:
    """Atomically write files with their modes; parent directories are created."""
    sftp = client.open_sftp()
    try:
        for parent in parents(files):
            sftp_makedirs(sftp, parent)
        write_files(sftp, files)
    finally:
        sftp.close()


def put_dir(client, local: str, remote: str) -> None:
    """Copy a local directory (binary files too) to `remote`, swapping it in whole at the end."""
    from pathlib import Path

    root = Path(local)
    part = remote.rstrip("/") + ".fimfleet-part"
    code, _, err = run(client, f"rm -rf {shlex.quote(part)} && mkdir -p {shlex.quote(part)}")
    if code:
        raise Error(f"preparing {part}: {err}")
    import paramiko

    sftp = client.open_sftp()
    try:
        for path in sorted(root.rglob("*")):
            target = f"{part}/{path.relative_to(root).as_posix()}"
            if path.is_dir():
                sftp.mkdir(target)
            else:
                sftp.put(str(path), target)
    except (OSError, paramiko.SSHException) as e:
        run(client, f"rm -rf {shlex.quote(part)}")  # a half copy is no use, and may fill the disk
        raise _failed(target, e) from None
    finally:
        sftp.close()
    code, _, err = run(client, f"rm -rf {shlex.quote(remote)} && mv {shlex.quote(part)} {shlex.quote(remote)}")
    if code:
        raise Error(f"installing {remote}: {err}")


def dir_digest(local: str) -> str:
    """Content hash of a local directory, so an unchanged model is not copied again."""
    from pathlib import Path

    h = hashlib.sha256()
    for path in sorted(Path(local).rglob("*")):
        if path.is_file():
            h.update(path.relative_to(local).as_posix().encode())
            with path.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]
