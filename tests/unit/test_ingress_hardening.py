"""The ingress's hardening as rendered (issue 20): Mozilla's intermediate TLS, slow-client limits
and descriptors, body size from the context, plain HTTP that never logs a key, and the config
checks that share the renderer's rules."""

from __future__ import annotations

import configparser
import json
import re

import pytest

from components.ingress_render import (INT_RULES, MAIN_CONF, SSL_ECDH_CURVES, IngressSpec, body_size_for, render_ingress,
                                       rule, setting_problem)
from components.nginx_base import DROPIN_PATH, nofile_limit, render_dropin
from tests.unit.ingress_spec import SITE, location_block, make_spec, server_block

MOZILLA_INTERMEDIATE_CIPHERS = {  # ssl-config.mozilla.org guidelines 6.0, intermediate
    "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256", "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-RSA-AES256-GCM-SHA384", "ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305"}
MOZILLA_INTERMEDIATE_GROUPS = {"X25519MLKEM768", "X25519", "prime256v1", "secp384r1"}


def directive(text: str, name: str) -> str:
    values = re.findall(rf"^\s*{name} ([^;]+);", text, re.M)
    assert len(values) == 1, (name, values)
    return values[0]


def test_tls_follows_mozilla_intermediate(tmp_path, tls):
    site = render_ingress(make_spec(tmp_path, tls))[SITE]
    assert directive(site, "ssl_protocols") == "TLSv1.2 TLSv1.3"
    assert set(directive(site, "ssl_ciphers").split(":")) == MOZILLA_INTERMEDIATE_CIPHERS
    curves = directive(site, "ssl_ecdh_curve").split(":")
    assert curves == SSL_ECDH_CURVES.split(":") and set(curves) < MOZILLA_INTERMEDIATE_GROUPS
    assert "secp521r1" not in curves and "X448" not in curves
    assert directive(site, "ssl_session_cache") == "off" and directive(site, "ssl_session_tickets") == "off"


def test_slow_client_limits_and_descriptors(tmp_path, tls):
    spec = make_spec(tmp_path, tls, client_header_timeout_s=7, client_body_timeout_s=8, send_timeout_s=45,
                     max_conns_per_address=5, worker_connections=3000, read_timeout_s=900)
    files = render_ingress(spec)
    site, main = files[SITE], files[MAIN_CONF]
    # in both servers: port 80 gets the same slow-client limits as the API
    for server in (server_block(site, tls=True), server_block(site, tls=False)):
        assert [directive(server, d) for d in ("client_header_timeout", "client_body_timeout", "send_timeout")] == \
            ["7s", "8s", "45s"]
        assert directive(server, "reset_timedout_connection") == "on"
        assert directive(server, "limit_conn") == "fimfleet_node_per_addr 5"
        assert directive(server, "limit_conn_status") == "429"
    assert directive(site, "limit_conn_zone") == "$binary_remote_addr zone=fimfleet_node_per_addr:10m"
    # the streaming read timeout is not the slow-client one
    assert "proxy_read_timeout 900s;" in location_block(server_block(site, tls=True), "location /v1/ {")
    assert directive(main, "worker_rlimit_nofile") == "6000" == str(nofile_limit(spec.base))
    dropin = configparser.ConfigParser()
    dropin.read_string(render_dropin(spec.base))
    assert dict(dropin["Service"]) == {"limitnofile": "6000"} and DROPIN_PATH.endswith(".conf")


def test_body_size_is_derived_from_the_context():
    assert body_size_for(8192) == "144k" and body_size_for(32768) == "528k" and body_size_for(1024) == "32k"
    sizes = [int(body_size_for(n)[:-1]) for n in (256, 1024, 8192, 32768, 131072)]
    assert sizes == sorted(sizes) and all(k * 1024 >= n * 16 for k, n in zip(sizes, (256, 1024, 8192, 32768, 131072)))
    assert IngressSpec.__dataclass_fields__["client_max_body_size"].default == "144k"


def test_plain_http_answers_the_api_with_use_https_and_logs_no_key(tmp_path, tls):
    site = render_ingress(make_spec(tmp_path, tls))[SITE]
    plain = server_block(site, tls=False)
    v1 = location_block(plain, "location /v1/ {")
    body = re.search(r"return 403 '(.*)\\n';", v1).group(1)
    error = json.loads(body)["error"]
    assert error["code"] == "https_required" and "https://fimfleet.test:18443/v1/" in error["message"]
    assert "default_type application/json;" in v1 and "$" not in v1
    assert "return 301 https://fimfleet.test:18443$request_uri;" in location_block(plain, "location / {")
    assert "acme-challenge" not in plain  # the challenge path falls under the 301, as before
    assert f"access_log {tmp_path}/logs/fimfleet-node-access.log fimfleet_node_plain;" in plain
    fmt = site[site.index("log_format fimfleet_node_plain"):]
    fmt = fmt[:fmt.index(";")]
    assert "$" in fmt and "$fimfleet" not in fmt and "$http_authorization" not in fmt


def test_config_checks_are_the_renderer_rules():
    assert setting_problem("metrics_allow_cidr", "10.0.0.0/8") is None
    assert "192.168.10.0/24" in setting_problem("metrics_allow_cidr", "192.168.10.5/24")
    for everyone in ("0.0.0.0/0", "::/0"):
        assert "whole internet" in setting_problem("metrics_allow_cidr", everyone)
    assert rule("max_conns_per_address")(0) == "must be between 1 and 65535"
    assert rule("max_conns_per_address")(32) is None and rule("send_timeout_s")(30) is None
    assert rule("client_max_body_size", allow_empty=True)("") is None
    assert rule("client_max_body_size")("") and rule("client_max_body_size")("1 m")
    assert set(INT_RULES) <= set(IngressSpec.__dataclass_fields__)
    with pytest.raises(KeyError):
        rule("no_such_setting")
