"""muP: the coordinate check (activation size flat in width under muP, growing under SP)."""
import os

from megatron_ext.hydro.coord_check import coord_data, growth, plot


def test_coordinate_check_separates_mup_from_sp(tmp_path):
    widths = [16, 128]
    sp = coord_data(widths, "sp", steps=4, lr=1e-2, seeds=2)
    mu = coord_data(widths, "mup", steps=4, lr=1e-2, seeds=2)
    for layer in ("blocks.0.attn", "blocks.0.mlp.fc2"):
        assert growth(sp, layer) > 1.8, (layer, growth(sp, layer))          # SP: updates grow with width
        assert 0.6 < growth(mu, layer) < 1.5, (layer, growth(mu, layer))    # muP: width-independent
    # at initialization both parametrizations agree on hidden layers (muP changes the updates)
    assert abs(growth(sp, "blocks.0.mlp.fc2", 0) - growth(mu, "blocks.0.mlp.fc2", 0)) < 0.2
    out = tmp_path / "coord.png"
    plot({"sp": sp, "mup": mu}, str(out))
    assert os.path.getsize(out) > 10_000


def test_coordinate_check_passes_for_the_llama_block():
    """RMSNorm, SwiGLU (gate, fc1, fc2), grouped-query attention with rotary positions: under muP
    every hidden activation keeps its size from width 16 to 128 after training steps; under SP the
    same layers grow."""
    widths = [16, 128]
    sp = coord_data(widths, "sp", steps=4, lr=1e-2, seeds=2, family="llama")
    mu = coord_data(widths, "mup", steps=4, lr=1e-2, seeds=2, family="llama")
    for layer in ("blocks.0.attn", "blocks.0.mlp.fc2"):
        assert growth(sp, layer) > 1.6, (layer, growth(sp, layer))
        assert 0.6 < growth(mu, layer) < 1.5, (layer, growth(mu, layer))
        assert growth(sp, layer) > 1.8 * growth(mu, layer), layer
    assert 0.9 < growth(mu, "tok") < 1.1                                     # input embedding: width-free
    # the readout at initialization shrinks like 1/sqrt(width) under muP (8x width: 0.35)
    assert 0.25 < growth(mu, "head", 0) < 0.45 and 0.8 < growth(sp, "head", 0) < 1.2
