"""Configuration of ``hfx-universal``."""

from __future__ import annotations

from ...configs.text_config import HfxTextConfig

# The paper's transitions: a position-wise feed-forward block, or separable convolutions over the sequence.
TRANSITIONS = ("ffn", "sepconv")
# "sinusoidal": the paper's position signal added at every step; "absolute": a learned table (ALBERT, BERT).
POSITION_EMBEDDING_TYPES = ("sinusoidal", "absolute")


class HfxUniversalConfig(HfxTextConfig):
    r"""Configuration of a Universal Transformer (Dehghani et al., 2019): one shared post-LN Transformer block applied
    recurrently in depth, with per-position Adaptive Computation Time (ACT) or a fixed number of steps.

    Defaults follow tensor2tensor's ``universal_transformer_base`` where it has one (ACT epsilon, loss weight and
    halting bias, twice as many ACT steps as fixed steps); the size and special-token fields are ``RobertaConfig``'s.

    Attributes:
        use_act (`bool`, defaults to True): dynamic halting per position (ACT). False: every position takes exactly
            ``num_hidden_layers`` steps.
        num_hidden_layers (`int`, defaults to 6): the number of recurrent steps in fixed-step mode (``use_act=False``).
            The block's weights are shared, so it does not change the number of parameters.
        act_max_steps (`int`, defaults to 12): the most steps a position may take with ACT (tensor2tensor:
            ``2 * num_hidden_layers``). A position still running at this step halts there with its remainder.
        act_epsilon (`float`, defaults to 0.01): a position halts once its summed halting probability exceeds
            ``1 - act_epsilon``; must lie in (0, 1).
        act_loss_weight (`float`, defaults to 0.01): weight of the ponder loss ``mean(N + R)`` over real tokens, added to
            the task loss when ``labels`` are given (always reported as ``ponder_loss``).
        act_halting_bias_init (`float`, defaults to 1.0): initial bias ``b`` of the halting unit
            ``p = sigmoid(W s + b)``; 1.0 as in tensor2tensor (``p`` starts near 0.73, so positions halt after 2 steps).
        act_early_exit (`bool`, *optional*): whether an eager forward leaves the ACT loop once every position has
            halted (the outputs are the same either way). Deciding it reads one value back per step: on a GPU a
            device-to-host synchronisation per step. None (the default): on the CPU only, where the read waits for no
            device; True: on every device (worth it when whole batches halt well before ``act_max_steps``); False:
            never (every forward runs ``act_max_steps`` steps, as compiled graphs always do).
        transition (`str`, defaults to ``"ffn"``): the block's transition function: ``"ffn"``, the position-wise
            feed-forward network ``dense(act(dense(x)))``; ``"sepconv"``, the paper's separable convolutions
            ``sepconv_k2(relu(sepconv_k1(x)))`` over the sequence (centred in encoders, causal in decoders).
        sepconv_first_kernel_size (`int`, defaults to 3): kernel width of the first separable convolution
            (tensor2tensor's 3).
        sepconv_second_kernel_size (`int`, defaults to 5): kernel width of the second (tensor2tensor's 5).
        position_embedding_type (`str`, defaults to ``"sinusoidal"``): ``"sinusoidal"``, the paper's coordinate
            embedding: the sinusoidal position signal is added to the state at every step (no position table);
            ``"absolute"``, a learned position table added once in the embeddings (BERT/ALBERT).
        add_timestep_signal (`bool`, defaults to True): add the sinusoidal signal of the step number to the state before
            every application of the block (the paper's timestep embedding). ALBERT imports turn it off.
        embedding_size (`int`, *optional*): None: embeddings have ``hidden_size`` features. An int ``E``: ALBERT's
            factorised embeddings, ``E`` features projected to ``hidden_size`` by ``embedding_hidden_mapping_in`` (and
            the LM head maps back to ``E`` before the tied decoder).
        max_position_embeddings (`int`, defaults to 512): the longest input (past plus new tokens for a decoder);
            positions start at 0. With ``"absolute"`` also the rows of the position table.
        is_decoder (`bool`, defaults to False): causal self-attention (and causal separable convolutions).
            ``HfxUniversalForCausalLM`` sets it on its own copy of the config.
        add_cross_attention (`bool`, defaults to False): the block attends to encoder states after self-attention
            (the decoder of ``HfxUniversalForSeq2SeqLM``, which sets it on its decoder's copy of the config).
        decoder_start_token_id (`int`, *optional*): first decoder token of ``HfxUniversalForSeq2SeqLM``; None:
            ``bos_token_id``.

    Other fields as in ``RobertaConfig`` (``hidden_act`` is used by the feed-forward transition and the LM head).
    """

    model_type = "hfx-universal"
    use_act: bool = True
    act_max_steps: int = 12
    act_epsilon: float = 0.01
    act_loss_weight: float = 0.01
    act_halting_bias_init: float = 1.0
    act_early_exit: bool | None = None
    transition: str = "ffn"
    sepconv_first_kernel_size: int = 3
    sepconv_second_kernel_size: int = 5
    position_embedding_type: str = "sinusoidal"
    add_timestep_signal: bool = True
    embedding_size: int | None = None
    is_decoder: bool = False
    add_cross_attention: bool = False
    decoder_start_token_id: int | None = None
    # Defaults that differ from HfxTextConfig's RoBERTa ones.
    num_hidden_layers: int = 6
    max_position_embeddings: int = 512

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        self.validate_universal()

    def validate_universal(self) -> None:
        """Raise ``ValueError`` naming the field to change when the values cannot work together."""

        def positive_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        if not positive_int(self.act_max_steps):
            raise ValueError(f"act_max_steps must be an integer >= 1 (the most ACT steps), got {self.act_max_steps!r}.")
        if not positive_int(self.num_hidden_layers):
            raise ValueError(
                f"num_hidden_layers must be an integer >= 1 (the steps in fixed-step mode), got {self.num_hidden_layers!r}."
            )
        if (
            isinstance(self.act_epsilon, bool)
            or not isinstance(self.act_epsilon, (int, float))
            or not 0 < self.act_epsilon < 1
        ):
            raise ValueError(
                f"act_epsilon must lie strictly between 0 and 1 (halting threshold 1 - act_epsilon), got {self.act_epsilon!r}."
            )
        if (
            isinstance(self.act_loss_weight, bool)
            or not isinstance(self.act_loss_weight, (int, float))
            or self.act_loss_weight < 0
        ):
            raise ValueError(f"act_loss_weight must be a number >= 0, got {self.act_loss_weight!r}.")
        if self.act_early_exit is not None and not isinstance(self.act_early_exit, bool):
            raise ValueError(
                f"act_early_exit must be None (early exit on the CPU only), True or False, got {self.act_early_exit!r}."
            )
        if self.transition not in TRANSITIONS:
            raise ValueError(f"transition must be one of {TRANSITIONS}, got {self.transition!r}.")
        for name in ("sepconv_first_kernel_size", "sepconv_second_kernel_size"):
            if not positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}.")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type must be one of {POSITION_EMBEDDING_TYPES}, got {self.position_embedding_type!r}."
            )
        if self.embedding_size is not None and not positive_int(self.embedding_size):
            raise ValueError(
                f"embedding_size must be None (no factorisation) or an integer >= 1, got {self.embedding_size!r}."
            )
        if not positive_int(self.max_position_embeddings):
            raise ValueError(f"max_position_embeddings must be an integer >= 1, got {self.max_position_embeddings!r}.")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id must be a token id below vocab_size, got {self.pad_token_id!r}.")

    @property
    def num_recurrent_steps(self) -> int:
        """The number of times the block runs at most: ``act_max_steps`` with ACT, else ``num_hidden_layers``."""
        return self.act_max_steps if self.use_act else self.num_hidden_layers
