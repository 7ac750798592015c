"""RemoteStep and HostIdentity against a real OpenSSH server (tests/sshd.py).

Host keys are pinned and verified, a host that moved keeps its identity, a wiped or
replaced one gets a new identity (so every step runs again), `refresh` finds a wiped
host, a bastion's client is closed, and progress lines are shown while a step runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from components import identity, remote, ssh
from tests.helpers import ssh_key
from tests.sshd import Sshd

pytestmark = pytest.mark.integration


@pytest.fixture
def sshd(tmp_path):
    server = Sshd(tmp_path, ssh_key()).start()
    yield server
    ssh.drop_shared()  # the next test's server may reuse the port: no connection outlives its test
    server.stop()


def step(conn: dict, **kw) -> dict:
    base = {"connection": conn, "apply": "echo applied", "check": "", "destroy": "echo destroyed", "files": None,
            "uploads": None, "env": {}, "triggers": [], "timeoutS": 60, "label": "test step"}
    return {**base, **kw}


def first_contact(sshd: Sshd, owner: str = "", **conn) -> dict:
    return identity.HostIdentityProvider().create({"connection": sshd.connection(ssh_key(), **conn),
                                                   "hostKey": "", "bastionHostKey": "", "owner": owner}).outs


def pinned(sshd: Sshd, ident: dict) -> dict:
    return sshd.connection(ssh_key(), hostKey=ident["hostKeySeen"], identity=ident["identity"])


def test_first_contact_pins_the_presented_key_and_writes_an_identity(sshd):
    ident = first_contact(sshd)
    assert ident["hostKeySeen"] == sshd.host_key
    assert (sshd.varlib / "fimfleet" / "host-id").read_text().strip() == ident["identity"]
    assert len(ident["machineId"]) >= 8


def test_a_host_another_stack_deploys_to_is_refused_before_anything_changes(sshd):
    """Two stacks on one host overwrote each other's kernel tuning, engine unit and site (a
    single-node stack's node is `node` in both), and destroying one took the other down."""
    owner_file = sshd.varlib / "fimfleet" / "owner"
    prod, staging = "organization/fimfleet/cpu-epyc-prod", "organization/fimfleet/cpu-epyc-staging"
    ident = first_contact(sshd, owner=prod)
    assert owner_file.read_text() == prod + "\n"
    with pytest.raises(identity.Error) as err:
        first_contact(sshd, owner=staging)
    msg = str(err.value)
    assert f"is deployed by another stack, {prod}" in msg and f"pulumi destroy -s {prod}`" in msg, msg
    assert owner_file.read_text() == prod + "\n"
    assert (sshd.varlib / "fimfleet" / "host-id").read_text().strip() == ident["identity"]
    # the same stack moved to another org or backend is not told to destroy itself
    with pytest.raises(identity.Error) as err:
        first_contact(sshd, owner="acme/fimfleet/cpu-epyc-prod")
    assert "pulumi destroy" not in str(err.value) and "write acme/fimfleet/cpu-epyc-prod into" in str(err.value)
    # the same stack again (its state lost) adopts the host
    assert first_contact(sshd, owner=prod)["identity"] == ident["identity"]
    # another stack's destroy (it adopted the host before owners were written) keeps the owner
    identity.HostIdentityProvider().delete("id", {"connection": sshd.connection(ssh_key()), "hostKeySeen": ident["hostKeySeen"],
                                                  "bastionHostKeySeen": "", "owner": staging})
    assert owner_file.read_text() == prod + "\n"
    assert (sshd.varlib / "fimfleet" / "host-id").read_text().strip() == ident["identity"]
    # a host an older fimfleet deployed has no owner: the first `up` after the upgrade writes it
    owner_file.unlink()
    olds = {"connection": sshd.connection(ssh_key()), "hostKey": "", "bastionHostKey": "", **ident}
    olds.pop("owner")
    news = {**olds, "owner": prod}
    claim = identity.HostIdentityProvider().diff("id", olds, news)
    assert claim.changes and "identity" in claim.stables  # no step's connection changes, in preview too
    assert not identity.HostIdentityProvider().diff("id", {**olds, "owner": prod}, {**news, "owner": staging}).changes
    assert identity.HostIdentityProvider().update("id", olds, news).outs["identity"] == ident["identity"]
    assert owner_file.read_text() == prod + "\n"
    # and the host leaving its stack leaves no owner behind
    identity.HostIdentityProvider().delete("id", {**news, **ident, "owner": prod})
    assert not (sshd.varlib / "fimfleet").exists()


