"""A failed deploy, rerun, converges and loses nothing: the monitoring steps and the package
ledgers (files/host/apt-ledger.sh.j2, files/prometheus/packages*.sh.j2) run against a fake
host (stub apt-get, dpkg, dpkg-query, systemctl; every absolute path moved under a tmp dir),
killed at a line or inside dpkg, then run again or destroyed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from components import monitoring as m
from components import templates
from tests.unit.test_monitoring_rules import make_args

EXPORTER = m.ExporterArgs("a", monitors=(("a", "vllm-a.service"),))
EXPORTER_V2 = m.ExporterArgs("a", monitors=(("a", "vllm-a.service"), ("b", "vllm-b.service")))
EXPORTER_PKGS = ("prometheus-node-exporter", "dbus", "openssl")
DEST = "/etc/default/prometheus-node-exporter"
AM_DEST = "/etc/default/prometheus-alertmanager"
WEBHOOK = "https://hooks.example.com/x"

# The fake dpkg database: $FAKE/status/<pkg> holds dpkg-query's ${Status}, $FAKE/deps/<pkg> what
# an install pulls in (marked auto in $FAKE/auto/), $FAKE_ROOT/var/lib/dpkg/updates dpkg's journal.
STUBS = {
    "dpkg-query": r'''
if [[ ${!#} == -f* ]]; then for f in "$FAKE"/status/*; do [ -e "$f" ] && echo "$(<"$f")"; done; exit 0; fi  # every package
f="$FAKE/status/${!#}"
if [ -f "$f" ]; then printf '%s' "$(<"$f")"; exit 0; fi
echo "dpkg-query: no packages found matching ${!#}" >&2; exit 1
''',
    "dpkg": r'''
echo "dpkg $*" >> "$FAKE/calls"
partial() { grep -lE 'unpacked|half-|triggers-' "$FAKE"/status/* 2>/dev/null || true; }
case " $* " in
  *" --configure -a "*) for f in $(partial); do echo "install ok installed" > "$f"; done
                        rm -f "$FAKE_ROOT"/var/lib/dpkg/updates/[0-9]* ;;
  *) exit 2 ;;
esac
''',
    "apt-get": r'''
echo "apt-get $*" >> "$FAKE/calls"
sim=0 autorm=0 cmd="" pkgs=()
while [ $# -gt 0 ]; do
  case $1 in -o) shift ;; -s) sim=1 ;; --autoremove) autorm=1 ;; -*) ;; *) if [ -z "$cmd" ]; then cmd=$1; else pkgs+=("$1"); fi ;; esac
  shift
done
orphans() { # REMOVED...: auto-installed packages that nothing left needs
  local -A gone=(); local p q f g more=1 needed
  for p in "$@"; do gone[$p]=1; done
  while [ $more = 1 ]; do
    more=0
    for f in "$FAKE"/auto/*; do
      [ -e "$f" ] || continue; p=${f##*/}
      [ -z "${gone[$p]:-}" ] && [ -f "$FAKE/status/$p" ] || continue
      needed=0
      for g in "$FAKE"/status/*; do q=${g##*/}; [ -n "${gone[$q]:-}" ] && continue
        if grep -qx -- "$p" "$FAKE/deps/$q" 2>/dev/null; then needed=1; break; fi; done
      if [ $needed = 0 ]; then gone[$p]=1; echo "$p"; more=1; fi
    done
  done
}
if [ $sim = 1 ]; then
  case $cmd in
    autoremove) for p in $(orphans); do echo "Remv $p [1.0]"; done ;;
    purge) for p in "${pkgs[@]}"; do echo "Purg $p [1.0]"; done
           if [ $autorm = 1 ]; then for p in $(orphans "${pkgs[@]}"); do echo "Purg $p [1.0]"; done; fi ;;
  esac
  exit 0
fi
[ "$cmd" = update ] && exit 0
if compgen -G "$FAKE_ROOT/var/lib/dpkg/updates/[0-9]*" >/dev/null || grep -qlE 'unpacked|half-' "$FAKE"/status/* 2>/dev/null; then
  echo "E: dpkg was interrupted, you must manually run 'dpkg --configure -a' to correct the problem." >&2; exit 100
fi
case $cmd in
  install)
    n=0
    for p in "${pkgs[@]}"; do
      n=$((n + 1))
      if [ -n "${FAKE_KILL_IN_DPKG:-}" ] && [ $n = 2 ]; then  # killed while dpkg unpacks the second one
        echo "install ok unpacked" > "$FAKE/status/$p"; touch "$FAKE_ROOT/var/lib/dpkg/updates/0001"
        kill -9 "$PPID"; exit 137
      fi
      echo "install ok installed" > "$FAKE/status/$p"; rm -f "$FAKE/auto/$p"
      for d in $(cat "$FAKE/deps/$p" 2>/dev/null); do
        [ -f "$FAKE/status/$d" ] || { echo "install ok installed" > "$FAKE/status/$d"; touch "$FAKE/auto/$d"; }
      done
    done ;;
  purge)
    [ -z "${FAKE_PURGE_FAIL:-}" ] || { echo "E: Sub-process /usr/bin/dpkg returned an error code (1)" >&2; exit 100; }
    all=("${pkgs[@]}"); if [ $autorm = 1 ]; then mapfile -t -O ${#all[@]} all < <(orphans "${pkgs[@]}"); fi
    for p in "${all[@]}"; do rm -f "$FAKE/status/$p" "$FAKE/auto/$p"; done ;;
  *) exit 2 ;;
esac
''',
    "systemctl": r'''
echo "systemctl $*" >> "$FAKE/calls"
case $1 in show) echo no ;; esac
exit 0
''',
    "ss": r'''
port=${!#}; port=${port##*:}
echo "LISTEN 0 4096 127.0.0.1:$port 0.0.0.0:*"
''',
    "curl": r'''
printf '%s\n' 'node_cpu_seconds_total{cpu="0",mode="steal"} 0' 'fimfleet_monitor_last_probe_timestamp_seconds{node="a"} 1' \
  'prometheus_config_last_reload_successful 1' 'prometheus_config_last_reload_success_timestamp_seconds 99999999999' \
  "$FAKE_RULES"
''',
    # `cp` killed half-way through its copy (FAKE_KILL_IN_CP)
    "cp": r'''
if [ -n "${FAKE_KILL_IN_CP:-}" ]; then head -c 12 "${@: -2:1}" > "${!#}"; kill -9 "$PPID"; exit 137; fi
exec /bin/cp "$@"
''',
    # install -o/-g needs the account; the fake host has none
    "install": r'''
echo "install $*" >> "$FAKE/calls"
args=(); while [ $# -gt 0 ]; do case $1 in -o|-g) shift ;; *) args+=("$1") ;; esac; shift; done
exec /usr/bin/install "${args[@]}"
''',
    # the check wants Alertmanager's config 0640 root:prometheus; the fake host has no such group
    "stat": r'''
if [ "$1 $2" = "-c %a:%U:%G" ]; then echo 640:root:prometheus; else exec /usr/bin/stat "$@"; fi
''',
    "promtool": "exit 0", "amtool": "exit 0", "getent": "exit 0", "useradd": "exit 0",
}

ABSOLUTE = re.compile(r"(?<![\w.-])/(etc|var|run|usr)/")


class Host:
    """A fake Debian host under tmp: its files under root/, its dpkg database under world/."""

    def __init__(self, tmp: Path, fresh: bool = True):
        self.root, self.world, stubs = tmp / "root", tmp / "world", tmp / "bin"
        if fresh:
            for d in (self.root / "run/lock", self.root / "var/lib/dpkg/updates", self.root / "etc/default",
                      self.world / "status", self.world / "deps", self.world / "auto", stubs):
                d.mkdir(parents=True)
            (self.world / "calls").write_text("")
            for name, body in STUBS.items():
                (stubs / name).write_text(f"#!/bin/bash\n{body.strip()}\n")
                (stubs / name).chmod(0o755)
        rules = ",".join(f'{{"name":"{g}"}}' for g in m.RULE_GROUPS)
        self.env = {"PATH": f"{stubs}:/usr/bin:/bin", "FAKE": str(self.world), "FAKE_ROOT": str(self.root),
                    "FAKE_RULES": rules, "LC_ALL": "C"}

    def clone(self, tmp: Path) -> Host:
        """This host as it is now, under another tmp dir (its files hold no path of their own)."""
        shutil.copytree(self.root.parent, tmp, symlinks=True)
        return Host(tmp, fresh=False)

    def rewrite(self, text: str) -> str:
        return ABSOLUTE.sub(lambda mt: f"{self.root}/{mt.group(1)}/", text)

    def path(self, p: str) -> Path:
        return Path(self.rewrite(p))

    def has(self, *pkgs: str, auto: bool = False, deps: dict | None = None) -> None:
        for p in pkgs:
            (self.world / "status" / p).write_text("install ok installed")
            if auto:
                (self.world / "auto" / p).touch()
        for p, ds in (deps or {}).items():
            (self.world / "deps" / p).write_text("".join(f"{d}\n" for d in ds))

    def status(self, p: str) -> str | None:
        f = self.world / "status" / p
        return f.read_text().strip() if f.exists() else None

    def upload(self, files: list[dict]) -> None:
        """What RemoteStep does before the apply: the step's files in place."""
        for f in files:
            path = self.path(f["path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f["content"])
            path.chmod(int(f["mode"], 8))

    def run(self, script: str, kill_after: str | None = None, **env) -> subprocess.CompletedProcess:
        """The script as ssh.run runs it (set -euo pipefail), SIGKILLed right after the first line
        that contains `kill_after` when given."""
        lines = self.rewrite(script).splitlines()
        if kill_after:
            at = next(i for i, line in enumerate(lines) if self.rewrite(kill_after) in line)
            lines.insert(at + 1, "kill -9 $$")
        body = "set -euo pipefail\n{\n" + "\n".join(lines) + "\n} </dev/null\n"
        return subprocess.run(["bash", "-c", body], capture_output=True, text=True, timeout=120,
                              env={**self.env, **env})

    def calls(self, since: int = 0) -> list[str]:
        return (self.world / "calls").read_text().splitlines()[since:]

    def ok(self, script: str, **env) -> None:
        r = self.run(script, **env)
        assert r.returncode == 0, r.stdout + r.stderr


def killed(r: subprocess.CompletedProcess) -> bool:
    return r.returncode in (-9, 137)


def exporter(e: m.ExporterArgs = EXPORTER) -> dict:
    return m.exporter_steps(e)[0]


# ------------------------------------------------------------------ 2: the ledgers

@pytest.mark.parametrize("then", ["rerun", "destroy"])
def test_packages_installed_by_a_run_killed_before_it_recorded_them_are_still_purged(tmp_path, then):
    """Killed after `apt-get install` returned, before the record: the rerun found them installed
    and recorded nothing, and destroy never purged them. The user's openssl stays."""
    h = Host(tmp_path)
    h.has("openssl")
    step = exporter()
    h.upload(step["files"])
    assert killed(h.run(step["apply"], kill_after='apt-get "${apt_opts[@]}" install'))
    if then == "rerun":
        h.ok(step["apply"])
    h.ok(step["destroy"])
    assert [h.status(p) for p in EXPORTER_PKGS] == [None, None, "install ok installed"]
    assert not list(h.path("/var/lib/fimfleet").glob("monitoring-exporter-packages*"))


@pytest.mark.parametrize("then", ["rerun", "destroy"])
def test_a_dpkg_killed_mid_install_is_finished_and_its_packages_are_fimfleets(tmp_path, then):
    """A kill inside dpkg leaves "dpkg was interrupted": every later apt-get failed until someone
    ran `dpkg --configure -a` by hand."""
    h = Host(tmp_path)
    step = exporter()
    h.upload(step["files"])
    assert killed(h.run(step["apply"], FAKE_KILL_IN_DPKG="1"))
    assert h.status("dbus") == "install ok unpacked"
    if then == "rerun":
        h.ok(step["apply"])
        assert [h.status(p) for p in EXPORTER_PKGS] == ["install ok installed"] * 3
        assert any(c.startswith("dpkg ") and "--configure -a" in c for c in h.calls())
    h.ok(step["destroy"])
    assert [h.status(p) for p in EXPORTER_PKGS] == [None, None, None]
    assert not list(h.path("/var/lib/dpkg/updates").iterdir())


def test_a_package_a_users_killed_dpkg_left_half_set_up_stays_the_users(tmp_path):
    h = Host(tmp_path)
    h.has("prometheus-node-exporter", "dbus", "openssl")
    (h.world / "status" / "dbus").write_text("install ok unpacked")
    step = exporter()
    h.upload(step["files"])
    h.ok(step["apply"])
    h.ok(step["destroy"])
    assert [h.status(p) for p in EXPORTER_PKGS] == ["install ok installed"] * 3


def host_destroy() -> str:
    return templates.render("host/packages-destroy.sh.j2")


def test_host_destroy_leaves_what_was_autoremovable_before_fimfleet(tmp_path):
    """`purge --autoremove` also removed what was autoremovable before fimfleet came (an old
    kernel): only the recorded packages and what they alone pulled in go."""
    h = Host(tmp_path)
    h.has("linux-image-old", "libssl3", auto=True)  # an old kernel nothing needs; openssl's library
    h.has("openssl", deps={"openssl": ["libssl3"], "nginx": ["nginx-common", "libssl3"]})
    h.has("nginx", "jq")
    h.has("nginx-common", auto=True)
    record = h.path("/var/lib/fimfleet/installed-packages")
    record.parent.mkdir(parents=True)
    record.write_text("jq\nnginx\n")
    h.ok(host_destroy())
    assert {p: h.status(p) for p in ("nginx", "nginx-common", "jq")} == dict.fromkeys(("nginx", "nginx-common", "jq"))
    assert all(h.status(p) for p in ("linux-image-old", "libssl3", "openssl"))
    assert not record.exists()


@pytest.mark.parametrize("which", ["host", "exporter", "server"])
def test_a_failed_purge_keeps_the_record_so_the_destroy_rerun_purges(tmp_path, which):
    h = Host(tmp_path)
    h.has("nginx", "prometheus-node-exporter", "prometheus")
    record, pkg, destroy = {
        "host": ("/var/lib/fimfleet/installed-packages", "nginx", host_destroy()),
        "exporter": (m.PACKAGE_RECORD.format(role="exporter"), "prometheus-node-exporter", exporter()["destroy"]),
        "server": (m.PACKAGE_RECORD.format(role="server"), "prometheus", m.steps(make_args())[0]["destroy"]),
    }[which]
    h.path(record).parent.mkdir(parents=True)
    h.path(record).write_text(f"{pkg}\n")
    r = h.run(destroy, FAKE_PURGE_FAIL="1")
    assert r.returncode != 0 and "returned an error code" in r.stderr
    assert h.path(record).read_text() == f"{pkg}\n" and h.status(pkg)
    h.ok(destroy)
    assert not h.path(record).exists() and h.status(pkg) is None


@pytest.mark.parametrize("which", ["host", "exporter"])
def test_the_destroys_purge_what_a_pending_record_holds(tmp_path, which):
    """A record left pending by a killed install (installed: purged; never installed: dropped)."""
    h = Host(tmp_path)
    h.has("nginx", "prometheus-node-exporter")
    record, pkg, destroy = {
        "host": ("/var/lib/fimfleet/installed-packages", "nginx", host_destroy()),
        "exporter": (m.PACKAGE_RECORD.format(role="exporter"), "prometheus-node-exporter", exporter()["destroy"]),
    }[which]
    pending = h.path(record + ".pending")
    pending.parent.mkdir(parents=True)
    pending.write_text(f"{pkg}\nnever-installed\n")
    h.ok(destroy)
    assert h.status(pkg) is None and not pending.exists() and not h.path(record).exists()


# a line that changes the host, or calls what does: the points where a kill matters
CHANGES = re.compile(r"(^|[\s;{(])(cp|mv|rm|install|apt-get|apt_update|dpkg|dpkg_recover|ledger_\w+|systemctl|enable_unit|"
                     r"reload_units|restore_default|flock|exec|printf|sort|: >)(\s|$)")


def kill_points(script: str, start: str = "", end: str = "") -> list[str]:
    """Each line of the script (from `start` to `end`) that changes the host, after which a
    `kill -9 $$` is a command of its own: where a run may die, inside the helpers' functions too."""
    lines = script.splitlines()
    first = next(i for i, line in enumerate(lines) if start in line)
    last = next(i for i, line in enumerate(lines) if i >= first and end in line) if end else len(lines) - 1
    points = []
    for i in range(first, last + 1):
        line = lines[i]
        if line.lstrip().startswith("#") or not CHANGES.search(line) or line.rstrip().endswith(("\\", "|", "&&")):
            continue
        if line.count("(") != line.count(")") or line in points:  # in an array; run() kills after the first match
            continue
        body = "\n".join(lines[:i + 1] + ["kill -9 $$"] + lines[i + 1:])
        if subprocess.run(["bash", "-n"], input=body, text=True, capture_output=True).returncode == 0:
            points.append(line)
    return points


def test_a_destroy_killed_at_any_line_finishes_on_its_rerun(tmp_path):
    step = exporter()
    lines = kill_points(step["destroy"])
    assert len(lines) > 20
    base = Host(tmp_path / "base")
    base.has("openssl")
    base.upload(step["files"])
    base.ok(step["apply"])
    for n, line in enumerate(lines):
        h = base.clone(tmp_path / str(n))
        r = h.run(step["destroy"], kill_after=line)
        assert r.returncode in (0, -9, 137), (line, r.stderr)
        h.ok(step["destroy"])
        assert [h.status(p) for p in EXPORTER_PKGS] == [None, None, "install ok installed"], line
        assert not h.path("/etc/default/prometheus-node-exporter").exists(), line
        assert not [p for p in h.path("/var/lib/fimfleet").iterdir() if p.name.startswith("monitoring-")], line


HOST_PKGS = ("nginx", "jq", "openssl")


@pytest.mark.parametrize("then", ["rerun", "destroy"])
def test_the_hosts_packages_killed_at_any_line_or_inside_dpkg_are_fimfleets_and_destroy_purges_them(tmp_path, then):
    """The host's install appended to its record only after `apt-get install` returned: a run killed
    in between left packages that no destroy purged, and a kill inside dpkg failed every later
    apt-get. The user's openssl stays either way."""
    apply = templates.render("host/packages.sh.j2", packages=list(HOST_PKGS))
    base = Host(tmp_path / "base")
    base.has("openssl")
    cases = [{"kill_after": line} for line in kill_points(apply, start="ledger_install() {")] + [{"FAKE_KILL_IN_DPKG": "1"}]
    assert len(cases) > 8
    for n, case in enumerate(cases):
        h = base.clone(tmp_path / str(n))
        r = h.run(apply, **case)
        assert r.returncode in (0, -9, 137), (case, r.stderr)
        if then == "rerun":
            h.ok(apply)
            assert [h.status(p) for p in HOST_PKGS] == ["install ok installed"] * 3, case
        h.ok(host_destroy())
        assert [h.status(p) for p in HOST_PKGS] == [None, None, "install ok installed"], case
        assert not list(h.path("/var/lib/fimfleet").glob("installed-packages*")), case


def restarted_after_its_last_change(calls: list[str], service: str) -> bool:
    """The daemon's last restart came after its /etc/default file last changed."""
    changed = max(i for i, c in enumerate(calls) if c.startswith("install ") and c.endswith(f"/etc/default/{service}"))
    return any(c == f"systemctl restart {service}" for c in calls[changed:])


@pytest.mark.parametrize("users", [False, True])
def test_an_apply_killed_at_any_line_converges_on_its_rerun_and_destroy_gives_everything_back(tmp_path, users):
    """node_exporter's step killed after each line of packages.sh (its helpers' lines too), run
    again, then destroyed. users: the package and its /etc/default file were the user's, and the
    stack changes node_exporter's ARGS; else fimfleet installs it next to the user's openssl."""
    mine = 'ARGS="--collector.textfile.directory=/srv/prom"\n'
    base = Host(tmp_path / "base")
    if users:
        base.has(*EXPORTER_PKGS)
        base.path(DEST).write_text(mine)
        base.upload(exporter()["files"])
        base.ok(exporter()["apply"])
    else:
        base.has("openssl")
    step = exporter(EXPORTER_V2 if users else EXPORTER)
    base.upload(step["files"])
    lines = kill_points(step["apply"], "record=", "reload_or_start() {")
    assert len(lines) > 30
    kills = 0
    for n, line in enumerate(lines):
        h = base.clone(tmp_path / str(n))
        r = h.run(step["apply"], kill_after=line)
        assert r.returncode in (0, -9, 137), (line, r.stderr)  # 0: a branch this run does not take
        kills += killed(r)
        h.ok(step["apply"])
        assert h.path(DEST).read_text() == step["files"][0]["content"], line
        assert restarted_after_its_last_change(h.calls(), "prometheus-node-exporter"), line
        record = h.path(m.PACKAGE_RECORD.format(role="exporter"))
        assert sorted(p.name for p in record.parent.iterdir()) == ([] if users else [record.name]), line
        assert record.exists() or users, line
        if not users:
            assert record.read_text() == "dbus\nprometheus-node-exporter\n", line
        h.ok(step["destroy"])
        want = ["install ok installed"] * 3 if users else [None, None, "install ok installed"]
        assert [h.status(p) for p in EXPORTER_PKGS] == want, line
        assert (h.path(DEST).read_text() == mine) if users else not h.path(DEST).exists(), line
        assert not list(h.path(m.STAGED_DIR).glob("*node-exporter*")), line
        assert not list(h.path("/var/lib/fimfleet").iterdir()), line
    assert kills > (5 if users else 20), kills


# ------------------------------------------------------------------ 4: a restart owed survives a kill

@pytest.mark.parametrize("role", ["exporter", "server"])
def test_a_run_killed_after_the_new_args_went_in_still_restarts_the_daemon(tmp_path, role):
    """Killed between installing the new /etc/default file and the restart: the rerun found the
    files equal and the daemon kept its old ARGS (node_exporter's unit-include, Prometheus's
    retention)."""
    h = Host(tmp_path)
    if role == "exporter":
        h.has(*EXPORTER_PKGS)
        v1, v2, service = exporter(EXPORTER), exporter(EXPORTER_V2), "prometheus-node-exporter"
    else:
        h.has("prometheus")
        v1, v2, service = m.steps(make_args())[0], m.steps(make_args(retention="90d"))[0], "prometheus"
    h.upload(v1["files"])
    h.ok(v1["apply"])
    h.upload(v2["files"])
    r = h.run(v2["apply"], kill_after=f"install -m 0644 /etc/fimfleet/monitoring/default-{service} /etc/default/{service}")
    assert killed(r)
    since = len(h.calls())
    h.ok(v2["apply"])
    assert f"systemctl restart {service}" in h.calls(since)
    assert not h.path(m.RESTART_STAMP.format(service=service)).exists()
    since = len(h.calls())
    h.ok(v2["apply"])  # owed once only
    assert f"systemctl restart {service}" not in h.calls(since)


# ------------------------------------------------------------------ 7: the file from before fimfleet

@pytest.mark.parametrize("before", [None, "fimfleet's, from a version that kept no marker"])
def test_a_users_package_without_an_etc_default_file_gets_none_back(tmp_path, before):
    """The package was the user's, with no /etc/default file: the second ARGS change saved
    fimfleet's first file as "before-fimfleet", and destroy put fimfleet's ARGS back."""
    h = Host(tmp_path)
    h.has(*EXPORTER_PKGS)
    if before:
        h.path(DEST).write_text(exporter()["files"][0]["content"])
    for e in (EXPORTER, EXPORTER_V2):
        h.upload(exporter(e)["files"])
        h.ok(exporter(e)["apply"])
    h.ok(exporter()["destroy"])
    assert not h.path(DEST).exists()
    assert [h.status(p) for p in EXPORTER_PKGS] == ["install ok installed"] * 3


def test_a_run_killed_while_copying_the_users_file_aside_loses_nothing(tmp_path):
    h = Host(tmp_path)
    h.has(*EXPORTER_PKGS)
    mine = 'ARGS="--web.listen-address=:9100 --collector.textfile.directory=/srv/prom"\n'
    h.path(DEST).write_text(mine)
    step = exporter()
    h.upload(step["files"])
    assert killed(h.run(step["apply"], FAKE_KILL_IN_CP="1"))
    h.ok(step["apply"])
    h.upload(exporter(EXPORTER_V2)["files"])
    h.ok(exporter(EXPORTER_V2)["apply"])
    h.ok(step["destroy"])
    assert h.path(DEST).read_text() == mine


# ------------------------------------------------------------------ 10: Alertmanager turned off

@pytest.mark.parametrize("fimfleets", [False, True])
def test_alertmanager_off_stops_only_the_one_fimfleet_installed(tmp_path, fimfleets):
    h = Host(tmp_path)
    h.has("prometheus", "prometheus-alertmanager")
    if fimfleets:
        record = h.path(m.PACKAGE_RECORD.format(role="server"))
        record.parent.mkdir(parents=True)
        record.write_text("prometheus-alertmanager\n")
    step = m.steps(make_args())[0]
    h.upload(step["files"])
    h.ok(step["apply"])
    assert ("systemctl disable -q --now prometheus-alertmanager" in h.calls()) == fimfleets


@pytest.mark.parametrize("via", ["apply off, then destroy", "destroy"])
def test_a_users_alertmanager_gets_its_file_back_after_fimfleet_turned_it_off(tmp_path, via):
    """Turning Alertmanager off dropped it from the step's /etc/default files: destroy never
    gave the user's Alertmanager its own file back."""
    h = Host(tmp_path)
    h.has("prometheus", "prometheus-alertmanager")
    mine = 'ARGS="--config.file=/srv/am/alertmanager.yml"\n'
    h.path(AM_DEST).write_text(mine)
    on, off = m.steps(make_args(alertmanager_webhook_url=WEBHOOK))[0], m.steps(make_args())[0]
    h.upload(on["files"])
    h.ok(on["apply"])
    assert h.path(AM_DEST).read_text() != mine
    h.upload(off["files"])
    if via != "destroy":
        since = len(h.calls())
        h.ok(off["apply"])
        assert h.path(AM_DEST).read_text() == mine
        assert "systemctl try-restart prometheus-alertmanager" in h.calls(since)
    h.ok(off["destroy"])
    assert h.path(AM_DEST).read_text() == mine
    assert h.status("prometheus-alertmanager")
    assert not list(h.path(m.STAGED_DIR).glob("*alertmanager*"))
