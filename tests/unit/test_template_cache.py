"""Compiled templates are kept between runs (compiling them all was a quarter of a no-op `up`),
but never stand in for a template that changed, are never loaded from a directory others may
write (they are code), and a cache that cannot be used only costs time."""

from __future__ import annotations

import os

from components import templates


def render(directory, name="t.j2", **values) -> str:
    return templates.make_environment(directory).get_template(name).render(**values)


def test_a_compiled_template_is_kept_under_the_fimfleet_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FIMFLEET_CACHE", str(tmp_path / "cache"))
    (tmp_path / "t.j2").write_text("port {{ port }}\n")
    assert render(tmp_path, port=443) == "port 443\n"
    kept = list((tmp_path / "cache" / "jinja").iterdir())
    assert len(kept) == 1 and kept[0].stat().st_size > 0
    assert (tmp_path / "cache" / "jinja").stat().st_mode & 0o777 == 0o700
    # A second environment (the next run) loads it instead of compiling: it still renders right.
    assert render(tmp_path, port=8443) == "port 8443\n"


def test_an_edited_template_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("FIMFLEET_CACHE", str(tmp_path / "cache"))
    (tmp_path / "t.j2").write_text("listen {{ port }};\n")
    assert render(tmp_path, port=443) == "listen 443;\n"
    (tmp_path / "t.j2").write_text("listen {{ port }} ssl;\n")
    assert render(tmp_path, port=443) == "listen 443 ssl;\n"


def test_a_cache_that_cannot_be_written_still_renders(tmp_path, monkeypatch):
    blocked = tmp_path / "ro"
    blocked.mkdir()
    blocked.chmod(0o500)
    monkeypatch.setenv("FIMFLEET_CACHE", str(blocked))
    (tmp_path / "t.j2").write_text("{{ x }}\n")
    try:
        if os.access(blocked, os.W_OK):  # root ignores the mode: a file where the directory should be
            blocked.chmod(0o700)
            (blocked / "jinja").write_text("not a directory")
        assert templates.bytecode_cache() is None
        assert render(tmp_path, x="ok") == "ok\n"
    finally:
        blocked.chmod(0o700)


def test_a_cache_directory_others_may_write_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("FIMFLEET_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "jinja").mkdir(parents=True)
    (tmp_path / "cache" / "jinja").chmod(0o777)
    assert templates.bytecode_cache() is None
    (tmp_path / "t.j2").write_text("{{ x }}\n")
    assert render(tmp_path, x="ok") == "ok\n"
    assert not list((tmp_path / "cache" / "jinja").iterdir())
    (tmp_path / "cache" / "jinja").chmod(0o700)
    assert templates.bytecode_cache() is not None
