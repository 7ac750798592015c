"""Third-party scanners and slow clients against the production ingress (issue 20).

The cpu-epyc-prod stack file is parsed like `pulumi up` parses it, and the ingress is rendered
by the component's own functions (components/ingress.py). gixy-ng reads those files as they are
installed; the real nginx serves them, with only the host layout (ports, directories, user)
changed, for sslyze's Mozilla intermediate check and for the slow-client probes. The scanners
live in their own pinned venv (toolchain/scanners/install.sh). Print the figures with -s.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import gzip
import json
import re
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from components import config, ingress, nginx_base, tls  # noqa: E402
from components.ingress_render import site_conf  # noqa: E402
from tests.helpers import raw_config  # noqa: E402
from tests.integration.nginx_harness import NGINX, Nginx, TlsFiles, Upstream, bearer, write_tls  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STACK = REPO / "stacks" / "Pulumi.cpu-epyc-prod.yaml"
INSTALL = REPO / "toolchain" / "scanners" / "install.sh"
SSLYZE = Path(__file__).with_name("sslyze_mozilla.py")
DEBIAN_CHANGELOG = Path("/usr/share/doc/nginx-common/changelog.Debian.gz")

# gixy-ng matches CVEs on the upstream version string alone. These need nothing from the config,
# and the Debian package nginx comes from carries the fix (checked in its changelog below).
VERSION_ONLY_CVES = {
    "CVE-2026-9256": "rewrite-module heap overflow, fixed upstream in 1.30.2; Debian backported the "
                     "fix to 1.22.1 (bookworm-security, d/p/CVE-2026-9256.patch)",
}
# The host layout the test changes; every other setting is production's.
LAYOUT = {"tls_cert_path", "tls_key_path", "https_port", "http_port", "listen_addresses", "upstream_port",
          "base", "conf_dir", "log_dir", "pid_path", "temp_dir", "worker_user"}
# Short slow-client limits for the probes (production: 10 s, 10 s, 30 s, 32).
HEADER_S, BODY_S, SEND_S, MAX_CONNS = 2, 2, 1, 3
PREFILL_MS = 2500  # the upstream's silence before the first chunk: longer than SEND_S


# ----------------------------------------------------------------------- helpers


def production_config() -> config.StackConfig:
    """The cpu-epyc-prod stack file, parsed as `pulumi up` does (test secrets added)."""
    stack = yaml.safe_load(STACK.read_text())["config"]
    sections = {k.split(":", 1)[1]: v for k, v in stack.items() if k.startswith("fimfleet:")}
    raw, secret = raw_config(sections.pop("tier"), **sections)
    return config.parse(raw, secret)


def production_overrides(cfg: config.StackConfig, **test_values) -> dict:
    """IngressSpec and host nginx fields as the components render them, minus the host layout."""
    spec = ingress.spec_for(ingress.args_for(cfg), cfg.ingress.domain, *ingress.tls_paths(cfg.ingress, "node"))
    return {**{f.name: getattr(o, f.name) for o in (spec, spec.base) for f in dataclasses.fields(o)
               if f.name not in LAYOUT}, **test_values}


def deployed_tree(cfg: config.StackConfig, root: Path, edit=lambda name, text: text) -> Path:
    """The host's and the node's nginx files as the two apply steps install them, under ``root``;
    only the include paths are re-rooted so the scanner reads these files and not /etc/nginx."""
    host_step = nginx_base.render(nginx_base.NginxBase())
    node_staged, node_installs = ingress.render_files(ingress.args_for(cfg), cfg.ingress.domain, "CERT", "KEY")
    content = {f["path"].rsplit("/", 1)[-1]: f["content"] for f in host_step.files + node_staged}
    dests = {"nginx.conf": "/etc/nginx/nginx.conf", **{i["name"]: i["dest"] for i in node_installs}}
    includes = []
    for name, dest in dests.items():
        text = edit(name, content[name])
        includes += re.findall(r"^\s*include (\S+);", text, re.M)
        path = root / dest.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace("include /etc/nginx/", f"include {root}/etc/nginx/"))
    assert includes == ["/etc/nginx/fimfleet.d/*.conf", "/etc/nginx/fimfleet.d/node.keys"]
    return root / "etc" / "nginx" / "nginx.conf"


def nginx_version() -> str:
    out = subprocess.run([NGINX, "-v"], capture_output=True, text=True, timeout=30).stderr
    return re.search(r"nginx/(\d+\.\d+\.\d+)", out).group(1)


def gixy(bin_dir: Path, conf: Path) -> list[dict]:
    r = subprocess.run([str(bin_dir / "gixy"), "-f", "json", "--nginx-version", nginx_version(), str(conf)],
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().startswith("["), f"gixy failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def sslyze(bin_dir: Path, server_name: str, port: int) -> dict:
    r = subprocess.run([str(bin_dir / "python"), "-W", "ignore", str(SSLYZE), server_name, "127.0.0.1", str(port)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, f"sslyze failed:\n{r.stderr[-3000:]}"
    result = json.loads(r.stdout.splitlines()[-1])
    assert "error" not in result, result
    return result


def long_lived_pems(common_name: str, days: int) -> dict:
    """A leaf of ``days`` (issue() refuses more than 365): the pre-issue-20 certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=False)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    return {"caPem": pem, "certPem": pem, "keyPem": key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()}


