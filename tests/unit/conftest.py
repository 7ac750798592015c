"""Pulumi mocks: set before any program code runs; records every registration with its
parent, dependencies and which inputs were secret."""

from __future__ import annotations

import pulumi
import pytest
from pulumi.runtime import mocks as pmocks
from pulumi.runtime import resource as presource
from pulumi.runtime.proto import source_pb2

SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"
SIG_KEY = "4dabf18193072939515e22adb298388d"


class Recorder(pmocks.MockMonitor):
    def __init__(self, m):
        super().__init__(m)
        self.registrations: list[dict] = []

    def RegisterResource(self, request):  # noqa: N802 - gRPC name
        resp = super().RegisterResource(request)
        secret_fields = {k for k, v in request.object.fields.items()
                         if v.HasField("struct_value") and v.struct_value.fields.get(SIG_KEY)
                         and v.struct_value.fields[SIG_KEY].string_value == SECRET_SIG}
        self.registrations.append({"type": request.type, "name": request.name, "urn": resp.urn,
                                   "parent": request.parent, "deps": set(request.dependencies),
                                   "secret_fields": secret_fields, "aliases": list(request.aliases),
                                   "inputs": pulumi.runtime.rpc.deserialize_properties(request.object)})
        return resp


class Mocks(pulumi.runtime.Mocks):
    def __init__(self):
        self.outputs: dict[str, dict] = {}
        """name -> what that resource's provider would add to its outputs (the recorder clears it)."""

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        outs = {**args.inputs, **self.outputs.get(args.name, {})}
        if args.name.endswith("-cert"):
            outs.update(caPem="CA", certPem="CERT", keyPem="KEY")
        if args.name.endswith("-probe-key"):  # components/keys.py: the provider's create does not run under mocks
            outs.update(key=f"mock-{args.name}-0123456789abcdefghijklmnop")  # one key per resource, as made
        return f"{args.name}-id", outs

    def call(self, args: pulumi.runtime.MockCallArgs):
        return {}


RECORDER = Recorder(Mocks())
pulumi.runtime.set_mocks(Mocks(), project="fimfleet", stack="test", preview=False, monitor=RECORDER,
                         organization="organization")  # as the file backend names it

# The mock monitor never reads where a resource was declared. The SDK walks the Python stack and
# turns every frame into a file URI on each registration: a quarter of the mocked programs' CPU
# (cProfile of test_odd_values: 25 s of 106). Private SDK API, so only if it is still there.
if callable(getattr(presource, "_get_stack_trace", None)):
    presource._get_stack_trace = source_pb2.StackTrace


@pytest.fixture
def recorder():
    # The active one: `from tests.unit.conftest import RECORDER` imports this file a second time
    # under another name, which installs a second recorder.
    active = pulumi.runtime.settings.get_monitor()
    active.registrations.clear()
    active.mocks.outputs.clear()
    return active


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A certificate and key from the product's own issuer, for the ingress render tests."""
    from tests.unit.ingress_spec import self_signed

    return self_signed(tmp_path_factory.mktemp("tls"))
