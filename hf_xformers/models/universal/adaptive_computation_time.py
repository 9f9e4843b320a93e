"""Adaptive Computation Time (Graves, 2016) per position, as the Universal Transformer uses it (dynamic halting).

The recipe is tensor2tensor's ``universal_transformer_act_basic``. At every step ``n`` each position ``t`` that is
still running gets a halting probability ``p = sigmoid(W s + b)`` from the state ``s`` the block is about to read
(``b`` is initialised to 1), and the bookkeeping below decides how much of the block's new output it takes:

* it keeps running while its summed probability stays ``<= 1 - epsilon``; its update weight is ``p``;
* it halts at the step where the sum would exceed ``1 - epsilon``: its remainder ``R = 1 - (sum so far)`` is its
  update weight and its summed probability becomes exactly 1;
* at step ``max_steps`` every position still running halts in the same way (Graves' cap ``N <= M``; tensor2tensor's
  while-loop instead leaves such positions with ``R = 0``, so the ponder loss would get no gradient from them);
* ``N`` counts the steps a position took (including the one it halted at).

The ACT state starts at zeros and is updated as ``state = new * w + old * (1 - w)`` (the update weight ``w`` as
above, 0 once a position has halted, so halted positions stop changing; tensor2tensor's code once read
``old * 1 - w``, a precedence bug not reproduced here). As in tensor2tensor, the block's next input is its own raw
output (``new``), for halted positions too, because running positions keep attending to them.

Padding (``real_mask`` False) starts halted: it never runs, takes ``N = R = 0`` and never keeps the loop going, so
it cannot influence halting or the ponder loss ``weight * mean(N + R)`` over real positions.

The loop always has ``max_steps`` iterations at most, written with masks only; an optional early exit, once no
position runs, is a Python check on a tensor and so is skipped while ``torch.compile`` traces (the exit changes no
output: every remaining update weight would be 0). That check reads one value back per step that ran: on a GPU a
device-to-host synchronisation per step, on the CPU a plain memory read. Callers choose where it runs
(:func:`early_exit_enabled`, ``config.act_early_exit``).

Precision: the halting unit, the counters (summed probabilities, remainders, step counts), the update weights and the
ponder loss are float32 whatever the model's dtype and autocast say. A 16-bit running sum cannot hold the threshold
``1 - epsilon``: bfloat16 rounds 0.99 to 0.98828 and has steps of 2**-8 just below 1, so sums near the threshold
round across it and positions halt a step early or late. The state update itself runs in the state's dtype (see
:meth:`HfxAdaptiveComputationTime.forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.input_checks import is_tracing, on_host
from ...ops.precision import float32_autocast_off


class ActBookkeeping(NamedTuple):
    """The per-position ACT counters, each ``(batch, seq_len)`` float32."""

    halting_probability: torch.Tensor
    """Summed halting probability; exactly 1 once a position has halted (padding: 1 from the start)."""
    remainders: torch.Tensor
    """``R``: the probability mass a position was given at the step it halted (0 before)."""
    n_updates: torch.Tensor
    """``N``: the number of steps a position took."""


def act_start(real_mask: torch.Tensor) -> ActBookkeeping:
    """Counters before the first step. ``real_mask`` ``(batch, seq_len)`` bool, False for padding (starts halted)."""
    zeros = torch.zeros(real_mask.shape, dtype=torch.float32, device=real_mask.device)
    return ActBookkeeping((~real_mask).float(), zeros, zeros.clone())


def act_update(
    p: torch.Tensor, counters: ActBookkeeping, threshold: float, last_step: bool
) -> tuple[ActBookkeeping, torch.Tensor, torch.Tensor]:
    """One ACT step's bookkeeping.

    Args:
        p: ``(batch, seq_len)`` halting probabilities of this step (any float dtype; the bookkeeping is float32).
        counters: the counters after the previous step.
        threshold: ``1 - act_epsilon``.
        last_step: this is step ``max_steps``: every position still running halts now.

    Returns:
        ``(counters, update_weights, still_running)``: the new counters, the weights ``w`` ``(batch, seq_len)`` of
        this step's block output in ``state = new * w + old * (1 - w)``, and the bool mask of the positions that keep
        running after this step.
    """
    halting_probability, remainders, n_updates = counters
    # Comparisons of a 16-bit tensor with the threshold round the threshold to 16 bits too: keep everything float32.
    p = p.float()
    running = halting_probability < 1.0
    would_reach = halting_probability + p * running
    halts_now = running & (would_reach > threshold)
    if last_step:
        halts_now = running
    keeps_running = running & ~halts_now
    halting_probability = halting_probability + p * keeps_running
    new_remainders = halts_now * (1.0 - halting_probability)
    remainders = remainders + new_remainders
    # Exactly 1 for halted positions: `sum + (1 - sum)` can round to just below 1 in float32 and restart them.
    halting_probability = torch.where(halts_now, torch.ones_like(halting_probability), halting_probability)
    n_updates = n_updates + running.float()
    update_weights = p * keeps_running + new_remainders
    return ActBookkeeping(halting_probability, remainders, n_updates), update_weights, keeps_running


class ActOutput(NamedTuple):
    state: torch.Tensor
    """``(batch, seq_len, hidden)``: the ACT-weighted state (zeros at padding)."""
    ponder_steps: torch.Tensor
    """``N``, ``(batch, seq_len)`` float32 (0 at padding)."""
    remainders: torch.Tensor
    """``R``, ``(batch, seq_len)`` float32 (0 at padding)."""
    step_states: tuple[torch.Tensor, ...]
    """The ACT-weighted state after each step that ran (empty unless asked for)."""
    step_extras: tuple
    """What ``block`` returned besides its output at each step that ran (e.g. attention probabilities)."""


class HfxHaltingUnit(nn.Linear):
    """``hidden -> 1`` logits of the halting probability. Its own class so that the model's ``_init_weights``
    (called for modules that hold parameters) can set the bias to ``act_halting_bias_init``."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__(hidden_size, 1)


