"""Self-signed TLS for the ingress: the node's own CA signs its server certificate.

The CA lives CA_VALIDITY_DAYS and its key stays in the state as a secret, beside the server
key: a reissued server certificate (its date, or new names) is signed by the same CA, so the
editors that pin `caPem`, the SLA probe and a fleet's gateway keep trusting the node across
renewals. (A fresh CA at each reissue broke every user's editor config once a year, and a
fleet's gateway, whose CA bundle follows the last wave, could not verify a renewed node until
the end of the roll.) A state from before this keeps no CA key: its next reissue makes the CA.

Certificates live at most MAX_VALIDITY_DAYS (Mozilla's intermediate profile allows fewer
than 366 days). The provider's diff reads the certificate in the state, so every
`pulumi preview`/`up` plans a reissue once fewer than RENEW_BEFORE_DAYS remain, or when the
certificate lives longer than the configured validity (e.g. an 825-day one from an older
fimfleet). The provider class keeps its import path: dill pickles it into the state by it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import uuid
from typing import Any

import pulumi
from pulumi.dynamic import CreateResult, DiffResult, Resource, ResourceProvider, UpdateResult

MAX_VALIDITY_DAYS = 365
"""Longest life of a self-signed certificate (Mozilla intermediate: fewer than 366 days)."""
RENEW_BEFORE_DAYS = 30
"""`pulumi up` reissues a certificate with fewer days than this left."""
CA_VALIDITY_DAYS = 3650
"""The node's CA: a server certificate is signed by it while it outlives that certificate."""
NAME_KEYS = ("commonName", "dnsNames", "ipAddresses")


CN_MAX = 64
"""RFC 5280's upper bound on a commonName; the names clients check are the subjectAltNames."""


def _cn(text: str) -> str:
    """A commonName within CN_MAX: a long domain (up to 253 characters) is shortened there only."""
    return text if len(text) <= CN_MAX else text[:CN_MAX - 3] + "..."


def _kept_ca(ca_pem: Any, ca_key_pem: Any, not_after: dt.datetime):
    """(certificate, key) of the CA in the state, when it still signs: whole, its key the
    certificate's, and outliving a server certificate that ends at `not_after`; else None."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        ca = x509.load_pem_x509_certificate(ca_pem.encode())
        key = serialization.load_pem_private_key(ca_key_pem.encode(), password=None)
    except (AttributeError, TypeError, ValueError):
        return None
    same = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) == \
        ca.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return (ca, key) if same and ca.not_valid_after_utc >= not_after else None


def issue(common_name: str, dns_names: list[str], ip_addresses: list[str],
          days: int = MAX_VALIDITY_DAYS, ca_pem: Any = None, ca_key_pem: Any = None) -> dict[str, str]:
    """Return caPem, caKeyPem, certPem, keyPem (PEM strings) and notAfter for a server certificate
    signed by the CA given (caPem, caKeyPem), while it can (_kept_ca), else by a new one."""
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_VALIDITY_DAYS:
        raise ValueError(f"certificate validity {days!r} days: use 1 to {MAX_VALIDITY_DAYS}")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)
    kept = _kept_ca(ca_pem, ca_key_pem, now + dt.timedelta(days=days))
    if kept:
        ca, ca_key = kept
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _cn(f"fimfleet CA {common_name}"))])
        ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
              .not_valid_after(now + dt.timedelta(days=CA_VALIDITY_DAYS))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                           content_commitment=False, key_encipherment=False, data_encipherment=False,
                                           key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _cn(common_name))]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = lambda c: c.public_bytes(serialization.Encoding.PEM).decode()  # noqa: E731
    private = lambda k: k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,  # noqa: E731
                                        serialization.NoEncryption()).decode()
    return {
        "caPem": pem(ca),
        "caKeyPem": private(ca_key),
        "certPem": pem(cert) + pem(ca),
        "keyPem": private(key),
        "notAfter": cert.not_valid_after_utc.isoformat(),
    }


def reissue_reason(cert_pem: Any, validity_days: int, now: dt.datetime | None = None) -> str | None:
    """Why the certificate in the state must be reissued (None: keep it)."""
    from cryptography import x509

    try:
        leaf = x509.load_pem_x509_certificates(cert_pem.encode())[0]
    except (AttributeError, IndexError, ValueError):
        return "the state holds no readable certificate"
    now = now or dt.datetime.now(dt.timezone.utc)
    not_after = leaf.not_valid_after_utc
    left = not_after - now
    if left < dt.timedelta(days=RENEW_BEFORE_DAYS):
        return f"it expires {not_after:%Y-%m-%d %H:%M} UTC, in under {RENEW_BEFORE_DAYS} days"
    # issue() backdates notBefore by 5 minutes; allow an hour of slack
    if not_after - leaf.not_valid_before_utc > dt.timedelta(days=validity_days, hours=1):
        return f"it lives {(not_after - leaf.not_valid_before_utc).days} days, longer than {validity_days}"
    return None


def _validity(props: dict[str, Any]) -> int:
    return int(props.get("validityDays") or MAX_VALIDITY_DAYS)


class SelfSignedProvider(ResourceProvider):
    def create(self, props: dict[str, Any]) -> CreateResult:
        out = issue(props["commonName"], list(props.get("dnsNames") or []), list(props.get("ipAddresses") or []),
                    days=_validity(props))
        return CreateResult(id_=uuid.uuid4().hex, outs={**props, **out})

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        # An update, never a replace: the reissued certificate keeps the CA in the state (update()).
        changed = [k for k in NAME_KEYS if olds.get(k) != news.get(k)]
        if not changed and reissue_reason(olds.get("certPem"), _validity(news)):
            changed = ["notAfter"]
        return DiffResult(changes=bool(changed), replaces=[], delete_before_replace=False)

    def update(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> UpdateResult:
        out = issue(news["commonName"], list(news.get("dnsNames") or []), list(news.get("ipAddresses") or []),
                    days=_validity(news), ca_pem=olds.get("caPem"), ca_key_pem=olds.get("caKeyPem"))
        return UpdateResult(outs={**news, **out})


class SelfSignedCertificate(Resource):
    """A server certificate for the node's names; reissued, by the same CA, when the names change,
    when fewer than RENEW_BEFORE_DAYS remain, or when it lives longer than `validity_days`."""

    caPem: pulumi.Output[str]  # noqa: N815 - dynamic outputs keep their state names
    caKeyPem: pulumi.Output[str]  # noqa: N815
    certPem: pulumi.Output[str]  # noqa: N815
    keyPem: pulumi.Output[str]  # noqa: N815

    def __init__(self, name: str, common_name: str, dns_names: list[str], ip_addresses: pulumi.Input[list],
                 validity_days: int = MAX_VALIDITY_DAYS, opts: pulumi.ResourceOptions | None = None):
        opts = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(additional_secret_outputs=["keyPem", "caKeyPem"]))
        super().__init__(SelfSignedProvider(), name, {
            "commonName": common_name, "dnsNames": dns_names, "ipAddresses": ip_addresses,
            "validityDays": validity_days, "caPem": None, "caKeyPem": None, "certPem": None, "keyPem": None,
            "notAfter": None,
        }, opts)
