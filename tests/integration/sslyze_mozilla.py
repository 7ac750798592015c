"""Scan one TLS server with sslyze and check it against Mozilla's intermediate profile.

Runs with the scanner venv's Python (toolchain/scanners/install.sh), not fimfleet's: sslyze
pins an older cryptography. Prints one JSON object: the profile's issues (an empty map means
compliant), what was accepted, and the scan time.

    python sslyze_mozilla.py HOSTNAME IP PORT
"""

from __future__ import annotations

import json
import sys
import time

from sslyze import Scanner, ServerNetworkLocation, ServerScanRequest, ServerScanStatusEnum
from sslyze.mozilla_tls_profile.tls_config_checker import (
    SCAN_COMMANDS_NEEDED_BY_MOZILLA_CHECKER,
    MozillaTlsConfiguration,
    ServerNotCompliantWithTlsConfiguration,
    TlsConfigurationEnum,
    check_server_against_tls_configuration,
)


def main(hostname: str, ip: str, port: int) -> dict:
    t0 = time.monotonic()
    scanner = Scanner()
    scanner.queue_scans([ServerScanRequest(
        server_location=ServerNetworkLocation(hostname=hostname, port=port, ip_address=ip),
        scan_commands=SCAN_COMMANDS_NEEDED_BY_MOZILLA_CHECKER)])
    (result,) = list(scanner.get_results())
    if result.scan_status != ServerScanStatusEnum.COMPLETED:
        return {"error": f"scan not completed: {result.scan_status} {result.connectivity_error_trace}"}
    profile = MozillaTlsConfiguration.get(TlsConfigurationEnum.MOZILLA_INTERMEDIATE)
    try:
        check_server_against_tls_configuration(result, profile)
        issues = {}
    except ServerNotCompliantWithTlsConfiguration as e:
        issues = e.issues
    scan = result.scan_result
    versions = {name: bool(getattr(scan, name).result.accepted_cipher_suites)
                for name in ("ssl_2_0_cipher_suites", "ssl_3_0_cipher_suites", "tls_1_0_cipher_suites",
                             "tls_1_1_cipher_suites", "tls_1_2_cipher_suites", "tls_1_3_cipher_suites")}
    leaf = scan.certificate_info.result.certificate_deployments[0].received_certificate_chain[0]
    return {
        "issues": issues,
        "accepted_versions": sorted(name for name, accepted in versions.items() if accepted),
        "curves": sorted(c.name for c in scan.elliptic_curves.result.supported_curves or ()),
        "cipher_suites": sorted({s.cipher_suite.openssl_name for name in versions
                                 for s in getattr(scan, name).result.accepted_cipher_suites}),
        "certificate_days": (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days,
        "profile_curves": sorted(profile.tls_curves),
        "scan_seconds": round(time.monotonic() - t0, 2),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
