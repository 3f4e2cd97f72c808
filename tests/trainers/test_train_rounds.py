"""The train loop's rounds under fault tolerance (trainers/train.py `_Rounds`): a discarded round goes back to the
state the round started from, exactly, whether that state was this rank's own or one it healed to."""

from __future__ import annotations

import copy
import itertools
from types import SimpleNamespace

import torch

from trainers.train import _Rounds


class _Optimizing:
    """A method as far as the rounds see one: its state is a torch AdamW's (as Method.state_dict's inner optimizer)."""

    def __init__(self, module: torch.nn.Module):
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)

    def state_dict(self) -> dict:
        return {"inner_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["inner_optimizer"])


class _HealingGroup:
    """A quorum in which this rank heals to `peer_state` (as torchft's Manager does: it loads the state it fetched,
    and the quorum returns it), and whose round then fails (a peer died in the exchange)."""

    rejoining = True

    def __init__(self, peer_state: dict):
        self.peer_state = peer_state

    def quorum(self, snapshot: dict, load) -> dict:
        load(self.peer_state)
        return self.peer_state

    def commit(self) -> bool:
        return False

    def size(self) -> int:
        return 2


def _train_step(module: torch.nn.Module, method: _Optimizing) -> None:
    module(torch.ones(1, 4)).pow(2).sum().backward()
    method.optimizer.step()
    method.optimizer.zero_grad(set_to_none=True)


def test_a_discarded_round_after_a_heal_goes_back_to_the_healed_state_exactly():
    torch.manual_seed(0)
    peer_module = torch.nn.Linear(4, 2)
    peer_method = _Optimizing(peer_module)
    for _ in range(3):
        _train_step(peer_module, peer_method)
    peer_state = {"step": 3, "model": peer_module.state_dict(), "method": peer_method.state_dict()}
    peer_state = copy.deepcopy(peer_state)  # as fetched over the link: tensors of its own
    expected = copy.deepcopy(peer_state)

    module = torch.nn.Linear(4, 2)
    method = _Optimizing(module)
    setup = SimpleNamespace(stage=SimpleNamespace(module=module), method=method, batches_from=itertools.count)
    rounds = _Rounds(_HealingGroup(peer_state), setup, log=lambda event: None)

    assert rounds.begin(0, []) == 3
    _train_step(module, method)  # the round trains; its exchange fails
    assert rounds.commit(3, [0.0]) is False

    state = method.state_dict()["inner_optimizer"]["state"]
    for index, saved in expected["method"]["inner_optimizer"]["state"].items():
        for key, value in saved.items():
            assert torch.equal(state[index][key], value), (index, key)
    for name, value in expected["model"].items():
        assert torch.equal(module.state_dict()[name], value), name
