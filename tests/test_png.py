"""Palette PNGs (`eagle_jax.png`): the plots keep their pixels to within a palette's rounding, in
fewer bytes, and a file the palette would not shrink stays byte for byte."""

import io

import numpy as np
import pytest

from eagle_jax import png

Image = pytest.importorskip("PIL.Image")
plt = pytest.importorskip("matplotlib.pyplot")


def _figure():
    fig, ax = plt.subplots(figsize=(5, 3))
    x = np.linspace(0, 6, 200)
    for i in range(4):
        ax.plot(x, np.sin(x + i), label=f"line {i}")
    ax.bar([1, 2, 3], [0.5, 0.8, 0.3], color="tab:red", alpha=0.6)
    ax.legend()
    ax.set_title("speedup")
    return fig


def _rgb(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"), dtype=np.int16)


def test_save_figure_is_a_smaller_palette_png_with_the_same_pixels(tmp_path):
    fig = _figure()
    raw = io.BytesIO()
    fig.savefig(raw, format="png", dpi=100)
    out = png.save_figure(fig, tmp_path / "p.png", dpi=100)
    plt.close(fig)
    data = out.read_bytes()
    with Image.open(io.BytesIO(data)) as im:
        assert im.mode == "P"
    assert len(data) < 0.7 * len(raw.getvalue())
    a, b = _rgb(raw.getvalue()), _rgb(data)
    assert a.shape == b.shape
    diff = np.abs(a - b)
    assert diff.mean() < 1.0 and np.mean(diff.max(-1) > 24) < 0.01  # a palette's rounding, nothing moved
    assert not list(tmp_path.glob("*.tmp"))


def test_slim_file_rewrites_only_when_smaller(tmp_path, capsys):
    fig = _figure()
    big = tmp_path / "big.png"
    fig.savefig(big, dpi=100)
    plt.close(fig)
    tiny = tmp_path / "tiny.png"
    Image.new("P", (4, 4)).save(tiny)  # already as small as a PNG gets
    tiny_bytes, big_bytes = tiny.read_bytes(), big.read_bytes()
    assert png.main([str(big), str(tiny)]) == 0
    assert "2 files" in capsys.readouterr().out
    assert tiny.read_bytes() == tiny_bytes
    assert len(big.read_bytes()) < len(big_bytes)
    assert np.abs(_rgb(big.read_bytes()) - _rgb(big_bytes)).mean() < 1.0


def test_transparent_pixels_go_on_white(tmp_path):
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[:4, :, :] = (10, 20, 200, 255)  # top half opaque blue, bottom half transparent
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    out = _rgb(png.palette_png(buf.getvalue()))
    assert (out[:4] == (10, 20, 200)).all() and (out[4:] == 255).all()
