"""The live panels, fed hand-built protocol events (no engine process)."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import QPointF

from app.models.budget import BudgetScale, free_for_budget
from app.models.budget_estimate import Estimate, Estimator, scaled_tokens_per_s, slot_bytes_of
from app.models.heatmap import HeatmapData, OutlineCache, colour_values, overlay_scale
from app.models.telemetry_history import RingSeries, TelemetryHistory
from app.panels.budget import BudgetPanel
from app.panels.heatmap import HeatmapPanel
from app.panels.hit_rate import HitRatePanel
from app.panels.system import SystemPanel, policy_label
from app.panels.traffic import TrafficPanel
from engine import protocol as p
from tests.helpers.app_fixtures import model_loaded, snapshot


# ----------------------------------------------------------------- Qt-free models
def test_ring_series_keeps_the_newest_rows_in_order():
    ring = RingSeries(3, ("a",))
    for i in range(5):
        ring.append(float(i), {"a": i * 10})
    assert ring.times().tolist() == [2.0, 3.0, 4.0]
    assert ring.column("a").tolist() == [20.0, 30.0, 40.0]


def test_history_restarts_when_engine_time_goes_back():
    history = TelemetryHistory(capacity=10)
    history.add(snapshot(5.0))
    history.add(snapshot(6.0))
    history.add(snapshot(0.5))  # a restarted engine
    assert history.series.times().tolist() == [0.5]


def test_colour_values_are_fixed_range_float32():
    counts = np.array([[0, 5], [10, 20]], dtype=np.int32)
    values, peak = colour_values(counts)
    assert values.dtype == np.float32 and peak == 20
    assert values.min() == 0.0 and values.max() == 1.0
    zeros, peak = colour_values(np.zeros((2, 2), dtype=np.int32))
    assert peak == 0 and not zeros.any()


def test_outline_is_a_one_pixel_frame_around_resident_cells_and_rebuilt_only_on_change():
    resident = np.array([[True, False]])
    cache = OutlineCache()
    assert cache.update(resident, (4, 4))
    mask = cache.mask
    assert mask.shape == (4, 8)
    assert mask[:, :4].tolist() == [[1, 1, 1, 1], [1, 0, 0, 1], [1, 0, 0, 1], [1, 1, 1, 1]]
    assert not mask[:, 4:].any()
    assert not cache.update(resident.copy(), (4, 4))  # same residency, same scale: nothing to do
    assert cache.update(resident, (5, 5))  # resized plot
    assert overlay_scale(1.5, 10) == (1, 1)  # too small for a frame: tint instead
    assert overlay_scale(6.2, 20.4) == (20, 6)


def test_cell_description_names_layer_expert_count_residency_and_bytes():
    data = HeatmapData(np.array([[3, 0]], dtype=np.int32), np.array([[True, False]]), "reply")
    text = data.describe(0, 0, 2048)
    assert "layer 0" in text and "expert 0" in text and "3 tokens" in text and "resident" in text
    assert "2.00 KiB" in text
    assert "not resident" in data.describe(0, 1, 2048)


def test_budget_scale_maps_positions_to_bytes_and_says_all_at_the_top():
    scale = BudgetScale(min_bytes=8 * 1024, max_bytes=32 * 1024, slot_bytes=1024)
    assert scale.steps == 24
    assert scale.to_bytes(0) == 8 * 1024 and scale.to_bytes(24) == 32 * 1024
    assert scale.to_position(20 * 1024) == 12
    assert scale.budget_text(24) == "all" and scale.budget_text(0) == str(8 * 1024)
    big = BudgetScale(2**30, 200 * 2**30, 2**20)
    assert big.steps == 1000
    assert free_for_budget(2**30, 3 * 2**30) == 4 * 2**30


def test_tokens_per_second_scales_the_stall_with_the_misses():
    # 10 tok/s, half of each token stalled: half the misses -> 0.05 + 0.025 s per token
    assert scaled_tokens_per_s(10.0, 0.05, 2.0, 1.0) == pytest.approx(1 / 0.075)
    assert scaled_tokens_per_s(0.0, 0.05, 2.0, 1.0) is None
    assert scaled_tokens_per_s(10.0, 0.0, 0.0, 0.0) == 10.0


def test_estimator_uses_the_planner_on_the_engine_curves():
    pytest.importorskip("engine.accounting.planner")
    model = model_loaded(layers=4, experts=8)
    snap = snapshot(layers=4, experts=8, slots=4)
    estimate = Estimator()
    low, high = estimate(model.min_budget_bytes, model, snap), estimate(model.max_budget_bytes, model, snap)
    if low is None:
        pytest.skip("engine.accounting.planner has no estimate() yet")
    assert sum(low.slots_per_layer) == 4 * 2 and sum(high.slots_per_layer) == 4 * 8
    assert low.hit_rate < high.hit_rate == pytest.approx(1.0)
    assert slot_bytes_of(model) == 1024
    assert estimate(model.min_budget_bytes, model, snapshot(curves=False)) is None


# ----------------------------------------------------------------- Qt views
def test_heatmap_shows_counts_and_outline_and_hover_text(qtbot):
    panel = HeatmapPanel()
    qtbot.addWidget(panel)
    panel.resize(600, 400)
    panel.show()
    panel.on_event(model_loaded(layers=4, experts=8))
    counts = np.zeros((4, 8), dtype=np.int32)
    counts[2, 5] = 7
    resident = np.zeros((4, 8), dtype=bool)
    resident[2, 5] = True
    panel.on_event(snapshot(layers=4, experts=8, counts=counts, resident=resident))
    panel.refresh()
    image = panel.image.image
    assert image.dtype == np.float32 and image.shape == (4, 8)
    assert image[2, 5] == 1.0 and image.sum() == 1.0
    assert panel.outline._image is not None and panel.updates == 1
    # what is on screen: the hot cell is bright, a cold one is dark
    panel.plot.viewport().repaint()
    frame = panel.plot.grab().toImage()
    view = panel.plot.getPlotItem().getViewBox()

    def pixel(layer: int, expert: int):
        point = panel.plot.mapFromScene(view.mapViewToScene(QPointF(expert, layer)))
        return frame.pixelColor(point)

    assert pixel(2, 5).lightness() > 150 and pixel(0, 0).lightness() < 30
    # hovering the middle of cell (layer 2, expert 5)
    scene_pos = view.mapViewToScene(QPointF(5.0, 2.0))
    assert panel.cell_at(scene_pos) == (2, 5)
    panel._hover(scene_pos)
    assert "layer 2 · expert 5 · 7 tokens" in panel.hover_label.text()
    assert "resident" in panel.hover_label.text() and "1.00 KiB" in panel.hover_label.text()
    # switch to since-load counts
    panel.mode.setCurrentIndex(1)
    panel.refresh()
    assert panel.data.mode == "total" and panel.updates == 2
    panel.refresh()  # nothing new: no redraw
    assert panel.updates == 2


def test_heatmap_keeps_only_the_latest_snapshot(qtbot):
    panel = HeatmapPanel()
    qtbot.addWidget(panel)
    for i in range(5):
        panel.on_event(snapshot(t=i, seed=i))
    panel.refresh()
    assert panel.updates == 1


def test_hit_rate_and_traffic_panels_draw_the_history(qtbot):
    history = TelemetryHistory()
    hit, traffic = HitRatePanel(history), TrafficPanel(history)
    for w in (hit, traffic):
        qtbot.addWidget(w)
    for panel in (hit, traffic):
        panel.on_event(model_loaded())
    for i in range(5):
        s = snapshot(t=0.1 * i, seed=i, gpu=True)
        history.add(s)
        hit.on_event(s)
        traffic.on_event(s)
    hit.layer.setCurrentIndex(hit.layer.findData(2))
    hit.refresh()
    traffic.refresh()
    assert len(hit.overall.getData()[1]) == 5 and hit.overall.getData()[1][0] == pytest.approx(80.0)
    assert len(hit.chosen.getData()[1]) == 5
    assert "Since load" in hit.figures.text() and "75.0%" in hit.figures.text()
    assert traffic.total.getData()[1][-1] == pytest.approx(3e6)  # on-demand stacked on prefetch
    assert traffic.prefetch.getData()[1][-1] == pytest.approx(1e6)
    assert traffic.pcie.getData()[1][-1] == pytest.approx(3e6)  # the driver's counter beside ours
    assert "PCIe host -> GPU" in traffic.link.text()


def test_traffic_panel_without_gpu_has_no_pcie_curve(qtbot):
    history = TelemetryHistory()
    traffic = TrafficPanel(history)
    qtbot.addWidget(traffic)
    s = snapshot()
    history.add(s)
    traffic.on_event(s)
    traffic.refresh()
    assert traffic.pcie.scene() is None
    assert "disk -> RAM" in traffic.link.text()


def test_budget_slider_previews_while_dragging_and_applies_on_release(qtbot):
    asked: list[int] = []

    def fake_estimator(nbytes: int) -> Estimate:
        asked.append(nbytes)
        return Estimate(nbytes, [3, 3, 2, 2], 0.625, 1.5, 12.5)

    panel = BudgetPanel(estimator=fake_estimator)
    qtbot.addWidget(panel)
    panel.show()
    model = model_loaded(layers=4, experts=8, expert_bytes=1024)
    panel.on_event(model)
    assert panel.slider.isEnabled() and panel.slider.value() == panel.slider.maximum()
    requested: list[str] = []
    panel.budget_requested.connect(requested.append)

    panel.slider.setSliderDown(True)
    panel.slider.setSliderPosition(4)  # emits sliderMoved while down
    assert asked and asked[-1] == panel.scale.to_bytes(4)
    assert "62.5%" in panel.estimate_label.text() and "12.5 tok/s" in panel.estimate_label.text()
    assert panel.planned.isVisible()
    assert requested == []  # nothing is sent while dragging
    panel.slider.setSliderDown(False)  # release
    assert requested == [str(panel.scale.to_bytes(4))]

    panel.on_event(p.BudgetChanged(requested[0], 10 * 1024, [3, 3, 2, 2]))
    panel.refresh()
    assert panel.slots == [3, 3, 2, 2] and "10.00 KiB" in panel.heading.text()
    assert list(panel.bars.opts["height"]) == [3, 3, 2, 2]


def test_budget_keyboard_steps_apply_after_a_pause(qtbot):
    panel = BudgetPanel(estimator=lambda n: None)
    qtbot.addWidget(panel)
    panel.on_event(model_loaded())
    with qtbot.waitSignal(panel.budget_requested, timeout=3000) as blocker:
        panel.slider.setValue(0)
    assert blocker.args == [str(model_loaded().min_budget_bytes)]


def test_budget_panel_shows_the_engines_own_memory_beside_dense_cache_and_the_rest(qtbot):
    from dataclasses import replace

    MiB = 2**20
    panel = BudgetPanel(estimator=lambda n: None)
    qtbot.addWidget(panel)
    model = replace(model_loaded(layers=4, experts=8, expert_bytes=MiB), overhead_bytes=350 * MiB,
                    baseline_rss_bytes=320 * MiB, dense_resident_bytes=20 * MiB)
    panel.on_event(model)
    panel.on_event(replace(snapshot(expert_bytes=MiB), rss_bytes=420 * MiB))  # cache: 4 x 8 slots of 1 MiB
    panel.refresh()
    assert panel.memory_label.text() == ("Engine RAM 420.00 MiB: engine overhead 350.00 MiB · dense weights 20.00 MiB"
                                         " · expert cache 32.00 MiB · KV cache and scratch 18.00 MiB")
    # an engine that did not measure itself (a remote server): no line rather than a wrong one
    panel.on_event(model_loaded())
    panel.refresh()
    assert panel.memory_label.text() == ""


def test_system_panel_lists_policies_with_lossy_marked(qtbot):
    panel = SystemPanel()
    qtbot.addWidget(panel)
    panel.on_event(model_loaded())
    labels = [panel.policy.itemText(i) for i in range(panel.policy.count())]
    assert labels == ["lru", "swapmoe (LOSSY)"]
    assert policy_label(p.PolicyInfo("x", False, "")) == "x (LOSSY)"
    with qtbot.waitSignal(panel.policy_requested) as blocker:
        panel.policy.activated.emit(1)
    assert blocker.args == ["swapmoe"]
    panel.on_event(snapshot(gpu=True))
    panel.refresh()
    assert panel.vram.isVisibleTo(panel) and "GiB" in panel.ram.format()
    assert panel.state.text() == "decoding"
    panel.on_event(p.Error("engine-crashed", "killed", False))
    assert panel.state.text() == "crashed" and not panel.policy.isEnabled()


def test_system_panel_exact_switch_is_off_by_default_and_follows_the_engine(qtbot):
    panel = SystemPanel()
    qtbot.addWidget(panel)
    assert not panel.exact.isEnabled()  # nothing loaded yet
    loaded = model_loaded()
    loaded.fast_decode, loaded.fast_decode_available = True, True  # the default on a bf16 CPU model
    panel.on_event(loaded)
    assert panel.exact.isEnabled() and not panel.exact.isChecked()
    assert "Exact" in panel.exact.text() and "bit-identical" in panel.exact.text()
    with qtbot.waitSignal(panel.exact_requested) as blocker:
        panel.exact.click()  # as a user click does: toggles and emits clicked
    assert blocker.args == [True]
    panel.on_event(p.FastDecodeChanged(enabled=False, available=True))
    assert panel.exact.isChecked() and panel.exact.isEnabled()
    panel.on_event(p.FastDecodeChanged(enabled=True, available=False))  # e.g. a float32 model: exact is all there is
    assert not panel.exact.isEnabled() and panel.exact.isChecked()
    assert "bf16" in panel.exact.toolTip()


def test_system_panel_offers_the_lossy_8_bit_inputs_switch_off_and_labelled(qtbot):
    panel = SystemPanel()
    qtbot.addWidget(panel)
    loaded = model_loaded()
    loaded.fast_decode, loaded.fast_decode_available = True, True
    panel.on_event(loaded)
    assert panel.int8_inputs.isEnabled() and not panel.int8_inputs.isChecked()  # opt-in
    assert "LOSSY" in panel.int8_inputs.text() and "differ" in panel.int8_inputs.toolTip()
    with qtbot.waitSignal(panel.int8_inputs_requested) as blocker:
        panel.int8_inputs.click()
    assert blocker.args == [True]
    panel.on_event(p.FastDecodeChanged(enabled=True, available=True, int8_inputs=True))
    assert panel.int8_inputs.isChecked()
    panel.on_event(p.FastDecodeChanged(enabled=False, available=True, int8_inputs=True))  # Exact: no native path
    assert not panel.int8_inputs.isEnabled()


def test_the_8_bit_inputs_switch_is_remembered_under_its_old_name_too(tmp_path):
    from app.settings import AppSettings

    path = str(tmp_path / "settings.ini")
    old = AppSettings(path)
    old.qs.setValue("engine/int8_prompt", "true")  # as a version that rounded prompts alone stored it
    old.qs.sync()
    settings = AppSettings(path)
    assert settings.int8_inputs
    settings.int8_inputs = False
    assert not settings.int8_inputs and not AppSettings(path).int8_inputs


def test_system_panel_says_in_which_formats_the_model_runs(qtbot):
    panel = SystemPanel()
    qtbot.addWidget(panel)
    loaded = model_loaded()
    loaded.expert_format, loaded.dense_format, loaded.dtype = "q4_k", "original", "bfloat16"
    panel.on_event(loaded)
    assert panel.formats.text() == "experts Q4_K, dense bf16"
    loaded.expert_format, loaded.dense_format, loaded.dtype = "original", "q8_0", "float32"
    panel.on_event(loaded)
    assert panel.formats.text() == "experts fp32, dense Q8_0"
    assert not panel.load_notes.isVisibleTo(panel)  # nothing the load decided
    loaded.load_notes = ["Q5_K to Q6_K (no native kernel for Q5_K): blk.0.ffn_down_exps"]
    panel.on_event(loaded)
    assert panel.load_notes.isVisibleTo(panel) and "Q5_K to Q6_K" in panel.load_notes.text()


def test_system_panel_names_the_kernel_variant_and_why_not_a_better_one(qtbot):
    panel = SystemPanel()
    qtbot.addWidget(panel)
    loaded = model_loaded()
    loaded.kernels = "x86-64-v3: AVX2 and FMA"
    loaded.kernels_note = "not x86-64-v4-bf16: the CPU lacks avx512_bf16, avx512f"
    panel.on_event(loaded)
    assert panel.kernel_variant.isVisibleTo(panel) and panel.kernel_variant.text() == "native build: x86-64-v3"
    assert "AVX2 and FMA" in panel.kernel_variant.toolTip() and "lacks avx512_bf16" in panel.kernel_variant.toolTip()
    loaded.kernels, loaded.kernels_note = "native decode kernels unavailable (this install was built without a C++ compiler)", ""
    panel.on_event(loaded)
    assert "without a C++ compiler" in panel.kernel_variant.text()


def test_system_panel_says_how_the_last_token_ran(qtbot):
    panel = SystemPanel()
    qtbot.addWidget(panel)
    assert panel.decode_path.text() == "–"  # no token yet
    running = snapshot()
    running.decode_path = "fast: whole token in one native call"
    panel.on_event(running)
    panel.render()
    assert panel.decode_path.text() == "fast: whole token in one native call"
    assert "Why not faster" not in panel.decode_path.toolTip()
    slower = snapshot()
    slower.decode_path = "fast: native kernels, layer by layer"
    slower.decode_path_reason = "not every expert is resident (the budget is below all)"
    panel.on_event(slower)
    panel.render()
    assert "Why not faster: not every expert is resident" in panel.decode_path.toolTip()
    assert panel.decode_reason.text() == "not faster: not every expert is resident (the budget is below all)"


def test_server_dock_lists_the_replies_decoding_together_and_their_sharing(qtbot):
    from dataclasses import replace

    from app.engine_bridge import EngineBridge
    from app.local_server import LocalServer
    from app.panels.server import ServerPanel

    bridge = EngineBridge(client_factory=lambda on_event: None)  # no engine: the dock takes events as given
    bridge.model = replace(model_loaded(), parallel=4)
    panel = ServerPanel(LocalServer(bridge))
    qtbot.addWidget(panel)
    streams = [p.StreamInfo(f"{p.API_REQUEST_PREFIX}1234abcd5678", "decoding", 30, 12, 8.5),
               p.StreamInfo("chat-7", "prefill", 900, 0, 0.0)]
    sharing = p.BatchSharing(streams=2, turns=10, uses=320, distinct=200, layers=4)
    panel.on_event(replace(snapshot(), streams=streams, sharing=sharing))
    panel.refresh()
    lines = panel.running.text().splitlines()
    assert lines == ["1234abcd: 12 tokens, 8.5 tok/s", "chat: reading its 900-token prompt",
                     "2 streams, 5.0 distinct experts a layer, each picked 1.60x a turn"]
    panel.on_event(replace(snapshot(), streams=[], sharing=None))  # the batch ended
    panel.refresh()
    assert panel.running.text() == ""
    assert panel.server.parallel == 4


def test_heatmap_and_traffic_say_when_replies_decode_together(qtbot):
    from dataclasses import replace

    streams = [p.StreamInfo(f"{p.API_REQUEST_PREFIX}{i}", "decoding", 10, 5, 3.0) for i in range(3)]
    sharing = p.BatchSharing(streams=3, turns=4, uses=96, distinct=64, layers=4)
    together = replace(snapshot(layers=4, experts=8), streams=streams, sharing=sharing)
    heatmap = HeatmapPanel()
    qtbot.addWidget(heatmap)
    heatmap.on_event(model_loaded(layers=4, experts=8))
    heatmap.on_event(together)
    heatmap.refresh()
    assert "(the 3 replies decoding together)" in heatmap.scale_label.text()  # the union of their experts
    assert TrafficPanel.figures_text(together).endswith(
        "3 streams, 4.0 distinct experts a layer, each picked 1.50x a turn")
    alone = snapshot(layers=4, experts=8)
    heatmap.on_event(alone)
    heatmap.refresh()
    assert "(this reply)" in heatmap.scale_label.text() and "streams" not in TrafficPanel.figures_text(alone)
