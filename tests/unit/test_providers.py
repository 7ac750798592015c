"""fimfleet's own dynamic providers, called directly (under mocks they never run)."""

import dill
import pytest
from cryptography import x509
from pulumi.output import UNKNOWN

from components import remote, ssh, tls

CONN = {"host": "203.0.113.10", "port": 22, "user": "root", "privateKey": "-----BEGIN OPENSSH PRIVATE KEY-----"}


def props(**kw):
    base = {"connection": CONN, "apply": "echo hi", "check": "true", "destroy": "", "files": [{"path": "/a", "content": "x"}],
            "uploads": None, "env": {}, "triggers": ["t1"], "timeoutS": 60, "label": "step"}
    base.update(kw)
    return base


def applied(p):
    return {**p, "stdout": "hi", "appliedDigest": remote._digest(p)}


def test_unchanged_step_has_no_diff():
    p = props()
    assert not remote.RemoteStepProvider().diff("id", applied(p), p).changes


@pytest.mark.parametrize("change", [{"apply": "echo bye"}, {"files": [{"path": "/a", "content": "y"}]},
                                    {"triggers": ["t2"]}, {"env": {"A": "1"}}, {"check": "false"}])
def test_changed_content_is_an_update_not_a_replace(change):
    d = remote.RemoteStepProvider().diff("id", applied(props()), props(**change))
    assert d.changes and not d.replaces


def test_new_address_is_an_update_never_a_delete_before_replace():
    # The old host may be gone for good: its destroy must not block the move.
    d = remote.RemoteStepProvider().diff("id", applied(props()), props(connection={**CONN, "host": "198.51.100.1"}))
    assert d.changes and not d.replaces and not d.delete_before_replace


def test_rotated_key_is_recorded_without_running_the_step(monkeypatch):
    provider = remote.RemoteStepProvider()
    olds, news = applied(props()), props(connection={**CONN, "privateKey": "other"})
    d = provider.diff("id", olds, news)
    assert d.changes and not d.replaces
    monkeypatch.setattr(provider, "_exec", lambda *a: pytest.fail("apply must not run for a key rotation"))
    monkeypatch.setattr(provider, "_remark", lambda *a: True)
    assert provider.update("id", olds, news).outs["connection"]["privateKey"] == "other"


@pytest.mark.parametrize("connection", [UNKNOWN, {**CONN, "identity": UNKNOWN}])
def test_a_connection_a_preview_does_not_know_yet_is_an_update(connection):
    """A changed key or address: HostIdentity reads the host again, so in a preview every step's
    connection (or its identity) is unknown. That is an update, not a traceback in diff."""
    olds = applied(props(connection={**CONN, "identity": "a"}))
    d = remote.RemoteStepProvider().diff("id", olds, props(connection=connection))
    assert d.changes and not d.replaces and not d.delete_before_replace


def test_a_new_host_identity_applies_the_step_again():
    olds = applied(props(connection={**CONN, "identity": "a"}))
    assert remote.RemoteStepProvider().diff("id", olds, props(connection={**CONN, "identity": "a"})).changes is False
    assert remote.RemoteStepProvider().diff("id", olds, props(connection={**CONN, "identity": "b"})).changes
    assert remote._wanted(olds, props(connection={**CONN, "identity": "b"})) != olds["appliedDigest"]


def test_steps_recorded_before_host_identities_are_adopted_without_applying():
    legacy = applied(props())  # state written before connections carried an identity
    news = props(connection={**CONN, "identity": "a"})
    assert remote._wanted(legacy, news) == legacy["appliedDigest"]


def test_drift_found_by_read_makes_the_next_diff_apply_again():
    drifted = {**applied(props()), "appliedDigest": "drifted"}
    assert remote.RemoteStepProvider().diff("id", drifted, props()).changes


def test_unpinned_connection_is_refused_before_any_network_io():
    from tests.helpers import ssh_key

    t = ssh.SshTarget(host="192.0.2.1", port=22, user="root", private_key=ssh_key())
    with pytest.raises(remote.Error, match="no pinned SSH host key"):
        with ssh.session(t):
            pass


def test_unreachable_host_fails_with_a_clear_message():
    from tests.helpers import ssh_key

    t = ssh.SshTarget(host="127.0.0.1", port=1, user="root", private_key=ssh_key(), connect_timeout_s=1,
                         host_key="ssh-ed25519 AAAA")
    with pytest.raises(ssh.Unreachable, match=r"cannot reach root@127.0.0.1:1 over SSH.*fimfleet:host.address"):
        with ssh.session(t, retries=1):
            pass


def test_bad_private_key_is_named():
    with pytest.raises(remote.Error, match="sshPrivateKey is not a usable private key"):
        ssh._pkey("-----BEGIN OPENSSH PRIVATE KEY-----\nnope\n-----END OPENSSH PRIVATE KEY-----\n")


