"""Pure rendering of one node's nginx site: the ingress that sits in front of its vLLM.

No Pulumi imports here: ``components/ingress.py`` (the Pulumi component) builds an
:class:`IngressSpec` from the validated stack config, calls :func:`site_files` and uploads
the files. Everything in this module is testable with plain pytest and the real ``nginx -t``.

A node's files live in the host's ``fimfleet.d/`` (components/nginx_base.py owns the main
config that includes them):

* ``<node>.conf``  0644  TLS server, redirect, limits, upstream, ACLs; includes the keys file
* ``<node>.keys``  0600  SECRET: bearer-key map and upstream key

Several nodes share one http block, so every http-level name a site defines carries its
node's name (:func:`name_prefix`), and the settings nginx allows once per level live in
the site's server blocks.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from components import grammar, nginx_base
from components.gateway_render import DRAINED_RETRY_AFTER_S, FLEET_PROBE_KEY_NAME, FLEET_TLS_NAME, FleetUpstream
from components.nginx_base import MAIN_CONF, SITES_DIR, NginxBase, address_port, check_int, check_path, int_problem

_SIZE_RE = re.compile(r"^[1-9][0-9]*[kKmMgG]?\Z")

SSL_ECDH_CURVES = "X25519:prime256v1:secp384r1"
"""Mozilla intermediate key-exchange groups (guidelines 5.7-6.0). 6.0 also lists the hybrid
X25519MLKEM768, left out on purpose: it needs OpenSSL 3.5, Debian bookworm ships 3.0, and
nginx refuses to start when OpenSSL does not know one group of the list."""

BODY_BYTES_PER_TOKEN = 16
"""Request bytes allowed per context token: code averages about 4 bytes a token, and JSON
escaping (quotes, newlines, \\uXXXX for non-ASCII) can multiply that by up to 4."""
BODY_ENVELOPE_KIB = 16
"""Room for the rest of a completion request (model, stop tokens, sampling fields)."""

LOOPBACK_CIDRS = ("127.0.0.1/32", "::1/128")


def metrics_cidrs(configured: Sequence[str], own_prometheus: bool) -> tuple[str, ...]:
    """Who may read /metrics: the stack's list (loopback when empty), plus loopback when the
    node's own Prometheus (components/monitoring.py) scrapes it there."""
    cidrs = tuple(configured or LOOPBACK_CIDRS)
    return cidrs + tuple(c for c in LOOPBACK_CIDRS if own_prometheus and c not in cidrs)


def body_size_for(max_model_len: int) -> str:
    """client_max_body_size for an engine context of ``max_model_len`` tokens, in nginx syntax."""
    return f"{-(-max_model_len * BODY_BYTES_PER_TOKEN // 1024) + BODY_ENVELOPE_KIB}k"


# Bounds of the integer fields: the one rule for validate_spec and for config.py (see rule()).
INT_RULES = {
    "https_port": (1, 65535),
    "http_port": (1, 65535),
    "upstream_port": (1, 65535),
    "rate_per_second": (1, 10000),
    "burst": (0, 100000),
    "read_timeout_s": (10, 86400),
    "connect_timeout_s": (1, 300),
    "keepalive": (1, 4096),
    "upstream_keepalive_timeout_s": (1, 3600),
    "client_header_timeout_s": (1, 3600),
    "client_body_timeout_s": (1, 3600),
    "send_timeout_s": (1, 3600),
    "max_conns_per_address": (1, 65535),
    "hsts_max_age_s": (0, 10 * 365 * 86400),
}


