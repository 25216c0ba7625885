"""Plots a reader can trust: miss and sparsity in % from 0, the random and oracle references the
results carry, a legend on every panel, predictors compared at effective sparsity; the mask plot
zoomed to a readable window with a colour key; progress bars that name their phase."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from spin_trtllm import SpinConfig  # noqa: E402
from spin_trtllm.cli import build_parser, main  # noqa: E402
from spin_trtllm.errors import SpinError  # noqa: E402
from spin_trtllm.replay import plots  # noqa: E402
from spin_trtllm.replay.evaluate import replay  # noqa: E402
from spin_trtllm.testing.traces import make_trace, planted_v2_trace  # noqa: E402

SPARSITIES = [0.3, 0.5, 0.7]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def results():
    trace = make_trace(steps=10, layers=2, start=160, block_size=8, index_topk=16)
    return replay(trace, SPARSITIES, SpinConfig())


@pytest.fixture(scope="module")
def predictor_results():
    """SPIN and the probe on one v2 trace: the probe reads summary rows."""
    trace = planted_v2_trace(steps=12, start=256, block_size=16, index_topk=32)
    return (replay(trace, SPARSITIES, SpinConfig()) +
            replay(trace, SPARSITIES, SpinConfig(), predictor="probe", label="probe"))


def _lines(ax):
    return {line.get_label(): line for line in ax.get_lines()}


def _pct(rows, key, by):
    """100 x rows[key], ordered by rows[by]."""
    return [100 * r[key] for r in sorted(rows, key=lambda r: r[by])]


def _check_percent_axes_from_zero(fig):
    fig.canvas.draw()                                   # tick labels exist once drawn
    for ax in fig.axes:
        assert ax.get_ylim()[0] == 0 and ax.get_xlim()[0] == 0
        for labels in (ax.get_yticklabels(), ax.get_xticklabels()):
            texts = [t.get_text() for t in labels if t.get_text()]
            assert texts and all(t.endswith("%") for t in texts), texts
        assert ax.get_legend() is not None, ax.get_title()
        top = max(max(line.get_ydata()) for line in ax.get_lines())
        assert top <= ax.get_ylim()[1]


def test_miss_plot_in_percent_with_random_and_oracle(results, tmp_path):
    assert all(r["random_mean_miss"] is not None and r["oracle_mean_miss"] is not None
               for r in results)
    fig = plots.miss_curve_figure(results)
    _check_percent_axes_from_zero(fig)
    assert len(fig.axes) == 2
    by = "realized_sparsity"                      # one predictor, spin: no summary rows read
    for ax, stat in zip(fig.axes, ("mean", "p99")):
        assert "realized" in ax.get_xlabel()
        lines = _lines(ax)
        assert set(lines) == {"spin", "random", "oracle"}
        legend = {t.get_text() for t in ax.get_legend().get_texts()}
        assert legend == set(lines)
        for label, key in (("spin", f"{stat}_miss"), ("random", f"random_{stat}_miss"),
                           ("oracle", f"oracle_{stat}_miss")):
            np.testing.assert_allclose(lines[label].get_ydata(), _pct(results, key, by))
            np.testing.assert_allclose(lines[label].get_xdata(), _pct(results, by, by))
        # the references bracket SPIN: oracle <= SPIN <= random
        assert all(o <= s + 1e-9 for o, s in zip(lines["oracle"].get_ydata(),
                                                 lines["spin"].get_ydata()))
    matplotlib.pyplot.close(fig)
    out = plots.plot_miss_curve(results, tmp_path / "miss.png")
    assert out.read_bytes()[:8] == PNG


def test_predictors_are_compared_at_effective_sparsity(predictor_results, tmp_path):
    probe = [r for r in predictor_results if r.get("variant") == "probe"]
    spin = [r for r in predictor_results if "variant" not in r]
    assert probe and spin and all(r["probe_bytes_fraction"] > 0 for r in probe)
    assert plots.miss_curve_axis(predictor_results) == "effective"
    assert plots.miss_curve_axis(probe) == "effective"          # the probe alone reads rows
    fig = plots.miss_curve_figure(predictor_results)
    _check_percent_axes_from_zero(fig)
    by = "effective_sparsity"
    for ax, stat in zip(fig.axes, ("mean", "p99")):
        assert "effective" in ax.get_xlabel()
        lines = _lines(ax)
        for name, rows in (("spin", spin), ("probe", probe)):
            np.testing.assert_allclose(lines[name].get_xdata(), _pct(rows, by, by))
            np.testing.assert_allclose(lines[name].get_ydata(), _pct(rows, f"{stat}_miss", by))
            # at another x than SPIN's, each predictor's references are its own lines
            for ref in ("random", "oracle"):
                line = lines[f"{ref} ({name})"]
                np.testing.assert_allclose(line.get_ydata(), _pct(rows, f"{ref}_{stat}_miss", by))
                np.testing.assert_allclose(line.get_xdata(), _pct(rows, by, by))
    # the probe's summary rows count: its x is below its realized sparsity
    x = _lines(fig.axes[0])["probe"].get_xdata()
    assert all(a < b for a, b in zip(x, _pct(probe, "realized_sparsity", by)))
    matplotlib.pyplot.close(fig)
    fig = plots.miss_curve_figure(predictor_results, x="realized")
    assert "realized" in fig.axes[0].get_xlabel()
    matplotlib.pyplot.close(fig)
    assert plots.plot_miss_curve(predictor_results, tmp_path / "p.png").stat().st_size > 1000


def _row(trace, variant, s, miss, rnd, orc):
    return {"trace": trace, "variant": variant, "predictor": "spin", "realized_sparsity": s,
            "effective_sparsity": s, "probe_bytes_fraction": 0.0, "mean_miss": miss,
            "p99_miss": miss, "random_mean_miss": rnd, "random_p99_miss": rnd,
            "oracle_mean_miss": orc, "oracle_p99_miss": orc}


def test_variants_with_one_budget_share_one_reference_line():
    rows = [_row("t", v, s, m * s, s, s / 4) for v, m in (("A1", 0.5), ("A2", 0.6))
            for s in (0.2, 0.4)]
    fig = plots.miss_curve_figure(rows)
    lines = _lines(fig.axes[0])
    assert set(lines) == {"A1", "A2", "random", "oracle"}
    np.testing.assert_allclose(lines["random"].get_ydata(), [20.0, 40.0])
    matplotlib.pyplot.close(fig)
    rows[0]["random_mean_miss"] = 0.2005                       # rounding: still one line
    fig = plots.miss_curve_figure(rows)
    assert "random" in _lines(fig.axes[0])
    matplotlib.pyplot.close(fig)
    rows[0]["random_mean_miss"] = 0.1                          # now the budgets differ
    fig = plots.miss_curve_figure(rows)
    lines = _lines(fig.axes[0])
    assert {"random (A1)", "random (A2)", "oracle"} <= set(lines) and "random" not in lines
    np.testing.assert_allclose(lines["random (A1)"].get_ydata(), [10.0, 40.0])
    matplotlib.pyplot.close(fig)
    many = rows + [_row("t", v, s, s / 2, s, s / 4) for v in ("A3", "A4") for s in (0.2, 0.4)]
    fig = plots.miss_curve_figure(many)
    assert {"random (A1)", "random (all but A1)"} <= set(_lines(fig.axes[0]))
    matplotlib.pyplot.close(fig)
    two = rows[:2] + [_row("u", "A1", s, s / 2, s, s / 4) for s in (0.2, 0.4)]
    fig = plots.miss_curve_figure(two)
    assert {"t [A1]", "u [A1]"} <= set(_lines(fig.axes[0]))
    matplotlib.pyplot.close(fig)


def test_miss_plot_refuses_an_unknown_axis(results):
    with pytest.raises(SpinError, match="x axis 'bogus'"):
        plots.miss_curve_figure(results, x="bogus")


# ---- the mask plot ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_trace():
    """More steps and slots than the default window shows."""
    return make_trace(steps=plots.MASK_STEPS + 90, layers=1, start=1200, block_size=16,
                      index_topk=32, seed=3)


def _selection(trace, b, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(-(-int(n) // b), generator=gen) < 0.5 for n in trace.row_len[:, 0, 0]]


def _key(ax):
    """{legend label: uint8 RGBA}."""
    leg = ax.get_legend()
    return {t.get_text(): tuple(int(round(255 * c)) for c in h.get_facecolor())
            for t, h in zip(leg.get_texts(), leg.legend_handles)}


def _pixels(ax):
    """{uint8 RGBA: count} over the drawn canvas."""
    counts = {}
    for im in ax.get_images():
        arr = np.asarray(im.get_array()).reshape(-1, 4)
        colors, n = np.unique(arr, axis=0, return_counts=True)
        for c, k in zip(map(tuple, colors.tolist()), n.tolist()):
            counts[c] = counts.get(c, 0) + k
    return counts


def test_mask_plot_default_window_is_readable(long_trace, tmp_path):
    trace, b, K = long_trace, 16, 32
    sel = _selection(trace, b)
    fig = plots.topk_mask_figure(trace, selected=sel, block_size=b, sparsity=0.5)
    (ax,) = fig.axes
    T = trace.num_steps
    newest = int(trace.row_len[T - plots.MASK_STEPS:, 0, 0].max())
    assert newest > plots.MASK_SLOTS and T > plots.MASK_STEPS     # the window is a zoom
    lo = newest - plots.MASK_SLOTS
    assert ax.get_xlim() == (lo - 0.5, newest - 0.5)               # the newest slots
    assert ax.get_ylim() == (T - 0.5, T - plots.MASK_STEPS - 0.5)  # the last steps
    box = ax.get_window_extent()
    assert box.width >= plots.MASK_SLOTS and box.height >= plots.MASK_STEPS  # >= 1 px each
    key = _key(ax)
    assert len(key) == len(set(key.values())) == 5                 # distinct colours
    misses = [label for label in key if "miss" in label]
    assert len(misses) == 1
    for words in (("top-K", "selected"), ("selected", "not top-K"), ("skipped", "not top-K"),
                  ("not visible",)):
        assert any(all(w in label for w in words) for label in key), (words, list(key))
    drawn = _pixels(ax)
    assert set(drawn) <= set(key.values())                         # every colour explained
    # the red pixels are the top-K slots in the window whose block SPIN did not select
    expect = 0
    for t in range(T - plots.MASK_STEPS, T):
        n = int(trace.row_len[t, 0, 0])
        top = trace.step_scores(t)[0, 0, :n].topk(min(K, n)).indices
        blocks = sel[t]
        expect += int(((top >= lo) & ~blocks[top // b]).sum())
    assert expect > 0 and drawn.get(key[misses[0]], 0) == expect
    matplotlib.pyplot.close(fig)
    out = plots.plot_topk_mask(trace, tmp_path / "mask.png", selected=sel, block_size=b)
    assert out.read_bytes()[:8] == PNG


def test_mask_plot_without_a_selection_and_its_window(long_trace):
    fig = plots.topk_mask_figure(long_trace, max_slots=100, max_steps=40)
    (ax,) = fig.axes
    key = _key(ax)
    assert not any("miss" in label or "SPIN" in label for label in key)
    assert any("top-K" in label for label in key) and any("not visible" in label for label in key)
    assert set(_pixels(ax)) <= set(key.values())
    newest = int(long_trace.row_len[-40:, 0, 0].max())
    assert ax.get_xlim() == (newest - 100 - 0.5, newest - 0.5)
    matplotlib.pyplot.close(fig)
    fig = plots.topk_mask_figure(long_trace, max_slots=None, max_steps=None)   # everything
    ax = fig.axes[0]
    assert ax.get_xlim() == (-0.5, long_trace.max_slots - 0.5)
    assert ax.get_ylim() == (long_trace.num_steps - 0.5, -0.5)
    matplotlib.pyplot.close(fig)


@pytest.mark.parametrize("kw,match", [({"max_slots": 0}, "slots to show must be >= 1"),
                                      ({"max_steps": 0}, "steps to show must be >= 1"),
                                      ({"layer": 1}, r"layer 1 is outside \[0, 1\)")])
def test_mask_plot_refuses_bad_windows(long_trace, kw, match):
    with pytest.raises(SpinError, match=match):
        plots.topk_mask_figure(long_trace, **kw)


def test_cli_mask_window_defaults_are_the_readable_window():
    parser = build_parser()
    args = parser.parse_args(["replay", "t.safetensors", "--mask-plot", "m.png"])
    assert (args.mask_slots, args.mask_steps) == (plots.MASK_SLOTS, plots.MASK_STEPS)
    sub = parser._subparsers._group_actions[0].choices["replay"]
    helps = {a.dest: a.help for a in sub._actions}
    assert f"default {plots.MASK_SLOTS}" in helps["mask_slots"]
    assert f"default {plots.MASK_STEPS}" in helps["mask_steps"]


# ---- progress bars ------------------------------------------------------------------------


def test_replay_cli_bars_name_each_phase(bars, tmp_path, capsys):
    trace = make_trace(steps=7, layers=2, start=60, block_size=8, index_topk=8)
    paths = [str(trace.save(tmp_path / f"{name}.safetensors")) for name in ("a", "b")]
    assert main(["replay", *paths, "--sparsity", "0.3", "0.5", "--mask-plot",
                 str(tmp_path / "m.png")]) == 0
    descs = [b.kw["desc"] for b in bars]
    assert descs == ["load traces"] + [
        desc for i, path in enumerate(paths, 1)
        for desc in (f"replay {path} sparsity 0.3 0.5 (trace {i}/2)", f"mask plot {path} layer 0")]
    assert all(b.total and b.n == b.total for b in bars), [(b.n, b.total) for b in bars]
    assert [b.total for b in bars] == [2, 7, 7, 7, 7]


def test_replay_bar_names_trace_predictor_and_sparsities(bars):
    trace = planted_v2_trace(steps=4, start=64, block_size=16, index_topk=16)
    replay(trace, [0.25, 0.5], predictor="probe", label="probe", progress=True)
    (bar,) = bars
    assert bar.kw["desc"] == f"replay {trace.name} [probe] sparsity 0.25 0.5"
    assert bar.kw["unit"] == "step" and bar.total == bar.n == 4


def test_mask_plot_names_the_predictor_that_selected(long_trace):
    trace, b = long_trace, 16
    fig = plots.topk_mask_figure(trace, selected=_selection(trace, b), block_size=b,
                                 selector="probe")
    (ax,) = fig.axes
    labels = list(_key(ax)) + [ax.get_title()]
    assert all("SPIN" not in text for text in labels)
    assert sum("probe" in text for text in labels) == 5           # 4 selection colours + title
    matplotlib.pyplot.close(fig)
