"""Failures a user can read, for every fimfleet dynamic provider.

Pulumi's dynamic-provider host reports an exception with `traceback.format_exc()`, so an
expected failure (a step that failed, an unreachable host, a changed host key, an SLA
miss) arrived wrapped in a dozen lines of Python traceback. `format_exc` honours
`sys.tracebacklimit` of the provider process: a provider method wrapped with
`readable_failures` sets it to 0 only when it raises `Error`, so the user sees
`fimfleet.Error: <message>` alone, while a real bug (any other exception) keeps its full
traceback. The limit is cleared again at the start of every call. It is set only inside that
host process (`python -m pulumi.dynamic`): elsewhere (a test, a program) a lingering limit of 0
would empty every stack walk, and Pulumi's resource registration walks the stack.
"""

from __future__ import annotations

import functools
import sys


def _in_provider_host() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return getattr(spec, "name", "") == "pulumi.dynamic.__main__"


IN_PROVIDER_HOST = _in_provider_host()


class Error(Exception):
    """An expected failure whose message says what happened and what to do."""


Error.__module__ = "fimfleet"


def readable_failures(method):
    """Wrap a provider method: `Error` is shown without a traceback, anything else with one."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if not IN_PROVIDER_HOST:
            return method(*args, **kwargs)
        sys.__dict__.pop("tracebacklimit", None)
        try:
            return method(*args, **kwargs)
        except Error:
            # The SDK formats the exception right after this frame unwinds; the worker threads
            # of one provider process may race here, which at worst shows one extra traceback.
            sys.tracebacklimit = 0
            raise

    return wrapper


def warn(message: str) -> None:
    """A warning from a provider process: its stderr is shown by the CLI (no engine connection there)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)
