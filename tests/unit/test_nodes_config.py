"""fimfleet:nodes: per-node hosts on top of the stack, checked per node, errors at the node's key."""

import pytest

from components import config, fleet
from tests.helpers import raw_config


def nodes_raw(nodes, **sections):
    return raw_config(nodes=nodes, **sections)


def problems(raw, secret):
    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, secret)
    return {p.key: p for p in err.value.problems}


def test_each_node_gets_its_own_host_on_top_of_the_stacks_host_settings():
    raw, secret = nodes_raw({"epyc1": {"address": "203.0.113.10"}, "epyc2": {"address": "203.0.113.11", "port": 2222}},
                            host={"user": "deploy"})
    cfg = config.parse(raw, secret)
    assert cfg.node_names() == ["epyc1", "epyc2"]
    one, two = cfg.for_node("epyc1"), cfg.for_node("epyc2")
    assert (one.host.address, one.host.port, one.host.user) == ("203.0.113.10", 22, "deploy")
    assert (two.host.address, two.host.port, two.host.user) == ("203.0.113.11", 2222, "deploy")
    assert cfg.host == one.host  # the first node is the canary, and the single-node view


def test_the_single_node_shorthand_is_the_node_called_node():
    raw, secret = raw_config()
    cfg = config.parse(raw, secret)
    assert cfg.node_names() == ["node"] and cfg.for_node("node").host.address == "203.0.113.10"


def test_a_nodes_hardware_must_fit_the_tier_and_the_error_names_that_node():
    raw, secret = nodes_raw({"big": {"address": "203.0.113.10"}, "small": {"address": "203.0.113.11", "memoryGiB": 8}})
    found = problems(raw, secret)
    assert "nodes.small.memoryGiB" in found, found
    assert not any(k.startswith("nodes.big") for k in found), found
    assert found["nodes.small.memoryGiB"].value == 8


def test_two_nodes_on_one_machine_are_refused():
    raw, secret = nodes_raw({"a": {"address": "203.0.113.10"}, "b": {"address": "203.0.113.10"}})
    found = problems(raw, secret)
    assert list(found) == ["nodes.b.address"] and "nodes.a" in found["nodes.b.address"].fix
    raw, secret = nodes_raw({"a": {"address": "203.0.113.10"}, "b": {"address": "203.0.113.10", "port": 2222}})
    assert config.parse(raw, secret).node_names() == ["a", "b"]  # one address, two sshd ports: two machines


@pytest.mark.parametrize("a, b", [("VPS1.example.com", "vps1.example.com"), ("vps1.example.com.", "vps1.example.com"),
                                  ("2001:db8::1", "2001:DB8:0:0::1")])
def test_two_spellings_of_one_machine_are_one_machine(a, b):
    raw, secret = nodes_raw({"a": {"address": a}, "b": {"address": b}})
    assert list(problems(raw, secret)) == ["nodes.b.address"]
    raw, secret = nodes_raw({"a": {"address": a}, "b": {"address": "203.0.113.11"}},
                            gateway={"host": b}, ingress={"httpsPort": 8443, "httpPort": 8080})
    assert "gateway.host" in problems(raw, secret)  # it is node a's machine: name the node


@pytest.mark.parametrize("nodes, key, word", [
    ({"Bad_Name": {"address": "203.0.113.10"}}, "nodes.Bad_Name", "node name"),
    ({"gateway": {"address": "203.0.113.10"}}, "nodes.gateway", "reserved"),
    ({"a": {"adress": "203.0.113.10"}}, "nodes.a.adress", "address"),
    ({"a": {"address": "203.0.113.10", "engine": {}}}, "nodes.a.engine", "stack-wide"),
    ({"a": {"address": "203.0.113.10;reboot"}}, "nodes.a.address", "IP address"),
    ({"a": {}}, "nodes.a.address", "nodes.a.address"),
    ({"a": "203.0.113.10"}, "nodes.a", "map"),
    ({}, "nodes", "map node names"),
])
def test_bad_nodes_name_key_value_and_fix(nodes, key, word):
    raw, secret = nodes_raw(nodes)
    found = problems(raw, secret)
    assert key in found and word in found[key].fix, found


@pytest.mark.parametrize("nodes", [{}, ["epyc1"], {"Bad_Name": {"address": "203.0.113.10"}},
                                   {"gateway": {"address": "203.0.113.10"}}])
def test_a_refused_nodes_map_is_the_one_error_without_a_stand_in_nodes(nodes):
    """The stack is still checked with a stand-in node, whose own problems (it has no address)
    were reported too, under a key the stack does not have: nodes.node.address."""
    raw, secret = nodes_raw(nodes)
    found = problems(raw, secret)
    assert len(found) == 1 and next(iter(found)).startswith("nodes"), found


def test_a_machines_own_keys_cannot_sit_stack_wide_beside_nodes():
    raw, secret = nodes_raw({"a": {"address": "203.0.113.11"}}, host={"address": "203.0.113.10"})
    found = problems(raw, secret)
    assert "host.address" in found and "nodes.a.address" in found["host.address"].fix


def test_a_stack_wide_problem_is_reported_once_not_per_node():
    raw, secret = nodes_raw({"a": {"address": "203.0.113.10"}, "b": {"address": "203.0.113.11"}},
                            host={"user": "no such user!"})
    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, secret)
    assert [p.key for p in err.value.problems] == ["host.user"]


def test_the_fleet_has_a_host_and_a_node_per_entry_in_rollout_order():
    raw, secret = nodes_raw({"n1": {"address": "203.0.113.10"}, "n2": {"address": "203.0.113.11", "cpus": 64}})
    shape = fleet.args_for(config.parse(raw, secret))
    assert list(shape.nodes) == ["n1", "n2"] and [a.host for a in shape.nodes.values()] == ["n1", "n2"]
    assert shape.hosts["n2"].host.configured_address == "203.0.113.11"
    # Each node's engine binds its own host's CPUs.
    assert shape.nodes["n1"].runtime != shape.nodes["n2"].runtime


def test_a_cloud_node_takes_its_address_from_the_instance_it_gets():
    raw, secret = nodes_raw({"a": {"address": "203.0.113.9"}}, tier="gpu-h100",
                            host={"provider": "aws", "adminCidrs": ["198.51.100.7/32"]},
                            ingress={"allowSelfSigned": True})
    found = problems(raw, secret)
    assert "nodes.a.address" in found and "creates the instance" in found["nodes.a.address"].fix, found


@pytest.mark.parametrize("value", [0.0, 0, False])
def test_a_falsy_stack_wide_address_beside_nodes_is_refused_not_dropped(value):
    """With fimfleet:nodes, host.address names no node: any value set there is refused, a falsy
    one too (it was silently dropped)."""
    raw, secret = raw_config(nodes={"a": {"address": "203.0.113.10"}}, host={"address": value})
    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, secret)
    assert "host.address" in [p.key for p in err.value.problems]
