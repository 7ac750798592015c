"""Everything checked before any host is touched, in one place: the stack config's own rules
(config.py), the passphrase guard, and vLLM's own parser on the engine arguments exactly as
the runtime renders them. __main__.py only composes what this returns."""

from __future__ import annotations

import pulumi

from components import config, engine, host, passphrase, runtime


def engine_arguments(cfg: config.StackConfig) -> None:
    """vLLM's parser, wherever the pinned vLLM is installed (FIMFLEET_VLLM_PYTHON): a removed or
    misspelled flag fails the preview with vLLM's own words."""
    if not engine.vllm_python():
        return
    launch = engine.render(cfg, runtime.model_path(cfg))
    try:
        engine.check_with_vllm(launch.args, launch.env)
    except engine.VllmRejected as err:
        raise config.ConfigError([config.Problem("engine", " ".join(launch.args),
                                                 f"{err}. Fix engine.extraArgs / engine.env in the stack config")]) from None


def local_vms(cfg: config.StackConfig) -> None:
    """Each local-vm host's test VM is there: its facts (info.json) hold the SSH port and host key
    that every step uses, so a missing one is a config error here, not a traceback mid-deploy."""
    views = [cfg.for_node(n) for n in cfg.node_names()] + ([cfg.for_gateway()] if cfg.gateway_host else [])
    problems = []
    for view in views:
        if view.host.kind != "local-vm":
            continue
        try:
            host.testbed_connection(view.host.testbed_state)
        except (OSError, ValueError, KeyError, TypeError) as err:
            why = "no test VM there (no info.json)" if isinstance(err, FileNotFoundError) else \
                f"its info.json is not a test VM's ({type(err).__name__})"
            problems.append(config.Problem(
                f"{view.node_key}.testbedState", view.host.testbed_state,
                f"{why}; `./fimfleet demo` starts the local stack's VM and sets this key, "
                "`.venv/bin/python -m scripts.local_fleet` the local-fleet's"))
    if problems:
        raise config.ConfigError(problems)


def stack() -> config.StackConfig:
    """The running stack's validated config; raises config.ConfigError listing every problem."""
    cfg = config.from_pulumi()
    passphrase.check_passphrase(pulumi.get_stack(), dry_run=pulumi.runtime.is_dry_run())
    local_vms(cfg)
    engine_arguments(cfg)
    return cfg