@dataclass(frozen=True)
class IngressSpec:
    """Everything one node's nginx site needs. Validated on construction (ValueError)."""

    server_name: str
    """DNS name (or IP) the editors use; must match the TLS certificate."""
    tls_cert_path: str
    """Absolute path of the PEM certificate chain on the host."""
    tls_key_path: str
    """Absolute path of the PEM private key on the host (keep it 0600)."""
    upstream_port: int
    """Port of vLLM's OpenAI-compatible server on ``upstream_host``."""
    api_keys: Mapping[str, str] = field(repr=False)
    """SECRET. key name -> bearer key. Names are logged and rate-limited; keys never
    leave the node's keys file. Remove an entry (and reload) to revoke that key."""
    https_port: int = 443
    """TLS listener port."""
    http_port: int = 80
    """Plain-HTTP listener port; it only redirects to HTTPS."""
    listen_addresses: Sequence[str] = ("0.0.0.0", "::")
    """IP addresses to bind both listeners to (tests use ("127.0.0.1",))."""
    upstream_host: str = "127.0.0.1"
    """Where vLLM listens. Keep it on loopback: nginx is the only door in."""
    upstream_api_key: Optional[str] = field(default=None, repr=False)
    """SECRET, optional. Sent upstream as ``Authorization: Bearer ...`` if vLLM runs
    with ``--api-key``. The client's own key is never forwarded upstream."""
    rate_per_second: int = 10
    """Sustained requests per second allowed for EACH key (nginx limit_req)."""
    burst: int = 20
    """Requests a key may make above the rate before it gets 429 (served without delay)."""
    metrics_allow_cidrs: Sequence[str] = LOOPBACK_CIDRS
    """Networks allowed to read /metrics; every other source gets 403."""
    read_timeout_s: int = 600
    """proxy_read_timeout / proxy_send_timeout on /v1/: longest silence between two
    chunks (covers the prefill of a long prompt on a slow tier)."""
    connect_timeout_s: int = 5
    """proxy_connect_timeout to vLLM."""
    keepalive: int = 32
    """Idle keepalive connections to vLLM kept per nginx worker."""
    upstream_keepalive_timeout_s: int = 4
    """How long nginx keeps an idle upstream connection. Must stay BELOW vLLM's
    ``--timeout-keep-alive`` (uvicorn default 5 s), or a POST can race a closing
    connection and fail with 502 (nginx does not retry non-idempotent requests)."""
    client_max_body_size: str = body_size_for(8192)
    """Largest request body (nginx size syntax: 144k, 1m). Derive it from the engine's context
    with body_size_for(max_model_len); larger bodies get 413 before anything reaches vLLM."""
    client_header_timeout_s: int = 10
    """Time a client has to send its whole request header (it also bounds the TLS handshake)."""
    client_body_timeout_s: int = 10
    """Longest pause between two reads of a request body."""
    send_timeout_s: int = 30
    """Longest time a client may leave response data unread. It runs only while nginx has
    bytes the client does not take, so an SSE stream waiting for a long prefill is bounded
    by read_timeout_s alone."""
    max_conns_per_address: int = 32
    """Requests in progress per client address (limit_conn); idle keep-alive connections do not
    count. Editors send one completion at a time, so 32 leaves room for a team behind one NAT."""
    node: str = "node"
    """The node's name: its file names, log and every http-level name it defines carry it."""
    base: NginxBase = NginxBase()
    """The host's nginx the site is installed into (its paths, and the workers tests start)."""
    hsts_max_age_s: int = 63072000
    """Strict-Transport-Security max-age (2 years); 0 disables the header."""
    fleet: Optional[FleetUpstream] = None
    """Set for the fleet gateway: proxy to these nodes' ingresses over TLS instead of a local vLLM."""
    stream_buffering: bool = False
    """Keep False. True turns proxy_buffering ON for /v1/; it exists only so the
    integration test can prove its latency measurement detects buffering."""

    def __post_init__(self) -> None:
        # normalise containers so the frozen spec does not alias caller-owned lists
        object.__setattr__(self, "api_keys", dict(self.api_keys))
        object.__setattr__(self, "listen_addresses", tuple(self.listen_addresses))
        object.__setattr__(self, "metrics_allow_cidrs", tuple(self.metrics_allow_cidrs))
        validate_spec(self)


# --------------------------------------------------------------------------- checks


def _fail(field_name: str, value: object, fix: str) -> None:
    nginx_base.fail("IngressSpec", field_name, value, fix)


def _redact(key: object) -> str:
    """Describe a secret without printing it."""
    if not isinstance(key, str):
        return f"<{type(key).__name__}>"
    return f"<secret of {len(key)} chars>"


