"""System: RAM and VRAM use, the engine's state, the cache policy picker (lossy ones marked), the
Exact kernels switch, the lossy 8-bit prompt inputs switch, and how the last token ran: the weights'
formats and the decode path."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QCheckBox, QComboBox, QFormLayout, QLabel, QProgressBar, QWidget

from app.elided_label import ElidedLabel
from app.models.format_choices import loaded_formats_text
from app.models.stats_format import format_bytes
from app.panels.base import Panel
from engine import protocol as p

EXACT_TEXT = "Exact kernels (bit-identical)"  # short: the panel fits a laptop's column; the tooltip says more
EXACT_TIP = ("On: transformers' own kernels, every token bit-identical to theirs. "
             "Off (the default): bf16 decode steps on the CPU use MoEScope's native kernels (a layer's experts in "
             "one pass, built for this CPU's instruction set; the line below names the build) and float32-matmul attention; with every "
             "expert resident, a Qwen3-MoE, Qwen2-MoE, OLMoE or Mixtral token runs whole in one native call. Several times faster "
             "decode (docs/performance.md), the same arithmetic summed in another order, so replies can differ from "
             "plain transformers in rare near-ties. On: every token equals transformers'.")
EXACT_ONLY_TIP = ("This model decodes on transformers' kernels: the native ones compute bf16 weights on a CPU "
                  "(load it in bfloat16 for them).")


INT8_INPUTS_TEXT = "8-bit inputs (LOSSY)"
INT8_INPUTS_TIP = ("Faster prompts and decode on 4-bit weights, LOSSY. Off by default. On: 4-bit and other K-quant "
                   "(Q4_K, Q6_K, ...) experts and dense layers take their inputs rounded to 8 bits (one scale per 256 "
                   "values, as llama.cpp always does) and multiply them in integers: half the products per weight, and "
                   "replies can differ from the exact ones (docs/performance.md measures how much). On CPUs with AMX "
                   "tiles (Intel Sapphire Rapids and later) prompts run faster without it, so prompts keep their "
                   "exact inputs there and the path says so.")


DECODE_PATH_TIP = ("How the last decode token ran. The whole-token native step needs every expert resident "
                   "(budget `all`), a Qwen3-MoE, Qwen2-MoE, OLMoE or Mixtral model, and a lossless policy that does not "
                   "look ahead; other families run their experts on the native per-layer kernel.")


def policy_label(info: p.PolicyInfo) -> str:
    return info.name if info.lossless else f"{info.name} (LOSSY)"


def _usage(bar: QProgressBar, used: int, total: int) -> None:
    bar.setRange(0, 1000)
    bar.setValue(int(1000 * used / total) if total else 0)
    bar.setFormat(f"{format_bytes(used)} of {format_bytes(total)}")


class SystemPanel(Panel):
    title = "System"
    dock_name = "dock-system"
    local_only = True
    policy_requested = Signal(str)
    exact_requested = Signal(bool)  # True: transformers' kernels only
    int8_inputs_requested = Signal(bool)  # True: the lossy 8-bit inputs

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.snapshot: p.TelemetrySnapshot | None = None
        self.policies: list[p.PolicyInfo] = []
        self._build_memory()
        self._build_controls()
        self._build_load_info()
        self._lay_out()
        self._show_vram(False)

    # ----- construction -----
    def _build_memory(self) -> None:
        """The engine's state, and the memory it and the machine use."""
        self.state = ElidedLabel("starting")
        self.state.setObjectName("engine-state")
        self.ram = QProgressBar()
        self.ram.setTextVisible(True)
        self.engine_rss = ElidedLabel("–")
        self.vram = QProgressBar()
        self.vram.setTextVisible(True)
        self.vram_label = QLabel("VRAM")

    def _build_controls(self) -> None:
        """The cache policy and the kernel switches, off until a model is loaded."""
        self.policy = QComboBox()
        self.policy.setEnabled(False)
        self.policy.activated.connect(self._picked)
        self.policy_note = QLabel("")
        self.policy_note.setWordWrap(True)
        self.exact = QCheckBox(EXACT_TEXT)
        self.exact.setToolTip(EXACT_TIP)
        self.exact.setEnabled(False)
        self.exact.clicked.connect(self._exact_clicked)  # user clicks only, not setChecked
        self.int8_inputs = QCheckBox(INT8_INPUTS_TEXT)
        self.int8_inputs.setToolTip(INT8_INPUTS_TIP)
        self.int8_inputs.setEnabled(False)
        self.int8_inputs.clicked.connect(lambda: self.int8_inputs_requested.emit(self.int8_inputs.isChecked()))
        self.kernel_variant = QLabel("")
        self.kernel_variant.setObjectName("kernel-variant")
        self.kernel_variant.setWordWrap(True)
        self.kernel_variant.setStyleSheet("color: palette(placeholder-text);")

    def _build_load_info(self) -> None:
        """How the loaded model's weights are stored, and which decode path it runs."""
        self.formats = ElidedLabel("–")
        self.formats.setObjectName("weight-formats")
        self.formats.setToolTip("How the loaded model's weights are stored: the routed experts, and every other "
                                "linear layer. Quantized formats are approximate (pick them in the model bar).")
        self.load_notes = QLabel("")
        self.load_notes.setObjectName("load-notes")
        self.load_notes.setWordWrap(True)
        self.load_notes.setStyleSheet("color: palette(placeholder-text);")
        self.decode_path = ElidedLabel("–")
        self.decode_path.setObjectName("decode-path")
        self.decode_path.setToolTip(DECODE_PATH_TIP)
        self.decode_reason = QLabel("")
        self.decode_reason.setObjectName("decode-reason")
        self.decode_reason.setWordWrap(True)
        self.decode_reason.setStyleSheet("color: palette(placeholder-text);")

    def _lay_out(self) -> None:
        form = QFormLayout(self)
        form.setContentsMargins(6, 6, 6, 6)
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)  # narrow: a field goes under its label
        form.addRow("Engine", self.state)
        form.addRow("RAM", self.ram)
        form.addRow("Engine process", self.engine_rss)
        form.addRow(self.vram_label, self.vram)
        form.addRow("Cache policy", self.policy)
        form.addRow("", self.policy_note)
        form.addRow("Kernels", self.exact)
        form.addRow("", self.int8_inputs)
        form.addRow("", self.kernel_variant)
        form.addRow("Weights", self.formats)
        form.addRow("", self.load_notes)
        form.addRow("Decode", self.decode_path)
        form.addRow("", self.decode_reason)

    def _show_vram(self, visible: bool) -> None:
        self.vram.setVisible(visible)
        self.vram_label.setVisible(visible)

    def set_state(self, text: str) -> None:
        self.state.setText(text)

    def on_event(self, event) -> None:
        if isinstance(event, p.TelemetrySnapshot):
            self.snapshot = event
            self.dirty = True
        elif isinstance(event, p.EngineStarted):
            self.set_state(f"started (pid {event.pid})")
        elif isinstance(event, p.LoadProgress):
            self.set_state(f"loading {event.fraction:.0%}: {event.message}")
        elif isinstance(event, p.ModelLoaded):
            self.policy.clear()
            for info in event.policies:
                self.policy.addItem(policy_label(info), info.name)
                self.policy.setItemData(self.policy.count() - 1, info.description, 3)  # Qt.ToolTipRole
            self.policy.setCurrentIndex(max(0, self.policy.findData(event.policy)))
            self.policy.setEnabled(True)
            self.policies = list(event.policies)
            self._describe()
            self._show_kernels(event.fast_decode, event.fast_decode_available, event.int8_inputs)
            self._show_variant(event.kernels, event.kernels_note)
            self.formats.setText(loaded_formats_text(event.expert_format, event.dense_format, event.dtype))
            self.load_notes.setText("\n".join(event.load_notes))
            self.load_notes.setVisible(bool(event.load_notes))
        elif isinstance(event, p.FastDecodeChanged):
            self._show_kernels(event.enabled, event.available, event.int8_inputs)
        elif isinstance(event, p.PolicyChanged):
            self.policy.setCurrentIndex(max(0, self.policy.findData(event.policy)))
            self._describe()
        elif isinstance(event, p.Error) and event.kind == "engine-crashed":
            self.policy.setEnabled(False)
            self.exact.setEnabled(False)
            self.int8_inputs.setEnabled(False)
            self.snapshot = None
            self.set_state("crashed")

    def _exact_clicked(self) -> None:
        self.exact_requested.emit(self.exact.isChecked())

    def _show_kernels(self, native_on: bool, available: bool, int8_inputs: bool) -> None:
        """Exact is ticked whenever transformers' kernels decode: asked for, or the only ones for this model.
        The 8-bit inputs apply on the native kernels only, so they are offered only with those on."""
        self.exact.setChecked(not (native_on and available))
        self.exact.setEnabled(available)
        self.exact.setToolTip(EXACT_TIP if available else EXACT_ONLY_TIP)
        self.int8_inputs.setChecked(int8_inputs)
        self.int8_inputs.setEnabled(native_on and available)

    def _show_variant(self, kernels: str, note: str) -> None:
        """Which build of the native kernels the engine runs (the instruction-set variant), and in the
        tooltip why not a better one."""
        name = kernels.split(":", 1)[0] if ":" in kernels else kernels
        self.kernel_variant.setText(f"native build: {name}" if ":" in kernels else kernels)
        self.kernel_variant.setToolTip("\n".join(part for part in (kernels, note) if part))
        self.kernel_variant.setVisible(bool(kernels))

    def _describe(self) -> None:
        current = self.policy.currentData()
        info = next((i for i in self.policies if i.name == current), None)
        self.policy_note.setText(("" if info is None or info.lossless else "LOSSY: replies may differ. ")
                                 + (info.description if info else ""))

    def _picked(self, index: int) -> None:
        name = self.policy.itemData(index)
        if name:
            self.policy_requested.emit(name)

    def render(self) -> None:
        s = self.snapshot
        if s is None:
            return
        self.set_state(s.state)
        self.decode_path.setText(s.decode_path or "–")
        why = f"not faster: {s.decode_path_reason}" if s.decode_path and s.decode_path_reason else ""
        self.decode_reason.setText(why)
        self.decode_path.setToolTip(DECODE_PATH_TIP + (f"\n\nWhy {why}." if why else ""))
        _usage(self.ram, s.ram_used_bytes, s.ram_total_bytes)
        self.engine_rss.setText(f"{format_bytes(s.rss_bytes)} resident · cache {format_bytes(s.budget_bytes)}")
        has_gpu = s.gpu_total_bytes is not None and s.gpu_used_bytes is not None
        self._show_vram(has_gpu)
        if has_gpu:
            _usage(self.vram, s.gpu_used_bytes, s.gpu_total_bytes)
