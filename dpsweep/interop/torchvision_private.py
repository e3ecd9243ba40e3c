"""torchvision's private names: the door to them.

torchvision's ``Flowers102`` opens each JPEG only when an example is read; the list of files its
``setid.mat`` names is a private attribute. Reading it lets a run say which images are missing
before it trains, not halfway through an epoch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PRIVATE_NAMES = (("torchvision.datasets.flowers102", "Flowers102.__init__:_image_files"),)


def image_files(dataset: Any) -> list[Path]:
    """The image files a torchvision ``Flowers102`` split lists (none for another dataset).

    Private name: ``torchvision.datasets.Flowers102._image_files``. The dataset has no public list of
    its files; indexing it opens and decodes every image."""
    return [Path(f) for f in getattr(dataset, "_image_files", [])]
