"""The ingress step's certificate upkeep and hardening settings, as rendered from a stack config:
certbot.timer for ACME, the expiry warning of the refresh check (run for real with openssl),
the nginx unit's descriptor limit, and the new ingress settings."""

from __future__ import annotations

import configparser
import os
import re
import subprocess
from pathlib import Path

import pytest

from components import config, ingress, tls
from components.nginx_base import DROPIN_PATH, NginxBase, render as render_host_nginx
from tests.helpers import provided_tls, raw_config

ACME = {"tls": "acme", "domain": "code.example.com", "acmeEmail": "ops@example.com"}


def cfg_for(tier: str = "cpu-epyc-prod", **ingress_keys) -> config.StackConfig:
    raw, secret = raw_config(tier, ingress={"domain": "code.example.com", **ingress_keys})
    return config.parse(raw, secret)


def scripts(cfg: config.StackConfig) -> dict[str, str]:
    args = ingress.args_for(cfg)
    return ingress.step_scripts(args, ingress.render_files(args, "code.example.com", "CERT", "KEY")[1])


def staged(cfg: config.StackConfig) -> dict[str, str]:
    files, _ = ingress.render_files(ingress.args_for(cfg), "code.example.com", "CERT", "KEY")
    return {f["path"].rsplit("/", 1)[-1]: f["content"] for f in files}


# ------------------------------------------------------------------ ACME renewal


def test_acme_apply_enables_certbot_timer_and_renews_when_due():
    apply = scripts(cfg_for(**ACME))["apply"]
    lines = [line.strip() for line in apply.splitlines()]
    assert "systemctl enable -q --now certbot.timer" in lines
    assert "certbot renew --quiet" in lines
    # the timer is enabled on every apply, not only when the first certificate is issued
    issue_block = apply[apply.index("if [ ! -f /etc/letsencrypt/live/code.example.com/fullchain.pem ]"):]
    assert issue_block.index("fi\n") < issue_block.index("certbot.timer")
    # renewals reuse the saved hooks: port 80 is freed for certbot and nginx restarts on the new cert
    assert "--pre-hook 'systemctl stop nginx' --post-hook 'systemctl start nginx || true'" in apply


@pytest.mark.parametrize("source", [{}, {"tls": "provided"}])
def test_other_certificate_sources_do_not_touch_certbot(source):
    if source:
        raw, secret = raw_config(ingress={"domain": "code.example.com", **source}, **provided_tls())
        cfg = config.parse(raw, secret | {"tlsCert", "tlsKey"})
    else:
        cfg = cfg_for()
    s = scripts(cfg)
    assert "certbot" not in s["apply"] + s["check"]
    # its destroy gives back a certbot that fimfleet installed while the node had ACME (the ledger,
    # tests/unit/test_ingress_rerun.py), and only once no other node on the host uses it
    assert f"grep -qx certbot \"$ledger\"" in s["destroy"] and "ledger_purge \"$ledger\"" in s["destroy"]


# ------------------------------------------------------------ expiry warning, run


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A fake host for the check script: nginx and systemctl succeed, openssl is real."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("nginx", "systemctl"):
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / tool).chmod(0o755)
    cert = tmp_path / "server.pem"
    monkeypatch.setattr(ingress, "tls_paths", lambda settings, node: (str(cert), str(tmp_path / "server.key")))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def run(script: str, days: int) -> subprocess.CompletedProcess:
        cert.write_text(tls.issue("code.example.com", ["code.example.com"], [], days=days)["certPem"])
        return subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True,
                              env=env, timeout=30)

    return run


def check_only(cfg) -> tuple[str, str]:
    """(refresh check, the check at the end of apply) without the file comparisons."""
    s = ingress.step_scripts(ingress.args_for(cfg), [])
    marker = "# fimfleet NginxIngress: installed files match"
    return s["check"], s["apply"][s["apply"].index(marker):]


@pytest.mark.parametrize("tls_keys", [{}, ACME, {"tls": "provided"}])
def test_refresh_check_flags_a_certificate_expiring_within_30_days(host, tls_keys):
    if tls_keys.get("tls") == "provided":
        raw, secret = raw_config(ingress={"domain": "code.example.com", **tls_keys}, **provided_tls())
        cfg = config.parse(raw, secret | {"tlsCert", "tlsKey"})
    else:
        cfg = cfg_for(**tls_keys)
    refresh, end_of_apply = check_only(cfg)
    fresh = host(refresh, days=365)
    assert fresh.returncode == 0 and not fresh.stderr, fresh.stderr
    near = host(refresh, days=tls.RENEW_BEFORE_DAYS - 1)
    assert near.returncode == 1  # drift: refresh warns, the next up applies again
    assert re.search(r"WARNING: the TLS certificate \S+server\.pem expires within 30 days \(notAfter=", near.stderr)
    assert ingress.RENEW_HINTS[cfg.ingress.tls] in near.stderr
    # at the end of apply the same finding only warns, so a short test validity still deploys
    warned = host(end_of_apply, days=tls.RENEW_BEFORE_DAYS - 1)
    assert warned.returncode == 0 and "WARNING: the TLS certificate" in warned.stderr


