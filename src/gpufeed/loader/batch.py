"""A batch on its way to the consumer, as the feeds make it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpufeed.augment.params import Params


@dataclass
class Batch:
    """What the consumer turns into (images, labels): pixels are `images`, or `images[index]` (a
    fused gather reads the store's rows itself); `final`: already augmented (jpeg stores)."""

    images: torch.Tensor
    labels: torch.Tensor
    params: Params | None
    index: torch.Tensor | None = None
    final: bool = False
    samples: torch.Tensor | np.ndarray | None = None  # host: the store index of each sample, for fields
