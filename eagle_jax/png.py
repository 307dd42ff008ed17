"""PNG plots in a 256-colour palette: a third of the bytes of matplotlib's RGBA files.

The benchmark and training plots are flat colours, text and anti-aliased lines, which a
256-colour palette (median cut) draws with no difference a reader can see, in about a third of
the bytes. The repository keeps every run's plots, and a device call carries the whole checkout
under a size limit, so the bytes count. `save_figure` writes a matplotlib figure that way (whole,
through `write_atomic`); `python -m eagle_jax.png FILE...` converts PNGs already written. Either
keeps matplotlib's file where the palette one would not be smaller. Pillow comes with
matplotlib; without it the figure is saved as matplotlib writes it.
"""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path

from .atomic_file import write_atomic

COLOURS = 256


def palette_png(data: bytes) -> bytes:
    """`data` (a PNG) as an optimized PNG of at most `COLOURS` palette colours (transparency
    flattened onto white, as the plots are shown)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im.load()
        if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
            rgba = im.convert("RGBA")
            rgb = Image.new("RGB", rgba.size, (255, 255, 255))
            rgb.paste(rgba, mask=rgba.getchannel("A"))
        else:
            rgb = im.convert("RGB")
    out = io.BytesIO()
    rgb.quantize(COLOURS, method=Image.Quantize.MEDIANCUT).save(out, "PNG", optimize=True)
    return out.getvalue()


def slimmed(data: bytes) -> bytes:
    """`palette_png(data)` where it is smaller than `data` (a PNG), else `data` itself."""
    new = palette_png(data)
    return new if len(new) < len(data) else data


def save_figure(fig, path: str | os.PathLike, **savefig_kw) -> Path:
    """`fig.savefig(path, **savefig_kw)` as a palette PNG (module doc)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **savefig_kw)
    data = buf.getvalue()
    try:
        data = slimmed(data)
    except ImportError:  # no Pillow: matplotlib's own file
        pass
    return write_atomic(path, data)


def slim_file(path: str | os.PathLike) -> tuple[int, int]:
    """Rewrite the PNG at `path` as `slimmed` says; (bytes before, after)."""
    path = Path(path)
    old = path.read_bytes()
    new = slimmed(old)
    if new is not old:
        write_atomic(path, new)
    return len(old), len(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle_jax.png", description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="PNG files to rewrite in place")
    args = ap.parse_args(argv)
    before = after = 0
    for f in args.files:
        b, a = slim_file(f)
        before, after = before + b, after + a
        print(f"{f}: {b} -> {a} bytes")
    print(f"{len(args.files)} files: {before} -> {after} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
