"""fimfleet's vLLM CPU engine image: built from a real Dockerfile, cached by its pins, pushed by digest.

No base image can be pulled here, so the image starts from the testbed's debootstrap rootfs
(one layer, as `docker import` makes) and installs the engine from the pinned wheelhouse.
buildah builds it natively (chroot isolation, vfs storage): no Docker engine runs on this
machine, and inside the emulated VM the wheelhouse install alone takes about 17 minutes.

    build.py build                      build (or find) the image; prints its content tag
    build.py registry | registry-stop   start (idempotent) or stop Debian's docker-registry on 127.0.0.1
    build.py push [REGISTRY]            push to REGISTRY (default: that registry); prints repo@sha256:...

Cache: $FIMFLEET_CACHE/image/<key>/image.json, keyed by the rendered Dockerfile and health
check, the lock, the wheelhouse listing and the base rootfs's key. A second build is a no-op.
Builds and pushes hold one lock, so two runs at once build once.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from components import engine, host, runtime, templates  # noqa: E402
from components.config import RuntimeConfig  # noqa: E402
from scripts.local_deploy import last_value, run  # noqa: E402

CACHE = Path(os.environ.get("FIMFLEET_CACHE", Path.home() / ".cache" / "fimfleet"))
IMAGE_CACHE = CACHE / "image"
STORAGE = ["--root", str(IMAGE_CACHE / "storage"), "--runroot", str(IMAGE_CACHE / "run"), "--storage-driver", "vfs"]
REPO = "fimfleet/vllm-cpu"
UID = runtime.CONTAINER_UID
REGISTRY_PORT = int(os.environ.get("FIMFLEET_REGISTRY_PORT", "5959"))
REGISTRY = f"127.0.0.1:{REGISTRY_PORT}"
"""The test registry, on loopback only."""
GUEST_REGISTRY = f"10.0.2.2:{REGISTRY_PORT}"
"""The same registry as the test VM reaches it (QEMU user networking; the docker variant's
dockerd allows it over plain HTTP, toolchain/testbed/variants/docker.sh)."""
ROOTFS_EXCLUDES = ("./boot", "./lib/modules", "./usr/lib/modules", "./etc/ssh/ssh_host_*", "./root/.ssh",
                   "./var/cache/apt/archives/*.deb", "./etc/machine-id")
"""What a VM needs and a container must not carry: a kernel, its modules, the testbed's host keys."""


MANIFEST_TYPES = "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"