class EditedNginx(Nginx):
    """Negative controls: the rendered site file with one edit (no nginx -t after it)."""

    def __init__(self, *args, edit, **kwargs):
        super().__init__(*args, **kwargs)
        self.edit = edit

    def _write(self) -> None:
        super()._write()
        site = self.prefix / site_conf(self.spec.node)
        site.write_text(self.edit(site.read_text()))


# ----------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def scanners() -> Path:
    r = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"toolchain/scanners/install.sh failed:\n{r.stderr[-3000:]}"
    return Path(r.stdout.strip().splitlines()[-1].split("=", 1)[1]) / "bin"


@pytest.fixture(scope="module")
def cfg() -> config.StackConfig:
    return production_config()


@pytest.fixture(scope="module")
def prod_tls(cfg, tmp_path_factory) -> TlsFiles:
    """The certificate SelfSignedCertificate issues for this stack (names as NginxIngress picks them)."""
    i, address = cfg.ingress, cfg.host.address
    out = tls.SelfSignedProvider().create({
        "commonName": i.domain, "dnsNames": sorted({i.domain, "localhost"}),
        "ipAddresses": sorted({address, "127.0.0.1"}), "validityDays": i.cert_validity_days}).outs
    return write_tls(tmp_path_factory.mktemp("prod-tls"), out)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    up = Upstream(tmp_path_factory.mktemp("upstream"), first_delay_ms=PREFILL_MS)
    yield up
    up.stop()


@pytest.fixture
def serve(tmp_path, upstream):
    started: list[Nginx] = []

    def _serve(files: TlsFiles, overrides: dict, edit=None) -> Nginx:
        cls, extra = (EditedNginx, {"edit": edit}) if edit else (Nginx, {})
        ngx = cls(tmp_path / f"nginx{len(started)}", files, upstream.port, **overrides, **extra)
        started.append(ngx)
        return ngx.start()

    yield _serve
    for ngx in started:
        ngx.stop()


# -------------------------------------------------------------------------- gixy


def test_gixy_finds_nothing_above_low_in_the_production_config(scanners, cfg, tmp_path):
    findings = gixy(scanners, deployed_tree(cfg, tmp_path))
    serious = [f for f in findings if f["severity"] not in ("UNSPECIFIED", "LOW")]
    version_only = {f["reason"].split(":", 1)[0]: f for f in serious
                    if f["plugin"] == "nginx_cves" and "version falls in the affected range" in f["reason"]}
    print(f"\ngixy-ng on cpu-epyc-prod (nginx {nginx_version()}): {len(findings)} findings; "
          f"version-only CVE matches: {sorted(version_only)}")
    assert [f for f in serious if f not in version_only.values()] == []
    assert set(version_only) == set(VERSION_ONLY_CVES), "update VERSION_ONLY_CVES, with the reason"
    changelog = gzip.decompress(DEBIAN_CHANGELOG.read_bytes()).decode()  # part of nginx-common
    for cve in VERSION_ONLY_CVES:
        assert cve in changelog, f"{cve} is not fixed in the installed Debian nginx: upgrade it"