def test_of_two_first_contacts_at_once_one_owns_the_host(sshd):
    """Both read no owner, both wrote theirs, and both went on: the owner file is created only
    if absent, and the stack that finds another's there is refused."""
    ident = first_contact(sshd)  # a host id, no owner yet
    (sshd.varlib / "fimfleet" / "owner").write_text("organization/fimfleet/other\n")  # written since the probe
    real_probe = identity._probe
    identity._probe = lambda client: {**real_probe(client), "owner": ""}
    try:
        with pytest.raises(identity.Error, match="is deployed by another stack, organization/fimfleet/other"):
            first_contact(sshd, owner="organization/fimfleet/local")
    finally:
        identity._probe = real_probe
    assert (sshd.varlib / "fimfleet" / "owner").read_text() == "organization/fimfleet/other\n"
    assert (sshd.varlib / "fimfleet" / "host-id").read_text().strip() == ident["identity"]


def test_a_changed_host_key_is_refused_before_anything_is_sent(sshd, tmp_path):
    impostor = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHYl9LXv+aq1wLQ0WqW7V8bT5pQ3Vq8aH1ZkFh6sYc1E"
    conn = sshd.connection(ssh_key(), hostKey=impostor, identity="x")
    secret = {"path": "/var/lib/fimfleet/secret", "mode": "0600", "content": "api-key"}
    with pytest.raises(ssh.HostKeyChanged) as err:
        remote.RemoteStepProvider().create(step(conn, files=[secret]))
    msg = str(err.value)
    assert "changed" in msg and "pulumi config set --path fimfleet:host.hostKey" in msg and sshd.host_key in msg
    assert not (sshd.varlib / "fimfleet" / "secret").exists()


@pytest.mark.parametrize("kind", ["ecdsa", "rsa", "rsa as rsa-sha2-512"])
def test_a_pinned_key_of_another_type_than_paramikos_first_choice_is_the_one_verified(tmp_path, kind):
    """A host with ed25519, ECDSA and RSA keys (as Debian's sshd): paramiko asked for ed25519 first,
    so a pinned ECDSA or RSA key was refused as 'changed' on every connection."""
    server = Sshd(tmp_path, ssh_key(), more_key_types=("ecdsa", "rsa")).start()
    try:
        line = server.host_keys[kind.split()[0]]
        if "as" in kind:  # the same RSA key, named by the signature algorithm (the grammar accepts it)
            line = "rsa-sha2-512 " + line.split()[1]
        with ssh.session(ssh.SshTarget.from_props(server.connection(ssh_key(), hostKey=line))) as client:
            assert ssh.run(client, "echo ok")[1].strip() == "ok"
            assert client.fimfleet_seen[-1].split()[1] == line.split()[1]
        other = tmp_path / "other"  # a key of the same type that this host does not have
        subprocess.run(["ssh-keygen", "-q", "-t", kind.split()[0], "-N", "", "-f", str(other)], check=True)
        impostor = " ".join(other.with_suffix(".pub").read_text().split()[:2])
        with pytest.raises(ssh.HostKeyChanged):
            with ssh.session(ssh.SshTarget.from_props(server.connection(ssh_key(), hostKey=impostor))):
                pass
    finally:
        ssh.drop_shared()
        server.stop()


