"""The Pulumi gate: ``FimSlaCheck`` (a dynamic resource) and its ``FimSlaCheckProvider``.

create/update run the probe and raise ``SlaViolationError`` (whose message is the
readable report) when the SLA is missed; ``diff`` re-runs the check only when the
upstream ``trigger`` or a probe input changes; refresh and destroy send no traffic.

State contract: Pulumi pickles the provider into every stack's state with dill, by
reference to ``components.sla.FimSlaCheckProvider`` (module and class name only), and
loads it from there to refresh or destroy. That name must stay importable, the class
must construct with no arguments, and its methods must accept the outputs of every
earlier version (tests/data/sla_state_v1.json holds a state from before this package).
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any, Mapping, Optional

import pulumi
import pulumi.dynamic
from pulumi.runtime.rpc import UNKNOWN as _PULUMI_UNKNOWN

from components.sla.probe import ProbeConfig, check_sla
from components.errors import readable_failures
from components.sla.report import SlaViolationError
from components.sla.thresholds import SlaThresholds, as_int

_SAMPLE_KEYS = ("samples", "warmup", "concurrency", "max_tokens")
_CEILING_KEYS = ("bandwidth_bytes_per_s", "active_weight_bytes_per_token")
_INPUT_KEYS = ("endpoint", "api_key", "ca_pem", "model", "thresholds", *_SAMPLE_KEYS, "trigger", "ceiling")
_OUTPUT_ONLY_KEYS = ("report", "summary", "passed", "api_key_sha256")
# The key is compared by its hash. The ceiling only annotates the report: a host measured anew
# changes the trigger anyway, and an upgrade that adds it does not measure again.
_DIFF_KEYS = tuple(k for k in _INPUT_KEYS if k not in ("api_key", "ceiling"))
_DEFAULTS = ProbeConfig(endpoint="http://unused", model="unused")
_MAX_PER_REQUEST_IN_STATE = 100  # keeps stack state small for large sample counts


def _key_hash(api_key: Any) -> Optional[str]:
    if api_key is None or api_key == "":
        return None
    return hashlib.sha256(b"fimfleet-sla-key:" + str(api_key).encode()).hexdigest()


def _is_unknown(value: Any) -> bool:
    # During preview a computed input (e.g. the trigger, which hashes the host identity) arrives
    # as the UNKNOWN sentinel, an Unknown object (dynamic providers' check) or an Output.
    if isinstance(value, (pulumi.Output, pulumi.output.Unknown)) or value == _PULUMI_UNKNOWN:
        return True
    if isinstance(value, dict):
        return any(_is_unknown(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_is_unknown(v) for v in value)
    return False


def _normalize_props(props: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Canonical inputs (+ failures as (property, reason)).

    Pulumi sends numbers as floats; everything is coerced to a canonical form so that
    ``diff`` compares like with like. Unknown (preview) values pass through untouched.
    """
    failures: list[tuple[str, str]] = []
    out: dict[str, Any] = {}
    for key in props:
        if key not in _INPUT_KEYS and key not in _OUTPUT_ONLY_KEYS and key != "__provider":
            failures.append((key, f"unknown input; valid inputs: {', '.join(_INPUT_KEYS)}"))
    for key in ("endpoint", "model", "trigger"):
        v = props.get(key)
        if _is_unknown(v):
            out[key] = v
        elif not isinstance(v, str) or not v:
            failures.append((key, f"{key} is required (a non-empty string)"))
        else:
            out[key] = v
    endpoint = out.get("endpoint")
    if isinstance(endpoint, str) and not _is_unknown(endpoint) and not endpoint.startswith(("http://", "https://")):
        failures.append(("endpoint", "endpoint must start with https:// (or http://)"))
    for key in ("api_key", "ca_pem"):
        if props.get(key) not in (None, ""):
            out[key] = props[key]
    if "api_key" not in out:
        failures.append(("api_key", "api_key is required (pass it as a secret)"))

    raw_th = props.get("thresholds")
    if _is_unknown(raw_th):
        out["thresholds"] = raw_th
    else:
        try:
            out["thresholds"] = SlaThresholds.from_dict(raw_th).to_dict()
        except ValueError as exc:
            failures.append(("thresholds", str(exc)))
            out["thresholds"] = {}
    for key in _SAMPLE_KEYS:
        v = props.get(key)
        if _is_unknown(v):
            out[key] = v
            continue
        try:
            v = getattr(_DEFAULTS, key) if v is None else as_int(v, key)
        except ValueError as exc:
            failures.append((key, str(exc)))
            continue
        lo = 0 if key == "warmup" else 1
        if v < lo:
            failures.append((key, f"{key} must be >= {lo}, got {v}"))
        out[key] = v
    ceiling = props.get("ceiling")
    if _is_unknown(ceiling):
        out["ceiling"] = ceiling
    elif not isinstance(ceiling, Mapping) and ceiling is not None:
        failures.append(("ceiling", f"ceiling must be a mapping of {', '.join(_CEILING_KEYS)}, got {ceiling!r}"))
    elif ceiling:
        values = {k: ceiling.get(k) for k in _CEILING_KEYS}
        if all(v is None for v in values.values()):
            pass  # nothing measured (a runtime without the bandwidth step): no ceiling line
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values.values()):
            out["ceiling"] = {k: float(v) for k, v in values.items()}
        else:
            failures.append(("ceiling", f"ceiling needs positive numbers {', '.join(_CEILING_KEYS)}, got {ceiling!r}"))
    if isinstance(out.get("max_tokens"), int) and out["max_tokens"] < 2 and \
            isinstance(out.get("thresholds"), dict):
        for name in ("min_decode_tokens_per_s", "min_decode_ceiling_fraction"):
            if out["thresholds"].get(name):
                failures.append(("max_tokens", f"{name} needs max_tokens >= 2"))
    return out, failures


