"""The engine image's build inputs (toolchain/image/build.py) and its health check (files/image/health.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from components import engine, host, runtime, templates
from tests.helpers import image_build
from tests.integration.fake_vllm import FakeConfig, FakeVllm

build = image_build()

HEALTH = templates.FILES / "image" / "health.py"


def test_the_image_runs_the_engine_as_the_systemd_runtime_does_but_not_as_root():
    df = build.context_files()["Dockerfile"]
    assert f"USER {build.UID}:{build.UID}" in df and build.UID != 0
    assert f'"-m", "{engine.ENTRYPOINT_MODULE}"]' in df.splitlines()[-1]
    assert f"LD_PRELOAD={runtime.PRELOAD['jemalloc']}" in df
    assert " ".join(host.ALLOCATOR_PACKAGES["tcmalloc"]) in build.context_files("tcmalloc")["Dockerfile"]
    assert "--no-index" in df and "-r /tmp/requirements.lock" in df  # the pinned wheelhouse, nothing else
    assert "CMD [\"/opt/fimfleet/vllm/bin/python\", \"/usr/local/lib/fimfleet/health.py\"]" in df


def test_the_cache_key_follows_every_input():
    files = build.context_files()
    k = build.image_key(files, "lock", "a.whl 1\n", "base1")
    assert k == build.image_key(dict(files), "lock", "a.whl 1\n", "base1")
    changed = [build.image_key(files, "lock2", "a.whl 1\n", "base1"), build.image_key(files, "lock", "a.whl 2\n", "base1"),
               build.image_key(files, "lock", "a.whl 1\n", "base2"),
               build.image_key({**files, "health.py": files["health.py"] + "#"}, "lock", "a.whl 1\n", "base1"),
               build.image_key(build.context_files("tcmalloc"), "lock", "a.whl 1\n", "base1")]
    assert len({k, *changed}) == 6


def test_the_wheel_listing_has_names_and_sizes(tmp_path):
    (tmp_path / "b-1.whl").write_bytes(b"xx")
    (tmp_path / "a-1.whl").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("not a wheel")
    assert build.wheel_listing(tmp_path) == "a-1.whl 1\nb-1.whl 2\n"


def health(port: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTH)], env={"FIMFLEET_ENGINE_PORT": str(port)},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mode, tokens, healthy, why", [
    ("ok", None, True, ""),
    ("error", None, False, "HTTPError"),
    ("error_midstream", 2, False, "error"),
    ("ok", 0, False, "no token streamed"),
    ("ok", 3, False, "3 tokens completed"),
])
def test_health_is_one_streamed_token(mode, tokens, healthy, why):
    with FakeVllm(FakeConfig(api_keys=(), mode=mode, tokens=tokens)) as fake:
        r = health(fake.port)
        assert (r.returncode == 0) is healthy, r.stderr
        assert why in r.stderr
        if healthy:
            req = fake.completion_requests()[-1]["body"]
            assert req["max_tokens"] == 1 and req["stream"] is True and req["model"] == "fake-qwen"


def test_health_fails_when_nothing_listens():
    with FakeVllm(FakeConfig(api_keys=())) as fake:
        port = fake.port
    r = health(port)
    assert r.returncode == 1 and "unhealthy: URLError" in r.stderr


@pytest.mark.parametrize("dest", ["ghcr.io/acme", "127.0.0.1:5959", "registry.example.com:5000/team/sub", "localhost:5000"])
def test_a_push_destination_that_can_be_pulled_is_accepted(dest):
    assert build.push_destination(dest) == dest


@pytest.mark.parametrize("dest", ["ghcr.io/Acme", "acme", "ghcr.io/acme/", "ghcr.io;rm -rf /", "ghcr.io/a b",
                                  "ghcr.io:99999x", "$(id).io", ""])
def test_a_push_destination_outside_the_image_grammar_is_one_clear_error(dest):
    with pytest.raises(SystemExit) as e:
        build.push_destination(dest)
    assert f"push destination {dest!r}" in str(e.value) and "like ghcr.io/acme" in str(e.value)
