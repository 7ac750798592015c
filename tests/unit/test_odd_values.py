"""Every leaf of every shipped stack file replaced by odd values (nulls, wrong types, empties,
huge numbers, shell text), and every key of every section set to them on the headline stack
and the fleet: what __main__.py runs before any resource (validate.stack's config and test-VM
checks, then fleet.args_for) either refuses it with one ConfigError, or the fleet builds under
mocks. Anything else is a traceback a user would see.

Found by this sweep: `ingress.tls` set to null passed validation as None and failed in the
ingress with a KeyError; a testbedState whose VM was gone failed with a FileNotFoundError."""

from __future__ import annotations

import copy
import json
from dataclasses import fields
from pathlib import Path

import pulumi
import pytest
import yaml

from components import config, validate
from components.fleet import Fleet, args_for
from tests.helpers import API_KEY, TINY_CONFIG, fake_testbed, set_path, ssh_key, vm_state_keys

STACKS = Path(__file__).resolve().parents[2] / "stacks"
ODD = [None, True, -1, 0, 1.5, 10**30, "", "x" * 300, [], {"a": {"b": 1}}, "$(id)\n", "-1", "1e3", "--flag"]
SECRET = frozenset({"fimfleet:sshPrivateKey", "fimfleet:apiKeys", "hcloud:token"})
EVERY_KEY_ON = ("Pulumi.cpu-epyc-prod.yaml", "Pulumi.local-fleet.yaml")
"""Stacks on which every key of every section (most are not in the files) is set to each odd value."""
CLOUD = ("aws", "hcloud")
"""Cloud stacks: checked up to args_for; their fleets need the instance mocks of test_cloud.py."""


def leaves(obj, path=()):
    """Paths to every scalar (and every empty list or map) in a stack file's value."""
    if isinstance(obj, (dict, list)) and obj:
        for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            yield from leaves(v, path + (k,))
    else:
        yield path


def replaced(value, path, odd):
    if not path:
        return odd
    value = copy.deepcopy(value)
    at = value
    for p in path[:-1]:
        at = at[p]
    at[path[-1]] = odd
    return value


def base_values(stack: Path, root: Path) -> dict[str, str]:
    """The stack file as Pulumi hands it to the program, with throwaway secrets and, for a
    local stack, a tiny model and fake test VMs where the demo would fill them in."""
    doc = yaml.safe_load(stack.read_text())["config"]
    if doc.get("fimfleet:tier") == "local-vm":
        root.mkdir()
        (root / "model").mkdir()
        (root / "model" / "config.json").write_text(json.dumps(TINY_CONFIG))
        set_path(doc, "fimfleet:model.localPath", str(root / "model"))
        for path, state in vm_state_keys(doc, str(root / "vm")).items():
            set_path(doc, f"fimfleet:{path}", str(fake_testbed(Path(state))))
    values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in doc.items()}
    values.update({"fimfleet:sshPrivateKey": ssh_key(), "fimfleet:apiKeys": json.dumps({"alice": API_KEY})})
    if "hcloud" in stack.name:
        values["hcloud:token"] = "t" * 64
    return values


def variants(stack: Path, base: dict[str, str]):
    """(where, values): each leaf of the file, and on EVERY_KEY_ON each section key, set to each odd value."""
    for key, value in base.items():
        if key in SECRET:
            continue
        parsed = json.loads(value) if value[:1] in "[{" else value
        for path in leaves(parsed):
            for odd in ODD:
                changed = replaced(parsed, path, odd)
                yield (f"{stack.name}: {key}{''.join(f'.{p}' for p in path)} = {odd!r:.40}",
                       {**base, key: changed if isinstance(changed, str) else json.dumps(changed)})
    if stack.name not in EVERY_KEY_ON:
        return
    for section, cls in config.SECTIONS.items():
        current = json.loads(base.get(f"fimfleet:{section}", "{}"))
        for f in fields(cls):
            for odd in ODD:
                key = config.config_key(f)
                yield (f"{stack.name}: fimfleet:{section}.{key} = {odd!r:.40} (set)",
                       {**base, f"fimfleet:{section}": json.dumps({**current, key: odd})})


def accepted(values: dict[str, str]):
    """(config, fleet args) when the program's checks accept `values`, None when they refuse them."""
    try:
        cfg = config.from_mapping(values, SECRET)
        validate.local_vms(cfg)
        return cfg, args_for(cfg)
    except config.ConfigError:
        return None


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Every accepted odd config of every stack, by (stack, key, leaf, value)."""
    out = {}
    for stack in sorted(STACKS.glob("Pulumi.*.yaml")):
        base = base_values(stack, tmp_path_factory.mktemp("vms") / "root")
        assert accepted(base), f"{stack.name} itself does not validate"
        for where, values in variants(stack, base):
            try:
                if (ok := accepted(values)) is not None:
                    out[where] = ok
            except Exception as err:  # noqa: BLE001 - the finding this test exists for
                out[where] = err
    return out


def test_odd_values_are_refused_with_one_config_error_or_accepted(sweep):
    crashed = {w: f"{type(e).__name__}: {e}"[:200] for w, e in sweep.items() if isinstance(e, Exception)}
    assert not crashed, "\n".join(f"{w}: {e}" for w, e in crashed.items())
    assert len(sweep) > 100  # the sweep reached the fleets below, not only refusals


@pulumi.runtime.test
def test_every_accepted_odd_config_builds_its_fleet(sweep, recorder):
    """One Fleet per distinct accepted config (many odd values fall back to the same default)."""
    distinct = {}
    for where, ok in sweep.items():
        if not isinstance(ok, Exception) and not any(c in where for c in CLOUD):
            distinct.setdefault(repr(ok[0]), (where, ok[1]))
    failed = {}
    for i, (where, args) in enumerate(distinct.values()):
        try:
            Fleet(f"fleet{i}", args)
        except Exception as err:  # noqa: BLE001
            failed[where] = f"{type(err).__name__}: {err}"[:200]
    assert not failed, "\n".join(f"{w}: {e}" for w, e in failed.items())
    return pulumi.Output.from_input(len(distinct))
