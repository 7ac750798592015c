"""The engine image, built for real (buildah, from the pinned wheelhouse) and pushed to a real registry.

`./fimfleet image build` builds it once (cached by its pins: a fresh machine spends a few
minutes here, a warm one seconds). Checked: a second build is a no-op; the image's own
config (user, entry point, health check, allocator) read back by buildah; its venv holds
exactly the lock; Debian's docker-registry serves it by the digest `push` printed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from components import engine, runtime
from tests.helpers import image_build

ROOT = Path(__file__).resolve().parents[2]
build = image_build()

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

MANIFEST_TYPES = build.MANIFEST_TYPES


def image_cmd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "fimfleet"), "image", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=3000)


def buildah(*args: str) -> str:
    return subprocess.run(["buildah", *build.STORAGE, *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def image():
    first = image_cmd("build")
    assert first.returncode == 0, first.stderr[-3000:]
    yield first.stdout.strip().splitlines()[-1]
    build.stop_registry()


def test_a_second_build_is_a_no_op(image):
    again = image_cmd("build")
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.strip().splitlines()[-1] == image
    assert "fimfleet: image: cached:" in again.stderr and "STEP" not in again.stderr


def test_the_tag_is_the_content_digest(image):
    info = json.loads(buildah("inspect", "--type", "image", image))
    assert image.rsplit(":", 1)[1] == info["FromImageID"][:12]


def test_the_image_config_is_what_the_runtime_expects(image):
    cfg = json.loads(buildah("inspect", "--type", "image", image))["Docker"]["config"]
    assert cfg["User"] == f"{build.UID}:{build.UID}"
    assert cfg["Entrypoint"] == [f"{build.RuntimeConfig().venv_path}/bin/python", "-m", engine.ENTRYPOINT_MODULE]
    assert f"LD_PRELOAD={runtime.PRELOAD['jemalloc']}" in cfg["Env"]
    assert cfg["Healthcheck"]["Test"] == ["CMD", f"{build.RuntimeConfig().venv_path}/bin/python",
                                          "/usr/local/lib/fimfleet/health.py"]


def test_the_image_holds_the_locked_engine_and_its_libraries(image):
    ctr = buildah("from", "--pull-never", image).strip()
    try:
        mnt = Path(buildah("mount", ctr).strip())
        venv = mnt / build.RuntimeConfig().venv_path.lstrip("/")
        freeze = subprocess.run(["chroot", str(mnt), f"{build.RuntimeConfig().venv_path}/bin/pip", "freeze", "--all"],
                                capture_output=True, text=True, check=True).stdout

        def pins(text: str) -> set[str]:
            return {ln.strip().lower().replace("_", "-") for ln in text.splitlines() if "==" in ln and not ln.startswith("#")}
        assert pins(runtime.LOCK_FILE.read_text()) == pins(freeze)  # names and versions, nothing more
        assert (mnt / runtime.PRELOAD["jemalloc"].lstrip("/")).exists()
        assert (venv / "bin" / "python").exists() and not list((mnt / "boot").glob("vmlinuz*"))
        assert not list((mnt / "etc" / "ssh").glob("ssh_host_*"))  # never the testbed's host keys
        passwd = (mnt / "etc" / "passwd").read_text()
        assert f"{runtime.SERVICE_USER}:x:{build.UID}:{build.UID}:" in passwd
    finally:
        buildah("rm", ctr)


def test_the_registry_serves_the_image_by_the_digest_push_printed(image):
    pushed = image_cmd("push")
    assert pushed.returncode == 0, pushed.stderr[-2000:]
    ref = pushed.stdout.strip().splitlines()[-1]
    assert ref.startswith(f"{build.REGISTRY}/{build.REPO}@sha256:")
    digest = ref.split("@", 1)[1]
    url = f"http://{build.REGISTRY}/v2/{build.REPO}/manifests/{digest}"
    r = httpx.get(url, headers={"Accept": MANIFEST_TYPES})
    assert r.status_code == 200 and r.headers["Docker-Content-Digest"] == digest
    config_digest = r.json()["config"]["digest"]
    assert config_digest == "sha256:" + json.loads(buildah("inspect", "--type", "image", image))["FromImageID"]
    # a digest that was never pushed is not served: the reference pins the bytes
    wrong = digest[:-4] + ("0000" if not digest.endswith("0000") else "1111")
    assert httpx.get(url.replace(digest, wrong), headers={"Accept": MANIFEST_TYPES}).status_code == 404
