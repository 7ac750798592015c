"""What the ingress render tests share: a spec laid out under a temp prefix, the render written
there for the REAL `nginx -t`, and the blocks of a rendered site."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from components.ingress_render import MAIN_CONF, IngressSpec, ingress_install_plan, keys_conf, render_ingress, site_conf
from components.nginx_base import NginxBase
from components.tls import issue

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
# ./fimfleet bootstrap installs nginx; a missing binary is a failure, not a skip.
assert os.access(NGINX, os.X_OK), f"nginx binary not found at {NGINX}: run ./fimfleet bootstrap"

KEYS = {
    "alice": "sk-alice-0123456789abcdefABCDEF",
    "bob": "bob.key+with/b64~chars_0123456789==",
    "ci_bot": "CIBOTCIBOTCIBOTCIBOT4242",
}


def self_signed(directory: Path) -> tuple[Path, Path]:
    pems = issue("fimfleet.test", ["fimfleet.test"], [], days=1)  # the product's own issuer
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_text(pems["certPem"])
    key_path.write_text(pems["keyPem"])
    key_path.chmod(0o600)
    return cert_path, key_path


def make_spec(prefix: Path, tls: tuple[Path, Path], **overrides) -> IngressSpec:
    """A spec laid out under ``prefix`` (unprivileged layout, high ports)."""
    kwargs = dict(
        server_name="fimfleet.test",
        tls_cert_path=str(tls[0]),
        tls_key_path=str(tls[1]),
        upstream_port=8000,
        api_keys=dict(KEYS),
        https_port=18443,
        http_port=18080,
        listen_addresses=("127.0.0.1",),
    )
    base = dict(conf_dir=str(prefix), log_dir=str(prefix / "logs"), pid_path=str(prefix / "nginx.pid"),
                temp_dir=str(prefix / "tmp"), worker_user="root" if os.geteuid() == 0 else None)
    for name in [n for n in overrides if n in NginxBase.__dataclass_fields__]:
        base[name] = overrides.pop(name)
    kwargs.update(overrides)
    return IngressSpec(**kwargs, base=NginxBase(**base))


SITE, KEYS_FILE = site_conf("node"), keys_conf("node")


def write_render(spec: IngressSpec) -> dict[str, str]:
    prefix = Path(spec.base.conf_dir)
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    (prefix / "tmp").mkdir(parents=True, exist_ok=True)
    for f in ingress_install_plan(spec):
        path = Path(f.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f.content)
        path.chmod(f.mode)
    return render_ingress(spec)


def nginx_t(prefix: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [NGINX, "-t", "-p", str(prefix), "-c", str(prefix / MAIN_CONF)],
        capture_output=True, text=True, timeout=30,
    )


def location_block(site: str, header: str, start: int = 0) -> str:
    """Text of the block that starts with ``header`` at or after ``start``."""
    start = site.index(header, start)
    depth, i = 0, site.index("{", start)
    while True:
        if site[i] == "{":
            depth += 1
        elif site[i] == "}":
            depth -= 1
            if depth == 0:
                return site[start:i + 1]
        i += 1


def server_block(site: str, tls: bool) -> str:
    """The TLS server block, or the plain-HTTP one."""
    blocks, pos = [], 0
    while (pos := site.find("\nserver {", pos)) != -1:
        blocks.append(location_block(site, "server {", pos))
        pos += 1
    return next(b for b in blocks if (" ssl;" in b) is tls)
