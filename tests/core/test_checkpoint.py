"""Checkpoints: round trip, shipped names, and every way a file can be wrong."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from optim_table import fixed_grads, make_params, perturbed_net

from learned_opt import (
    FORMAT_VERSION,
    CheckpointError,
    LearnedOptimizer,
    LearnedOptimizerNet,
    MixingConfig,
    NetConfig,
    list_pretrained,
    load_checkpoint,
    save_checkpoint,
)
from learned_opt.checkpoint import DEFAULT_CHECKPOINT


@pytest.fixture
def saved(tmp_path):
    net = perturbed_net(width=16, seed=3)
    path = save_checkpoint(net, tmp_path / "opt.pt", {"name": "test", "trained": False})
    return net, path


def _payload(path):
    return torch.load(path, weights_only=True)


def test_round_trip_theta_card_and_steps(saved):
    net, path = saved
    loaded, card = load_checkpoint(path)
    assert card == {"name": "test", "trained": False}
    assert loaded.config == net.config
    for (k, a), (k2, b) in zip(net.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)

    runs = []
    for opt_kwargs in ({"net": net}, {"checkpoint": str(path)}):
        params = make_params()
        opt = LearnedOptimizer(params, **opt_kwargs)
        for k in range(3):
            fixed_grads(params, k)
            opt.step()
        runs.append(params)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_optimizer_save_checkpoint_and_load(tmp_path):
    params = make_params()
    opt = LearnedOptimizer(params, net=perturbed_net())
    path = opt.save_checkpoint(tmp_path / "exported.pt", card={"note": "export"})
    opt2 = LearnedOptimizer.load(make_params(), path)
    assert opt2.card == {"note": "export"}
    for a, b in zip(opt.net.parameters(), opt2.net.parameters()):
        assert torch.equal(a, b)


def test_list_pretrained_default_first_and_loadable():
    names = list_pretrained()
    assert names[0] == DEFAULT_CHECKPOINT
    assert "adam_init" in names
    for name in names:
        net, card = load_checkpoint(name)
        assert isinstance(card, dict) and card.get("summary")
    opt = LearnedOptimizer(make_params())  # alone: the shipped single-worker rule
    assert opt.card == load_checkpoint(DEFAULT_CHECKPOINT)[1]
    assert opt.checkpoint_path.stem == DEFAULT_CHECKPOINT


def test_shipped_cards_are_honest():
    for name in ("adam_init", DEFAULT_CHECKPOINT):  # hand-set rules say so
        _, card = load_checkpoint(name)
        assert card["trained"] is False
        assert "NOT meta-trained" in card["summary"]
    for name in ("default", "gossip_adapt"):
        _, card = load_checkpoint(name)
        assert card["trained"] is True
        assert card["command"].startswith("learned-opt-meta fit --config meta_train/configs/")
        assert card["wall_time_s"] > 0 and card["meta_steps"] > 0
    _, card = load_checkpoint("default")
    validation = card["validation"]
    assert {"median_speedup_adam", "median_speedup_dadam", "single", "decentralized"} <= set(
        validation
    )


def test_unknown_shipped_name_lists_the_shipped_ones():
    with pytest.raises(CheckpointError, match="no-such-optimizer") as info:
        LearnedOptimizer(make_params(), checkpoint="no-such-optimizer")
    for name in list_pretrained():
        assert name in str(info.value)


def _assert_error(path, *fragments):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert os.path.normpath(path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert "weights_only" not in message, "never advise loading a file unsafely"
    return message


def test_missing_file(tmp_path):
    _assert_error(tmp_path / "absent.pt", "no such file")


@pytest.mark.parametrize("kept", [0.1, 0.5, 0.75, 0.99])
def test_truncated_file(saved, tmp_path, kept):
    _, path = saved
    data = path.read_bytes()
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(data[: int(len(data) * kept)])
    _assert_error(bad, "cannot be read", "truncated: the file ends before its zip archive")


def test_random_bytes(tmp_path):
    bad = tmp_path / "noise.pt"
    bad.write_bytes(os.urandom(4096))
    _assert_error(bad, "cannot be read")


def test_empty_file_and_text_file(tmp_path):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    _assert_error(empty, "cannot be read", "empty or truncated")
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    _assert_error(text, "cannot be read", "not a torch file")


def test_malformed_card_and_config(saved, tmp_path):
    bad = _edited(saved, tmp_path, lambda d: d.update(card=[1, 2]))
    _assert_error(bad, "card must be a dict", "list")
    bad = _edited(saved, tmp_path, lambda d: d.update(config=[1, 2]))
    _assert_error(bad, "invalid network config", "list")


def test_dict_without_the_keys(tmp_path):
    bad = tmp_path / "other.pt"
    torch.save({"model": torch.zeros(3)}, bad)
    _assert_error(bad, "not a learned-opt checkpoint", "model")


def test_not_a_dict(tmp_path):
    bad = tmp_path / "tensor.pt"
    torch.save(torch.zeros(3), bad)
    _assert_error(bad, "not a learned-opt checkpoint", "Tensor")


def _edited(saved, tmp_path, edit):
    """A copy of the saved checkpoint with ``edit(payload)`` applied."""
    payload = _payload(saved[1])
    edit(payload)
    bad = tmp_path / "edited.pt"
    torch.save(payload, bad)
    return bad


def test_other_format_version(saved, tmp_path):
    bad = _edited(saved, tmp_path, lambda d: d.update(format="learned-opt/99"))
    _assert_error(bad, "learned-opt/99", FORMAT_VERSION)


def test_mismatched_shapes(saved, tmp_path):
    bad = _edited(saved, tmp_path, lambda d: d["config"].update(width=8))  # theta is width 16
    _assert_error(bad, "shape mismatch", "tensor_out.weight", "(17, 32)")


def test_missing_theta_key(saved, tmp_path):
    bad = _edited(saved, tmp_path, lambda d: d["theta"].pop("elem_out.bias"))
    _assert_error(bad, "theta keys", "elem_out.bias")


def test_invalid_config(saved, tmp_path):
    bad = _edited(saved, tmp_path, lambda d: d["config"].update(colour="blue"))
    _assert_error(bad, "invalid network config", "colour")


def test_nan_theta(saved, tmp_path):
    bad = _edited(saved, tmp_path, lambda d: d["theta"]["elem_hidden.weight"].fill_(float("nan")))
    _assert_error(bad, "elem_hidden.weight", "NaN")


def test_shipped_names_win_over_files_in_the_working_directory(saved, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()
    (tmp_path / "adam_init").write_text("junk")
    for name in ("default", "adam_init"):
        opt = LearnedOptimizer(make_params(), checkpoint=name)
        assert opt.checkpoint_path.parent.name == "checkpoints"
        assert opt.checkpoint_path.name == f"{name}.pt"
        assert opt.card == load_checkpoint(name)[1]
    _assert_error("./default", "is a directory")
    _assert_error("./adam_init", "cannot be read")
    os.replace(saved[1], tmp_path / "mine")  # a bare word that is not shipped is a path
    assert LearnedOptimizer(make_params(), checkpoint="mine").card["name"] == "test"
    assert LearnedOptimizer(make_params(), net=saved[0]).checkpoint_path is None


def _split_net():
    """A network whose update rule and mixing head both differ from the defaults."""
    return LearnedOptimizerNet(
        NetConfig(width=16, lr_adapt_rate=0.3), MixingConfig(edge_width=8, lr_adapt_max_gossip=4.0)
    )


def test_the_update_rule_and_the_mixing_head_are_stored_apart(tmp_path):
    net = _split_net()
    payload = _payload(save_checkpoint(net, tmp_path / "split.pt"))
    assert payload["config"] == net.config.to_dict() and "edge_width" not in payload["config"]
    assert payload["mixing"] == net.mixing.to_dict()
    loaded, _ = load_checkpoint(tmp_path / "split.pt")
    assert (loaded.config, loaded.mixing) == (net.config, net.mixing)


def test_checkpoints_written_before_the_split_load_the_same(tmp_path):
    """Files written before NetConfig and MixingConfig were split hold one flat config."""
    net = _split_net()
    path = save_checkpoint(net, tmp_path / "split.pt")
    old = _edited((net, path), tmp_path, lambda d: d["config"].update(d.pop("mixing")))
    loaded, _ = load_checkpoint(old)
    assert (loaded.config, loaded.mixing) == (net.config, net.mixing)
    assert load_checkpoint("gossip_adapt")[0].mixing.edge_width == 16  # shipped before it


def test_malformed_mixing_config(tmp_path):
    path = save_checkpoint(_split_net(), tmp_path / "split.pt")
    saved = (None, path)
    _assert_error(_edited(saved, tmp_path, lambda d: d.update(mixing=[1])), "invalid mixing config")
    bad = _edited(saved, tmp_path, lambda d: d["mixing"].update(edge_width=0))
    _assert_error(bad, "invalid network config", "edge_width")
    bad = _edited(saved, tmp_path, lambda d: d["mixing"].update(edge_width=16))
    _assert_error(bad, "shape mismatch", "edge_in.weight")
    bad = _edited(saved, tmp_path, lambda d: d["mixing"].update(width=8))  # the rule's field
    _assert_error(bad, "unknown MixingConfig fields", "width")


def test_networks_pickled_before_the_split_unpickle_split():
    """A network pickled before the split carries one config holding the mixing fields."""
    net = _split_net()
    flat = object.__new__(NetConfig)
    flat.__dict__.update({**vars(net.config), **vars(net.mixing)})  # as unpickling sets it
    state = {**net.__dict__, "config": flat}
    del state["mixing"]
    old = LearnedOptimizerNet.__new__(LearnedOptimizerNet)
    old.__setstate__(state)
    assert (old.config, old.mixing) == (net.config, net.mixing)
    assert pickle.loads(pickle.dumps(net)).mixing == net.mixing
