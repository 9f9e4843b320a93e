"""Image processor of ``hfx-swin``: PIL/NumPy only (no torchvision needed)."""

from __future__ import annotations

from transformers.image_processing_backends import PilBackend
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, PILImageResampling


class HfxSwinImageProcessor(PilBackend):
    """Resize to ``size`` (bicubic), rescale to [0, 1], normalise with the ImageNet mean/std and convert to RGB.

    The defaults are those of ``microsoft/swin-tiny-patch4-window7-224``'s processor (224 x 224, no centre crop).
    Returns ``pixel_values`` ``(batch, 3, height, width)``. The model accepts any size, so ``do_resize=False``
    (or another ``size``) is fine; images of one batch must share a size.
    """

    resample = PILImageResampling.BICUBIC
    image_mean = IMAGENET_DEFAULT_MEAN
    image_std = IMAGENET_DEFAULT_STD
    size = {"height": 224, "width": 224}
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    model_input_names = ["pixel_values"]


__all__ = ["HfxSwinImageProcessor"]
