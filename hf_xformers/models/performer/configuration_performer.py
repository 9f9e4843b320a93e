"""Configuration of ``hfx-performer``."""

from __future__ import annotations

from ...configs.choices import FAVOR_KERNELS
from ...configs.text_config import HfxTextConfig


class HfxPerformerConfig(HfxTextConfig):
    r"""Configuration of a Performer (RoBERTa encoder, or causal LM, with FAVOR+ linear attention).

    Attributes:
        num_random_features (`int`, *optional*): ``m``, random features per head. None (default): ``int(d ln d)``
            for head size ``d`` (266 for ``d = 64``). More features approximate softmax attention more closely
            at a cost linear in ``m``.
        favor_kernel (`str`, defaults to ``"softmax"``): ``"softmax"``, FAVOR+ positive random features that
            approximate softmax attention; ``"relu"``, the generalized kernel ``relu(W x) + 1e-3`` (a different
            attention, not an approximation of softmax).
        orthogonal_features (`bool`, defaults to True): orthogonal random features (lower variance) instead of
            i.i.d. Gaussian ones.
        random_feature_seed (`int`, defaults to 0): seed of the random projections, in ``[0, 2**64)``. Layer ``l``'s
            ``t``-th draw is keyed by ``(random_feature_seed, l, t)`` (Philox-4x32-10 normals), so a fresh model from
            the same config is reproducible.
        feature_redraw_interval (`int`, *optional*): in training mode, draw new projections every this many forward
            calls of the model (the first draw serves the first ``feature_redraw_interval`` calls). None (default):
            never redraw automatically; ``model.redraw_projections()`` redraws explicitly. Eval mode never redraws.
        is_decoder (`bool`, defaults to False): causal attention (each token sees itself and earlier tokens).
            ``HfxPerformerForCausalLM`` sets it; with it, every head of the model is causal.
        max_position_embeddings (`int`, defaults to 4098): rows of the position table; with RoBERTa's offset the
            model takes ``max_position_embeddings - pad_token_id - 1`` tokens (4096 by default).
        attention_probs_dropout_prob (`float`): kept for RoBERTa compatibility but unused: FAVOR+ never forms the
            attention probabilities, so there is nothing to drop.

    Other fields as in ``RobertaConfig``.
    """

    model_type = "hfx-performer"
    num_random_features: int | None = None
    favor_kernel: str = "softmax"
    orthogonal_features: bool = True
    random_feature_seed: int = 0
    feature_redraw_interval: int | None = None
    is_decoder: bool = False

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        self.validate_performer()

    def validate_performer(self) -> None:
        """Raise ``ValueError`` naming the field to change when the values cannot work together."""

        def positive_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        if self.num_random_features is not None and not positive_int(self.num_random_features):
            raise ValueError(
                f"num_random_features must be a positive integer or None (d ln d), got {self.num_random_features!r}."
            )
        if self.favor_kernel not in FAVOR_KERNELS:
            raise ValueError(f"favor_kernel must be one of {FAVOR_KERNELS}, got {self.favor_kernel!r}.")
        if self.feature_redraw_interval is not None and not positive_int(self.feature_redraw_interval):
            raise ValueError(
                "feature_redraw_interval must be a positive number of training forward calls, or None to never "
                f"redraw automatically; got {self.feature_redraw_interval!r}."
            )
        seed = self.random_feature_seed
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
            # The seed is Philox's 64-bit key: a larger one would alias a smaller one's features.
            raise ValueError(f"random_feature_seed must be an integer in [0, 2**64), got {seed!r}.")
        self.check_roberta_positions()