def say(msg: str) -> None:
    print(f"fimfleet: image: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _progress(what: str, every_s: float = 30):
    """A line every `every_s` while a long quiet step runs (pip -q inside buildah prints nothing)."""
    t0, done = time.monotonic(), threading.Event()

    def beat():
        while not done.wait(every_s):
            say(f"{what}: {time.monotonic() - t0:.0f} s so far")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def context_files(allocator: str = "jemalloc") -> dict[str, str]:
    """The Dockerfile and the health check, rendered: the pure part of the build."""
    dockerfile = templates.render(
        "image/Dockerfile.j2", suite="bookworm", venv=RuntimeConfig().venv_path, uid=UID,
        user=runtime.SERVICE_USER, home=runtime.HOME_DIR, preload=runtime.PRELOAD[allocator],
        packages=["libnuma1", *host.ALLOCATOR_PACKAGES[allocator]], port=8000, entrypoint=engine.ENTRYPOINT_MODULE)
    return {"Dockerfile": dockerfile, "health.py": (templates.FILES / "image" / "health.py").read_text()}


def wheel_listing(wheelhouse: Path) -> str:
    return "".join(sorted(f"{p.name} {p.stat().st_size}\n" for p in wheelhouse.glob("*.whl")))


def image_key(files: dict[str, str], lock: str, wheels: str, base_key: str) -> str:
    h = hashlib.sha256()
    for part in (*(f"{k}\0{v}" for k, v in sorted(files.items())), lock, wheels, base_key):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _inputs() -> tuple[Path, Path, dict]:
    """The base rootfs (built or cached by build-image.sh) and the pinned wheelhouse."""
    base = Path(run(["bash", ROOT / "toolchain/testbed/build-image.sh", "--variant", "base", "--quiet"]).split()[-1])
    wheelhouse = Path(last_value(run([ROOT / "toolchain/vllm/install.sh", "wheelhouse"]), "VLLM_WHEELHOUSE"))
    return base, wheelhouse, json.loads((base / "manifest.json").read_text())


def _locked():
    IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
    f = open(IMAGE_CACHE / ".lock", "w")
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def build() -> dict:
    base, wheelhouse, manifest = _inputs()
    files = context_files()
    key = image_key(files, runtime.LOCK_FILE.read_text(), wheel_listing(wheelhouse), manifest["key"])
    out = IMAGE_CACHE / key / "image.json"
    with _locked():
        if out.exists():
            info = json.loads(out.read_text())
            say(f"cached: {info['tag']} ({key})")
            return info
        ctx = IMAGE_CACHE / key / "context"
        shutil.rmtree(ctx, ignore_errors=True)
        ctx.mkdir(parents=True)
        for name, text in files.items():
            (ctx / name).write_text(text)
        shutil.copy(runtime.LOCK_FILE, ctx / "requirements.lock")
        run(["cp", "-al", str(wheelhouse), str(ctx / "wheelhouse")], capture=False)  # hard links: no second copy
        t0 = time.monotonic()
        say(f"packing the base rootfs {base / 'rootfs'}")
        run(["tar", "-C", str(base / "rootfs"), "--numeric-owner", "-cf", str(ctx / "rootfs.tar"),
             *(f"--exclude={e}" for e in ROOTFS_EXCLUDES), "."], capture=False)
        say("buildah bud (the wheelhouse install is the long step, a few minutes)")
        iid = ctx / "iid"
        # --format docker: the OCI image config has no HEALTHCHECK and buildah would drop it.
        # No --layers: vfs stores every layer as a full copy of the tree, so each stage commits once.
        with _progress("buildah bud"):
            run(["buildah", *STORAGE, "bud", "--isolation", "chroot", "--format", "docker", "--iidfile", str(iid),
                 "-f", str(ctx / "Dockerfile"), str(ctx)], capture=False)
        image_id = iid.read_text().strip()
        tag = f"localhost/{REPO}:{image_id.split(':')[-1][:12]}"  # tagged by the content digest
        run(["buildah", *STORAGE, "tag", image_id, tag], capture=False)
        run(["buildah", *STORAGE, "rmi", "--prune"], capture=False)  # the rootfs stage's untagged image
        info = {"key": key, "id": image_id, "tag": tag, "build_seconds": round(time.monotonic() - t0),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        shutil.rmtree(ctx)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        tmp.rename(out)  # written last: marks the build complete
        say(f"built {tag} in {info['build_seconds']} s")
        return info


def _answers(url: str, accept: str = "*/*") -> bool:
    try:
        _http("GET", url, headers={"Accept": accept})
        return True
    except OSError:  # refused, timed out, or an HTTP error status (urllib's HTTPError is an OSError)
        return False


def registry() -> str:
    """Debian's docker-registry on loopback, its storage in the cache; started once."""
    conf = IMAGE_CACHE / "registry.yml"
    IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
    conf.write_text(templates.render("image/registry.yml.j2", root=str(IMAGE_CACHE / "registry"), addr=REGISTRY))
    if not _answers(f"http://{REGISTRY}/v2/"):
        log = open(IMAGE_CACHE / "registry.log", "a")
        proc = subprocess.Popen(["docker-registry", "serve", str(conf)], stdout=log, stderr=log, start_new_session=True)
        (IMAGE_CACHE / "registry.pid").write_text(str(proc.pid))
        for _ in range(50):
            time.sleep(0.2)
            if _answers(f"http://{REGISTRY}/v2/"):
                break
        else:
            raise SystemExit(f"fimfleet: image: docker-registry did not answer on {REGISTRY}; see {log.name}")
    say(f"registry: http://{REGISTRY}/v2/")
    return REGISTRY


def stop_registry() -> None:
    """Stop the registry `registry()` started (its storage stays in the cache)."""
    pidfile = IMAGE_CACHE / "registry.pid"
    if pidfile.exists():
        try:
            os.kill(int(pidfile.read_text()), 15)
        except (ProcessLookupError, ValueError):
            pass
        pidfile.unlink()


def push(info: dict, dest: str) -> str:
    """Push by content; returns the pull reference `dest/repo@sha256:...`, cached per registry."""
    done = IMAGE_CACHE / info["key"] / f"pushed-{hashlib.sha256(dest.encode()).hexdigest()[:12]}"
    local = dest == REGISTRY
    with _locked():
        # the local registry's storage can be wiped apart from this cache: ask it, not the marker
        if done.exists() and local and not _answers(f"http://{dest}/v2/{REPO}/manifests/{done.read_text().strip()}",
                                                    MANIFEST_TYPES):
            done.unlink()
        if not done.exists():
            dg = IMAGE_CACHE / info["key"] / "digest.tmp"
            with _progress(f"push to {dest}"):
                run(["buildah", *STORAGE, "push", f"--tls-verify={str(not local).lower()}",
                     "--digestfile", str(dg), info["tag"], f"docker://{dest}/{REPO}"], capture=False)
            dg.rename(done)
        return f"{dest}/{REPO}@{done.read_text().strip()}"


def _http(method: str, url: str, body: bytes | None = None, headers: dict | None = None):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read(), r.headers


def _manifest(ref: str) -> tuple[str, str, str, dict]:
    """(registry, repo, API base, manifest) of host/repo@sha256:... in a plain-HTTP registry."""
    host_repo, digest = ref.split("@", 1)
    reg, repo = host_repo.split("/", 1)
    base = f"http://{reg}/v2/{repo}"
    return reg, repo, base, json.loads(_http("GET", f"{base}/manifests/{digest}", headers={"Accept": MANIFEST_TYPES})[0])


def config_digest(ref: str) -> str:
    """The digest of the image config that `ref` names: docker's image id once pulled."""
    return _manifest(ref)[3]["config"]["digest"]


def relabel(ref: str, label: str, value: str) -> str:
    """Another digest of the same image, for a roll without a rebuild: its config with one
    more label, the same layers (a pull fetches two small blobs). `ref`: host/repo@sha256:...
    in a plain-HTTP registry (the test registry). Returns the new host/repo@sha256:..."""
    reg, repo, base, manifest = _manifest(ref)
    conf = json.loads(_http("GET", f"{base}/blobs/{manifest['config']['digest']}")[0])
    conf.setdefault("config", {}).setdefault("Labels", {})[label] = value
    blob = json.dumps(conf, sort_keys=True).encode()
    blob_digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    _, headers = _http("POST", f"{base}/blobs/uploads/", b"")
    location = headers["Location"]
    location = location if location.startswith("http") else f"http://{reg}{location}"
    _http("PUT", f"{location}{'&' if '?' in location else '?'}digest={blob_digest}", blob,
          {"Content-Type": "application/octet-stream"})
    manifest["config"].update(digest=blob_digest, size=len(blob))
    body = json.dumps(manifest, indent=3).encode()
    _, headers = _http("PUT", f"{base}/manifests/{label}-{value}", body, {"Content-Type": manifest["mediaType"]})
    return f"{reg}/{repo}@{headers['Docker-Content-Digest']}"


def push_destination(dest: str) -> str:
    """A push DEST: a registry host[:port], optionally with a namespace (ghcr.io/acme); checked
    by the image grammar that the stack's runtime.image meets, so what is pushed can be pulled."""
    from components import grammar

    registry_host = grammar.image_registry(f"{dest}/{REPO}") == dest.split("/", 1)[0]
    problem = grammar.image(f"{dest}/{REPO}@sha256:{'0' * 64}") if registry_host else "names no registry host"
    if problem or dest.endswith("/"):
        raise SystemExit(f"fimfleet: image: push destination {dest!r}: must be a registry host[:port], optionally "
                         f"with a namespace, like ghcr.io/acme or 127.0.0.1:{REGISTRY_PORT} ({problem or 'trailing /'})")
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cmd", choices=("build", "registry", "registry-stop", "push"))
    p.add_argument("dest", nargs="?", help="push: the registry (host[:port]); default: the local test registry")
    a = p.parse_args(argv)
    if a.cmd == "registry":
        print(registry())
    elif a.cmd == "registry-stop":
        stop_registry()
    elif a.cmd == "build":
        print(build()["tag"])
    else:
        dest = push_destination(a.dest) if a.dest else registry()
        print(push(build(), dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