class HfxAdaptiveComputationTime(nn.Module):
    """The halting unit ``p = sigmoid(halting_unit(s))`` (:class:`HfxHaltingUnit`) and the ACT loop around a
    recurrent block."""

    def __init__(self, hidden_size: int, act_epsilon: float, act_max_steps: int) -> None:
        super().__init__()
        self.halting_unit = HfxHaltingUnit(hidden_size)
        self.threshold = 1.0 - act_epsilon
        self.max_steps = act_max_steps

    def halting_probability(self, state: torch.Tensor) -> torch.Tensor:
        """``(batch, seq_len, hidden)`` -> ``(batch, seq_len)`` float32 probabilities.

        The ``hidden -> 1`` projection runs in float32 (autocast off, weights and state cast up): a bfloat16 logit is
        rounded by up to 2**-8 of its size, which moves ``p`` by enough to change the step at which a position crosses
        the threshold. It costs one dot product per position."""
        unit = self.halting_unit
        with float32_autocast_off(state.device.type):
            logits = F.linear(state.float(), unit.weight.float(), unit.bias.float())
        return torch.sigmoid(logits.squeeze(-1))

    def forward(
        self,
        state: torch.Tensor,
        real_mask: torch.Tensor,
        prepare: Callable[[torch.Tensor, int], torch.Tensor],
        block: Callable[[torch.Tensor, int], tuple],
        stop_early: bool = True,
        keep_step_states: bool = False,
    ) -> ActOutput:
        """Run the block with dynamic halting.

        Args:
            state: ``(batch, seq_len, hidden)`` the block's first input (the embeddings).
            real_mask: ``(batch, seq_len)`` bool, False at padding.
            prepare: ``prepare(state, step)`` -> the block's input at ``step`` (0-based): the state plus the position
                and timestep signals. The halting unit reads this too.
            block: ``block(x, step)`` -> ``(new_state, *extras)``.
            stop_early: leave the loop once no position runs (eager mode only; outputs are the same). It reads one
                bool back after every step but the last (a host synchronisation per step on a GPU; see
                :func:`early_exit_enabled`). Callers that fill a cache for later tokens pass False, so every step's
                keys and values exist.
            keep_step_states: also return the ACT state after every step.
        """
        counters = act_start(real_mask)
        accumulated = torch.zeros_like(state)
        step_states, step_extras = [], []
        for step in range(self.max_steps):
            x = prepare(state, step)
            p = self.halting_probability(x)
            counters, weights, still_running = act_update(p, counters, self.threshold, step == self.max_steps - 1)
            new_state, *extras = block(x, step)
            # The mix runs in the state's dtype: rounding w to it costs what rounding the state itself costs (2**-8
            # relative in bfloat16), once per step and scaled down by later (1 - w) factors, so it does not build up
            # like the threshold sums do. 1 - w is taken after the rounding, so the two shares still sum to exactly 1.
            w = weights.unsqueeze(-1).to(new_state.dtype)
            accumulated = new_state * w + accumulated * (1 - w)
            state = new_state
            if keep_step_states:
                step_states.append(accumulated)
            step_extras.append(tuple(extras))
            last = step == self.max_steps - 1
            if stop_early and not last and not is_tracing() and not bool(still_running.any()):
                break
        return ActOutput(accumulated, counters.n_updates, counters.remainders, tuple(step_states), tuple(step_extras))


def ponder_loss(
    ponder_steps: torch.Tensor, remainders: torch.Tensor, real_mask: torch.Tensor, weight: float
) -> torch.Tensor:
    """``weight * mean(N + R)`` over real positions (``real_mask`` True); 0 when there are none. A float32 scalar (the
    counters are float32; a 16-bit sum over many positions of values near ``act_max_steps`` would lose the ``R``
    part). Only ``R`` carries a gradient (through the halting probabilities), as in the ACT paper."""
    total = ((ponder_steps.float() + remainders.float()) * real_mask).sum()
    return weight * total / real_mask.sum().clamp(min=1)


def early_exit_enabled(setting: bool | None, device: torch.device) -> bool:
    """Whether the ACT loop may leave early (``stop_early``) for inputs on ``device``.

    ``setting`` is ``config.act_early_exit``: True, always (one host read per step that ran; on a GPU each is a
    synchronisation, worth it when whole batches halt well before ``act_max_steps``, e.g. small-batch inference);
    False, never (every forward runs ``act_max_steps`` steps with masks, as traced graphs do); None (the default), on
    the CPU only (:func:`~hf_xformers.ops.input_checks.on_host`), where the read waits for no device and the skipped
    steps are saved compute (at the initial halting bias positions halt after 2 steps, so 10 of the default 12 steps
    are skipped)."""
    if setting is None:
        return on_host(device)
    return bool(setting)
