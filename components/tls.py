"""Self-signed TLS for the ingress: a throwaway CA signs the server certificate.

The CA's private key is discarded right after signing, so only the server key exists,
and it lives in the state as a secret. Editors and the SLA probe trust `caPem`.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import uuid
from typing import Any

import pulumi
from pulumi.dynamic import CreateResult, DiffResult, Resource, ResourceProvider

VALIDITY_DAYS = 825


def issue(common_name: str, dns_names: list[str], ip_addresses: list[str], days: int = VALIDITY_DAYS) -> dict[str, str]:
    """Return caPem, certPem and keyPem (PEM strings) for a server certificate signed by a fresh CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fimfleet CA {common_name}")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = lambda c: c.public_bytes(serialization.Encoding.PEM).decode()  # noqa: E731
    return {
        "caPem": pem(ca),
        "certPem": pem(cert) + pem(ca),
        "keyPem": key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode(),
        "notAfter": cert.not_valid_after_utc.isoformat(),
    }


class SelfSignedProvider(ResourceProvider):
    def create(self, props: dict[str, Any]) -> CreateResult:
        out = issue(props["commonName"], list(props.get("dnsNames") or []), list(props.get("ipAddresses") or []))
        return CreateResult(id_=uuid.uuid4().hex, outs={**props, **out})

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        keys = ("commonName", "dnsNames", "ipAddresses")
        changed = [k for k in keys if olds.get(k) != news.get(k)]
        return DiffResult(changes=bool(changed), replaces=changed, delete_before_replace=False)


class SelfSignedCertificate(Resource):
    """A server certificate for the node's names; replaced (re-issued) only when the names change."""

    caPem: pulumi.Output[str]  # noqa: N815 - dynamic outputs keep their state names
    certPem: pulumi.Output[str]  # noqa: N815
    keyPem: pulumi.Output[str]  # noqa: N815

    def __init__(self, name: str, common_name: str, dns_names: list[str], ip_addresses: pulumi.Input[list],
                 opts: pulumi.ResourceOptions | None = None):
        opts = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(additional_secret_outputs=["keyPem"]))
        super().__init__(SelfSignedProvider(), name, {
            "commonName": common_name, "dnsNames": dns_names, "ipAddresses": ip_addresses,
            "caPem": None, "certPem": None, "keyPem": None, "notAfter": None,
        }, opts)