@pytest.mark.parametrize("kind", ["ed25519", "ecdsa", "rsa"])
def test_a_pkcs8_private_key_logs_in(tmp_path, kind):
    """`openssl genpkey` writes PKCS#8 (-----BEGIN PRIVATE KEY-----), which paramiko cannot read:
    such a key passed the config check and failed at first contact, after a cloud instance existed."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    key = {"ed25519": lambda: ed25519.Ed25519PrivateKey.generate(), "ecdsa": lambda: ec.generate_private_key(ec.SECP256R1()),
           "rsa": lambda: rsa.generate_private_key(65537, 2048)}[kind]()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    assert "BEGIN PRIVATE KEY" in pem and ssh.private_key_problem(pem) is None
    server = Sshd(tmp_path, pem).start()
    try:
        conn = server.connection(pem, hostKey=server.host_key)
        with ssh.session(ssh.SshTarget.from_props(conn)) as client:
            assert ssh.run(client, "echo ok")[1].strip() == "ok"
    finally:
        ssh.drop_shared()
        server.stop()


def test_apply_leaves_a_marker_and_refresh_finds_a_wiped_host(sshd, capsys):
    ident = first_contact(sshd)
    conn = pinned(sshd, ident)
    p = remote.RemoteStepProvider()
    created = p.create(step(conn, check="true"))
    assert created.outs["stdout"].strip() == "applied"
    assert p.read(created.id, created.outs).outs["appliedDigest"] == created.outs["appliedDigest"]

    sshd.wipe()
    drifted = p.read(created.id, created.outs).outs
    assert drifted["appliedDigest"] == "drifted" and "marker is missing" in capsys.readouterr().err
    assert p.diff(created.id, drifted, step(conn, check="true")).changes

    ident_props = {"connection": sshd.connection(ssh_key()), "hostKey": "", "bastionHostKey": "", **ident}
    refreshed = identity.HostIdentityProvider().read("id", ident_props).outs
    assert refreshed["identity"] == ""
    assert identity.HostIdentityProvider().diff("id", refreshed, ident_props).changes
    repaired = identity.HostIdentityProvider().update("id", refreshed, ident_props).outs
    assert repaired["identity"] not in ("", ident["identity"])


def test_a_moved_host_keeps_its_identity_and_a_replaced_one_does_not(sshd, tmp_path):
    ident = first_contact(sshd)
    olds = {"connection": sshd.connection(ssh_key()), "hostKey": "", "bastionHostKey": "", **ident}
    # Same disk, new address (here: a second sshd on another port over the same /var/lib).
    moved = Sshd(tmp_path, ssh_key(), varlib=sshd.varlib).start()
    replacement_dir = tmp_path / "replacement"
    replacement_dir.mkdir()
    replacement = Sshd(replacement_dir, ssh_key()).start()
    try:
        news = {"connection": moved.connection(ssh_key()), "hostKey": "", "bastionHostKey": ""}
        assert identity.HostIdentityProvider().update("id", olds, news).outs["identity"] == ident["identity"]
        news = {"connection": replacement.connection(ssh_key()), "hostKey": "", "bastionHostKey": ""}
        out = identity.HostIdentityProvider().update("id", olds, news).outs
        assert out["identity"] != ident["identity"] and out["hostKeySeen"] == replacement.host_key
    finally:
        moved.stop()
        replacement.stop()


def test_a_rebuilt_host_at_the_same_address_is_refused_until_its_key_is_accepted(sshd, tmp_path):
    ident = first_contact(sshd)
    olds = {"connection": sshd.connection(ssh_key()), "hostKey": "", "bastionHostKey": "", **ident}
    sshd.stop()
    rebuilt_dir = tmp_path / "rebuilt"
    rebuilt_dir.mkdir()
    rebuilt = Sshd(rebuilt_dir, ssh_key(), port=sshd.port).start()  # reinstalled: new key, empty disk
    try:
        with pytest.raises(ssh.HostKeyChanged, match="pulumi config set --path fimfleet:host.hostKey"):
            identity.HostIdentityProvider().read("id", olds)
        accepted = {**olds, "hostKey": rebuilt.host_key}
        assert identity.HostIdentityProvider().diff("id", olds, accepted).changes
        out = identity.HostIdentityProvider().update("id", olds, accepted).outs
        assert out["hostKeySeen"] == rebuilt.host_key and out["identity"] != ident["identity"]
    finally:
        rebuilt.stop()


def test_bastion_sessions_are_verified_and_both_clients_closed(sshd):
    ident = first_contact(sshd)
    before = {t for t in threading.enumerate()}
    conn = {**pinned(sshd, ident), "bastionHost": "127.0.0.1", "bastionPort": sshd.port,
            "bastionUser": "root", "bastionHostKey": sshd.host_key}
    with ssh.session(ssh.SshTarget.from_props(conn)) as client:
        code, out, _ = ssh.run(client, "echo through-bastion")
    assert (code, out.strip()) == (0, "through-bastion")
    for t in [t for t in threading.enumerate() if t not in before]:
        t.join(timeout=5)  # a closed transport's thread ends within moments; an open one never does
    leftover = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not leftover, leftover


def test_progress_lines_are_shown_while_the_step_runs(sshd, capsys):
    ident = first_contact(sshd)
    script = "echo 'progress: engine starting, 30s elapsed' >&2; echo 'noise' >&2; echo done"
    remote.RemoteStepProvider().create(step(pinned(sshd, ident), apply=script, label="vLLM service"))
    err = capsys.readouterr().err
    assert "vLLM service: engine starting, 30s elapsed" in err and "noise" not in err


def test_a_silent_step_says_it_still_runs_with_its_last_output(sshd, capsys, monkeypatch):
    """No bare dots: a step that prints no progress of its own gets a heartbeat with its last line."""
    monkeypatch.setattr(ssh, "HEARTBEAT_S", 0.5)
    ident = first_contact(sshd)
    script = "echo 'Unpacking prometheus' >&2; sleep 1.3"
    remote.RemoteStepProvider().create(step(pinned(sshd, ident), apply=script, label="Prometheus"))
    beats = [l for l in capsys.readouterr().err.splitlines() if l.startswith("Prometheus: still running, ")]
    assert 1 <= len(beats) <= 4 and all(l.endswith("; last output: Unpacking prometheus") for l in beats), beats
    monkeypatch.setattr(ssh, "HEARTBEAT_S", 60.0)
    remote.RemoteStepProvider().create(step(pinned(sshd, ident), apply=script, label="Prometheus"))
    assert "still running" not in capsys.readouterr().err  # a step shorter than the heartbeat stays quiet


def test_a_failed_step_names_itself_and_the_host_without_progress_noise(sshd):
    ident = first_contact(sshd)
    script = "echo 'progress: still going' >&2; echo 'no space left' >&2; exit 3"
    with pytest.raises(remote.Error) as err:
        remote.RemoteStepProvider().create(step(pinned(sshd, ident), apply=script, label="packages"))
    assert str(err.value).startswith(f"packages: apply failed with exit 3 on root@127.0.0.1:{sshd.port}")
    assert "no space left" in str(err.value) and "still going" not in str(err.value)


def test_an_apply_that_exits_early_is_marked_and_a_failed_one_is_not(sshd):
    """The marker is written in the apply's own shell (after a subshell that holds the script),
    so an `exit 0` half-way still counts as applied, and a failure leaves no marker."""
    ident = first_contact(sshd)
    conn = pinned(sshd, ident)
    p = remote.RemoteStepProvider()
    early = p.create(step(conn, apply="echo done-early; exit 0\necho never", check="true"))
    assert early.outs["stdout"].strip() == "done-early"
    marker = sshd.varlib / "fimfleet" / "steps" / early.id
    assert marker.read_text() == early.outs["appliedDigest"]
    assert p.read(early.id, early.outs).outs["appliedDigest"] == early.outs["appliedDigest"]
    with pytest.raises(remote.Error, match="exit 4"):
        p.create(step(conn, apply="false || exit 4", label="failing"))
    with pytest.raises(remote.Error, match="exit 1"):
        p.create(step(conn, apply="false\necho not reached", label="failing under set -e"))
    assert sorted(m.name for m in marker.parent.iterdir()) == [early.id]


def test_files_land_in_new_nested_directories_made_over_sftp(sshd):
    ident = first_contact(sshd)
    files = [{"path": "/var/lib/fimfleet/a/b/c/one.conf", "mode": "0600", "content": "one\n"},
             {"path": "/var/lib/fimfleet/a/b/two.conf", "mode": "0644", "content": "two\n"}]
    out = remote.RemoteStepProvider().create(step(pinned(sshd, ident), files=files,
                                                  apply="stat -c '%a %n' /var/lib/fimfleet/a/b/c/one.conf"))
    assert out.outs["stdout"].strip() == "600 /var/lib/fimfleet/a/b/c/one.conf"
    assert (sshd.varlib / "fimfleet/a/b/c/one.conf").read_text() == "one\n"
    assert (sshd.varlib / "fimfleet/a/b/two.conf").read_text() == "two\n"
    with pytest.raises(remote.Error, match="mkdir /var/lib/fimfleet/a/b/two.conf"):
        remote.RemoteStepProvider().create(step(pinned(sshd, ident), files=[
            {"path": "/var/lib/fimfleet/a/b/two.conf/x", "mode": "0644", "content": ""}]))



def test_a_file_already_as_wanted_is_left_untouched_and_any_difference_rewrites_it(sshd):
    """An unchanged unit file keeps its mtime, so systemd needs no daemon-reload for it
    (files/host/reload-units.sh.j2); content, mode or a link in its place are written again."""
    ident = first_contact(sshd)
    base = sshd.varlib / "fimfleet"
    want = {"unit": ("0644", "[Unit]\n"), "key": ("0600", "secret\n"), "link": ("0644", "real\n"), "mode": ("0644", "m\n")}
    files = [{"path": f"/var/lib/fimfleet/{name}", "mode": mode, "content": text} for name, (mode, text) in want.items()]

    def apply():
        remote.RemoteStepProvider().create(step(pinned(sshd, ident), files=files))
        return {name: (base / name).lstat() for name in want}

    first = apply()
    (base / "key").write_text("changed by hand\n")
    (base / "mode").chmod(0o666)
    (base / "link").unlink()
    (base / "elsewhere").write_text("real\n")
    (base / "link").symlink_to(base / "elsewhere")
    second = apply()
    assert (second["unit"].st_ino, second["unit"].st_mtime_ns) == (first["unit"].st_ino, first["unit"].st_mtime_ns)
    for name, (mode, text) in want.items():  # lstat: a link left in place would show 0777
        assert (base / name).read_text() == text and f"{(base / name).lstat().st_mode & 0o777:04o}" == mode, name
    assert not list(base.glob("*.fimfleet-*"))

def client_ports(sshd: Sshd) -> list[int]:
    """Local ports of this machine's open connections to the server."""
    out = subprocess.run(["ss", "-Htn", "state", "established", f"( dport = :{sshd.port} )"], capture_output=True,
                         text=True, check=True).stdout
    return sorted(int(line.split()[-2].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip())


def test_the_steps_on_one_host_share_one_connection_and_a_dead_one_is_replaced(sshd):
    """A deploy pays one SSH handshake and login per host, not one per step (the provider's
    process lives for the whole `pulumi up`); a connection whose server side died is replaced."""
    ident = first_contact(sshd)
    conn = pinned(sshd, ident)
    p = remote.RemoteStepProvider()
    files = [{"path": f"/var/lib/fimfleet/d{i}/f", "mode": "0644", "content": f"{i}\n"} for i in range(3)]
    seen = []
    for i in range(4):
        created = p.create(step(conn, apply=f"cat /var/lib/fimfleet/d*/f; echo step{i}", files=files))
        assert created.outs["stdout"].split() == ["0", "1", "2", f"step{i}"]
        assert p.read(created.id, created.outs).outs["appliedDigest"] == created.outs["appliedDigest"]
        seen.append(client_ports(sshd))
    assert len(seen[0]) == 1 and all(ports == seen[0] for ports in seen), seen

    # the server's side of that connection dies (a host gone away): the next step connects again
    children = subprocess.run(["pgrep", "-P", str(sshd.proc.pid)], capture_output=True, text=True).stdout.split()
    assert children
    for pid in children:
        os.kill(int(pid), signal.SIGKILL)
    assert p.create(step(conn, apply="echo again")).outs["stdout"].strip() == "again"
    assert len(client_ports(sshd)) == 1 and client_ports(sshd) != seen[0]


def test_many_steps_at_once_on_one_host_all_run(sshd):
    """Concurrent steps share the connection up to SHARED_USERS; the rest get their own, so sshd's
    per-connection session limit (10) is never reached."""
    conn = pinned(sshd, first_contact(sshd))
    p = remote.RemoteStepProvider()
    with ThreadPoolExecutor(max_workers=8) as pool:
        outs = list(pool.map(lambda i: p.create(step(conn, apply=f"sleep 0.5; echo {i}",
                                                     files=[{"path": f"/var/lib/fimfleet/c/{i}", "content": "x"}])),
                             range(8)))
    assert [o.outs["stdout"].strip() for o in outs] == [str(i) for i in range(8)]
    deadline = time.monotonic() + 10
    while len(client_ports(sshd)) > 1 and time.monotonic() < deadline:  # a closed transport's socket goes soon after
        time.sleep(0.1)
    assert len(client_ports(sshd)) == 1  # the shared one stays; the others were closed


def test_steps_waiting_on_a_host_that_is_gone_share_its_failure_and_a_later_step_tries_again(sshd, monkeypatch):
    """Steps that queued on one target while its connection failed get that failure at once (in
    parallel they would have failed together), not three more attempts each; a later step tries
    once more, without the backoff (a destroy whose host is gone, step after step)."""
    conn = pinned(sshd, first_contact(sshd))
    sshd.stop()
    attempts = []
    real = ssh._connect
    monkeypatch.setattr(ssh, "_connect", lambda t, retries, *a: attempts.append(retries) or real(t, retries, *a))

    def create(_):
        try:
            remote.RemoteStepProvider().create(step(conn))
        except ssh.Unreachable as e:
            return e

    with ThreadPoolExecutor(max_workers=4) as pool:
        errors = list(pool.map(create, range(4)))
    assert all(isinstance(e, ssh.Unreachable) for e in errors) and attempts == [ssh.RETRIES], (errors, attempts)
    t0 = time.monotonic()
    assert isinstance(create(0), ssh.Unreachable) and attempts == [ssh.RETRIES, 1]
    assert time.monotonic() - t0 < 2, "the later step waited for a backoff"
    sshd.start()  # the host is back: a step reaches it, and a later failure gets every attempt again
    assert remote.RemoteStepProvider().create(step(conn)).outs["stdout"].strip() == "applied"
    sshd.stop()
    for shared in ssh._shared.values():  # its session's own sshd process outlives the server: cut it too
        shared.close()
    assert isinstance(create(0), ssh.Unreachable) and attempts[-1] == ssh.RETRIES


# ------------------------------------------------------------------ failures a user can read


def test_a_step_past_its_time_is_stopped_on_the_host_not_left_running(sshd):
    """A closed channel does not end the script: it ran on beside the next `up`'s copy."""
    ident = first_contact(sshd)
    late = sshd.varlib / "fimfleet" / "late"
    with pytest.raises(remote.Error, match="did not finish within 2s and was stopped on the host"):
        remote.RemoteStepProvider().create(step(pinned(sshd, ident), timeoutS=2, label="vLLM service",
                                                apply="sleep 5 && touch /var/lib/fimfleet/late"))
    time.sleep(5)
    assert not late.exists()


def test_a_connection_lost_mid_step_says_so_instead_of_an_exit_code(sshd):
    ident = first_contact(sshd)

    def cut():
        time.sleep(1.5)
        for pid in subprocess.run(["pgrep", "-P", str(sshd.proc.pid)], capture_output=True, text=True).stdout.split():
            os.kill(int(pid), signal.SIGKILL)  # the session processes sshd forked: the host went away

    threading.Thread(target=cut, daemon=True).start()
    with pytest.raises(remote.Error) as err:
        remote.RemoteStepProvider().create(step(pinned(sshd, ident), label="packages", apply="sleep 10"))
    assert "the SSH connection closed before the script finished" in str(err.value)
    assert "exit -1" not in str(err.value)


def test_no_command_of_a_script_can_read_the_rest_of_it_as_stdin(sshd):
    """bash -s reads its script from stdin: a command there that reads stdin (a dpkg prompt)
    swallowed the lines after it, and the script ended early with exit 0."""
    ident = first_contact(sshd)
    with ssh.session(ssh.SshTarget.from_props(pinned(sshd, ident))) as client:
        code, out, _ = ssh.run(client, "echo before\ncat >/dev/null\necho after")
    assert (code, out.split()) == (0, ["before", "after"])


def test_a_refused_key_is_named_as_such_at_once(sshd):
    """Not 'cannot reach ... after 3 attempts': the host answered, and said no."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    other = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()).decode()
    t0 = time.monotonic()
    with pytest.raises(remote.Error) as err:
        remote.RemoteStepProvider().create(step(sshd.connection(other, hostKey=sshd.host_key, identity="x")))
    assert "refused fimfleet:sshPrivateKey" in str(err.value) and "authorized_keys" in str(err.value)
    assert time.monotonic() - t0 < 2, "retried with backoff"


def test_a_reason_given_on_stdout_is_shown_when_stderr_holds_only_progress(sshd):
    ident = first_contact(sshd)
    script = "echo 'progress: starting' >&2; echo 'port 8000 is in use by pid 4242'; exit 1"
    with pytest.raises(remote.Error, match="port 8000 is in use by pid 4242"):
        remote.RemoteStepProvider().create(step(pinned(sshd, ident), apply=script, label="vLLM service"))


def test_a_file_that_cannot_be_written_is_named_and_leaves_no_partial_copy(sshd):
    ident = first_contact(sshd)
    (sshd.varlib / "fimfleet" / "adir" / "x").mkdir(parents=True)  # a directory where the file goes
    with pytest.raises(remote.Error) as err:
        remote.RemoteStepProvider().create(step(pinned(sshd, ident), files=[
            {"path": "/var/lib/fimfleet/adir", "mode": "0600", "content": "secret"}]))
    assert "cannot write /var/lib/fimfleet/adir on the host" in str(err.value) and "df -h" in str(err.value)
    assert sorted(p.name for p in (sshd.varlib / "fimfleet").iterdir()) == ["adir", "host-id"]


@pytest.mark.parametrize("files", [[], [{"path": "/var/lib/fimfleet/unit.conf", "mode": "0644", "content": "v2\n"}]])
def test_a_failed_update_is_drift_for_refresh_even_if_the_config_goes_back(sshd, files):
    """The state keeps the old step when an update fails, while the host may hold the new half: with
    the config rolled back there is no diff, so only the marker can tell refresh to apply it again."""
    ident = first_contact(sshd)
    p = remote.RemoteStepProvider()
    v1 = p.create(step(pinned(sshd, ident), apply="echo v1"))
    with pytest.raises(remote.Error, match="exit 7"):
        p.update(v1.id, v1.outs, step(pinned(sshd, ident), files=files, apply="exit 7"))
    assert (sshd.varlib / "fimfleet" / "steps" / v1.id).read_text() == "pending"
    assert p.read(v1.id, v1.outs).outs["appliedDigest"] == "drifted"


def test_a_new_destroy_script_is_recorded_without_running_the_apply_again(sshd):
    """A step whose destroy alone changed ran its whole apply again (a local model's upload, GBs)."""
    ident = first_contact(sshd)
    p = remote.RemoteStepProvider()
    v1 = p.create(step(pinned(sshd, ident), apply="date +%s%N"))  # each run prints another line
    news = step(pinned(sshd, ident), apply="date +%s%N", destroy="echo gone")
    assert p.diff(v1.id, v1.outs, news).changes
    v2 = p.update(v1.id, v1.outs, news).outs
    assert v2["stdout"] == v1.outs["stdout"] and v2["destroy"] == "echo gone"
    assert (sshd.varlib / "fimfleet" / "steps" / v1.id).read_text() == v2["appliedDigest"]
    assert p.read(v1.id, v2).outs["appliedDigest"] == v2["appliedDigest"]
    assert not p.diff(v1.id, v2, news).changes
    changed = p.update(v1.id, v2, {**news, "apply": "echo again"}).outs  # the apply's own change still runs it
    assert changed["stdout"].strip() == "again"


@pytest.mark.parametrize("files", [None, [{"path": "/var/lib/fimfleet-test/conf", "mode": "0644", "content": "x\n"}]])
def test_what_a_first_apply_that_failed_did_is_undone_when_its_host_leaves_the_stack(sshd, files):
    """A create that fails is not in the state, so `pulumi destroy` never ran its destroy: a timer
    it enabled, a registry login it uploaded stayed. Its destroy now waits on the host until the
    create succeeds, and the host's identity runs what is left when the host leaves."""
    ident = first_contact(sshd)
    p = remote.RemoteStepProvider()
    mark = sshd.varlib / "fimfleet-test" / "made"
    failing = step(pinned(sshd, ident), files=files, apply="mkdir -p /var/lib/fimfleet-test; touch /var/lib/fimfleet-test/made; exit 3",
                   destroy="rm -rf /var/lib/fimfleet-test", undoKey="node-monitor-timer")
    with pytest.raises(remote.Error, match="exit 3"):
        p.create(failing)
    undo = list((sshd.varlib / "fimfleet" / "steps" / "undo").iterdir())
    assert len(undo) == 1 and mark.exists()
    # a rerun whose create succeeds holds the destroy in the state: its undo file goes
    ok = p.create({**failing, "apply": "echo fixed"})
    assert not list((sshd.varlib / "fimfleet" / "steps" / "undo").iterdir())
    with pytest.raises(remote.Error, match="exit 3"):
        p.create(failing)
    props = {"connection": sshd.connection(ssh_key()), "hostKey": "", "bastionHostKey": "", **ident}
    identity.HostIdentityProvider().delete("id", props)
    assert not (sshd.varlib / "fimfleet-test").exists()
    assert not (sshd.varlib / "fimfleet" / "steps" / "undo").exists()
    assert not (sshd.varlib / "fimfleet" / "host-id").exists()
    assert ok.outs["stdout"].strip() == "fixed" and (sshd.varlib / "fimfleet" / "steps" / ok.id).exists()  # its record


def test_a_destroy_change_after_a_failed_update_applies_the_step_again(sshd):
    """Recording a changed destroy without applying would have covered the failed update's half
    (its marker "pending") with a fresh digest, and refresh could not find it any more."""
    ident = first_contact(sshd)
    p = remote.RemoteStepProvider()
    v1 = p.create(step(pinned(sshd, ident), apply="date +%s%N"))
    with pytest.raises(remote.Error, match="exit 7"):
        p.update(v1.id, v1.outs, step(pinned(sshd, ident), apply="exit 7"))
    again = p.update(v1.id, v1.outs, step(pinned(sshd, ident), apply="date +%s%N", destroy="echo gone")).outs
    assert again["stdout"] != v1.outs["stdout"], "the step was recorded, not applied"
    assert (sshd.varlib / "fimfleet" / "steps" / v1.id).read_text() == again["appliedDigest"]


def test_the_undo_sweep_runs_each_within_its_time_and_a_failing_one_stops_no_other(sshd):
    ident = first_contact(sshd)
    p = remote.RemoteStepProvider()
    for name, destroy, timeout in (("a", "touch /var/lib/fimfleet-test/a-undone", 60), ("b", "sleep 60", 2),
                                   ("c", "echo broken >&2; exit 4", 60)):
        with pytest.raises(remote.Error, match="exit 3"):
            p.create(step(pinned(sshd, ident), apply="mkdir -p /var/lib/fimfleet-test; exit 3", destroy=destroy,
                          timeoutS=timeout, undoKey=name))
    (sshd.varlib / "fimfleet" / "steps" / "undo" / "0123.fimfleet-x1y2").write_text("touch /var/lib/fimfleet-test/ran\n")
    props = {"connection": sshd.connection(ssh_key()), "hostKey": "", "bastionHostKey": "", **ident}
    t0 = time.monotonic()
    identity.HostIdentityProvider().delete("id", props)
    assert time.monotonic() - t0 < 40
    assert (sshd.varlib / "fimfleet-test" / "a-undone").exists()
    assert not (sshd.varlib / "fimfleet-test" / "ran").exists()  # an upload's temp file is not run
    assert not (sshd.varlib / "fimfleet").exists()  # no step left on the host: nothing of fimfleet's either
