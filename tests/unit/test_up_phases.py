"""The no-op benchmark's phase split (benchmarks/_up_phases.py) on logs shaped like the CLI's -v=9."""

import json

import pytest

from benchmarks._up_phases import phases


def _log(*events: tuple[float, str]) -> str:
    """JSON lines as the CLI writes them, at the given seconds past 12:00:00."""
    lines = []
    for at, msg in events:
        # Nanoseconds as the CLI prints them, which drops trailing zeros (and a whole zero fraction).
        stamp = f"2026-12-05T12:00:{at:09.6f}123".rstrip("0").rstrip(".") + "Z"
        lines.append(json.dumps({"time": stamp, "level": "INFO", "msg": msg, "v": 9}))
    return "\n".join(lines)


def test_segments_cover_the_whole_run_of_a_program_with_a_dynamic_provider():
    log = _log(
        (0.0, "OTLP receiver started"),
        (0.01, "Handshake: not supported by 'pulumi-language-python'"),  # before the program: not the provider's
        (0.3, "langhost[python].Run(pwd=/w) executing"),
        (0.9, "ResourceMonitor.RegisterResource received: t=pulumi:pulumi:Stack"),
        (0.91, "eventSink::Debug(<{%reset%}>resource registration prepared)"),
        (1.2, "Handshake: not supported by 'pulumi-resource-pulumi-python'"),
        (1.3, "ResourceMonitor.RegisterResource received: t=pulumi-python:dynamic:Resource"),
        (1.31, "ResourceMonitor.RegisterResourceOutputs received: urn=x"),
        (1.6, "SignalAndWaitForShutdown waiting ..."),
        (1.75, "OTLP receiver stopped gracefully"),
    ) + "\nplain stderr of a plugin, no timestamp\n"
    got = phases(log)
    assert got["ms"] == {"cli": 300, "program": 600, "provider": 300, "resources": 400, "teardown": 150}
    assert sum(got["ms"].values()) == got["total_ms"] == 1750
    assert got["registrations"] == 2  # RegisterResourceOutputs is not a registration
    assert got["sdk_debug_lines"] == 1


def test_a_program_without_a_dynamic_provider_has_no_provider_segment():
    got = phases(_log((0.0, "start"), (0.2, "langhost[python].Run( executing"),
                      (0.5, "ResourceMonitor.RegisterResource received: t=pulumi:pulumi:Stack"),
                      (0.55, "SignalAndWaitForShutdown waiting ..."), (0.6, "end")))
    assert got["ms"] == {"cli": 200, "program": 300, "provider": 0, "resources": 50, "teardown": 50}


def test_a_log_without_timestamps_is_refused():
    with pytest.raises(ValueError, match="-v=9"):
        phases("no json here\n")