def test_expiry_window_is_the_provider_reissue_window():
    refresh, _ = check_only(cfg_for())
    assert f"-checkend {tls.RENEW_BEFORE_DAYS * 86400} " in refresh


# ------------------------------------------------------ rendered settings, wired


def test_nginx_unit_gets_the_workers_descriptor_limit():
    step = render_host_nginx(NginxBase())
    files = {f["path"].rsplit("/", 1)[-1]: f["content"] for f in step.files}
    nofile = re.search(r"^worker_rlimit_nofile (\d+);", files["nginx.conf"], re.M).group(1)
    connections = re.search(r"worker_connections (\d+);", files["nginx.conf"]).group(1)
    dropin = configparser.ConfigParser()
    dropin.read_string(files[Path(DROPIN_PATH).name])
    assert dropin["Service"]["LimitNOFILE"] == nofile == str(2 * int(connections))
    assert f"fimfleet-limits.conf:{DROPIN_PATH}:0644" in step.apply
    # a changed limit reloads systemd and restarts nginx, a rerun after a kill too (a stamp made before
    # the new file is installed, tests/unit/test_ingress_rerun.py); destroy reloads systemd without it
    assert re.search(r'if ! cmp -s "\$staged/\$\{dropin##\*/\}" "\$dropin"; then : > "\$restart_pending"; fi', step.apply)
    assert 'if [ -e "$restart_pending" ]; then systemctl daemon-reload; fi' in step.apply
    assert "systemctl daemon-reload" in step.destroy
    # the node's own step never touches the unit or the main config
    node_installs = ingress.render_files(ingress.args_for(cfg_for()), "code.example.com", "C", "K")[1]
    assert {i["dest"] for i in node_installs} == {"/etc/nginx/fimfleet.d/node.conf", "/etc/nginx/fimfleet.d/node.keys",
                                                  "/etc/fimfleet/tls/node/server.pem", "/etc/fimfleet/tls/node/server.key"}
    assert "daemon-reload" not in "".join(scripts(cfg_for()).values())


@pytest.mark.parametrize("tier, size", [("cpu-epyc-prod", "144k"), ("gpu-h100", "528k")])
def test_body_limit_follows_the_engine_context(tier, size):
    assert f"client_max_body_size {size};" in staged(cfg_for(tier))["node.conf"]
    assert "client_max_body_size 1m;" in staged(cfg_for(tier, clientMaxBodySize="1m"))["node.conf"]


def test_connection_limit_setting_reaches_nginx():
    assert "limit_conn fimfleet_node_per_addr 32;" in staged(cfg_for())["node.conf"]
    assert "limit_conn fimfleet_node_per_addr 4;" in staged(cfg_for(maxConnsPerAddress=4))["node.conf"]


@pytest.mark.parametrize("key, value, fix", [
    ("maxConnsPerAddress", 0, "must be between 1 and 65535"),
    ("ratePerSecond", 10001, "must be between 1 and 10000"),
    ("readTimeoutS", 5, "must be between 10 and 86400"),
    ("clientMaxBodySize", "1 MB", "nginx size"),
    ("certValidityDays", tls.MAX_VALIDITY_DAYS + 1, "between 1 and 365"),
    ("certValidityDays", 0, "between 1 and 365"),
])
def test_bad_ingress_settings_name_key_value_and_fix(key, value, fix):
    with pytest.raises(config.ConfigError) as err:
        cfg_for(**{key: value})
    assert any(p.key == f"ingress.{key}" and p.value == value and fix in p.fix for p in err.value.problems), \
        err.value.problems


def test_config_validity_bound_is_the_issuers():
    assert cfg_for(certValidityDays=tls.MAX_VALIDITY_DAYS).ingress.cert_validity_days == 365
    with pytest.raises(ValueError):
        tls.issue("a", ["a"], [], days=tls.MAX_VALIDITY_DAYS + 1)


def test_no_node_name_reaches_the_hosts_own_nginx_directories():
    """The host step stages and keeps its previous files beside each node's: a node named
    like it would have its destroy delete the host's staged main config."""
    from components import grammar, nginx_base

    host_step = render_host_nginx(NginxBase())
    assert not grammar.DNS_LABEL.fullmatch(nginx_base.HOST_DIR)
    assert {f["path"].rsplit("/", 1)[0] for f in host_step.files} == {f"{nginx_base.STAGED_ROOT}/{nginx_base.HOST_DIR}"}
    assert f"{nginx_base.STATE_DIR}/{nginx_base.HOST_DIR}-prev" in host_step.apply
    assert ingress.staged_dir("host") != nginx_base.STAGED_DIR
