"""Run inside the vLLM interpreter: parse engine arguments with vLLM's own server parser.

Reads JSON on stdin, either {"args": [...], "env": {...}} or {"cases": [those]}, and
prints one JSON line: {"ok": bool, "error": str} (or {"results": [...]}). Unknown
VLLM_* environment variables are rejected too: vLLM ignores them silently, which is
how OpenVINO-era runbooks keep "working" while doing nothing.
"""

import contextlib
import io
import json
import sys


class Rejected(Exception):
    pass


def check(parser_factory, known_env, validate, case):
    parser = parser_factory()

    def error(message):
        raise Rejected(message)

    parser.error = error
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            ns = parser.parse_args(list(case["args"]))
            validate(ns)
    except (Rejected, ValueError, TypeError, SystemExit) as e:
        return {"ok": False, "error": f"vLLM rejected the arguments: {e}"}
    unknown = sorted(k for k in case.get("env", {}) if k.startswith("VLLM_") and k not in known_env)
    if unknown:
        return {"ok": False, "error": f"vLLM does not know the environment variable(s) {', '.join(unknown)}"}
    return {"ok": True, "error": ""}


def main():
    request = json.load(sys.stdin)
    with contextlib.redirect_stdout(io.StringIO()):
        import vllm.envs as envs
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

    def factory():
        return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))

    known = set(envs.environment_variables)
    cases = request.get("cases", [request])
    results = [check(factory, known, validate_parsed_serve_args, c) for c in cases]
    print(json.dumps({"results": results} if "cases" in request else results[0]))


if __name__ == "__main__":
    main()
