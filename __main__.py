"""fimfleet: reads the stack config, builds the fleet, exports what editors and operators need."""

import pulumi

from components import config, fleet as fleet_shape, validate
from components.fleet import Fleet

try:
    cfg = validate.stack()
    args = fleet_shape.args_for(cfg)
except config.ConfigError as err:
    # One readable list of every problem, before any resource (or host) is touched.
    pulumi.log.error(str(err))
    raise SystemExit(32) from None

# Behind a gateway, a node the last `up` did not deploy waits only for the canary.
fleet = Fleet("fleet", args, deployed=fleet_shape.deployed_nodes() if args.gateway else None)
node = next(iter(fleet.nodes.values()))  # the canary; the only node of a single-node stack
pulumi.export("endpoint", fleet.endpoint)
pulumi.export("model", node.model)
pulumi.export("tier", cfg.tier.name)
pulumi.export("caPem", fleet.ca_pem)
pulumi.export("memoryPlan", cfg.memory.explain() if cfg.memory else "")
# The plan's KV token capacity beside what vLLM allocated on the node, and the error in %.
pulumi.export("kvCache", node.kv_cache)
# Per user key: editorConfigs.<name>.continueYaml and .cursorNotes, all secret (components/editors.py),
# pointing at the fleet's endpoint (its gateway when it has one).
pulumi.export("editorConfigs", fleet.editor_configs)
pulumi.export("curlSmokeTest", node.curl)
if len(fleet.nodes) > 1 or fleet.gateway:
    # Per node: its own endpoint, its state and its last SLA summary. A node that failed its check
    # is out of the gateway's rotation; `up` failed then, and `pulumi refresh` reports its enable as drift.
    pulumi.export(fleet_shape.NODES_OUTPUT, {n: {"endpoint": svc.endpoint, "state": fleet.states[n],
                                                 "slaSummary": svc.sla.summary if svc.sla else None}
                                             for n, svc in fleet.nodes.items()})
if fleet.fleet_sla is not None:
    pulumi.export("fleetSlaReport", fleet.fleet_sla.summary)
if node.monitoring is not None:
    pulumi.export("prometheusTunnel", node.monitoring.tunnel_command)
    pulumi.export("prometheusUrl", node.monitoring.url)
    pulumi.export("grafanaDashboard", node.monitoring.dashboard_json)
if node.sla is not None:
    pulumi.export("slaReport", node.sla.summary)
    pulumi.export("slaPassed", node.sla.passed)
    # Measured decode tok/s, the memory-bandwidth ceiling and the efficiency (null: not measured).
    pulumi.export("decodeCeiling", node.sla.report.apply(lambda r: (r or {}).get("decode_ceiling")))