SIZE_MAX_BYTES = 2**63 - 1
"""nginx parses a size into an off_t: anything larger is `invalid value` at nginx -t."""
_UNITS = {"k": 1024, "m": 1024**2, "g": 1024**3}


def _size_problem(value: object) -> Optional[str]:
    if not isinstance(value, str) or not _SIZE_RE.match(value):
        return "use an nginx size such as '144k' or '1m'"
    if int(value.rstrip("kKmMgG")) * _UNITS.get(value[-1].lower(), 1) > SIZE_MAX_BYTES:
        return "is larger than nginx can read (8589934591g at most); a FIM request needs kilobytes, e.g. '1m'"
    return None


def setting_problem(name: str, value: object) -> Optional[str]:
    """The renderer's rule for one setting: None when ``value`` is valid, else the fix.

    ``name`` is an IngressSpec field (INT_RULES, ``client_max_body_size``) or
    ``metrics_allow_cidr`` (one entry of ``metrics_allow_cidrs``)."""
    if name in INT_RULES:
        return int_problem(value, *INT_RULES[name])
    if name == "client_max_body_size":
        return _size_problem(value)
    if name == "metrics_allow_cidr":
        return grammar.cidr(value)
    raise KeyError(f"no ingress rule named {name!r}")


def rule(name: str, allow_empty: bool = False) -> Callable[[object], Optional[str]]:
    """``setting_problem`` for one setting, shaped as config.py's ``check``; with
    ``allow_empty`` an empty string (meaning "derive it") passes."""
    setting_problem(name, None)  # unknown names fail at import, not at the first bad value
    return lambda value: None if allow_empty and value == "" else setting_problem(name, value)


def _check_host(name: str, value: object) -> None:
    if problem := grammar.address(value):
        _fail(name, value, problem)


def _check_bearer(name: str, value: object, what: str) -> None:
    """One rule for every key, the config's own (grammar.API_KEY)."""
    if problem := grammar.api_key(value):
        _fail(name, _redact(value), f"{what}: {problem}")


def validate_spec(spec: IngressSpec) -> None:
    """Raise ValueError naming the field, the bad value and the fix."""
    if not isinstance(spec.node, str) or not grammar.DNS_LABEL.fullmatch(spec.node):
        _fail("node", spec.node, "use a DNS label: lowercase letters, digits and '-', up to 63")
    if not isinstance(spec.base, NginxBase):
        _fail("base", spec.base, "give the host's nginx as a NginxBase")
    _check_host("server_name", spec.server_name)
    for name, (lo, hi) in INT_RULES.items():
        check_int("IngressSpec", name, getattr(spec, name), lo, hi)
    if spec.https_port == spec.http_port:
        _fail("http_port", spec.http_port, "use a port different from https_port")
    if not spec.listen_addresses:
        _fail("listen_addresses", spec.listen_addresses, "give at least one IP, e.g. ('0.0.0.0', '::')")
    for addr in spec.listen_addresses:
        if not grammar.ip(addr):
            _fail("listen_addresses", addr, "use IP addresses such as '0.0.0.0', '::' or '127.0.0.1'")
    if len(set(spec.listen_addresses)) != len(spec.listen_addresses):
        _fail("listen_addresses", spec.listen_addresses, "list each address once")
    check_path("IngressSpec", "tls_cert_path", spec.tls_cert_path)
    check_path("IngressSpec", "tls_key_path", spec.tls_key_path)
    _check_host("upstream_host", spec.upstream_host)

    if not isinstance(spec.api_keys, dict) or not spec.api_keys:
        _fail("api_keys", "<empty>", "give at least one key name -> key, e.g. {'alice': '<32+ random chars>'}")
    seen: dict = {}
    for key_name, key in spec.api_keys.items():
        if problem := grammar.key_name(key_name):
            _fail("api_keys", key_name, problem)
        _check_bearer(f"api_keys[{key_name!r}]", key, "the key")
        if key in seen:
            _fail(f"api_keys[{key_name!r}]", _redact(key), f"the same key is also used by "
                  f"{seen[key]!r}; give every name its own key so each can be revoked alone")
        seen[key] = key_name
    if spec.upstream_api_key is not None:
        _check_bearer("upstream_api_key", spec.upstream_api_key, "the upstream key")

    for cidr in spec.metrics_allow_cidrs:
        if fix := setting_problem("metrics_allow_cidr", cidr):
            _fail("metrics_allow_cidrs", cidr, fix)
    if fix := _size_problem(spec.client_max_body_size):
        _fail("client_max_body_size", spec.client_max_body_size, fix)
    if spec.fleet is not None and not isinstance(spec.fleet, FleetUpstream):
        _fail("fleet", spec.fleet, "give the gateway's nodes as a FleetUpstream, or None for a node's own site")
    if not isinstance(spec.stream_buffering, bool):
        _fail("stream_buffering", spec.stream_buffering, "use False (True is a test-only negative control)")