def _config_from_props(props: Mapping[str, Any]) -> tuple[ProbeConfig, SlaThresholds]:
    norm, failures = _normalize_props(props)
    if failures:
        raise ValueError("invalid FimSlaCheck inputs: " + "; ".join(f"{p}: {r}" for p, r in failures))
    cfg = ProbeConfig(endpoint=norm["endpoint"], model=norm["model"], api_key=norm.get("api_key"),
                      ca_pem=norm.get("ca_pem"), **{k: norm[k] for k in _SAMPLE_KEYS}, **norm.get("ceiling", {}))
    problems = cfg.validate()
    if problems:
        raise ValueError("invalid FimSlaCheck inputs: " + "; ".join(problems))
    return cfg, SlaThresholds.from_dict(norm["thresholds"])


def changed_inputs(olds: Mapping[str, Any], news: Mapping[str, Any]) -> list[str]:
    """Inputs whose change re-runs the check (what ``FimSlaCheckProvider.diff`` uses).

    ``olds`` are the previous outputs (which echo the normalized inputs plus
    ``api_key_sha256``), ``news`` the new inputs. Outputs such as ``report``, and inputs
    that earlier versions had and this one dropped, never count, so an unchanged stack
    does not re-run the probe. Unknown values (during preview) count as changed.
    """
    old_n, _ = _normalize_props({k: v for k, v in olds.items() if k in _INPUT_KEYS})
    new_n, _ = _normalize_props({k: v for k, v in news.items() if k in _INPUT_KEYS})
    changed = [k for k in _DIFF_KEYS if _is_unknown(new_n.get(k)) or old_n.get(k) != new_n.get(k)]
    new_key = news.get("api_key")
    old_hash = olds.get("api_key_sha256")
    if old_hash is None and olds.get("api_key") is not None:
        old_hash = _key_hash(olds.get("api_key"))
    if _is_unknown(new_key) or old_hash != _key_hash(new_key):
        changed.append("api_key")
    return changed


