"""What the fleet benchmarks share: native vLLM engines, each behind its own real node ingress,
behind a real gateway (components/ingress_render.py with a FleetUpstream) whose rotation the
real drain and enable scripts change (components/gateway_render.py), as tests/integration/
test_gateway.py runs them. Imported as ``benchmarks._fleet`` with the repository root on sys.path."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable

from benchmarks._engine import API_KEY, Engine
from components import gateway_render
from components.gateway_render import FLEET_TLS_NAME, FleetUpstream, GatewayPaths, Member
from components.tls import issue
from tests.helpers import free_port
from tests.integration.nginx_harness import SERVER_NAME, Nginx, write_tls

RATE = 1000
"""Requests a second per key at every nginx, and the burst: the benchmark measures the engines."""


class NativeFleet:
    """Nodes node0..nodeN-1 (one engine and one ingress each) on 127.0.0.1; gateways on demand."""

    def __init__(self, work: Path, engines: list[Engine], keys: dict[str, str], log: Callable[[str], None]):
        self.work, self.engines, self.keys, self.log = work, engines, keys, log
        self.nodes: list[Nginx] = []
        self.gateways: list[Nginx] = []
        self.cas: list[str] = []
        self.node_ca: list[Path] = []

    @property
    def members(self) -> tuple[Member, ...]:
        return tuple(Member(f"node{i}", "127.0.0.1", ngx.https_port) for i, ngx in enumerate(self.nodes))

    def start(self) -> "NativeFleet":
        for e in self.engines:
            e.start()
        for e in self.engines:
            e.wait_healthy()
        for i, e in enumerate(self.engines):
            d = self.work / f"node{i}"
            d.mkdir()
            tls = write_tls(d, issue(SERVER_NAME, [SERVER_NAME, FLEET_TLS_NAME], ["127.0.0.1"], days=1))
            self.cas.append(tls.ca.read_text())
            self.node_ca.append(tls.ca)
            self.nodes.append(Nginx(d / "nginx", tls, e.port, node=f"node{i}", api_keys=self.keys,
                                    upstream_api_key=API_KEY, rate_per_second=RATE, burst=RATE).start())
        return self

    def gateway(self, name: str, affinity: bool = True) -> "Gateway":
        """A gateway over every node, all in rotation, as the gateway's own step leaves it."""
        d = self.work / name
        d.mkdir()
        (d / "nodes-ca.pem").write_text("".join(self.cas))
        paths = GatewayPaths(servers=str(d / "gateway.servers"), state_dir=str(d / "state"), lock=str(d / "lock"))
        Path(paths.enabled_dir).mkdir(parents=True)
        for m in self.members:
            (Path(paths.enabled_dir) / m.name).touch()
        fleet = FleetUpstream(members=self.members, paths=paths, ca_path=str(d / "nodes-ca.pem"), affinity=affinity,
                              member_port=free_port())  # each gateway on this machine its own
        Path(paths.generator).write_text(gateway_render.servers_script(fleet))
        Path(paths.generator).chmod(0o755)
        subprocess.run([paths.generator], check=True, timeout=30)
        tls = write_tls(d, issue(SERVER_NAME, [SERVER_NAME], ["127.0.0.1"], days=1))
        ngx = Nginx(d / "nginx", tls, 1, node="gateway", api_keys=self.keys, rate_per_second=RATE, burst=RATE,
                    fleet=fleet).start()
        self.gateways.append(ngx)
        return Gateway(ngx, tls.ca, paths)

    def stop(self) -> None:
        for ngx in [*self.gateways, *self.nodes]:
            ngx.stop()
        for e in self.engines:
            e.stop()


class Gateway:
    """One running gateway: its nginx, the CA its clients verify and the rotation's paths."""

    def __init__(self, nginx: Nginx, ca: Path, paths: GatewayPaths):
        self.nginx, self.ca, self.paths = nginx, ca, paths

    def url(self, path: str) -> str:
        return self.nginx.url(path)

    def member(self, node: str, enabled: bool, drain_timeout_s: int = 60) -> str:
        """The real drain (enabled=False) or enable step (it changes a marker; nginx does not reload)."""
        script = gateway_render.member_script(node, enabled, self.nginx.spec.base, self.paths, drain_timeout_s)
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                              timeout=drain_timeout_s + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"the {'enable' if enabled else 'drain'} step of {node} failed:\n"
                               f"{proc.stdout}{proc.stderr}")
        return proc.stdout