# ------------------------------------------------------------------------- rendering


def _key_regex(key: str) -> str:
    """Case-sensitive, anchored PCRE for 'Bearer <key>' (nginx string map entries are
    matched IGNORING CASE, which would make 'sk-AbC' equal 'sk-abc')."""
    escaped = key.replace(".", r"\.").replace("+", r"\+")
    return r"~^(?i:bearer) +" + escaped + "$"


def name_prefix(node: str) -> str:
    """What every http-level name of node `node`'s site starts with (nginx names take no '-')."""
    return "fimfleet_" + node.replace("-", "_")


def site_conf(node: str) -> str:
    """The node's site, relative to conf_dir (the host's main config includes it)."""
    return f"{SITES_DIR}/{node}.conf"


def keys_conf(node: str) -> str:
    """The node's keys (SECRET, 0600), relative to conf_dir: only its site includes it."""
    return f"{SITES_DIR}/{node}.keys"


def _context(spec: IngressSpec) -> dict:
    conf_dir = spec.base.conf_dir.rstrip("/") or "/"
    https_suffix = "" if spec.https_port == 443 else f":{spec.https_port}"
    return {
        "spec": spec,
        "p": name_prefix(spec.node),
        "keys_conf_path": f"{conf_dir}/{keys_conf(spec.node)}",
        "access_log": access_log(spec),
        "https_listens": [address_port(a, spec.https_port) for a in spec.listen_addresses],
        "http_listens": [address_port(a, spec.http_port) for a in spec.listen_addresses],
        "redirect_base": f"https://{grammar.url_host(spec.server_name)}{https_suffix}",
        "metrics_cidrs": [str(ipaddress.ip_network(c)) for c in spec.metrics_allow_cidrs],
        "upstream": address_port(spec.upstream_host, spec.upstream_port),
        "key_entries": [(_key_regex(k), n) for n, k in sorted(spec.api_keys.items())],
        "upstream_authorization": f"Bearer {spec.upstream_api_key}" if spec.upstream_api_key else "",
        "json_errors": {code: _json_error_body(code) for code in _JSON_ERRORS},
        "https_required": _https_required_body(f"https://{grammar.url_host(spec.server_name)}{https_suffix}/v1/"),
        "https_required_status": HTTPS_REQUIRED_STATUS,
        "ecdh_curves": SSL_ECDH_CURVES,
        "fleet": spec.fleet,
        "fleet_tls_name": FLEET_TLS_NAME,
        "fleet_probe_key_name": FLEET_PROBE_KEY_NAME,
        "member_servers": _member_servers(spec.fleet) if spec.fleet else [],
        "drained": _DRAINED_BODY,
        "drained_retry_after_s": DRAINED_RETRY_AFTER_S,
    }


def _member_servers(fleet: FleetUpstream) -> list:
    """(index, member, listen) per node: the index names its upstream block."""
    listens = fleet.listens
    return [(i, m, listens[m.name]) for i, m in enumerate(fleet.members)]


def access_log(spec: IngressSpec) -> str:
    """The node's JSON access log (key names, never keys)."""
    return f"{spec.base.log_dir.rstrip('/')}/fimfleet-{spec.node}-access.log"


