"""Everything checked before any host is touched, in one place: the stack config's own rules
(config.py), the passphrase guard, and vLLM's own parser on the engine arguments exactly as
the runtime renders them. __main__.py only composes what this returns."""

from __future__ import annotations

import pulumi

from components import config, engine, passphrase, runtime


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


def stack() -> config.StackConfig:
    """The running stack's validated config; raises config.ConfigError listing every problem."""
    cfg = config.from_pulumi()
    passphrase.check_passphrase(pulumi.get_stack(), dry_run=pulumi.runtime.is_dry_run())
    engine_arguments(cfg)
    return cfg
