"""Self-signed certificate lifetime: at most 365 days, reissued by `pulumi up` before expiry.

The provider's diff never runs under Pulumi mocks, so it is called directly with the
outputs a real create left in the state.
"""

from __future__ import annotations

import datetime as dt

import dill
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from components import tls

NAMES = {"commonName": "code.example.com", "dnsNames": ["code.example.com", "localhost"], "ipAddresses": ["127.0.0.1"]}
NOW = dt.datetime.now(dt.timezone.utc)


def cert_pem(not_before: dt.datetime, not_after: dt.datetime) -> str:
    """A certificate with exactly these dates (issue() refuses lifetimes the profile forbids)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "code.example.com")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def state(**outs) -> dict:
    """What a create leaves in the state: the inputs plus the issued PEMs."""
    return {**NAMES, "validityDays": tls.MAX_VALIDITY_DAYS, **outs}


def reissued(d) -> bool:
    """A reissue is an update, never a replace: it keeps the CA in the state (tls.update)."""
    return bool(d.changes) and not d.replaces


def diff(olds: dict, **news):
    return tls.SelfSignedProvider().diff("id", olds, {**NAMES, "validityDays": tls.MAX_VALIDITY_DAYS, **news})


def test_new_certificates_live_at_most_365_days():
    out = tls.SelfSignedProvider().create(dict(NAMES)).outs
    leaf = x509.load_pem_x509_certificates(out["certPem"].encode())[0]
    life = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    # sslyze's Mozilla check compares whole days with maximum_certificate_lifespan (366)
    assert life.days == tls.MAX_VALIDITY_DAYS < 366
    assert dt.datetime.fromisoformat(out["notAfter"]) == leaf.not_valid_after_utc


def test_validity_days_is_honoured_and_bounded():
    out = tls.SelfSignedProvider().create({**NAMES, "validityDays": 40}).outs
    leaf = x509.load_pem_x509_certificates(out["certPem"].encode())[0]
    assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days == 40
    for bad in (0, 366, 825, True, "90"):
        with pytest.raises(ValueError, match="use 1 to 365"):
            tls.issue("a", ["a"], [], days=bad)


def test_fresh_certificate_is_kept():
    d = diff(state(**tls.issue("code.example.com", ["code.example.com"], [])))
    assert not d.changes and not d.replaces


def test_near_expiry_certificate_is_reissued():
    near = tls.issue("code.example.com", ["code.example.com"], [], days=tls.RENEW_BEFORE_DAYS - 1)
    d = diff(state(**near))
    assert reissued(d) and d.delete_before_replace is False


@pytest.mark.parametrize("left, reissue", [(dt.timedelta(days=31), False), (dt.timedelta(days=30, hours=1), False),
                                           (dt.timedelta(days=30, hours=-1), True), (dt.timedelta(days=1), True),
                                           (dt.timedelta(days=-3), True)])
def test_reissue_window_is_thirty_days(left, reissue):
    # dates from the test's own clock: the diff reads the real clock, and a suite can run for half an hour
    now = dt.datetime.now(dt.timezone.utc)
    pem = cert_pem(now - dt.timedelta(days=100), now + left)
    assert (tls.reissue_reason(pem, tls.MAX_VALIDITY_DAYS, now=now) is not None) is reissue
    assert bool(diff(state(certPem=pem)).changes) is reissue


def test_expired_reason_names_the_date():
    pem = cert_pem(NOW - dt.timedelta(days=300), NOW + dt.timedelta(days=5))
    reason = tls.reissue_reason(pem, 365, now=NOW)
    assert reason and (NOW + dt.timedelta(days=5)).strftime("%Y-%m-%d") in reason and "30 days" in reason


def test_long_lived_certificate_from_an_older_release_is_reissued():
    # fimfleet used to issue 825-day certificates; Mozilla intermediate allows < 366
    pem = cert_pem(NOW - dt.timedelta(days=10), NOW + dt.timedelta(days=815))
    d = diff(state(certPem=pem))
    assert reissued(d)
    assert "825 days" in tls.reissue_reason(pem, 365, now=NOW)


def test_shorter_configured_validity_reissues_a_longer_certificate():
    olds = state(**tls.issue("code.example.com", ["code.example.com"], [], days=200))
    assert not diff(olds, validityDays=200).changes
    assert reissued(diff(olds, validityDays=90))


def test_name_change_reissues_by_name_not_by_date():
    d = diff(state(**tls.issue("code.example.com", ["code.example.com"], [])), dnsNames=["other.example.com"])
    assert reissued(d)


@pytest.mark.parametrize("cert", [None, "", "not a pem", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"])
def test_unreadable_certificate_in_state_is_reissued(cert):
    assert reissued(diff(state(certPem=cert)))


def test_provider_class_path_is_stable_for_dill():
    """State holds the pickled provider by reference: moving the class breaks every existing stack."""
    assert (tls.SelfSignedProvider.__module__, tls.SelfSignedProvider.__qualname__) == ("components.tls", "SelfSignedProvider")
    clone = dill.loads(dill.dumps(tls.SelfSignedProvider(), recurse=True))
    assert reissued(clone.diff("id", state(certPem=None), dict(NAMES)))


@pytest.mark.parametrize("domain", ["a" * 41 + ".example.com", ".".join(["b" * 63] * 3) + ".example.com"])
def test_a_domain_longer_than_a_common_name_gets_its_certificate(domain):
    """ingress.domain may be 253 characters, a commonName 64 (RFC 5280): `fimfleet CA <domain>`
    failed in cryptography with a traceback from 53 on. The subjectAltName carries the whole name."""
    out = tls.issue(domain, [domain], [])
    leaf, ca = x509.load_pem_x509_certificates(out["certPem"].encode())
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert sans == [domain]
    for c in (leaf, ca):
        cn = c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        assert len(cn) <= tls.CN_MAX
    assert leaf.issuer == ca.subject


def test_a_reissue_is_signed_by_the_ca_in_the_state_which_editors_and_the_gateway_pin():
    """A fresh CA at each reissue broke every user's editor config (it pins caPem) once a year,
    and a fleet's gateway could not verify a renewed node until the roll's end."""
    p = tls.SelfSignedProvider()
    first = p.create({**NAMES, "validityDays": 29}).outs
    assert p.diff("id", first, {**NAMES, "validityDays": 29}).changes  # under the renewal window
    renewed = p.update("id", first, {**NAMES, "dnsNames": ["code.example.com", "other.example.com"]}).outs
    assert renewed["caPem"] == first["caPem"] and renewed["caKeyPem"] == first["caKeyPem"]
    assert renewed["certPem"] != first["certPem"] and renewed["keyPem"] != first["keyPem"]
    leaf = x509.load_pem_x509_certificates(renewed["certPem"].encode())[0]
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(first["caPem"].encode()))
    assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days == tls.MAX_VALIDITY_DAYS
    ca = x509.load_pem_x509_certificate(first["caPem"].encode())
    assert (ca.not_valid_after_utc - ca.not_valid_before_utc).days == tls.CA_VALIDITY_DAYS


@pytest.mark.parametrize("ca", ["none", "other key", "ending", "damaged"])
def test_a_ca_that_cannot_sign_the_reissue_is_made_again(ca):
    """A state from before the CA was kept (no key), a key that is not the CA's, a CA that ends
    before the new certificate would, or an unreadable one: a new CA, never a failed reissue."""
    first = tls.issue("code.example.com", ["code.example.com"], [])
    olds = {**state(**first)}
    if ca == "none":
        olds.pop("caKeyPem")
    elif ca == "other key":
        olds["caKeyPem"] = tls.issue("x", ["x"], [])["caKeyPem"]
    elif ca == "ending":
        olds.update(caPem=cert_pem(NOW - dt.timedelta(days=1), NOW + dt.timedelta(days=100)))
    else:
        olds["caPem"] = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    renewed = tls.SelfSignedProvider().update("id", olds, {**NAMES}).outs
    assert renewed["caPem"] != first["caPem"]
    leaf = x509.load_pem_x509_certificates(renewed["certPem"].encode())[0]
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(renewed["caPem"].encode()))

