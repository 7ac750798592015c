"""Jinja2 rendering of files/ templates; StrictUndefined, so a missing value fails loudly."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from functools import lru_cache
from pathlib import Path

import jinja2

from components import cache

FILES = Path(__file__).resolve().parent.parent / "files"


def bytecode_cache() -> jinja2.BytecodeCache | None:
    """Compiled templates, kept between runs: compiling the ~60 templates every run was a
    quarter of a no-op `up`. Jinja checks each entry against its template's source and the
    Python version, so an edited template is compiled again. The entries are code this process
    runs, so only a directory that this user owns and no one else may write is used; None (no
    cache, only slower) otherwise, or when it cannot be made."""
    directory = cache.root() / "jinja"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.stat()
    except OSError:
        return None
    if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not os.access(directory, os.W_OK):
        return None
    return jinja2.FileSystemBytecodeCache(str(directory))


def make_environment(directory: Path, **options) -> jinja2.Environment:
    """A jinja2 environment over `directory` that fails on any undefined value."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(directory)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        bytecode_cache=bytecode_cache(),
        **options,
    )


def shell_quote(value) -> str:
    """The one quoting rule for every value that reaches a shell: a single POSIX word."""
    return shlex.quote(str(value))


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    # Shell templates use ${#array[@]}; keep jinja comments out of their way.
    env = make_environment(FILES, comment_start_string="{##", comment_end_string="##}")
    env.filters["q"] = shell_quote
    return env


def render(name: str, **values) -> str:
    return environment().get_template(name).render(**values)


def digest(*parts) -> str:
    """Stable short hash of rendered content, used as a trigger."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