def test_gixy_negative_control_flags_the_included_site_file(scanners, cfg, tmp_path):
    def regress(name: str, text: str) -> str:
        if name == "nginx.conf":
            return re.sub(r"^worker_rlimit_nofile .*\n", "", text, flags=re.M)
        return text.replace("ssl_ecdh_curve X25519:", "ssl_ecdh_curve X25519MLKEM768:X25519:")

    plugins = {(f["plugin"], f["severity"]) for f in gixy(scanners, deployed_tree(cfg, tmp_path, regress))}
    assert {("ssl_ecdh_curve", "HIGH"), ("worker_rlimit_nofile_vs_connections", "MEDIUM")} <= plugins


# ------------------------------------------------------------------------ sslyze


def test_sslyze_mozilla_intermediate_passes_except_path_validation(scanners, cfg, prod_tls, serve):
    ngx = serve(prod_tls, production_overrides(cfg))
    result = sslyze(scanners, cfg.ingress.domain, ngx.https_port)
    print(f"\nsslyze Mozilla intermediate on cpu-epyc-prod: issues {sorted(result['issues'])}, versions "
          f"{result['accepted_versions']}, groups {result['curves']}, {len(result['cipher_suites'])} suites, "
          f"certificate {result['certificate_days']} days, scan {result['scan_seconds']} s")
    # the only deviation: the self-signed CA is in no public trust store
    assert set(result["issues"]) == {"certificate_path_validation"}, result["issues"]
    assert result["accepted_versions"] == ["tls_1_2_cipher_suites", "tls_1_3_cipher_suites"]
    assert set(result["curves"]) <= set(result["profile_curves"])
    assert result["certificate_days"] <= tls.MAX_VALIDITY_DAYS


def test_sslyze_negative_control_flags_the_old_groups_and_lifetime(scanners, cfg, tmp_path, serve):
    old = write_tls(tmp_path, long_lived_pems(cfg.ingress.domain, 825))
    ngx = serve(old, production_overrides(cfg), edit=lambda site: re.sub(r"^\s*ssl_ecdh_curve .*\n", "", site, flags=re.M))
    result = sslyze(scanners, cfg.ingress.domain, ngx.https_port)
    assert {"tls_curves", "maximum_certificate_lifespan", "certificate_path_validation"} <= set(result["issues"])


# ------------------------------------------------------------------ slow clients


@pytest.fixture
def slow_limits(cfg, prod_tls, serve):
    ngx = serve(prod_tls, production_overrides(cfg, client_header_timeout_s=HEADER_S, client_body_timeout_s=BODY_S,
                                               send_timeout_s=SEND_S, max_conns_per_address=MAX_CONNS))
    key = next(iter(cfg.secrets.api_keys.values()))
    ctx = prod_tls.context()

    def connect() -> ssl.SSLSocket:
        raw = socket.create_connection(("127.0.0.1", ngx.https_port), timeout=10)
        return ctx.wrap_socket(raw, server_hostname=cfg.ingress.domain)

    return ngx, key, connect