# status -> (OpenAI-style error type, code, message). Bodies are OpenAI-shaped so
# Continue.dev / Cursor surface the message.
_JSON_ERRORS = {
    401: ("authentication_error", "invalid_api_key", "missing or invalid API key; send the header Authorization: Bearer <key>"),
    403: ("permission_error", "forbidden", "forbidden from this address"),
    404: ("invalid_request_error", "not_found", "no such endpoint; completions live under /v1/"),
    413: ("invalid_request_error", "request_too_large", "request body too large"),
    429: ("rate_limit_error", "rate_limit_exceeded",
          "too many requests: the rate limit of this API key or the concurrent request limit of this address was reached; retry shortly"),
    500: ("server_error", "internal_error", "internal proxy error"),
    502: ("server_error", "upstream_unavailable", "the model server is not reachable"),
    503: ("server_error", "service_unavailable", "the model server is unavailable"),
    504: ("server_error", "upstream_timeout", "the model server did not answer in time"),
}


def _error_json(etype: str, ecode: str, message: str) -> str:
    body = json.dumps({"error": {"message": message, "type": etype, "code": ecode}},
                      separators=(",", ":"))
    # it is pasted into a single-quoted nginx string
    if "'" in body or "\\" in body or "$" in body:
        _fail("error body", body, "an answer pasted into a single-quoted nginx string holds no ', \\ or $")
    return body


def _json_error_body(code: int) -> str:
    return _error_json(*_JSON_ERRORS[code])


_DRAINED_BODY = _error_json("server_error", "no_node_in_rotation",
                           "no node of this fleet is in rotation now (a rolling update is draining it); retry shortly")
"""A drained member server's answer, status 404 so that the gateway tries the next node without
counting a failure; the client sees it only when every node is drained."""

HTTPS_REQUIRED_STATUS = 403


def _https_required_body(url: str) -> str:
    """Port 80's answer on /v1/: a redirect would turn the POST into a failing GET and
    invite the client to keep sending its key in cleartext."""
    return _error_json("invalid_request_error", "https_required",
                       f"plain HTTP is refused: use {url} (a key sent over http:// crossed the "
                       "network unencrypted; rotate it)")


@dataclass(frozen=True)
class IngressFile:
    """One rendered file with where and how to install it."""

    path: str
    """Absolute install path."""
    content: str = field(repr=False)
    """File content (secret when ``secret`` is True)."""
    mode: int
    """Unix mode, e.g. 0o600 for the key file."""
    secret: bool
    """True when content holds API keys: wrap it in pulumi.Output.secret."""


def site_files(spec: IngressSpec) -> list[IngressFile]:
    """The node's site and keys, as its ingress step installs them (keys last)."""
    validate_spec(spec)
    env = nginx_base.environment()
    ctx = _context(spec)
    conf_dir = spec.base.conf_dir.rstrip("/") or "/"
    return [IngressFile(f"{conf_dir}/{site_conf(spec.node)}", env.get_template("site.conf.j2").render(**ctx), 0o644, False),
            IngressFile(f"{conf_dir}/{keys_conf(spec.node)}", env.get_template("keys.conf.j2").render(**ctx), 0o600, True)]


def ingress_install_plan(spec: IngressSpec) -> list[IngressFile]:
    """What a host serving this one node holds: its main config, then the node's files."""
    return [IngressFile(spec.base.main_path, nginx_base.render_main(spec.base), 0o644, False), *site_files(spec)]


def render_ingress(spec: IngressSpec) -> dict[str, str]:
    """ingress_install_plan as file name relative to conf_dir -> content; only the keys file holds secrets."""
    conf_dir = spec.base.conf_dir.rstrip("/") + "/"
    return {f.path.removeprefix(conf_dir): f.content for f in ingress_install_plan(spec)}


def nginx_test_command(spec: IngressSpec, nginx: str = "nginx") -> list[str]:
    """argv that validates the installed config: ``nginx -t -c <conf_dir>/nginx.conf``."""
    return [nginx, "-t", "-q", "-c", spec.base.main_path]


def nginx_reload_command(spec: IngressSpec, nginx: str = "nginx") -> list[str]:
    """argv that reloads a running nginx started from this config (``-s reload``)."""
    return [nginx, "-c", spec.base.main_path, "-s", "reload"]
