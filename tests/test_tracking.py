"""What a run reports besides `metrics.jsonl`: the loss plot's title."""

from __future__ import annotations

from train import config as tc
from train.metrics import plot_losses, run_title


def test_run_title_names_a_mixture_of_experts_and_fits_the_figure(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    config = tc.override(tc.get_preset("moe_tiny"), optimizer="snoo_skewadam")
    title = run_title(config)
    assert title == ("moe_tiny\nsnoo_skewadam, n_layer=4, n_embd=128, n_head=4, "
                     "block_size=64\nmoe_every=2, n_experts=8, top_k=2")
    fig = plot_losses([{"step": 0, "val_loss": 1.0}], tmp_path / "loss.png", title=title)
    box = fig.axes[0].title.get_window_extent(FigureCanvasAgg(fig).get_renderer())
    assert 0 <= box.x0 < box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height, box


def test_plot_has_the_title_it_is_given_or_none(tmp_path):
    history = [{"step": 0, "val_loss": 1.0}, {"step": 1, "loss": 0.9}]
    fig = plot_losses(history, tmp_path / "titled.png", title="run\nadamw, n_layer=1")
    assert fig.axes[0].get_title() == "run\nadamw, n_layer=1"
    assert plot_losses(history, tmp_path / "bare.png").axes[0].get_title() == ""
    assert (tmp_path / "titled.png").stat().st_size > 0
