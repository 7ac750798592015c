"""fimfleet's CrossGuard policy pack: `pulumi preview --policy-pack policy/`.

The engine starts this file through the Python language host (PulumiPolicy.yaml) and
talks to it over gRPC. Stack-config facts are checked on the root `pulumi:pulumi:Stack`
resource, which the program registers before anything else, so they are reported even
when the program later stops on its own config check; facts about what gets deployed
are checked on the resources themselves (rules in policy/rules.py and policy/firewall.py).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: policy.*, components.*

from pulumi_policy import (  # noqa: E402
    EnforcementLevel,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy import policy as sdk  # noqa: E402
from pulumi_policy.proxy import UnknownValueError  # noqa: E402

from policy import rules  # noqa: E402
from policy.server import ENGINE, facts_for, make_servicer, serve  # noqa: E402

NAME = "fimfleet"
STACK_TYPE = "pulumi:pulumi:Stack"
SLA_CHECK_TYPE = "pulumi-python:dynamic/fimfleet:FimSlaCheck"
NODE_TYPE_PREFIX = "fimfleet:node:"


def _report_all(report: ReportViolation, messages: list[str], urn: str | None = None) -> None:
    for m in messages:
        report(m, urn)


def _on_stack(check):
    """A resource policy that judges the stack config, once, on the root Stack resource."""
    def validate(args: ResourceValidationArgs, report: ReportViolation) -> None:
        if args.resource_type == STACK_TYPE:
            _report_all(report, check(facts_for(args.urn)))
    return validate


def _secrets(args: ResourceValidationArgs, report: ReportViolation) -> None:
    facts = facts_for(args.urn)
    if args.resource_type == STACK_TYPE:
        _report_all(report, rules.plaintext_credentials_in_config(facts))
    _report_all(report, rules.plaintext_credentials_in_inputs(args.name, ENGINE.raw(args.urn), facts))


def _ssh(args: ResourceValidationArgs, report: ReportViolation) -> None:
    _report_all(report, rules.ssh_beyond_admin_cidrs(facts_for(args.urn), args.name, args.resource_type, args.props))


def _nodes(resources) -> int:
    return sum(r.resource_type.startswith(NODE_TYPE_PREFIX) for r in resources)


def _sla(args: StackValidationArgs, report: ReportViolation) -> None:
    urn = args.resources[0].urn if args.resources else ""
    checks = [(r.name, r.props.get("thresholds")) for r in args.resources if r.resource_type == SLA_CHECK_TYPE]
    _report_all(report, rules.sla_gate(facts_for(urn), checks, _nodes(args.resources)))


def _hardening(args: StackValidationArgs, report: ReportViolation) -> None:
    urn = args.resources[0].urn if args.resources else ""
    types = [r.resource_type for r in args.resources]
    _report_all(report, rules.prod_hardening(facts_for(urn), types, _nodes(args.resources)))


def _fail_closed(name: str, validate):
    """A rule that raises blocks the preview with a violation instead of failing the whole analysis.

    The SDK's own signals (an input unknown during preview, not applicable) pass through; the message
    names the rule's line, not the exception text, which may quote an input."""
    def run(args, report: ReportViolation) -> None:
        try:
            validate(args, report)
        except (UnknownValueError, sdk._NotApplicableError):  # noqa: SLF001 - the SDK's own control flow
            raise
        except Exception as exc:  # noqa: BLE001 - any rule bug must still block, never pass
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = getattr(args, "name", None) or "the stack"
            report(f"{where}: the {name} policy could not judge it ({type(exc).__name__} at "
                   f"{Path(frame.filename).name}:{frame.lineno}): fix the input it reads there, or the rule "
                   "in policy/.")
    return run


MANDATORY = EnforcementLevel.MANDATORY


def _policy(kind, name: str, level: EnforcementLevel, validate, description: str):
    return kind(name=name, enforcement_level=level, validate=_fail_closed(name, validate), description=description)


POLICIES = [
    _policy(ResourceValidationPolicy, "credentials-are-secret", MANDATORY, _secrets,
            "API keys, SSH keys, TLS keys and cloud tokens are Pulumi secrets, in the stack config and in "
            "every resource input."),
    _policy(ResourceValidationPolicy, "no-self-signed-tls-outside-local", MANDATORY, _on_stack(rules.self_signed_tls),
            "Only the local test stacks serve a self-signed certificate without ingress.allowSelfSigned."),
    _policy(StackValidationPolicy, "sla-gate-on-prod", MANDATORY, _sla,
            "*-prod stacks gate every node on the FIM latency SLA, no looser than the tier's limits."),
    _policy(ResourceValidationPolicy, "metrics-not-public", MANDATORY, _on_stack(rules.metrics_open_to_world),
            "/metrics is never open to 0.0.0.0/0 or ::/0."),
    _policy(ResourceValidationPolicy, "ssh-only-from-admin-cidrs", MANDATORY, _ssh,
            "Cloud firewalls of provisioned instances open SSH only to host.adminCidrs."),
    _policy(StackValidationPolicy, "prod-hardening", EnforcementLevel.ADVISORY, _hardening,
            "*-prod stacks run kernel tuning, the FIM monitor, and more than one node."),
]

if __name__ == "__main__":
    serve(make_servicer(NAME, POLICIES, "fimfleet: secrets, TLS, SLA gate, /metrics and SSH exposure"))