class FimSlaCheckProvider(pulumi.dynamic.ResourceProvider):
    """Dynamic provider behind ``FimSlaCheck``. Holds no state: dill stores only its name.

    Every method works when called directly (tests do; Pulumi mocks never run
    dynamic providers). The HTTP session is created inside ``run_probe`` per call.
    """

    # Pickled by this name (see the module docstring); the package re-exports the class.
    __module__ = "components.sla"

    def check(self, _olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.CheckResult:
        norm, failures = _normalize_props(news)
        return pulumi.dynamic.CheckResult(norm, [pulumi.dynamic.CheckFailure(p, r) for p, r in failures])

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.DiffResult:
        changed = changed_inputs(olds, news)
        return pulumi.dynamic.DiffResult(changes=bool(changed), replaces=[], stables=[],
                                         delete_before_replace=False)

    def _probe(self, props: Mapping[str, Any]) -> dict[str, Any]:
        cfg, thresholds = _config_from_props(props)
        result = check_sla(cfg, thresholds)
        report = result.report.to_dict(max_per_request=_MAX_PER_REQUEST_IN_STATE)
        report["violations"] = [v.to_dict() for v in result.violations]
        report["thresholds"] = thresholds.to_dict()
        if not result.passed:
            raise SlaViolationError("FIM latency SLA missed; the deploy is not done.\n" + result.summary, report)
        norm, _ = _normalize_props(props)
        outs = {k: v for k, v in norm.items() if k != "api_key"}
        outs.update(api_key_sha256=_key_hash(norm.get("api_key")), report=report, summary=result.summary,
                    passed=True)
        return outs

    @readable_failures
    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        return pulumi.dynamic.CreateResult(id_=f"fimsla-{uuid.uuid4().hex[:12]}", outs=self._probe(props))

    @readable_failures
    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.UpdateResult:
        return pulumi.dynamic.UpdateResult(outs=self._probe(news))

    def read(self, id_: str, props: dict[str, Any]) -> pulumi.dynamic.ReadResult:
        # Refresh keeps the recorded result; it must not send traffic.
        return pulumi.dynamic.ReadResult(id_, props)

    def delete(self, _id: str, _props: dict[str, Any]) -> None:
        return None


class FimSlaCheck(pulumi.dynamic.Resource, module="fimfleet", name="FimSlaCheck"):
    """Post-deploy FIM latency gate (type ``pulumi-python:dynamic/fimfleet:FimSlaCheck``).

    create/update probe ``endpoint`` and fail the deploy with the readable report when
    the SLA is missed. The probe re-runs only when ``trigger`` or a probe input
    (endpoint, model, thresholds, sample settings, ca_pem, api_key) changes. ``ceiling``
    ({bandwidth_bytes_per_s, active_weight_bytes_per_token}) adds the decode ceiling to the report.

    Outputs: ``report`` (dict, see ``ProbeReport.to_dict``; plus ``violations`` and
    ``thresholds``), ``summary`` (text with the TTFT histogram), ``passed`` (bool),
    the normalized inputs (without the key) and ``api_key_sha256`` (secret).
    """

    report: pulumi.Output[dict]
    summary: pulumi.Output[str]
    passed: pulumi.Output[bool]
    api_key_sha256: pulumi.Output[str]

    def __init__(
        self,
        resource_name: str,
        *,
        endpoint: pulumi.Input[str],
        api_key: pulumi.Input[str],
        model: pulumi.Input[str],
        trigger: pulumi.Input[str],
        thresholds: SlaThresholds,
        ca_pem: Optional[pulumi.Input[str]] = None,
        samples: Optional[pulumi.Input[int]] = None,
        warmup: Optional[pulumi.Input[int]] = None,
        concurrency: Optional[pulumi.Input[int]] = None,
        max_tokens: Optional[pulumi.Input[int]] = None,
        ceiling: Optional[pulumi.Input[dict]] = None,
        opts: Optional[pulumi.ResourceOptions] = None,
    ) -> None:
        if not isinstance(thresholds, SlaThresholds):
            raise TypeError(f"thresholds must be a SlaThresholds, got {type(thresholds).__name__}")
        props: dict[str, Any] = {
            "endpoint": endpoint,
            "api_key": pulumi.Output.secret(api_key),
            "model": model,
            "trigger": trigger,
            "thresholds": thresholds.to_dict(),
            "ca_pem": ca_pem,
            "samples": samples,
            "warmup": warmup,
            "concurrency": concurrency,
            "max_tokens": max_tokens,
            "ceiling": ceiling,
            # outputs
            "report": None,
            "summary": None,
            "passed": None,
            "api_key_sha256": None,
        }
        secret_outs = pulumi.ResourceOptions(additional_secret_outputs=["api_key", "api_key_sha256"])
        super().__init__(FimSlaCheckProvider(), resource_name, props, pulumi.ResourceOptions.merge(opts, secret_outs))
