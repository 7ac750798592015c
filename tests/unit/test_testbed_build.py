"""toolchain/testbed/common.py runs build-image.sh: what of this machine's environment reaches it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

COMMON = Path(__file__).resolve().parents[2] / "toolchain" / "testbed" / "common.py"


def _common():
    spec = importlib.util.spec_from_file_location("fimfleet_testbed_common", COMMON)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_image_build_gets_no_pip_setting_of_this_machine(tmp_path, monkeypatch):
    """The image is keyed by its pins; PIP_FIND_LINKS=/opt/wheels from this machine reached the
    chroot's pip (a warning per wheel, and a pip config outside the key)."""
    out = tmp_path / "image"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    seen = tmp_path / "env.json"
    fake = tmp_path / "build-image.sh"
    fake.write_text(f'python3 -c "import json, os; json.dump(dict(os.environ), open({str(seen)!r}, \'w\'))"\n'
                    f'echo {out}\n')
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_INDEX_URL", "http://203.0.113.5/simple")
    monkeypatch.setenv("FIMFLEET_CACHE", str(tmp_path / "cache"))
    common = _common()
    monkeypatch.setattr(common, "BUILD_IMAGE", str(fake))
    assert common.image_dir("vllm") == str(out)
    env = json.loads(seen.read_text())
    assert not [k for k in env if k.startswith("PIP_")]
    assert env["FIMFLEET_CACHE"] == str(tmp_path / "cache")  # the rest of the environment still reaches it
