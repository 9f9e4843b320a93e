"""Configuration of ``hfx-swin``."""

from __future__ import annotations

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.backbone_utils import BackboneConfigMixin

from ...configs.transformers_checkpoints import TransformersCheckpointConfig, WeightRenames


class HfxSwinConfig(TransformersCheckpointConfig, BackboneConfigMixin, PreTrainedConfig):
    r"""Configuration of a Swin Transformer (hierarchical, shifted-window attention; Liu et al., 2021).

    Field names and defaults follow ``transformers.SwinConfig`` (the defaults are Swin-T,
    ``microsoft/swin-tiny-patch4-window7-224``), so its checkpoints convert by renaming.

    Attributes:
        image_size (`int` or `(int, int)`, defaults to 224): the training resolution, which sizes the absolute
            position table (with ``use_absolute_embeddings``). Any other input size works too (see the model).
        patch_size (`int` or `(int, int)`, defaults to 4): side of the patches (stride of the patch embedding).
        num_channels (`int`, defaults to 3): input channels.
        embed_dim (`int`, defaults to 96): channels of stage 1; each later stage doubles them.
        depths (`list[int]`, defaults to `[2, 2, 6, 2]`): blocks per stage.
        num_heads (`list[int]`, defaults to `[3, 6, 12, 24]`): attention heads per stage.
        window_size (`int`, defaults to 7): side of the attention windows, in tokens.
        mlp_ratio (`float`, defaults to 4.0): hidden width of the MLP relative to the stage width.
        qkv_bias (`bool`, defaults to True): biases on the query, key and value projections.
        hidden_dropout_prob (`float`, defaults to 0.0): dropout after the output projections.
        attention_probs_dropout_prob (`float`, defaults to 0.0): dropout on the attention probabilities.
        drop_path_rate (`float`, defaults to 0.1): stochastic depth, rising linearly from 0 to this value over
            all blocks.
        hidden_act (`str`, defaults to "gelu"): as in transformers.
        layer_norm_eps (`float`, defaults to 1e-5): as in transformers.
        initializer_range (`float`, defaults to 0.02): as in transformers.
        use_absolute_embeddings (`bool`, defaults to False): add a learned absolute position table.
        encoder_stride (`int`, defaults to 32): upsampling factor of the SimMIM decoder; must equal
            ``patch_size * 2 ** (len(depths) - 1)``.
        out_features (`list[str]`, *optional*): stages the backbone returns (``"stem"``, ``"stage1"`` ...), as in
            transformers' backbone API.
        out_indices (`list[int]`, *optional*): the same stages by index.

    A transformers ``swin`` config loads as this one (``configs/transformers_checkpoints.py``), and its checkpoints
    into our classes (the names transformers saves are ours; the newer in-memory names are renamed).
    """

    model_type = "hfx-swin"
    attribute_map = {"num_attention_heads": "num_heads", "num_hidden_layers": "num_layers"}

    image_size: int | list[int] | tuple[int, int] = 224
    patch_size: int | list[int] | tuple[int, int] = 4
    num_channels: int = 3
    embed_dim: int = 96
    depths: list[int] | tuple[int, ...] = (2, 2, 6, 2)
    num_heads: list[int] | tuple[int, ...] = (3, 6, 12, 24)
    window_size: int = 7
    mlp_ratio: float | int = 4.0
    qkv_bias: bool = True
    hidden_dropout_prob: float | int = 0.0
    attention_probs_dropout_prob: float | int = 0.0
    drop_path_rate: float | int = 0.1
    hidden_act: str = "gelu"
    use_absolute_embeddings: bool = False
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-5
    encoder_stride: int = 32
    _out_features: list[str] | None = None
    _out_indices: list[int] | None = None

    transformers_model_type = "swin"
    transformers_architectures = {
        "SwinModel": "HfxSwinModel",
        "SwinForImageClassification": "HfxSwinForImageClassification",
        "SwinForMaskedImageModeling": "HfxSwinForMaskedImageModeling",
        "SwinBackbone": "HfxSwinBackbone",
    }

    def __post_init__(self, **kwargs) -> None:
        # Lists, not tuples: a config must compare equal to itself after a save/load through JSON.
        self.depths = list(self.depths)
        self.num_heads = list(self.num_heads)
        self.validate_swin()
        self.num_layers = len(self.depths)
        # Channels after the last stage; lets VisionEncoderDecoderModel and friends read `hidden_size`.
        self.hidden_size = int(self.embed_dim * 2 ** (len(self.depths) - 1))
        self.stage_names = ["stem"] + [f"stage{i}" for i in range(1, len(self.depths) + 1)]
        self.set_output_features_output_indices(
            out_indices=kwargs.pop("out_indices", None), out_features=kwargs.pop("out_features", None)
        )
        # Derived values stored in saved configs; recomputed above, so the saved copies are dropped.
        for derived in ("num_layers", "hidden_size", "stage_names"):
            kwargs.pop(derived, None)
        super().__post_init__(**kwargs)

    @classmethod
    def transformers_weight_renames(cls, config_dict: dict, tensor_names: set[str] | None) -> WeightRenames:
        """transformers saves Swin under the names of the Hub checkpoints, which are ours; its in-memory names
        (``attention.q_proj`` ..., what ``state_dict()`` of a transformers 5.x Swin returns) are renamed, and the
        ``relative_position_index`` buffers of older checkpoints are recomputed."""
        return WeightRenames(
            key_mapping={
                r"attention\.q_proj\.": "attention.self.query.",
                r"attention\.k_proj\.": "attention.self.key.",
                r"attention\.v_proj\.": "attention.self.value.",
                r"attention\.relative_position_bias\.relative_position_bias_table": "attention.self.relative_position_bias_table",
                r"attention\.o_proj\.": "attention.output.dense.",
                r"mlp\.fc1\.": "intermediate.dense.",
                r"mlp\.fc2\.": "output.dense.",
            },
            unused=(r"relative_position_index$",),
        )

    @staticmethod
    def _pair(value, name: str) -> tuple[int, int]:
        pair = tuple(value) if isinstance(value, (list, tuple)) else (value, value)
        if len(pair) != 2 or not all(isinstance(v, int) and v > 0 for v in pair):
            raise ValueError(
                f"{name} must be a positive int or a pair of positive ints (height, width), got {value!r}."
            )
        return pair

    def validate_swin(self) -> None:
        """Raise ``ValueError`` naming the field to change when the values cannot work together."""
        self._pair(self.image_size, "image_size")
        self._pair(self.patch_size, "patch_size")
        if not self.depths or not all(isinstance(d, int) and d > 0 for d in self.depths):
            raise ValueError(f"depths must be a non-empty list of positive ints (blocks per stage), got {self.depths}.")
        if len(self.num_heads) != len(self.depths):
            raise ValueError(
                f"num_heads has {len(self.num_heads)} entries but depths has {len(self.depths)}; give one head "
                "count per stage."
            )
        for stage, heads in enumerate(self.num_heads):
            dim = self.embed_dim * 2**stage
            if not isinstance(heads, int) or heads <= 0 or dim % heads:
                raise ValueError(
                    f"Stage {stage + 1} has {dim} channels (embed_dim * 2**{stage}), which num_heads[{stage}]={heads} "
                    "does not divide; change embed_dim or num_heads."
                )
        for name in ("embed_dim", "window_size", "num_channels", "encoder_stride"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be positive, got {self.mlp_ratio}.")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "drop_path_rate"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"{name} must lie in [0, 1), got {value}.")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act {self.hidden_act!r} is unknown; use one of e.g. 'gelu', 'relu', 'silu'.")
