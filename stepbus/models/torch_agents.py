"""The built-in PyTorch models of `--model torch`, laid out as CleanRL's agents.

`make_agent(observation_space, action_space)` picks by the observation's shape: a channels-last
image ``(H, W, C)`` gets CleanRL ``ppo_atari.py``'s Nature CNN (frames converted to channels
first and, for uint8, scaled to [0, 1] inside the model, so they cross the bus as bytes), or,
under 36 pixels a side, the MinAtar paper's small CNN (one 16-channel 3x3 convolution and 128
units: MinAtar's 10x10 frames); anything else gets CleanRL ``ppo.py``'s MLP on the flattened
observation (64x64 tanh, separate actor and critic; any other space flattened, categorical
leaves one-hot). Categorical actions (Discrete, MultiDiscrete, MultiBinary) get a categorical
head per dimension, Box actions a Gaussian one with a state-independent log-std
(``ppo_continuous_action.py``). Orthogonal init with CleanRL's gains.

Your own model is any factory with this signature whose module has these two methods; see
docs/models.md.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

HIDDEN = 64
CNN_FEATURES = 512
SMALL_CNN_FEATURES = 128
LOG_2PI = math.log(2 * math.pi)
MIN_IMAGE_SIDE = 36  # the Nature CNN's three convolutions need at least this many pixels a side
MIN_SMALL_IMAGE_SIDE = 3  # the small CNN's one 3x3 convolution needs this many


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias_const: float = 0.0
               ) -> nn.Module:
    """CleanRL's init: orthogonal weights with gain `std`, constant biases."""
    assert isinstance(layer, nn.Linear | nn.Conv2d)
    nn.init.orthogonal_(layer.weight, std)
    if layer.bias is not None:
        nn.init.constant_(layer.bias, bias_const)
    return layer


def categories(action_space: Any) -> tuple[int, ...]:
    """Each categorical dimension's count: (n,) for Discrete, the flat nvec for MultiDiscrete,
    twos for MultiBinary; () for a Box."""
    if isinstance(action_space, spaces.Discrete):
        return (int(action_space.n),)
    if isinstance(action_space, spaces.MultiDiscrete):
        return tuple(int(n) for n in np.ravel(action_space.nvec))
    if isinstance(action_space, spaces.MultiBinary):
        return (2,) * math.prod(action_space.shape)
    return ()


