"""A real OpenSSH server on 127.0.0.1 for provider tests.

Its own ed25519 host key, one authorized key, root login by key only. Every session runs
in a private mount namespace whose /var/lib is a directory of the test (`varlib`), so the
steps' markers and host ids persist between sessions like on a real host, yet never touch
this machine. Scripts the tests run are harmless one-liners.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.helpers import free_port

SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"


def public_line(private_pem: str) -> str:
    from cryptography.hazmat.primitives import serialization

    from components.ssh import load_private_key

    key = load_private_key(private_pem)  # OpenSSH or PEM (PKCS#8, PKCS#1)
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


class Sshd:
    """Start with `Sshd(tmp, client_key).start()`; `host_key` is its public key line."""

    def __init__(self, tmp: Path, client_key: str, varlib: Path | None = None, port: int | None = None,
                 more_key_types: tuple[str, ...] = ()):
        assert Path(SSHD).exists(), "openssh-server is missing: ./fimfleet bootstrap installs it"
        self.dir = tmp
        self.varlib = varlib or tmp / "varlib"
        self.varlib.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        key = tmp / "host_key"
        if not key.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        self.host_key = " ".join(key.with_suffix(".pub").read_text().split()[:2])
        self.host_keys = {"ed25519": self.host_key}
        """Every host key the server has, by ssh-keygen type (ed25519 first, as paramiko prefers it)."""
        for kind in more_key_types:  # e.g. ecdsa, rsa: a host with several keys, as Debian's sshd has
            extra = tmp / f"host_key_{kind}"
            if not extra.exists():
                subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(extra)], check=True)
            self.host_keys[kind] = " ".join(extra.with_suffix(".pub").read_text().split()[:2])
        host_key_lines = "".join(f"HostKey {tmp / ('host_key' if k == 'ed25519' else f'host_key_{k}')}\n"
                                 for k in self.host_keys)
        (tmp / "authorized_keys").write_text(public_line(client_key) + "\n")
        wrap = tmp / "wrap.sh"
        wrap.write_text(f"#!/bin/sh\nmount --bind {self.varlib} /var/lib || exit 97\n"
                        'exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"\n')
        wrap.chmod(0o755)
        self.config = tmp / f"sshd_config.{self.port}"
        self.config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\n{host_key_lines}PidFile {tmp}/sshd.{self.port}.pid\n"
            f"AuthorizedKeysFile {tmp}/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\n"
            f"AllowTcpForwarding yes\nSubsystem sftp {SFTP_SERVER}\n"
            f"ForceCommand unshare -m --propagation private {wrap}\n")
        self.proc: subprocess.Popen | None = None

    def start(self) -> Sshd:
        os.makedirs("/run/sshd", exist_ok=True)
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.config)], stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sshd exited: {self.proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.1)
        raise RuntimeError("sshd did not listen within 10 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def connection(self, private_key: str, **kw) -> dict:
        return {"host": "127.0.0.1", "port": self.port, "user": "root", "privateKey": private_key, **kw}

    def wipe(self) -> None:
        """What a reinstall does to fimfleet's state on the host."""
        shutil.rmtree(self.varlib / "fimfleet", ignore_errors=True)