def test_destroy_on_a_host_marked_gone_warns_and_skips(capsys):
    remote.RemoteStepProvider().delete("id", applied(props(destroy="false", connection={**CONN, "gone": True})))
    assert "marked gone" in capsys.readouterr().err


def test_destroy_on_an_unreachable_host_warns_instead_of_failing(capsys):
    from tests.helpers import ssh_key

    conn = {"host": "127.0.0.1", "port": 1, "user": "root", "privateKey": ssh_key(), "hostKey": "ssh-ed25519 AAAA"}
    remote.RemoteStepProvider().delete("id", applied(props(destroy="true", connection=conn, label="nginx ingress")))
    err = capsys.readouterr().err
    assert "nginx ingress" in err and "cannot reach root@127.0.0.1:1" in err and "stays" in err


def test_expected_failures_have_no_traceback_and_bugs_keep_theirs(monkeypatch):
    import sys
    import traceback

    from components import errors
    from components.errors import Error, readable_failures

    monkeypatch.setattr(errors, "IN_PROVIDER_HOST", True)  # as inside `python -m pulumi.dynamic`

    @readable_failures
    def expected():
        raise Error("kernel tuning: apply failed with exit 1 on root@h:22")

    @readable_failures
    def bug():
        return {}["missing"]

    for fn, want_traceback in ((expected, False), (bug, True), (expected, False)):
        try:
            fn()
        except Exception:  # noqa: BLE001 - the SDK's wrapper does exactly this
            text = traceback.format_exc()
        assert ("Traceback" in text) is want_traceback, text
    assert text.strip() == "fimfleet.Error: kernel tuning: apply failed with exit 1 on root@h:22"
    sys.__dict__.pop("tracebacklimit", None)


def test_outside_the_provider_host_the_traceback_limit_is_never_touched():
    """A lingering limit of 0 empties every stack walk; Pulumi's registration under mocks then hangs."""
    import sys

    from components.errors import IN_PROVIDER_HOST, Error, readable_failures

    @readable_failures
    def expected():
        raise Error("x")

    with pytest.raises(Error):
        expected()
    assert not IN_PROVIDER_HOST and not hasattr(sys, "tracebacklimit")


@pytest.mark.parametrize("provider", [remote.RemoteStepProvider(), tls.SelfSignedProvider()])
def test_providers_pickle_without_state(provider):
    clone = dill.loads(dill.dumps(provider, recurse=True))
    assert type(clone).__name__ == type(provider).__name__ and vars(clone) == {}


def test_self_signed_chain_verifies_and_names_match():
    out = tls.SelfSignedProvider().create({"commonName": "code.example.com", "dnsNames": ["code.example.com", "localhost"],
                                           "ipAddresses": ["127.0.0.1"]}).outs
    ca = x509.load_pem_x509_certificate(out["caPem"].encode())
    leaf = x509.load_pem_x509_certificates(out["certPem"].encode())[0]
    leaf.verify_directly_issued_by(ca)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["code.example.com", "localhost"]
    assert "PRIVATE KEY" in out["keyPem"]


def test_certificate_is_reissued_only_when_names_change():
    p = tls.SelfSignedProvider()
    olds = {"commonName": "a", "dnsNames": ["a"], "ipAddresses": [], **tls.issue("a", ["a"], [])}
    assert not p.diff("id", olds, {"commonName": "a", "dnsNames": ["a"], "ipAddresses": []}).changes
    d = p.diff("id", olds, {"commonName": "a", "dnsNames": ["a", "b"], "ipAddresses": []})
    assert d.changes and not d.replaces  # an update: the reissue keeps the CA (tls.py)


def test_a_host_declared_gone_is_recorded_without_contact(monkeypatch):
    from components import identity

    monkeypatch.setattr(ssh, "_connect", lambda *a, **k: pytest.fail("no SSH to a host declared gone"))
    olds = {**applied(props(connection={**CONN, "identity": "a"}))}
    news = props(connection={**CONN, "identity": "a", "gone": True})
    assert remote.RemoteStepProvider().update("id", olds, news).outs["connection"]["gone"] is True
    ident_olds = {"connection": CONN, "hostKey": "", "bastionHostKey": "", "hostKeySeen": "ssh-ed25519 AAAA",
                  "bastionHostKeySeen": "", "identity": "a", "machineId": "m"}
    ident_news = {"connection": {**CONN, "gone": True}, "hostKey": "", "bastionHostKey": ""}
    out = identity.HostIdentityProvider().update("id", ident_olds, ident_news).outs
    assert out["identity"] == "a" and out["connection"]["gone"] is True
    assert identity.HostIdentityProvider().read("id", out).outs == out
