#!/usr/bin/env python3
"""Validate vLLM serve arguments and environment with vLLM's own parser, without a server.

Run with the vLLM venv's python (the Pulumi program's venv has no vLLM):

    "$VLLM_VENV/bin/python" toolchain/vllm/check_args.py [--env K=V ...] [--deep] -- <serve args>
    "$VLLM_VENV/bin/python" toolchain/vllm/check_args.py --batch < cases.json

A case is {"name": str, "args": [str, ...], "env": {str: str}, "deep": bool}. --batch reads
a JSON list of cases and writes a JSON list of results; one process pays the vLLM import
(about 5-15 s, mostly torch) once for all cases. A single check writes one JSON object.
Exit status: 0 when every case is ok, 1 otherwise.

Checks, in order (the parse itself takes milliseconds):
1. `make_arg_parser(FlexibleArgumentParser())` from `vllm.entrypoints.launchers.cli_args`
   parses the args; argparse errors (unknown flag, bad choice, bad int, ambiguous
   prefix) are returned as text instead of exiting.
2. `validate_parsed_serve_args(ns)` (vLLM's own pre-start checks).
3. `AsyncEngineArgs.from_cli_args(ns)` when --model is a local directory (for a Hub id it
   would look the model up, which an offline check cannot).
4. Every VLLM_* variable in "env" must be one vLLM knows (`vllm.envs.environment_variables`;
   vLLM itself only logs "Unknown vLLM environment variable detected"), and its value must
   parse with vLLM's own getter.
5. deep=true only: `create_engine_config()` with HF_HUB_OFFLINE=1. Needs --model to be a
   local directory with config.json (weights are not read). Catches unknown
   --quantization, quantization/model mismatch, --max-model-len above the model limit.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

_T0 = time.perf_counter()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import vllm  # noqa: E402
import vllm.envs as vllm_envs  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.entrypoints.launchers.cli_args import (  # noqa: E402
    make_arg_parser,
    validate_parsed_serve_args,
)
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

IMPORT_SECONDS = time.perf_counter() - _T0
_BIND_RE = re.compile(r"^(auto|nobind|[0-9,\-]+(\|[0-9,\-]+)*)$")


class ArgError(ValueError):
    """argparse error text (argparse would print usage and exit 2)."""


class _Parser(FlexibleArgumentParser):
    def error(self, message):  # noqa: D102
        raise ArgError(message)

    def exit(self, status=0, message=None):  # noqa: D102 - e.g. --help
        raise ArgError(message or f"parser exited with status {status}")


def _check_env(env: dict[str, str]) -> list[str]:
    errors = []
    known = vllm_envs.environment_variables
    for k, v in sorted(env.items()):
        if not k.startswith("VLLM_"):
            continue
        if k not in known:
            errors.append(f"unknown vLLM environment variable: {k}")
            continue
        old = os.environ.get(k)
        os.environ[k] = v
        try:
            known[k]()
        except Exception as e:  # noqa: BLE001
            errors.append(f"{k}={v!r}: {type(e).__name__}: {e}")
        finally:
            if old is None:
                del os.environ[k]
            else:
                os.environ[k] = old
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND")
    if bind is not None and not _BIND_RE.match(bind):
        errors.append(f"VLLM_CPU_OMP_THREADS_BIND={bind!r}: expected auto, nobind or CPU lists like 0-3|4-7")
    return errors


def check(args: list[str], env: dict[str, str] | None = None, deep: bool = False) -> dict:
    t = time.perf_counter()
    errors: list[str] = []
    ns = None
    try:
        ns = make_arg_parser(_Parser(prog="vllm serve")).parse_args(list(args))
        validate_parsed_serve_args(ns)
        # from_cli_args resolves a Hub id's files; offline that only works for a local directory.
        if deep or os.path.isdir(str(getattr(ns, "model", "") or "")):
            engine_args = AsyncEngineArgs.from_cli_args(ns)
            if deep:
                engine_args.create_engine_config()
    except ArgError as e:
        errors.append(f"argparse: {e}")
    except Exception as e:  # noqa: BLE001 - report vLLM's own validation text
        msg = str(e).strip()
        errors.append(f"{type(e).__name__}: {msg}")
    errors += _check_env(env or {})
    return {
        "ok": not errors,
        "errors": errors,
        "model": getattr(ns, "model", None) if ns is not None else None,
        "seconds": round(time.perf_counter() - t, 3),
    }


def main(argv: list[str]) -> int:
    if "--batch" in argv:
        cases = json.load(sys.stdin)
        results = []
        for c in cases:
            r = check(c.get("args", []), c.get("env"), bool(c.get("deep")))
            results.append({"name": c.get("name"), **r})
        json.dump(
            {"vllm_version": vllm.__version__, "import_seconds": round(IMPORT_SECONDS, 2), "results": results},
            sys.stdout,
            indent=2,
        )
        print()
        return 0 if all(r["ok"] for r in results) else 1
    env: dict[str, str] = {}
    deep = False
    rest = list(argv)
    while rest and rest[0] != "--":
        a = rest.pop(0)
        if a == "--env" and rest:
            k, _, v = rest.pop(0).partition("=")
            env[k] = v
        elif a == "--deep":
            deep = True
        else:
            print(f"usage: {sys.argv[0]} [--env K=V ...] [--deep] -- <vllm serve args> | --batch", file=sys.stderr)
            return 2
    if rest:
        rest.pop(0)
    r = check(rest, env, deep)
    json.dump({"vllm_version": vllm.__version__, "import_seconds": round(IMPORT_SECONDS, 2), **r}, sys.stdout, indent=2)
    print()
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
