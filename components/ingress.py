"""NginxIngress: TLS, named bearer keys, per-key rate limits and unbuffered SSE in front of vLLM.

The node's nginx site is rendered by components/ingress_render.py (pure, tested with the
real nginx); the host's main config belongs to HostBase (components/nginx_base.py). This
component chooses the certificate source, stages the node's files on the host and installs
them only when `nginx -t` accepts them (files/ingress/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import pulumi

from components import gateway_render, grammar, templates
from components.config import IngressConfig
from components.host import HostFacts
from components.gateway_render import FLEET_TLS_NAME, FleetUpstream
from components.ingress_render import IngressSpec, body_size_for, metrics_cidrs, site_files
from components.nginx_base import LEGACY_FILES, LOCK, STAGED_ROOT, STATE_DIR, NginxBase
from components.remote import RemoteStep
from components.tls import RENEW_BEFORE_DAYS, SelfSignedCertificate

CERTBOT_LEDGER = f"{STATE_DIR}/installed-packages"
"""certbot when an ingress step installed it (one line, as files/host/packages.sh.j2 records its own)."""
CERTBOT_USERS = f"{STATE_DIR}/certbot-users"
"""One file per node on the host with an ACME certificate: the last one's destroy purges certbot."""
TLS_ROOT = "/etc/fimfleet/tls"
"""Each node's certificate lives in a directory named after it, as its staged files do."""
RENEW_HINTS = {
    "self-signed": "the next pulumi up reissues it",
    "acme": "certbot.timer should have renewed it: see journalctl -u certbot; pulumi up runs certbot renew",
    "provided": "set a new fimfleet:tlsCert and fimfleet:tlsKey, then run pulumi up",
}
"""What the expiry warning of the refresh check tells the operator, per certificate source."""


@dataclass(frozen=True)
class IngressArgs:
    """What one node's ingress needs: its own settings and the few facts of the engine and
    stack it fronts. The API keys and a provided certificate are secrets."""

    node: str
    """The node's name: its files, certificate, log and nginx names carry it."""
    settings: IngressConfig
    """fimfleet:ingress, validated."""
    upstream_port: int
    """The engine's loopback port."""
    max_model_len: int
    """Sizes the request body limit when ingress.clientMaxBodySize is unset."""
    monitoring: bool
    """Prometheus on the node scrapes /metrics from loopback."""
    api_keys: Mapping[str, str] = field(default_factory=dict)
    tls_cert: str | None = None
    tls_key: str | None = None
    fleet: FleetUpstream | None = None
    """The gateway's site: proxy to these nodes' ingresses (components/gateway.py)."""
    fleet_member: bool = False
    """A node behind the gateway: its certificate also names FLEET_TLS_NAME, which the gateway verifies."""


def args_for(cfg, node: str = "node") -> IngressArgs:
    """A validated StackConfig's ingress of node `node`, with the engine and secrets it needs."""
    return IngressArgs(node=node, settings=cfg.ingress, upstream_port=cfg.engine.port,
                       max_model_len=cfg.engine.max_model_len, monitoring=cfg.monitoring.enabled,
                       api_keys=dict(cfg.secrets.api_keys),
                       tls_cert=cfg.secrets.tls_cert, tls_key=cfg.secrets.tls_key)


def public_name(args: IngressArgs, address: str) -> str:
    return args.settings.domain or address


def endpoint_url(host: str, port: int) -> str:
    return f"https://{grammar.url_host(host)}" + ("" if port == 443 else f":{port}")


def spec_for(args: IngressArgs, server_name: str, cert_path: str, key_path: str,
             extra_keys: dict | None = None, nginx: NginxBase = NginxBase()) -> IngressSpec:
    i = args.settings
    return IngressSpec(
        node=args.node, base=nginx, server_name=server_name, tls_cert_path=cert_path, tls_key_path=key_path,
        upstream_port=args.upstream_port,
        api_keys={**args.api_keys, **(extra_keys or {})}, https_port=i.https_port, http_port=i.http_port,
        rate_per_second=i.rate_per_second, burst=i.burst,
        metrics_allow_cidrs=metrics_cidrs(i.metrics_allow_cidrs, args.monitoring),
        read_timeout_s=i.read_timeout_s, max_conns_per_address=i.max_conns_per_address,
        client_max_body_size=i.client_max_body_size or body_size_for(args.max_model_len), fleet=args.fleet,
    )


def tls_paths(i: IngressConfig, node: str) -> tuple[str, str]:
    """Where node `node`'s certificate chain and key live on the host (i: fimfleet:ingress)."""
    if i.tls == "acme":
        live = f"/etc/letsencrypt/live/{i.domain}"
        return f"{live}/fullchain.pem", f"{live}/privkey.pem"
    return f"{TLS_ROOT}/{node}/server.pem", f"{TLS_ROOT}/{node}/server.key"


def staged_dir(node: str) -> str:
    """Where node `node`'s files are uploaded before apply installs them."""
    return f"{STAGED_ROOT}/{node}"


def render_files(args: IngressArgs, server_name: str, cert_pem: str, key_pem: str,
                 extra_keys: dict | None = None, nginx: NginxBase = NginxBase(),
                 upstream_ca_pem: str = "") -> tuple[list[dict], list[dict]]:
    """Files to stage (uploaded) and where apply installs them; extra_keys are fimfleet's own (the
    probes'). The gateway also installs its servers generator and the nodes' CAs it trusts."""
    cert_path, key_path = tls_paths(args.settings, args.node)
    spec = spec_for(args, server_name, cert_path, key_path, extra_keys, nginx)
    rendered = [(f.path, f"{f.mode:04o}", f.content) for f in site_files(spec)]
    if args.settings.tls != "acme":
        rendered += [(cert_path, "0644", cert_pem), (key_path, "0600", key_pem)]
    if args.fleet:
        rendered += [(args.fleet.ca_path, "0644", upstream_ca_pem),
                     (args.fleet.paths.generator, "0755", gateway_render.servers_script(args.fleet))]
    staged, installs = [], []
    for dest, mode, content in rendered:
        name = dest.rsplit("/", 1)[-1]
        staged.append({"path": f"{staged_dir(args.node)}/{name}", "mode": mode, "content": content})
        installs.append({"name": name, "dest": dest, "mode": mode})
    return staged, installs


