"""FIM latency SLA: probe a node through its ingress and gate the deploy on the result.

Modules, each usable on its own:
  stats       nearest-rank percentiles, histogram
  corpus      realistic FIM cases and the prompt built from them
  probe       the streaming FIM probe (ProbeConfig -> run_probe -> ProbeReport), check_sla
  thresholds  SlaThresholds (the SLA's limits, one source) and evaluate
  report      ProbeReport, decode ceiling, readable text
  provider    FimSlaCheck, the Pulumi gate, and its dynamic provider
  __main__    CLI: python -m components.sla --help

Import from the modules. The one name kept here is the provider: stack states written by
every version pickle it as ``components.sla.FimSlaCheckProvider``.
"""

from components.sla.provider import FimSlaCheckProvider

__all__ = ["FimSlaCheckProvider"]
