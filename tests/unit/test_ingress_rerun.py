"""A failed deploy, rerun, converges and loses nothing: the nginx steps (the host's main config,
each node's site, certbot) run for real in a temp root with stub nginx/systemctl/apt, killed after
each line in turn (`kill -9`, as a dropped SSH session or a full disk ends them), then rerun."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from components import config, ingress, nginx_base
from components.nginx_base import DROPIN_PATH, LEGACY_FILES, STATE_DIR, NginxBase
from tests.helpers import API_KEY, raw_config

ROOTED = re.compile(r"(?<![\w.-])(/etc/|/var/lib/|/run/lock/)")
"""The host paths the scripts write: rewritten under the temp root."""

STUBS = {
    # rejects a config when any file of its directory says BAD
    "nginx": 'for a; do if [ -f "$a" ] && grep -rqs BAD "$(dirname "$a")"; then '
             'echo "nginx: [emerg] unknown directive BAD" >&2; exit 1; fi; done',
    "systemctl": 'echo "systemctl $*" >> "$CALLS"',
    "openssl": '[ "$1" != x509 ] || echo "sha256 Fingerprint=00"',
    "dpkg-query": 'grep -qx -- "${*: -1}" "$DPKG" 2>/dev/null && printf "install ok installed" || exit 1',
    # install/purge mark the package in $DPKG; certbot's command comes and goes with it
    "apt-get": '''echo "apt-get $*" >> "$CALLS"
for a; do case $a in install|purge) op=$a;; certbot) pkg=$a;; esac; done
if [ "${op:-}" = install ] && [ -n "${pkg:-}" ]; then echo certbot >> "$DPKG"
  printf '#!/bin/sh\\necho "certbot $*" >> "$CALLS"\\n' > "$STUB_BIN/certbot"; chmod +x "$STUB_BIN/certbot"; fi
if [ "${op:-}" = purge ] && [ -n "${pkg:-}" ]; then sed -i /^certbot$/d "$DPKG"; rm -f "$STUB_BIN/certbot"; fi''',
}


class Host:
    """A temp root with stub commands; run() runs a rendered script as RemoteStep does."""

    def __init__(self, base: Path):
        self.root, self.bin, self.calls, self.dpkg = base / "root", base / "bin", base / "calls", base / "dpkg"
        (self.root / "run/lock").mkdir(parents=True)
        self.bin.mkdir()
        for name, body in STUBS.items():
            (self.bin / name).write_text(f"#!/bin/bash\n{body}\nexit 0\n")
            (self.bin / name).chmod(0o755)
        self.dpkg.write_text("")
        self.env = {"PATH": f"{self.bin}:{os.environ['PATH']}", "CALLS": str(self.calls), "DPKG": str(self.dpkg),
                    "STUB_BIN": str(self.bin)}

    def path(self, p: str) -> Path:
        return self.root / p.lstrip("/")

    def write(self, p: str, content: str, mode: int = 0o644) -> None:
        path = self.path(p)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        path.chmod(mode)

    def read(self, p: str) -> str | None:
        return self.path(p).read_text() if self.path(p).exists() else None

    def stage(self, files: list[dict]) -> None:
        """What RemoteStep uploads before its apply (components/upload.py: with each file's mode)."""
        for f in files:
            self.write(f["path"], f["content"], int(f["mode"], 8))

    def run(self, script: str, kill_after: int | None = None) -> subprocess.CompletedProcess:
        lines = ROOTED.sub(lambda m: f"{self.root}{m.group(1)}", script).splitlines()
        if kill_after is not None:
            lines.insert(kill_after, "kill -9 $$")
        body = "set -euo pipefail\n{\n" + "\n".join(lines) + "\n} </dev/null\n"  # as components/ssh.py run
        return subprocess.run(["bash", "-c", body], capture_output=True, text=True, env=self.env, timeout=60)

    def clone(self, base: Path) -> "Host":
        """A copy of this host (files, installed packages, calls so far) under `base`."""
        other = Host(base)
        shutil.rmtree(other.root)
        shutil.copytree(self.root, other.root, symlinks=True)
        other.dpkg.write_text(self.dpkg.read_text())
        if self.calls.exists():
            other.calls.write_text(self.calls.read_text())
        for extra in {p.name for p in self.bin.iterdir()} - set(STUBS):
            shutil.copy2(self.bin / extra, other.bin / extra)
        return other

    def log(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


def kill_points(script: str, first: str, last: str | None = None) -> list[int]:
    """Each line from the one with `first` to the next one with `last` (the end: None) after which
    a `kill -9 $$` parses (not inside a continued command); a comment or blank line is the line
    before it, and a function's body is where it is called."""
    lines = script.splitlines()
    start = next(n for n, line in enumerate(lines) if first in line)
    end = next((n for n in range(start, len(lines)) if last in lines[n]), None) if last else len(lines) - 1
    assert end is not None, f"no line with {last!r}"
    points, in_function = [], False
    for i in range(start + 1, end + 2):
        line = lines[i - 1].strip()
        in_function = (in_function or re.fullmatch(r"\w+\(\) \{", line) is not None) and line != "}"
        if not line or line.startswith("#") or line.endswith("\\") or in_function:
            continue
        probe = "\n".join(lines[:i] + ["kill -9 $$"] + lines[i:])
        if subprocess.run(["bash", "-n"], input=probe, capture_output=True, text=True).returncode == 0:
            points.append(i)
    return points


def cfg_for(**ingress_keys) -> config.StackConfig:
    raw, secret = raw_config(ingress={"domain": "code.example.com", **ingress_keys})
    return config.parse(raw, secret)


ACME = {"tls": "acme", "acmeEmail": "ops@example.com"}


def node_step(cfg, cert="CERT-1", key="KEY-1", node="node", bad=False) -> tuple[list[dict], dict[str, str], dict]:
    """(files to stage, the step's scripts, dest -> content it installs); `bad`: a site nginx rejects."""
    args = ingress.args_for(cfg, node)
    staged, installs = ingress.render_files(args, "code.example.com", cert, key)
    if bad:
        staged = [dict(f, content=f["content"] + "BAD;\n") if f["path"].endswith(".conf") else f for f in staged]
    by_name = {f["path"].rsplit("/", 1)[-1]: f["content"] for f in staged}
    return staged, ingress.step_scripts(args, installs, "code.example.com"), {i["dest"]: by_name[i["name"]] for i in installs}


def installed(host: Host, wanted: dict) -> dict:
    return {dest: host.read(dest) for dest in wanted}


# --------------------------------------------------------------------- the host's main config


USERS_MAIN = "# the user's own nginx.conf\ninclude /etc/nginx/fimfleet-site.conf;\n"
LEGACY = {name: f"# the single-node layout's {name}\n" for name in LEGACY_FILES}


def old_host(host: Host) -> None:
    """A host of the single-node layout: the user's main config includes fimfleet's old site and keys."""
    host.write("/etc/nginx/nginx.conf", USERS_MAIN)
    for name, text in LEGACY.items():
        host.write(f"/etc/nginx/{name}", text, 0o600)


def host_step(base: NginxBase = NginxBase(), bad: bool = False):
    step = nginx_base.render(base)
    files = [dict(f, content=f["content"] + "BAD;\n") if bad and f["path"].endswith("nginx.conf") else f
             for f in step.files]
    return files, step


@pytest.mark.parametrize("layout", ["users-config", "single-node-layout"])
def test_host_nginx_killed_anywhere_then_rerun_keeps_the_config_nginx_accepted(tmp_path, layout):
    """A rejected main config, killed at any line and rerun: the user's config (and the old
    layout's site) stay. Before, the rerun took its own half install for the previous config and
    "restored" it, and lost the old site it had moved."""
    legacy = LEGACY if layout == "single-node-layout" else {}
    bad_files, step = host_step(bad=True)
    good_files, _ = host_step()
    before = Host(tmp_path / "before")
    before.write("/etc/nginx/nginx.conf", USERS_MAIN)
    for name, text in legacy.items():
        before.write(f"/etc/nginx/{name}", text, 0o600)
    before.stage(bad_files)
    points = kill_points(step.apply, 'mkdir -p "$prev"', 'echo "$err" >&2')
    assert len(points) > 20
    for i in points:
        host = before.clone(tmp_path / str(i))
        host.run(step.apply, kill_after=i)
        rerun = host.run(step.apply)
        assert rerun.returncode == 1 and "nginx rejected the new main config" in rerun.stderr, (i, rerun.stderr)
        assert host.read("/etc/nginx/nginx.conf") == USERS_MAIN, f"killed after line {i}"
        assert host.read(DROPIN_PATH) is None, i
        for name, text in legacy.items():
            assert host.read(f"/etc/nginx/{name}") == text, (i, name)
            assert host.read(f"/etc/nginx/fimfleet.d/legacy-{name}") is None, (i, name)
        assert host.read(f"{STATE_DIR}/dist/nginx.conf") == USERS_MAIN, i
        # the next apply of a good config goes through, and the old site keeps serving from its new place
        host.stage(good_files)
        ok = host.run(step.apply)
        assert ok.returncode == 0, (i, ok.stderr)
        assert host.read("/etc/nginx/nginx.conf") == good_files[0]["content"], i
        for name, text in legacy.items():
            assert host.read(f"/etc/nginx/fimfleet.d/legacy-{name}") == text, (i, name)
            assert host.read(f"/etc/nginx/{name}") is None, (i, name)


def test_host_nginx_killed_anywhere_then_rerun_still_restarts_for_a_new_unit_limit(tmp_path):
    """The unit's LimitNOFILE reaches nginx through a daemon-reload and a restart. A run killed after
    it installed the new drop-in left nothing to compare; the rerun only reloaded (before)."""
    v1_files, v1 = host_step()
    v2_files, v2 = host_step(NginxBase(worker_connections=2048))
    assert v1_files[1]["content"] != v2_files[1]["content"]
    before = Host(tmp_path / "before")
    before.stage(v1_files)
    assert before.run(v1.apply).returncode == 0
    before.calls.unlink()
    before.stage(v2_files)
    for i, host, rerun in killed_and_rerun(before, v2.apply, 'mkdir -p "$prev"',
                                           "# fimfleet host nginx: the installed main config", tmp_path):
        assert rerun.returncode == 0, (i, rerun.stderr)
        log = host.log()
        reloads = [n for n, c in enumerate(log) if c == "systemctl daemon-reload"]
        restarts = [n for n, c in enumerate(log) if c == "systemctl restart nginx"]
        assert reloads and restarts and restarts[-1] > reloads[-1], f"killed after line {i}: {log}"
        assert host.read(DROPIN_PATH) == v2_files[1]["content"], i
        assert not host.path(f"{STATE_DIR}/_host-restart-pending").exists(), i
    # once restarted, an unchanged apply only reloads
    host.calls.unlink()
    assert host.run(v2.apply).returncode == 0
    assert "systemctl reload nginx" in host.log() and "systemctl restart nginx" not in host.log(), host.log()
    assert "systemctl daemon-reload" not in host.log()


def test_host_nginx_backup_of_the_users_config_is_whole_or_taken_again(tmp_path):
    """The user's nginx.conf is copied once, for destroy. A copy cut short (full disk) was kept as
    it was and restored by destroy (before); now it is taken again on the rerun."""
    files, step = host_step()
    host = Host(tmp_path)
    old_host(host)
    host.stage(files)
    flag = tmp_path / "disk-was-full"
    real_cp = shutil.which("cp")
    (host.bin / "cp").write_text(f"""#!/bin/bash
last=${{*: -1}}
if [[ $last == */dist/* ]] && [ ! -e {flag} ]; then
  : > {flag}; head -c 9 "${{@: -2:1}}" > "$last"; echo "cp: error writing '$last': No space left on device" >&2; exit 1
fi
exec {real_cp} "$@"
""")
    (host.bin / "cp").chmod(0o755)
    assert host.run(step.apply).returncode == 1 and flag.exists()
    assert host.run(step.apply).returncode == 0
    assert host.read(f"{STATE_DIR}/dist/nginx.conf") == USERS_MAIN
    assert host.run(step.destroy).returncode == 0
    assert host.read("/etc/nginx/nginx.conf") == USERS_MAIN


def test_host_nginx_destroy_killed_anywhere_then_rerun_gives_the_users_config_back(tmp_path):
    files, step = host_step()
    before = Host(tmp_path / "before")
    before.write("/etc/nginx/nginx.conf", USERS_MAIN)
    before.stage(files)
    assert before.run(step.apply).returncode == 0
    for i in kill_points(step.destroy, "flock 8", "systemctl restart nginx"):
        host = before.clone(tmp_path / str(i))
        host.run(step.destroy, kill_after=i)
        assert host.run(step.destroy).returncode == 0, i
        assert host.read("/etc/nginx/nginx.conf") == USERS_MAIN, i
        assert host.read(DROPIN_PATH) is None and not host.path(STATE_DIR).exists(), i


# ------------------------------------------------------------------------ a node's site


def killed_and_rerun(before: Host, script: str, first: str, last: str, tmp_path):
    """(line, host, rerun) for each kill point between `first` and `last`: a copy of `before` whose
    run of `script` was killed after that line, and the result of running it again."""
    for i in kill_points(script, first, last):
        host = before.clone(tmp_path / str(i))
        host.run(script, kill_after=i)
        yield i, host, host.run(script)


def site_applied(tmp_path, files, step) -> Host:
    """A host whose nginx accepted the node's site `step`: where a kill sweep starts."""
    host = Host(tmp_path / "before")
    host.write("/etc/nginx/nginx.conf", "# main\n")
    host.stage(files)
    assert host.run(step["apply"]).returncode == 0
    return host


def test_site_killed_anywhere_then_rerun_keeps_the_site_nginx_accepted(tmp_path):
    """A rejected site (new certificate and key too), killed at any line and rerun: the accepted
    site, its keys and certificate stay, as they were (before: the rerun restored its own half)."""
    cfg = cfg_for()
    v1_files, v1, v1_installs = node_step(cfg)
    bad_files, bad, _ = node_step(cfg, cert="CERT-2", key="KEY-2", bad=True)
    v3_files, v3, v3_installs = node_step(cfg, cert="CERT-3", key="KEY-3")
    before = site_applied(tmp_path, v1_files, v1)
    before.stage(bad_files)
    for i, host, rerun in killed_and_rerun(before, bad["apply"], "install_pairs=(", 'echo "$err" >&2', tmp_path):
        assert rerun.returncode == 1 and "nginx rejected the new config" in rerun.stderr, (i, rerun.stderr)
        assert installed(host, v1_installs) == v1_installs, f"killed after line {i}"
        assert host.path("/etc/nginx/fimfleet.d/node.keys").stat().st_mode & 0o777 == 0o600, i
        assert host.path("/etc/fimfleet/tls/node/server.key").stat().st_mode & 0o777 == 0o600, i
        host.stage(v3_files)
        ok = host.run(v3["apply"])
        assert ok.returncode == 0, (i, ok.stderr)
        assert installed(host, v3_installs) == v3_installs, i


def test_site_killed_while_taking_a_good_config_in_then_rerun_rolls_later_failures_back_to_it(tmp_path):
    """The previous files are taken again only once nginx accepted the new ones: a kill while they
    are, or before, never leaves a later rollback without the config nginx accepted last."""
    cfg = cfg_for()
    v1_files, v1, _ = node_step(cfg)
    v2_files, v2, v2_installs = node_step(cfg, cert="CERT-2", key="KEY-2")
    bad_files, bad, _ = node_step(cfg, cert="CERT-3", key="KEY-3", bad=True)
    before = site_applied(tmp_path, v1_files, v1)
    before.stage(v2_files)
    for i in kill_points(v2["apply"], "install_pairs=(", "# What the single-node layout left beside"):
        host = before.clone(tmp_path / str(i))
        host.run(v2["apply"], kill_after=i)
        assert host.run(v2["apply"]).returncode == 0, i
        host.stage(bad_files)
        assert host.run(bad["apply"]).returncode == 1, i
        assert installed(host, v2_installs) == v2_installs, f"killed after line {i}"


def test_site_killed_anywhere_then_rerun_keeps_the_old_layouts_site_until_one_is_accepted(tmp_path):
    """The single-node layout's site makes way for the node's. A run killed after it moved it away
    lost it on the rerun (before), and a rejected new site then left the host with no site at all."""
    cfg = cfg_for()
    bad_files, bad, bad_installs = node_step(cfg, bad=True)
    good_files, good, good_installs = node_step(cfg)
    before = Host(tmp_path / "before")
    before.write("/etc/nginx/nginx.conf", "# main\n")
    for name, text in LEGACY.items():
        before.write(f"/etc/nginx/fimfleet.d/legacy-{name}", text, 0o600)
    before.stage(bad_files)
    for i, host, rerun in killed_and_rerun(before, bad["apply"], "install_pairs=(", 'echo "$err" >&2', tmp_path):
        assert rerun.returncode == 1, (i, rerun.stderr)
        for name, text in LEGACY.items():
            assert host.read(f"/etc/nginx/fimfleet.d/legacy-{name}") == text, f"killed after line {i}: {name}"
        assert set(installed(host, bad_installs).values()) == {None}, i
        host.stage(good_files)
        assert host.run(good["apply"]).returncode == 0, i
        assert installed(host, good_installs) == good_installs, i
        assert not any(host.path("/etc/nginx/fimfleet.d").glob("legacy-*")), i


def test_a_rejected_site_leaves_its_secrets_root_only(tmp_path):
    """The API keys and the TLS key stay where a rerun needs them after nginx rejected the site
    (staged: RemoteStep compares them at refresh), and nowhere readable but by root."""
    cfg = cfg_for()
    v1_files, v1, _ = node_step(cfg, key="TLS-KEY-1")
    bad_files, bad, _ = node_step(cfg, key="TLS-KEY-2", bad=True)
    assert {f["path"].rsplit("/", 1)[-1]: f["mode"] for f in bad_files if "TLS-KEY" in f["content"]
            or API_KEY in f["content"]} == {"node.keys": "0600", "server.key": "0600"}
    host = site_applied(tmp_path, v1_files, v1)
    host.stage(bad_files)
    assert host.run(bad["apply"]).returncode == 1
    secrets = [p for p in host.root.rglob("*") if p.is_file() and re.search(f"TLS-KEY|{API_KEY}", p.read_text())]
    assert len(secrets) >= 6  # staged, installed and the previous copies of both
    assert all(p.stat().st_mode & 0o077 == 0 for p in secrets), [(str(p), oct(p.stat().st_mode)) for p in secrets]


# ------------------------------------------------------------------------------- certbot


def test_certbot_fimfleet_installed_leaves_with_destroy_even_after_a_killed_apply(tmp_path):
    """certbot came with apt outside fimfleet's ledger and outlived destroy, timer and all
    (before). Now it is in the ledger before apt runs, so a killed apply's rerun still owns it."""
    cfg = cfg_for(**ACME)
    files, step, _ = node_step(cfg)
    before = Host(tmp_path / "before")
    before.write("/etc/nginx/nginx.conf", "# main\n")
    before.stage(files)
    for i, host, rerun in killed_and_rerun(before, step["apply"], 'mkdir -p "$prev"', "certbot certonly", tmp_path):
        assert rerun.returncode == 0, (i, rerun.stderr)
        assert host.dpkg.read_text().split() == ["certbot"], i
        assert host.read(ingress.CERTBOT_LEDGER) == "certbot\n", i
        # the apt lists were updated under fimfleet's apt lock (files/host/apt-update.sh.j2)
        assert any(c.startswith("apt-get") and c.endswith(" update") for c in host.log()), i
        assert host.path("/run/lock/fimfleet-apt.lock").exists(), i
        assert host.run(step["destroy"]).returncode == 0, i
        assert host.dpkg.read_text().split() == [] and not (host.bin / "certbot").exists(), i
        assert "certbot" not in (host.read(ingress.CERTBOT_LEDGER) or ""), i


def test_certbot_destroy_killed_anywhere_then_rerun_purges_it_once_the_last_acme_node_goes(tmp_path):
    cfg = cfg_for(**ACME)
    a_files, a, _ = node_step(cfg, node="a")
    b_files, b, _ = node_step(cfg, node="b")
    before = Host(tmp_path / "before")
    before.write("/etc/nginx/nginx.conf", "# main\n")
    for files, step in ((a_files, a), (b_files, b)):
        before.stage(files)
        assert before.run(step["apply"]).returncode == 0
    assert sum(c.startswith("apt-get") and " install " in c for c in before.log()) == 1
    for i in kill_points(a["destroy"], "flock 8"):
        host = before.clone(tmp_path / str(i))
        host.run(a["destroy"], kill_after=i)
        assert host.run(a["destroy"]).returncode == 0, i
        assert host.dpkg.read_text().split() == ["certbot"], f"node b still needs certbot (killed after line {i})"
        host.run(b["destroy"], kill_after=i)
        assert host.run(b["destroy"]).returncode == 0, i
        assert host.dpkg.read_text().split() == [], i
        assert "certbot" not in (host.read(ingress.CERTBOT_LEDGER) or ""), i


def test_certbot_of_the_users_own_stays(tmp_path):
    cfg = cfg_for(**ACME)
    files, step, _ = node_step(cfg)
    host = Host(tmp_path)
    host.dpkg.write_text("certbot\n")
    (host.bin / "certbot").write_text("#!/bin/sh\nexit 0\n")
    (host.bin / "certbot").chmod(0o755)
    host.write("/etc/nginx/nginx.conf", "# main\n")
    host.stage(files)
    assert host.run(step["apply"]).returncode == 0
    assert not any(c.startswith("apt-get") for c in host.log())
    assert host.run(step["destroy"]).returncode == 0
    assert host.dpkg.read_text().split() == ["certbot"] and not any(c.startswith("apt-get") for c in host.log())


def test_certbot_leaves_with_a_node_that_no_longer_uses_acme(tmp_path):
    """A node switched to another certificate source still held certbot: its destroy (rendered
    for the new source) purges it all the same."""
    acme_files, acme, _ = node_step(cfg_for(**ACME))
    _, self_signed, _ = node_step(cfg_for())
    host = Host(tmp_path)
    host.write("/etc/nginx/nginx.conf", "# main\n")
    host.stage(acme_files)
    assert host.run(acme["apply"]).returncode == 0
    assert host.run(self_signed["destroy"]).returncode == 0
    assert host.dpkg.read_text().split() == []


def test_a_rejected_gateway_site_leaves_the_servers_file_its_restored_generator_writes(tmp_path):
    """The new generator wrote the servers file for its own members before nginx refused the new
    site; the site and generator went back, the servers file did not: an added node got a server
    line with no member listener, sent traffic at the next reload of any site on that host."""
    from components import fleet as fleet_shape

    def gateway_step(nodes: dict, bad: bool = False):
        raw, secret = raw_config(nodes=nodes, gateway={"host": "n1"}, ingress={"httpsPort": 8443, "httpPort": 8080})
        args = fleet_shape.args_for(config.parse(raw, secret)).gateway.ingress
        staged, installs = ingress.render_files(args, "code.example.com", "CERT", "KEY")
        if bad:
            staged = [dict(f, content=f["content"] + "BAD;\n") if f["path"].endswith(".conf") else f for f in staged]
        root = tmp_path / "before" / "root"  # site_applied's: the generator writes under it too
        staged = [dict(f, content=ROOTED.sub(lambda m: f"{root}{m.group(1)}", f["content"])) for f in staged]
        return staged, ingress.step_scripts(args, installs, "code.example.com"), args.fleet.paths.servers

    two = {"n1": {"address": "203.0.113.10"}, "n2": {"address": "203.0.113.11"}}
    v1_files, v1, servers = gateway_step(two)
    host = site_applied(tmp_path, v1_files, v1)
    accepted = host.read(servers)
    assert accepted and accepted.count("server ") == 2, accepted
    bad_files, bad, _ = gateway_step({**two, "n3": {"address": "203.0.113.12"}}, bad=True)
    host.stage(bad_files)
    proc = host.run(bad["apply"])
    assert proc.returncode == 1 and "nginx rejected the new config" in proc.stderr, proc.stderr
    assert host.read(servers) == accepted


def test_a_sites_destroy_after_the_hosts_nginx_step_left_makes_nothing_again(tmp_path):
    """A site whose first apply failed is undone when its host leaves the stack, after the host's
    nginx step removed its state: taking the lock made /var/lib/fimfleet/nginx again."""
    files, step, _ = node_step(cfg_for())
    host = site_applied(tmp_path, files, step)
    shutil.rmtree(host.path(STATE_DIR))  # what the host's nginx step's destroy does last
    proc = host.run(step["destroy"])
    assert proc.returncode == 0, proc.stderr
    assert not host.path(STATE_DIR).exists()
