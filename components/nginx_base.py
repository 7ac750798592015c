"""The host's nginx: one main config and the unit's descriptor limit, whatever nodes it fronts.

nginx has one main config per host, and the http-level names in it (log formats, zones,
upstreams, map variables) share one namespace. So HostBase owns this file, once per host,
and each node's ingress (components/ingress_render.py) adds its own site under
``fimfleet.d/`` with names that carry the node's name.

The main config is self-contained (it does not include Debian's ``sites-enabled``), so
Debian's default site cannot grab port 80. It sets no ``daemon`` directive: Debian's unit
passes ``-g 'daemon on; master_process on;'`` and a duplicate makes nginx refuse to start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional, Union

from components import grammar, templates
from components.templates import make_environment

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "files" / "nginx"

MAIN_CONF = "nginx.conf"
SITES_DIR = "fimfleet.d"
"""Under conf_dir: each node's site (``<node>.conf``, included) and keys (``<node>.keys``)."""
DROPIN_PATH = "/etc/systemd/system/nginx.service.d/fimfleet-limits.conf"
"""systemd drop-in that sets the nginx unit's LimitNOFILE (see render_dropin)."""
STAGED_ROOT = "/etc/fimfleet/nginx-staged"
STATE_DIR = "/var/lib/fimfleet/nginx"
"""The distribution's nginx.conf (restored by destroy), each step's previous files (what nginx last
accepted), and the ledger of what the ingress steps installed with apt (certbot)."""
LOCK = f"{STATE_DIR}/lock"
"""Held by every step that changes this host's nginx (its main config, each site, the gateway's
rotation): one `nginx -t` never sees another step's files half installed."""
HOST_DIR = "_host"
"""This step's directory under both, beside each node's (named after it): no node is named
so, since node names are DNS labels."""
STAGED_DIR = f"{STAGED_ROOT}/{HOST_DIR}"
LEGACY_FILES = ("fimfleet-keys.conf", "fimfleet-site.conf")
"""The single-node layout's site and keys, in conf_dir, which the old main config included."""

# absolute path without whitespace, quotes, ';', '{', '}', '$', '#' or backslash
_PATH_RE = re.compile(r"^/[A-Za-z0-9._+@%,:=/-]*\Z")


def address_port(host: str, port: int) -> str:
    """`host:port` as nginx reads it in listen and server lines: an IPv6 address in brackets."""
    return f"{grammar.url_host(host)}:{port}"


def fail(owner: str, field_name: str, value: object, fix: str) -> None:
    raise ValueError(f"{owner}.{field_name}: invalid value {value!r}; {fix}")


def int_problem(value: object, lo: int, hi: int) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        return f"must be between {lo} and {hi}"
    return None


def check_int(owner: str, name: str, value: object, lo: int, hi: int) -> None:
    if fix := int_problem(value, lo, hi):
        fail(owner, name, value, fix)


def check_path(owner: str, name: str, value: object) -> None:
    if not isinstance(value, str) or not _PATH_RE.match(value) or "//" in value or "/../" in value + "/":
        fail(owner, name, value, "use an absolute path made of letters, digits and ._+@%,:=/- "
             "(no spaces, quotes, ';', '$', '..')")


@dataclass(frozen=True)
class NginxBase:
    """How nginx runs on one host. Validated on construction (ValueError)."""

    worker_processes: Union[int, str] = "auto"
    """nginx worker_processes ("auto" = one per core)."""
    worker_connections: int = 1024
    """nginx worker_connections (client and upstream connections together, per worker)."""
    worker_user: Optional[str] = "www-data"
    """User the workers run as when the master runs as root; None omits the directive."""
    conf_dir: str = "/etc/nginx"
    """Where nginx.conf and fimfleet.d/ live (include paths are absolute)."""
    log_dir: str = "/var/log/nginx"
    """Directory of fimfleet-error.log and of each node's access log."""
    pid_path: str = "/run/nginx.pid"
    """nginx pid file (Debian's systemd unit expects /run/nginx.pid)."""
    temp_dir: str = "/var/lib/nginx"
    """Parent of nginx's body/proxy/fastcgi/uwsgi/scgi temp directories."""

    def __post_init__(self) -> None:
        o = "NginxBase"
        check_int(o, "worker_connections", self.worker_connections, 16, 524288)
        if self.worker_processes != "auto":
            check_int(o, "worker_processes", self.worker_processes, 1, 1024)
        if self.worker_user is not None and grammar.unix_user(self.worker_user):
            fail(o, "worker_user", self.worker_user, "use a POSIX user name such as 'www-data', or None")
        for name in ("conf_dir", "log_dir", "pid_path", "temp_dir"):
            check_path(o, name, getattr(self, name))

    @property
    def sites_dir(self) -> str:
        return f"{self.conf_dir.rstrip('/')}/{SITES_DIR}"

    @property
    def main_path(self) -> str:
        return f"{self.conf_dir.rstrip('/')}/{MAIN_CONF}"


def nofile_limit(base: NginxBase) -> int:
    """Descriptors per nginx process: a proxied request holds two (client and upstream)."""
    return 2 * base.worker_connections


@lru_cache(maxsize=1)
def environment():
    # nginx templates are laid out for trim_blocks/lstrip_blocks.
    return make_environment(TEMPLATE_DIR, trim_blocks=True, lstrip_blocks=True)


def render_main(base: NginxBase) -> str:
    """nginx.conf: workers, pid, temp paths, and the include of every node's site."""
    return environment().get_template("nginx.conf.j2").render(
        spec=base, nofile=nofile_limit(base), sites=f"{base.sites_dir}/*.conf")


def render_dropin(base: NginxBase) -> str:
    """systemd drop-in for nginx.service (install at DROPIN_PATH, then daemon-reload)."""
    return environment().get_template("nginx-limits.conf.j2").render(nofile=nofile_limit(base))


@dataclass(frozen=True)
class NginxBaseSteps:
    files: list[dict]
    apply: str
    check: str
    destroy: str


def render(base: NginxBase) -> NginxBaseSteps:
    """HostBase's nginx step: stage both files, install them only when `nginx -t` accepts them."""
    contents = {MAIN_CONF: (base.main_path, render_main(base)), "fimfleet-limits.conf": (DROPIN_PATH, render_dropin(base))}
    installs = [{"name": name, "dest": dest, "mode": "0644"} for name, (dest, _) in contents.items()]
    kw = dict(conf=base.conf_dir, main=base.main_path, sites=base.sites_dir, staged_dir=STAGED_DIR, state_dir=STATE_DIR,
              lock=LOCK,
              prev_dir=f"{STATE_DIR}/{HOST_DIR}-prev", restart_stamp=f"{STATE_DIR}/{HOST_DIR}-restart-pending",
              dropin=DROPIN_PATH, files=installs, legacy=LEGACY_FILES)
    check = templates.render("ingress/base-check.sh.j2", **kw)
    return NginxBaseSteps(
        files=[{"path": f"{STAGED_DIR}/{name}", "mode": "0644", "content": content} for name, (_, content) in contents.items()],
        apply=templates.render("ingress/base-apply.sh.j2", check=check, **kw), check=check,
        destroy=templates.render("ingress/base-destroy.sh.j2", **kw))