def step_scripts(args: IngressArgs, installs: list[dict], server_name: str = "localhost",
                 nginx: NginxBase = NginxBase()) -> dict[str, str]:
    """apply, check and destroy of the ingress step. On refresh a certificate near expiry is
    drift (warned; the next up applies again); at the end of apply it only warns, so a short
    test validity still deploys."""
    i = args.settings
    kw = dict(main=nginx.main_path, sites=nginx.sites_dir, staged_dir=staged_dir(args.node),
              staged_root=STAGED_ROOT, tls_dir=f"{TLS_ROOT}/{args.node}", tls_root=TLS_ROOT,
              prev_dir=f"{STATE_DIR}/{args.node}-prev", state_dir=STATE_DIR, lock=LOCK, legacy=LEGACY_FILES,
              files=installs, server_name=server_name, node=args.node,
              ledger=CERTBOT_LEDGER, certbot_users=CERTBOT_USERS,
              https_port=i.https_port, acme=i.tls == "acme", acme_email=i.acme_email, domain=i.domain,
              tls_cert=tls_paths(i, args.node)[0], renew_days=RENEW_BEFORE_DAYS, renew_hint=RENEW_HINTS[i.tls])
    if args.fleet:  # the gateway writes its servers file from the rotation's markers before nginx -t
        kw.update(generator=args.fleet.paths.generator, gateway_state=args.fleet.paths.state_dir,
                  gateway_servers=args.fleet.paths.servers)
    check = {drift: templates.render("ingress/check.sh.j2", expiry_is_drift=drift, **kw) for drift in (True, False)}
    return {"apply": templates.render("ingress/apply.sh.j2", check=check[False], **kw), "check": check[True],
            "destroy": templates.render("ingress/destroy.sh.j2", **kw)}


class NginxIngress(pulumi.ComponentResource):
    """See module docstring. Outputs: endpoint, probe_endpoint, ca_pem, digest."""

    def __init__(self, name: str, args: IngressArgs, host: HostFacts, connection: pulumi.Input[dict],
                 nginx: NginxBase, extra_keys: dict[str, pulumi.Input[str]] | None = None,
                 upstream_ca_pem: pulumi.Input[str] = "", opts: pulumi.ResourceOptions | None = None):
        super().__init__("fimfleet:ingress:NginxIngress", name, None, opts)
        extra_keys = extra_keys or {}
        child = pulumi.ResourceOptions(parent=self)
        i = args.settings
        conn = pulumi.Output.from_input(connection)
        # The test VM's 443 is a forwarded local port; a cloud instance's address exists only once it does.
        self.endpoint = host.address.apply(lambda a: endpoint_url(public_name(args, a), host.public_port(i.https_port)))
        self.probe_endpoint = self.endpoint

        if i.tls == "self-signed":
            ips = [a for a in {host.configured_address, "127.0.0.1"} if a and grammar.ip(a)]
            fleet_name = FLEET_TLS_NAME if args.fleet_member else ""
            dns = sorted({n for n in (i.domain, host.configured_address, "localhost", fleet_name) if n and not grammar.ip(n)})
            cert = SelfSignedCertificate(f"{name}-cert", common_name=i.domain or host.configured_address or "localhost",
                                         dns_names=dns, ip_addresses=(host.address.apply(lambda a: sorted({a, *ips}))
                                                                      if host.provisioned else sorted(ips)),
                                         validity_days=i.cert_validity_days, opts=child)
            cert_pem, key_pem, self.ca_pem = cert.certPem, cert.keyPem, cert.caPem
        elif i.tls == "provided":
            cert_pem = pulumi.Output.secret(args.tls_cert)
            key_pem = pulumi.Output.secret(args.tls_key)
            self.ca_pem = pulumi.Output.from_input(args.tls_cert)
        else:
            cert_pem = key_pem = pulumi.Output.from_input("")
            self.ca_pem = pulumi.Output.from_input("")

        server_name = i.domain or (host.configured_address if host.kind == "ssh" else "localhost")
        rendered = pulumi.Output.all(cert_pem, key_pem, pulumi.Output.all(**extra_keys), upstream_ca_pem).apply(
            lambda a: render_files(args, server_name, a[0], a[1], a[2], nginx, a[3]))
        staged = pulumi.Output.secret(rendered.apply(lambda r: r[0]))
        # Install paths, modes and the digest do not depend on the PEMs: render once with placeholders.
        placeholder_keys = {n: f"placeholder{i:04d}".ljust(32, "0") for i, n in enumerate(sorted(extra_keys))}
        placeholder_staged, installs = render_files(args, server_name, "<cert>", "<key>", placeholder_keys, nginx)
        scripts = step_scripts(args, installs, server_name, nginx)
        self.digest = templates.digest(placeholder_staged, i.tls)
        self.step = RemoteStep(f"{name}-nginx", label="nginx ingress", connection=conn, files=staged,
                               apply=scripts["apply"], check=scripts["check"], destroy=scripts["destroy"], opts=child)
        self.register_outputs({"endpoint": self.endpoint, "caPem": self.ca_pem})