class Head(nn.Module):
    """The action distribution on top of features: one categorical per dimension of a
    Discrete, MultiDiscrete or MultiBinary space (log-probs and entropies summed over them), or
    a Gaussian mean with a learned log-std for a Box. `action_mask` (bool, one per category,
    the dimensions' in turn) rules out actions by giving them a logit of -1e8. The log-probs
    and entropies are `torch.distributions`' Categorical and Normal ones, written out: building
    a distribution object cost more than the rest of a small model's forward pass.
    `deterministic` (no `action` given) takes the mode: each dimension's argmax, or the mean."""

    def __init__(self, features: int, action_space: Any) -> None:
        super().__init__()
        self.categories = categories(action_space)
        self.shape: tuple[int, ...] = (() if isinstance(action_space, spaces.Discrete)
                                       else tuple(action_space.shape))
        dim = sum(self.categories) if self.categories else math.prod(self.shape)
        self.out = layer_init(nn.Linear(features, dim), std=0.01)
        if not self.categories:
            self.logstd = nn.Parameter(torch.zeros(1, dim))

    def forward(self, hidden: torch.Tensor, action: torch.Tensor | None,
                action_mask: torch.Tensor | None, deterministic: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(action, log-prob, entropy): `action` sampled (or the mode) when None, else its
        log-prob."""
        b, out = hidden.shape[0], self.out(hidden)
        if self.categories:
            return self.categorical(out, action, action_mask, deterministic)
        logstd = self.logstd.expand_as(out)
        if action is not None:
            flat = action.reshape(b, -1).to(out.dtype)
        else:
            flat = out if deterministic else out + logstd.exp() * torch.randn_like(out)
        z = (flat - out) * (-logstd).exp()
        logp = (-0.5 * z * z - logstd - 0.5 * LOG_2PI).sum(1)
        entropy = (0.5 + 0.5 * LOG_2PI + logstd).sum(1)
        return flat.reshape(b, *self.shape), logp, entropy

    def categorical(self, out: torch.Tensor, action: torch.Tensor | None,
                    action_mask: torch.Tensor | None, deterministic: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = out.shape[0]
        if action_mask is not None:
            out = torch.where(action_mask.reshape(b, -1).to(torch.bool), out,
                              torch.full_like(out, -1e8))
        given = None if action is None else action.reshape(b, -1).long()
        taken, logp, entropy = [], out.new_zeros(b), out.new_zeros(b)
        for j, logits in enumerate(torch.split(out, list(self.categories), dim=1)):
            logp_all = torch.log_softmax(logits, dim=-1)
            probs = logp_all.exp()
            if given is not None:
                pick = given[:, j]
            else:
                pick = logp_all.argmax(1) if deterministic else torch.multinomial(probs, 1)[:, 0]
            taken.append(pick)
            logp = logp + logp_all.gather(1, pick[:, None])[:, 0]
            entropy = entropy - (probs * logp_all).sum(1)
        return torch.stack(taken, 1).reshape(b, *self.shape), logp, entropy


class Flatten(nn.Module):
    """Any observation as one float vector per row, as `stepbus.spaces.flatten` does it in
    numpy: Box and MultiBinary leaves flattened, Discrete and MultiDiscrete ones one-hot,
    Dict and Tuple leaves concatenated in the space's order."""

    def __init__(self, observation_space: Any) -> None:
        super().__init__()
        self.space = observation_space
        self.width = spaces.flatdim(observation_space)

    def forward(self, x: Any) -> torch.Tensor:
        return self.flat(self.space, x)

    def flat(self, space: Any, x: Any) -> torch.Tensor:
        if isinstance(space, spaces.Dict):
            return torch.cat([self.flat(sub, x[key]) for key, sub in space.spaces.items()], 1)
        if isinstance(space, spaces.Tuple):
            return torch.cat([self.flat(sub, part) for sub, part in zip(space.spaces, x,
                                                                        strict=True)], 1)
        b = x.shape[0]
        if isinstance(space, spaces.Discrete | spaces.MultiDiscrete):
            nvec = [int(space.n)] if isinstance(space, spaces.Discrete) else \
                [int(n) for n in np.ravel(space.nvec)]
            start = torch.as_tensor(np.ravel(space.start), device=x.device)
            codes = x.reshape(b, -1).long() - start
            return torch.cat([self.one_hot(codes[:, j], n) for j, n in enumerate(nvec)], 1)
        return x.reshape(b, -1).float()

    @staticmethod
    def one_hot(codes: torch.Tensor, n: int) -> torch.Tensor:
        """`codes` (from 0) one-hot in n columns; a value outside [0, n) all zeros."""
        inside = ((codes >= 0) & (codes < n)).unsqueeze(1)
        return nn.functional.one_hot(codes.clamp(0, n - 1), n).float() * inside


class MLPAgent(nn.Module):
    """CleanRL ``ppo.py``'s agent: separate 64x64 tanh MLPs for the critic and the actor."""

    def __init__(self, observation_space: Any, action_space: Any) -> None:
        super().__init__()
        self.flatten = Flatten(observation_space)
        n_in = self.flatten.width
        self.critic = nn.Sequential(
            layer_init(nn.Linear(n_in, HIDDEN)), nn.Tanh(),
            layer_init(nn.Linear(HIDDEN, HIDDEN)), nn.Tanh(),
            layer_init(nn.Linear(HIDDEN, 1), std=1.0))
        self.actor = nn.Sequential(
            layer_init(nn.Linear(n_in, HIDDEN)), nn.Tanh(),
            layer_init(nn.Linear(HIDDEN, HIDDEN)), nn.Tanh())
        self.head = Head(HIDDEN, action_space)

    def get_value(self, x: Any) -> torch.Tensor:
        return self.critic(self.flatten(x))

    def get_action_and_value(self, x: Any, action: torch.Tensor | None = None,
                             action_mask: torch.Tensor | None = None, deterministic: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.flatten(x)
        taken, logp, entropy = self.head(self.actor(x), action, action_mask, deterministic)
        return taken, logp, entropy, self.critic(x)


def image_torso(observation_space: Any) -> tuple[nn.Sequential, float, int]:
    """The torso for channels-last frames of this space, the scale of its input (1/255 for uint8
    frames) and its width: the Nature DQN's three convolutions and CNN_FEATURES units from 36
    pixels a side, else (MinAtar's 10x10 frames) the MinAtar paper's one 16-channel 3x3
    convolution and SMALL_CNN_FEATURES units, whose receptive field fits a small frame."""
    height, width, channels = observation_space.shape
    if min(height, width) < MIN_SMALL_IMAGE_SIDE:
        raise ValueError(f"images of {height}x{width} are too small for the built-in CNNs "
                         f"(at least {MIN_SMALL_IMAGE_SIDE}x{MIN_SMALL_IMAGE_SIDE}); name your "
                         "own model with --model module:factory")
    scale = 1.0 / 255.0 if np.dtype(observation_space.dtype) == np.uint8 else 1.0
    if min(height, width) >= MIN_IMAGE_SIDE:
        conv = nn.Sequential(
            layer_init(nn.Conv2d(channels, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(), nn.Flatten())
        features = CNN_FEATURES
    else:
        conv = nn.Sequential(layer_init(nn.Conv2d(channels, 16, 3, stride=1)), nn.ReLU(),
                             nn.Flatten())
        features = SMALL_CNN_FEATURES
    with torch.no_grad():
        flat = conv(torch.zeros(1, channels, height, width)).shape[1]
    torso = nn.Sequential(*conv, layer_init(nn.Linear(flat, features)), nn.ReLU())
    return torso, scale, features


class NatureCNNAgent(nn.Module):
    """CleanRL ``ppo_atari.py``'s agent: the Nature DQN torso shared by the actor and the critic,
    on channels-last frames (uint8 scaled by 1/255 here, in the model); for frames under 36
    pixels a side, the MinAtar paper's small torso instead (`image_torso`)."""

    def __init__(self, observation_space: Any, action_space: Any) -> None:
        super().__init__()
        self.network, self.scale, features = image_torso(observation_space)
        self.head = Head(features, action_space)
        self.critic = layer_init(nn.Linear(features, 1), std=1.0)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x.permute(0, 3, 1, 2).float() * self.scale)

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(self.features(x))

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None,
                             action_mask: torch.Tensor | None = None, deterministic: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.features(x)
        taken, logp, entropy = self.head(hidden, action, action_mask, deterministic)
        return taken, logp, entropy, self.critic(hidden)


def make_agent(observation_space: Any, action_space: Any) -> nn.Module:
    """`--model torch`: the Nature CNN for channels-last images (a Box of three dimensions),
    else the MLP on the flattened observation (any space)."""
    if isinstance(observation_space, spaces.Box) and len(observation_space.shape) == 3:
        return NatureCNNAgent(observation_space, action_space)
    return MLPAgent(observation_space, action_space)


LSTM_HIDDEN = 128


class Frames(nn.Module):
    """Channels-last frames through the image torso (`image_torso`); `width` its features."""

    def __init__(self, observation_space: Any) -> None:
        super().__init__()
        self.network, self.scale, self.width = image_torso(observation_space)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x.permute(0, 3, 1, 2).float() * self.scale)


class LSTMAgent(nn.Module):
    """`--model torch-lstm`, CleanRL ``ppo_atari_lstm.py``'s agent: an encoder (the image
    torso for channels-last images, else one 64-unit tanh layer on the flattened observation),
    an LSTM of LSTM_HIDDEN units, and actor and critic heads on its output.

    The recurrent interface stepbus drives: `initial_state(batch_size)` is the memory an
    episode starts with, ``(h, c)`` of shape ``(1, B, LSTM_HIDDEN)``; the other methods take
    the observations of T steps of B sequences, time-major and flattened to ``T * B`` rows,
    the state each sequence starts from, and `done` (``T * B``, True where a new episode
    starts: the state is zeroed there, as in CleanRL; stepbus passes all False and restarts
    states itself, from `initial_state`)."""

    def __init__(self, observation_space: Any, action_space: Any) -> None:
        super().__init__()
        if isinstance(observation_space, spaces.Box) and len(observation_space.shape) == 3:
            frames = Frames(observation_space)
            self.encoder: nn.Module = frames
            width = frames.width
        else:
            flat = Flatten(observation_space)
            self.encoder = nn.Sequential(flat, layer_init(nn.Linear(flat.width, HIDDEN)),
                                         nn.Tanh())
            width = HIDDEN
        self.lstm = nn.LSTM(width, LSTM_HIDDEN)
        for name, param in self.lstm.named_parameters():
            if "bias" in name:
                nn.init.constant_(param, 0)
            elif "weight" in name:
                nn.init.orthogonal_(param, 1.0)
        self.head = Head(LSTM_HIDDEN, action_space)
        self.critic = layer_init(nn.Linear(LSTM_HIDDEN, 1), std=1.0)

    def initial_state(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(self.parameters()).device
        zeros = torch.zeros(1, batch_size, LSTM_HIDDEN, device=device)
        return zeros, zeros.clone()

    def get_states(self, x: Any, state: tuple[torch.Tensor, torch.Tensor],
                   done: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The LSTM's output for every row (``T * B``) and the state after the last step."""
        hidden = self.encoder(x)
        batch = state[0].shape[1]
        hidden = hidden.reshape(-1, batch, hidden.shape[-1])
        done = done.reshape(-1, batch).to(hidden.dtype)
        if not done.any():  # one call over the whole sequence: what stepbus always asks
            out, state = self.lstm(hidden, state)
            return out.reshape(-1, LSTM_HIDDEN), state
        outs = []
        for h, d in zip(hidden, done, strict=True):
            keep = (1.0 - d).view(1, -1, 1)
            step, state = self.lstm(h.unsqueeze(0), (keep * state[0], keep * state[1]))
            outs.append(step)
        return torch.cat(outs).reshape(-1, LSTM_HIDDEN), state

    def get_value(self, x: Any, state: tuple[torch.Tensor, torch.Tensor],
                  done: torch.Tensor) -> torch.Tensor:
        return self.critic(self.get_states(x, state, done)[0])

    def get_action_and_value(self, x: Any, state: tuple[torch.Tensor, torch.Tensor],
                             done: torch.Tensor, action: torch.Tensor | None = None,
                             action_mask: torch.Tensor | None = None, deterministic: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        tuple[torch.Tensor, torch.Tensor]]:
        hidden, state = self.get_states(x, state, done)
        taken, logp, entropy = self.head(hidden, action, action_mask, deterministic)
        return taken, logp, entropy, self.critic(hidden), state


def make_lstm_agent(observation_space: Any, action_space: Any) -> nn.Module:
    """`--model torch-lstm`: `LSTMAgent`."""
    return LSTMAgent(observation_space, action_space)
