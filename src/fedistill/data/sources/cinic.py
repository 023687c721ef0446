"""CINIC-10: the official PNG folders ``<data>/cinic-10/{train,test}/<class>/*.png`` (no download)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ...errors import DatasetError
from ...registry import DATASETS
from ..dataset import Dataset
from .common import _build, _missing_error

# The package's name, the logger every loader used before they were split into modules: log lines keep it.
log = logging.getLogger("fedistill.data.sources")

CINIC10_FOLDER = "cinic-10"
CINIC10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)
"""CINIC-10 class folders; their sorted order is the label index (same classes and order as CIFAR-10)."""


def _read_png_folder(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """All ``<class>/*.png`` images below ``directory`` in (class, file name) order, as uint8 (N, 3, 32, 32)."""
    from PIL import Image, UnidentifiedImageError  # Pillow comes with matplotlib; only needed here

    missing = [c for c in CINIC10_CLASSES if not (directory / c).is_dir()]
    if missing:
        raise DatasetError(
            f"CINIC-10: class folder(s) {', '.join(missing)} missing in {directory.resolve()}; it must hold "
            f"one folder per class ({', '.join(CINIC10_CLASSES)}) with the official PNG files"
        )
    files: list[Path] = []
    labels: list[int] = []
    for label, cls in enumerate(CINIC10_CLASSES):
        pngs = sorted((directory / cls).glob("*.png"))
        if not pngs:
            raise DatasetError(
                f"CINIC-10: no .png files in {(directory / cls).resolve()}; the extraction is incomplete"
            )
        files.extend(pngs)
        labels.extend([label] * len(pngs))
    images = np.empty((len(files), 32, 32, 3), dtype=np.uint8)
    for i, path in enumerate(files):
        try:
            with Image.open(path) as im:
                # A few CINIC images (from ImageNet) are greyscale; the dataset is used as RGB.
                array = np.asarray(im if im.mode == "RGB" else im.convert("RGB"))
        except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as exc:
            raise DatasetError(
                f"{path}: cannot decode PNG ({type(exc).__name__}: {exc}); the file is corrupt"
            ) from None
        if array.shape != (32, 32, 3):
            raise DatasetError(f"{path}: image is {array.shape[1]}x{array.shape[0]}, expected 32x32")
        images[i] = array
    return images.transpose(0, 3, 1, 2), np.asarray(labels, dtype=np.int64)


@DATASETS.register("cinic10")
def load_cinic10(root: Path, download: bool = False, verify: bool = True) -> Dataset:
    """CINIC-10: 90k/90k 3x32x32, 10 CIFAR-10 classes (official PNG folders in <data>/cinic-10/{train,test}/).

    Labels follow the sorted class-folder order (airplane=0 ... truck=9), the same as CIFAR-10. The
    ``valid`` split is not used. Images are decoded once (Pillow) into the uint8 tensor. There is no
    published checksum for the PNGs, so ``verify`` has no effect; each file is validated while decoding.
    There is no ``download``: the release is a single ~700 MB tar on the University of Edinburgh
    DataShare, not a stable file host with a checksum (see github.com/BayesWatch/cinic-10); download and
    extract it by hand so that ``<data>/cinic-10/train/airplane/*.png`` exists.
    """
    directory = Path(root) / CINIC10_FOLDER
    absent = [s for s in ("train", "test") if not (directory / s).is_dir()]
    if absent:
        expected = [f"{s}/<class>/*.png" for s in ("train", "test")]
        raise _missing_error(
            "CINIC-10", directory, expected, [f"{s}/<class>/*.png" for s in absent],
            "CINIC-10 is not downloaded automatically (download=True does not apply): get CINIC-10.tar.gz "
            "from the release linked at github.com/BayesWatch/cinic-10 and extract it into that directory.",
        )
    if download:
        log.info("CINIC-10 has no automatic download; using the files in %s", directory)
    train = _read_png_folder(directory / "train")
    test = _read_png_folder(directory / "test")
    return _build(
        "cinic10", train, test, 10,
        # The dataset's own published statistics (the CINIC-10 README, github.com/BayesWatch/cinic-10); not checked
        # here: no CINIC-10 files on our machines.
        (0.47889522, 0.47227842, 0.43047404), (0.24205776, 0.23828046, 0.25874835),
    )
