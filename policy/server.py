"""Serves the policy pack like `pulumi_policy.PolicyPack`, keeping two facts the SDK drops.

pulumi-policy 1.21 for Python ignores the stack config that the engine sends with
ConfigureStack, and unwraps secrets before a policy sees a resource's inputs. fimfleet's
policies need both: the config holds the facts that no resource shows (the TLS mode, the
/metrics and admin CIDRs, the tier) and the keys a message tells the user to change, and
"is this key a secret" is a question about the wrapping itself. The servicer below records
them for the policies and otherwise is the SDK's own. It relies on the SDK's private
`_PolicyAnalyzerServicer` at the pinned version; tests/unit/test_policy_pack.py drives it
with real protocol messages, so an SDK bump that breaks it fails there.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from pulumi.runtime.proto import analyzer_pb2_grpc
from pulumi_policy import EnforcementLevel, Policy
from pulumi_policy import policy as sdk

from policy.rules import StackFacts


class _Engine:
    """What the engine told the pack: the stack's facts, and the raw inputs of the resource being analyzed."""

    def __init__(self) -> None:
        self.facts = StackFacts("", {}, frozenset())
        self._raw: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def raw(self, urn: str) -> dict[str, Any]:
        with self._lock:
            return self._raw.get(urn, {})

    def _hold(self, urn: str, props: dict[str, Any] | None) -> None:
        with self._lock:
            if props is None:
                self._raw.pop(urn, None)
            else:
                self._raw[urn] = props


ENGINE = _Engine()


def stack_of(urn: str) -> str:
    """The stack name in a URN (urn:pulumi:STACK::PROJECT::TYPE::NAME)."""
    parts = urn.split(":", 2)
    return parts[2].split("::", 1)[0] if len(parts) == 3 else ""


def facts_for(urn: str = "") -> StackFacts:
    """The stack's facts; the stack name falls back to the URN if ConfigureStack was not called."""
    f = ENGINE.facts
    if not f.stack and urn:
        return StackFacts(stack_of(urn), f.config, f.secret_keys)
    return f


class Servicer(sdk._PolicyAnalyzerServicer):  # noqa: SLF001 - see the module docstring
    def ConfigureStack(self, request, context):  # noqa: N802 - gRPC name
        ENGINE.facts = StackFacts.from_engine(request.stack, dict(request.config), request.config_secret_keys,
                                              Path.cwd())  # the engine starts the pack in the project directory
        return super().ConfigureStack(request, context)

    def Analyze(self, request, context):  # noqa: N802 - gRPC name
        ENGINE._hold(request.urn, json_format.MessageToDict(request.properties))
        try:
            return super().Analyze(request, context)
        finally:
            ENGINE._hold(request.urn, None)


def make_servicer(name: str, policies: list[Policy], description: str) -> Servicer:
    return Servicer(name, "0.0.1", policies, EnforcementLevel.ADVISORY, None, description,
                    None, None, None, None, None)


def serve(servicer: Servicer) -> None:
    """Start the analyzer on a free local port, print the port for the engine (as PolicyPack does), serve."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_receive_message_length", 400 * 1024 * 1024)])
    analyzer_pb2_grpc.add_AnalyzerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sys.stdout.write(f"{port}\n")
    sys.stdout.flush()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop(0)
