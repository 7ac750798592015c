"""Unit tests for components/ingress_render.py (pure rendering, no Pulumi).

Valid renders are checked by the REAL ``nginx -t`` under a temp prefix, with a certificate
from the product's own issuer (the `tls` fixture, conftest.py). The hardening is in
test_ingress_hardening.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from components.ingress_render import (MAIN_CONF, IngressSpec, ingress_install_plan, nginx_reload_command,
                                       nginx_test_command, render_ingress, site_conf, site_files)
from components.nginx_base import NginxBase
from tests.unit.ingress_spec import KEYS, KEYS_FILE, SITE, location_block, make_spec, nginx_t, server_block, write_render

# ----------------------------------------------------------------- real nginx -t

VALID_VARIANTS = {
    "minimal_one_key": dict(api_keys={"solo": "solo-key-0123456789abcdef"}),
    "three_keys": {},
    "ipv4_and_ipv6_listen": dict(listen_addresses=("127.0.0.1", "::1"),
                                 metrics_allow_cidrs=("10.0.0.0/8", "fd00::/8", "127.0.0.1/32")),
    "metrics_closed_to_all": dict(metrics_allow_cidrs=()),
    "upstream_key_and_tuning": dict(upstream_api_key="upstream-key-0123456789ab", rate_per_second=1,
                                    burst=0, keepalive=4, read_timeout_s=3600,
                                    client_max_body_size="512k", worker_processes=2,
                                    hsts_max_age_s=0),
    "many_keys": dict(api_keys={f"user_{i}": f"key-{i:03d}-0123456789abcdef" for i in range(50)}),
    "standard_ports_hostname_upstream": dict(https_port=443, http_port=80, upstream_host="localhost",
                                             listen_addresses=("0.0.0.0", "::")),
    "negative_control_buffering_on": dict(stream_buffering=True),
}


@pytest.mark.parametrize("variant", sorted(VALID_VARIANTS))
def test_real_nginx_accepts_rendered_config(variant, tmp_path, tls):
    spec = make_spec(tmp_path / "prefix", tls, **VALID_VARIANTS[variant])
    write_render(spec)
    result = nginx_t(tmp_path / "prefix")
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr
    # nginx -t ran against our files, not /etc/nginx
    assert str(tmp_path / "prefix" / MAIN_CONF) in result.stderr


def test_real_nginx_t_can_fail(tmp_path, tls):
    """Negative control for the harness: a missing certificate must fail nginx -t."""
    spec = make_spec(tmp_path / "prefix", tls, tls_cert_path=str(tmp_path / "missing.pem"))
    write_render(spec)
    result = nginx_t(tmp_path / "prefix")
    assert result.returncode != 0
    assert "missing.pem" in result.stderr


def test_real_nginx_rejects_a_corrupted_keys_file(tmp_path, tls):
    spec = make_spec(tmp_path / "prefix", tls)
    write_render(spec)
    keys = tmp_path / "prefix" / KEYS_FILE
    keys.write_text(keys.read_text().replace("default \"\";", "default \"\"", 1))
    assert nginx_t(tmp_path / "prefix").returncode != 0


def test_two_nodes_share_one_host_nginx(tmp_path, tls):
    """Two sites in one http block: every http-level name carries its node's, so real nginx
    accepts both; the same node name twice is the negative control (duplicate zones)."""
    def write(node, port, key):
        spec = make_spec(tmp_path, tls, node=node, https_port=port, http_port=port + 1, upstream_port=port + 2,
                         api_keys={"alice": key})
        write_render(spec)
        return spec

    write("node", 18443, "alice-key-node-0123456789abcdef")
    b = write("node-b", 19443, "alice-key-nodeb-0123456789abcd")
    result = nginx_t(tmp_path)
    assert result.returncode == 0, result.stderr
    site_b = render_ingress(b)[site_conf("node-b")]
    assert "upstream fimfleet_node_b_vllm {" in site_b and "fimfleet_node_per" not in site_b
    (tmp_path / "fimfleet.d" / "copy.conf").write_text(render_ingress(b)[site_conf("node-b")])
    clash = nginx_t(tmp_path)
    assert clash.returncode != 0 and "fimfleet_node_b" in clash.stderr, clash.stderr


# --------------------------------------------------------------- content checks


def test_renders_three_files_with_modes_and_secret_flags(tmp_path, tls):
    spec = make_spec(tmp_path, tls)
    files = render_ingress(spec)
    assert set(files) == {MAIN_CONF, "fimfleet.d/node.conf", "fimfleet.d/node.keys"}
    plan = ingress_install_plan(spec)
    assert [(f.path, f.mode, f.secret) for f in plan] == [
        (f"{tmp_path}/{MAIN_CONF}", 0o644, False),
        (f"{tmp_path}/{SITE}", 0o644, False),
        (f"{tmp_path}/{KEYS_FILE}", 0o600, True),
    ]
    assert all(f.content == files[str(Path(f.path).relative_to(tmp_path))] for f in plan)
    assert site_files(spec) == plan[1:]  # what the node's step installs: not the host's main config
    assert nginx_test_command(spec)[-1] == f"{tmp_path}/{MAIN_CONF}"
    assert nginx_reload_command(spec)[-2:] == ["-s", "reload"]


def test_defaults_target_a_debian_host(tls):
    spec = IngressSpec(server_name="code.example.com", tls_cert_path="/etc/ssl/fimfleet/cert.pem",
                       tls_key_path="/etc/ssl/fimfleet/key.pem", upstream_port=8000,
                       api_keys={"alice": KEYS["alice"]})
    files = render_ingress(spec)
    main, site = files[MAIN_CONF], files[SITE]
    assert re.findall(r"^\s*include (\S+);", main, re.M) == ["/etc/nginx/fimfleet.d/*.conf"]
    assert re.findall(r"^\s*include (\S+);", site, re.M) == ["/etc/nginx/fimfleet.d/node.keys"]
    assert "pid /run/nginx.pid;" in main
    assert "user www-data;" in main
    assert not re.search(r"^\s*daemon\b", main, re.M)  # systemd / tests pass it with -g
    assert "listen 0.0.0.0:443 ssl;" in site and "listen [::]:443 ssl;" in site
    assert "listen 0.0.0.0:80;" in site and "listen [::]:80;" in site
    assert "return 301 https://code.example.com$request_uri;" in site
    assert "access_log /var/log/nginx/fimfleet-node-access.log fimfleet_node_json;" in site
    assert "server 127.0.0.1:8000;" in site


def test_secrets_only_in_keys_file(tmp_path, tls):
    upstream_key = "upstream-secret-0123456789"
    spec = make_spec(tmp_path, tls, upstream_api_key=upstream_key)
    files = render_ingress(spec)
    for secret in [*KEYS.values(), upstream_key]:
        assert secret not in files[SITE]
        assert secret not in files[MAIN_CONF]
        assert secret not in repr(spec)
    # the key file carries every key (regex-escaped) and the names
    keys = files[KEYS_FILE]
    for name, key in KEYS.items():
        escaped = key.replace(".", "\\.").replace("+", "\\+")
        assert f'"~^(?i:bearer) +{escaped}$" {name};' in keys, name
    assert f'default "Bearer {upstream_key}";' in keys


def test_key_regexes_are_exact_and_case_sensitive(tmp_path, tls):
    keys = render_ingress(make_spec(tmp_path, tls))[KEYS_FILE]
    entries = dict((n, r) for r, n in re.findall(r'^\s*"~(.+)" (\w+);$', keys, re.M))
    assert set(entries) == set(KEYS)
    for name, key in KEYS.items():
        rx = re.compile(entries[name])  # the PCRE used is also valid Python re
        assert rx.match(f"Bearer {key}")
        assert rx.match(f"bearer {key}")  # the auth scheme is case-insensitive (RFC 7235)
        assert not rx.match(f"Bearer {key.swapcase()}")  # the key itself is not
        assert not rx.match(f"Bearer {key}x") and not rx.match(f"Bearer x{key}")
        assert not rx.match(key)
        # a '.' or '+' in a key is literal, not a regex wildcard / quantifier
        if "." in key or "+" in key:
            assert not rx.match(f"Bearer {key.replace('.', 'X').replace('+', 'Y')}")
    assert 'default "";' in keys


def test_no_upstream_key_means_authorization_is_cleared(tmp_path, tls):
    files = render_ingress(make_spec(tmp_path, tls))
    assert 'default "";' in files[KEYS_FILE].split("$fimfleet_node_upstream_authorization", 1)[1]
    assert "proxy_set_header Authorization $fimfleet_node_upstream_authorization;" in files[SITE]


def test_logging_uses_key_name_never_the_header(tmp_path, tls):
    site = render_ingress(make_spec(tmp_path, tls))[SITE]
    fmt = site[site.index("log_format fimfleet_node_json"):site.index("log_format fimfleet_node_plain")]
    assert "$fimfleet_node_key_name" in fmt
    assert "$http_authorization" not in site  # only the key file maps it
    assert f"access_log {tmp_path}/logs/fimfleet-node-access.log fimfleet_node_json;" in site


def test_streaming_location(tmp_path, tls):
    site = render_ingress(make_spec(tmp_path, tls, read_timeout_s=900, burst=7, rate_per_second=3))[SITE]
    v1 = location_block(server_block(site, tls=True), "location /v1/ {")
    for line in ("proxy_buffering off;", "proxy_cache off;", 'add_header X-Accel-Buffering "no" always;',
                 "tcp_nodelay on;", "gzip off;", "proxy_read_timeout 900s;", "proxy_send_timeout 900s;",
                 "limit_req zone=fimfleet_node_per_key burst=7 nodelay;", "proxy_pass http://fimfleet_node_vllm;",
                 "return 401;", "Strict-Transport-Security"):
        assert line in v1, line
    assert "limit_req_zone $fimfleet_node_key_name zone=fimfleet_node_per_key:10m rate=3r/s;" in site
    assert "limit_req_status 429;" in server_block(site, tls=True)
    assert "proxy_http_version 1.1;" in site and 'proxy_set_header Connection "";' in site
    assert re.search(r"upstream fimfleet_node_vllm \{[^}]*keepalive 32;", site)
    zero = render_ingress(make_spec(tmp_path, tls, burst=0))[SITE]
    assert "limit_req zone=fimfleet_node_per_key nodelay;" in zero  # nginx rejects burst=0
    # the negative control flips exactly the buffering
    buffered = render_ingress(make_spec(tmp_path, tls, stream_buffering=True))[SITE]
    v1b = location_block(server_block(buffered, tls=True), "location /v1/ {")
    assert "proxy_buffering on;" in v1b and "proxy_buffering off;" not in v1b


def test_tls_and_security_headers(tmp_path, tls):
    site = render_ingress(make_spec(tmp_path, tls))[SITE]
    assert "return 301 https://fimfleet.test:18443$request_uri;" in site
    # add_header is not inherited by a location that has its own: check every location
    https = server_block(site, tls=True)
    for header in re.findall(r"^\s*(location [^{]+\{)", https, re.M):
        block = location_block(https, header)
        if "return 301" in block or "return 404;" in block:
            continue
        for h in ("Strict-Transport-Security", "X-Content-Type-Options", "X-Frame-Options",
                  "Referrer-Policy", "Content-Security-Policy"):
            assert h in block, (header, h)
    no_hsts = render_ingress(make_spec(tmp_path, tls, hsts_max_age_s=0))[SITE]
    assert "Strict-Transport-Security" not in no_hsts


def test_acls_for_health_and_metrics(tmp_path, tls):
    site = render_ingress(make_spec(tmp_path, tls, metrics_allow_cidrs=("10.0.0.0/8", "fd00::/8")))[SITE]
    health = location_block(site, "location = /health {")
    assert re.search(r"allow 127\.0\.0\.1;\s*allow ::1;\s*deny all;", health)
    assert "proxy_pass http://fimfleet_node_vllm/health;" in health
    metrics = location_block(site, "location = /metrics {")
    assert re.search(r"allow 10\.0\.0\.0/8;\s*allow fd00::/8;\s*deny all;", metrics)
    assert "127.0.0.1" not in metrics
    closed = render_ingress(make_spec(tmp_path, tls, metrics_allow_cidrs=()))[SITE]
    assert "allow" not in location_block(closed, "location = /metrics {")


def test_json_error_pages(tmp_path, tls):
    site = render_ingress(make_spec(tmp_path, tls))[SITE]
    for code in (401, 403, 404, 413, 429, 502, 504):
        assert f"error_page {code} @fimfleet_{code};" in site
        block = location_block(site, f"location @fimfleet_{code} {{")
        assert "default_type application/json;" in block
        body = re.search(rf"return {code} '(.*)\\n';", block).group(1)
        assert json.loads(body)["error"]["code"]
    assert 'WWW-Authenticate \'Bearer realm="fimfleet"\'' in location_block(site, "location @fimfleet_401 {")
    assert "Retry-After" in location_block(site, "location @fimfleet_429 {")


def test_spec_is_frozen_and_copies_inputs(tmp_path, tls):
    keys = dict(KEYS)
    cidrs = ["10.0.0.0/8"]
    spec = make_spec(tmp_path, tls, api_keys=keys, metrics_allow_cidrs=cidrs)
    keys["eve"] = "eve-key-0123456789abcdef"
    cidrs.append("0.0.0.0/0")
    assert "eve" not in spec.api_keys and spec.metrics_allow_cidrs == ("10.0.0.0/8",)
    with pytest.raises(Exception):
        spec.burst = 1  # type: ignore[misc]


# ------------------------------------------------------------------- validation

INVALID = [
    ("server_name", dict(server_name="bad host;")),
    ("server_name", dict(server_name="")),
    ("https_port", dict(https_port=0)),
    ("https_port", dict(https_port=70000)),
    ("http_port", dict(http_port="80")),
    ("http_port", dict(http_port=18443)),  # same as https_port
    ("upstream_port", dict(upstream_port=-1)),
    ("upstream_host", dict(upstream_host="vllm host")),
    ("listen_addresses", dict(listen_addresses=("localhost",))),
    ("listen_addresses", dict(listen_addresses=())),
    ("tls_cert_path", dict(tls_cert_path="relative/cert.pem")),
    ("tls_key_path", dict(tls_key_path="/etc/ssl/key.pem; include /etc/shadow")),
    ("api_keys", dict(api_keys={})),
    ("api_keys", dict(api_keys={"bad-name": "k" * 20})),
    ("api_keys", dict(api_keys={"1st": "k" * 20})),
    ("api_keys", dict(api_keys={"": "k" * 20})),
    ("api_keys['alice']", dict(api_keys={"alice": ""})),
    ("api_keys['alice']", dict(api_keys={"alice": "short"})),
    ("api_keys['alice']", dict(api_keys={"alice": 'has"quote-0123456789'})),
    ("api_keys['alice']", dict(api_keys={"alice": "has space 0123456789"})),
    ("api_keys['alice']", dict(api_keys={"alice": "semi;colon0123456789"})),
    ("api_keys['alice']", dict(api_keys={"alice": "dollar$0123456789abc"})),
    ("api_keys['bob']", dict(api_keys={"alice": "same-key-0123456789abcdef", "bob": "same-key-0123456789abcdef"})),
    ("upstream_api_key", dict(upstream_api_key="it's-a-key-0123456789")),
    ("rate_per_second", dict(rate_per_second=0)),
    ("rate_per_second", dict(rate_per_second=2.5)),
    ("burst", dict(burst=-1)),
    ("metrics_allow_cidrs", dict(metrics_allow_cidrs=("10.0.0.1/8",))),
    ("metrics_allow_cidrs", dict(metrics_allow_cidrs=("not-a-cidr",))),
    ("metrics_allow_cidrs", dict(metrics_allow_cidrs=("10.0.0.0/33",))),
    ("metrics_allow_cidrs", dict(metrics_allow_cidrs=("0.0.0.0/0",))),
    ("metrics_allow_cidrs", dict(metrics_allow_cidrs=("10.0.0.0/8", "::/0"))),
    ("client_header_timeout_s", dict(client_header_timeout_s=0)),
    ("client_body_timeout_s", dict(client_body_timeout_s=3601)),
    ("send_timeout_s", dict(send_timeout_s="30s")),
    ("max_conns_per_address", dict(max_conns_per_address=0)),
    ("read_timeout_s", dict(read_timeout_s=0)),
    ("keepalive", dict(keepalive=0)),
    ("client_max_body_size", dict(client_max_body_size="8 MB")),
    ("node", dict(node="Node_1")),
    ("node", dict(node="a;b")),
    ("stream_buffering", dict(stream_buffering="yes")),
]


@pytest.mark.parametrize("field,overrides", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_spec_raises_value_error_naming_the_field(field, overrides, tmp_path, tls):
    with pytest.raises(ValueError) as excinfo:
        make_spec(tmp_path, tls, **overrides)
    message = str(excinfo.value)
    assert message.startswith(f"IngressSpec.{field}:"), message
    assert "invalid value" in message and ";" in message  # value + fix
    # secrets are described, never echoed
    for key in list(overrides.get("api_keys", {}).values()) + [overrides.get("upstream_api_key")]:
        if isinstance(key, str) and len(key) >= 8:
            assert key not in message


BASE_INVALID = [
    ("worker_connections", dict(worker_connections=8)),
    ("worker_processes", dict(worker_processes="many")),
    ("worker_user", dict(worker_user="www data")),
    ("log_dir", dict(log_dir="/var/log/nginx dir")),
    ("conf_dir", dict(conf_dir="/etc/../etc/nginx")),
]


@pytest.mark.parametrize("field,overrides", BASE_INVALID, ids=[f for f, _ in BASE_INVALID])
def test_invalid_host_nginx_raises_value_error_naming_the_field(field, overrides):
    with pytest.raises(ValueError, match=rf"^NginxBase\.{field}: invalid value .*; "):
        NginxBase(**overrides)


def test_error_message_names_value_and_fix(tmp_path, tls):
    with pytest.raises(ValueError, match=r"IngressSpec\.metrics_allow_cidrs: invalid value '10\.0\.0\.1/8'.*10\.0\.0\.0/8"):
        make_spec(tmp_path, tls, metrics_allow_cidrs=("10.0.0.1/8",))
    with pytest.raises(ValueError, match=r"IngressSpec\.https_port: invalid value 0; must be between 1 and 65535"):
        make_spec(tmp_path, tls, https_port=0)
    with pytest.raises(ValueError, match=r"metrics_allow_cidrs: invalid value '192\.168\.10\.5/24'.*192\.168\.10\.0/24"):
        make_spec(tmp_path, tls, metrics_allow_cidrs=("192.168.10.5/24",))
    with pytest.raises(ValueError, match=r"metrics_allow_cidrs: invalid value '::/0'.*whole internet"):
        make_spec(tmp_path, tls, metrics_allow_cidrs=("::/0",))


def test_an_ipv6_host_is_named_in_brackets_in_every_url(tmp_path, tls):
    """host.address may be an IPv6 address: `https://2001:db8::10:8443` is no URL (the SLA probe's
    aiohttp, the editors' apiBase and the HTTP redirect all failed on it)."""
    from urllib.parse import urlsplit

    import yarl

    from components.ingress import endpoint_url

    url = endpoint_url("2001:db8::10", 8443)
    assert url == "https://[2001:db8::10]:8443"
    assert urlsplit(url).port == 8443 and yarl.URL(url).host == "2001:db8::10"
    assert endpoint_url("2001:db8::10", 443) == "https://[2001:db8::10]"
    assert endpoint_url("203.0.113.10", 8443) == "https://203.0.113.10:8443"
    spec = make_spec(tmp_path / "prefix", tls, server_name="2001:db8::10")
    site = write_render(spec)[SITE]
    assert "return 301 https://[2001:db8::10]:18443$request_uri;" in site
    assert "https://2001:db8" not in site
    assert nginx_t(tmp_path / "prefix").returncode == 0