def post_head(host: str, key: str, length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def seconds_until_cut(sock: ssl.SSLSocket, drips: list[bytes], every_s: float, limit_s: float = 30) -> tuple[float, str]:
    """Send one drip every ``every_s`` seconds (then nothing) until the server ends the
    connection; return the seconds since the last drip and how it ended."""
    last, i = time.monotonic(), 0
    sock.settimeout(0.05)
    while time.monotonic() - last < limit_s:
        if i < len(drips) and time.monotonic() - last >= (every_s if i else 0):
            try:
                sock.sendall(drips[i])
            except OSError as e:
                return time.monotonic() - last, type(e).__name__
            last, i = time.monotonic(), i + 1
        try:
            data = sock.recv(4096)
        except (TimeoutError, ssl.SSLWantReadError):
            continue
        except (ssl.SSLError, OSError) as e:
            return time.monotonic() - last, type(e).__name__
        return time.monotonic() - last, data.split(b"\r\n", 1)[0].decode() if data else "EOF"
    raise AssertionError(f"still open {limit_s} s after the last drip")


def test_dripped_header_is_cut_by_the_header_timeout(slow_limits, cfg):
    ngx, key, connect = slow_limits
    head = post_head(cfg.ingress.domain, key, 10)
    # one header byte every 0.5 s: every read is in time, the whole header is not
    with connect() as sock:
        t0 = time.monotonic()
        after_last, how = seconds_until_cut(sock, [head[i:i + 1] for i in range(len(head))], every_s=0.5)
        total = time.monotonic() - t0
    print(f"\ndripped header (1 byte / 0.5 s, client_header_timeout {HEADER_S}s): cut after {total:.2f} s ({how})")
    assert HEADER_S - 0.3 <= total <= HEADER_S + 1.5, total


def test_dripped_body_is_cut_by_the_body_timeout(slow_limits, cfg):
    ngx, key, connect = slow_limits
    with connect() as sock:
        t0 = time.monotonic()
        # the issue's probe, scaled: one body byte every 1.5 x the timeout
        after_last, how = seconds_until_cut(sock, [post_head(cfg.ingress.domain, key, 1000) + b"{", b'"', b"m"],
                                            every_s=BODY_S * 1.5)
        total = time.monotonic() - t0
    print(f"\ndripped body (1 byte / {BODY_S * 1.5:.1f} s, client_body_timeout {BODY_S}s): "
          f"cut {after_last:.2f} s after the last byte, {total:.2f} s in all ({how})")
    assert BODY_S - 0.3 <= after_last <= BODY_S + 1.5, after_last
    assert total <= 2 * BODY_S + 2


def test_connection_beyond_the_per_address_limit_is_refused(slow_limits, cfg, prod_tls):
    ngx, key, connect = slow_limits
    held = [connect() for _ in range(MAX_CONNS)]
    try:
        for sock in held:  # a request in progress on each: header read, body pending
            sock.sendall(post_head(cfg.ingress.domain, key, 100) + b"{")
        time.sleep(0.3)
        with httpx.Client(verify=prod_tls.context(), timeout=10) as client:
            refused = client.get(ngx.url("/v1/models", host="127.0.0.1"), headers=bearer(key))
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert "concurrent request limit of this address" in refused.json()["error"]["message"]
            held.pop().close()
            time.sleep(0.3)
            assert client.get(ngx.url("/v1/models", host="127.0.0.1"), headers=bearer(key)).status_code == 200
    finally:
        for sock in held:
            sock.close()
    print(f"\nlimit_conn {MAX_CONNS}: connection {MAX_CONNS + 1} from one address got 429; "
          "after one closed, a new request got 200")


def test_sse_prefill_longer_than_send_timeout_is_not_cut(slow_limits, cfg, prod_tls):
    """send_timeout runs only while the client leaves data unread: a silent prefill is fine."""
    ngx, key, _ = slow_limits
    body = {"model": "sse-test", "prompt": "x", "max_tokens": 2, "stream": True}
    with httpx.Client(verify=prod_tls.context(), timeout=30) as client:
        t0 = time.monotonic()
        with client.stream("POST", ngx.url("/v1/completions", host="127.0.0.1"), json=body,
                           headers=bearer(key)) as resp:
            assert resp.status_code == 200
            text = resp.read().decode()
        elapsed = time.monotonic() - t0
    assert text.count("data: ") == 3 and text.rstrip().endswith("data: [DONE]"), text
    print(f"\nSSE with a {PREFILL_MS} ms silent prefill under send_timeout {SEND_S}s: complete after {elapsed:.2f} s")
    assert elapsed >= PREFILL_MS / 1000
