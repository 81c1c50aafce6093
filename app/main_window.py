"""The window: chat in the centre, live panels in docks around it, the engine behind a bridge.

Engine events arrive on the GUI thread through the bridge; each view takes what it needs and
marks itself dirty, and one frame timer repaints what changed (keeping only the latest snapshot).
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QRect, Qt, QTimer
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import QDockWidget, QFileDialog, QMainWindow, QMessageBox, QVBoxLayout, QWidget

from app.banner import CRASH_KINDS, Banner
from app.chat.chat_view import ChatView
from app.chat.controller import ChatController
from app.chat.conversation_list import ConversationList
from app.connect_dialog import ConnectDialog
from app.engine_bridge import EngineBridge
from app.library_dialog import LibraryDialog
from app.local_server import LocalServer
from app.model_bar import ModelBar
from app.models import export
from app.models.budget import same_share
from app.models.history import HistoryStore
from app.models.telemetry_history import TelemetryHistory
from app.panels.base import Panel
from app.panels.budget import BudgetPanel
from app.panels.heatmap import HeatmapPanel
from app.panels.hit_rate import HitRatePanel
from app.panels.server import ServerPanel
from app.panels.system import SystemPanel
from app.panels.traffic import TrafficPanel
from app.settings import AppSettings
from app.themes import ThemeManager
from app.window_layout import (
    PanelScroll,
    arrange,
    default_sizes,
    fits,
    fitted_geometry,
    is_wide,
    keep_on_screen,
    saved_frame_size,
)
from engine import protocol as p

FRAME_MS = 33  # ~30 repaints a second at most, whatever the event rate


class MainWindow(QMainWindow):
    def __init__(self, settings: AppSettings | None = None, store: HistoryStore | None = None,
                 bridge: EngineBridge | None = None, remember: bool = True) -> None:
        super().__init__()
        self.settings = settings or AppSettings()
        self.store = store or HistoryStore()
        self.bridge = bridge or EngineBridge(parent=self)
        self.remember = remember  # screenshot mode leaves the user's settings alone
        self.library: LibraryDialog | None = None  # made on first use, then kept: downloads outlive it closing
        self.setWindowTitle("MoEScope")
        self.setObjectName("moescope-main")
        self.setDockNestingEnabled(True)
        self._build_centre()
        self._build_panels()
        self._build_docks()
        self.themes = ThemeManager(self.settings.theme, self)
        self.themes.changed.connect(self._apply_theme)
        self._build_menus()
        self._connect_engine()
        self._connect_chat()
        self._start_frame_timer()
        self._restore_session()

    # ----- construction -----
    def _build_centre(self) -> None:
        """The banner, the model bar and the chat, one above the other."""
        self.banner = Banner()
        self.model_bar = ModelBar()
        self.chat_view = ChatView()
        centre = QWidget()
        column = QVBoxLayout(centre)
        column.setContentsMargins(4, 4, 4, 4)
        column.addWidget(self.banner)
        column.addWidget(self.model_bar)
        column.addWidget(self.chat_view, 1)
        self.setCentralWidget(centre)
        self.chat = ChatController(self.store, self.bridge, self.chat_view, self)

    def _build_panels(self) -> None:
        """What goes in the docks: the conversation list and the live panels."""
        self.history = TelemetryHistory()
        self.conversations = ConversationList()
        self.hit_rate = HitRatePanel(self.history)
        self.traffic = TrafficPanel(self.history)
        self.heatmap = HeatmapPanel()
        self.budget = BudgetPanel()
        self.system = SystemPanel()
        self.server = LocalServer(self.bridge, self)  # the OpenAI API on loopback, off until switched on
        self.server_panel = ServerPanel(self.server)
        self.panels: list[Panel] = [self.heatmap, self.budget, self.hit_rate, self.traffic, self.system,
                                    self.server_panel]

    def _connect_engine(self) -> None:
        """Engine events in; the banner's, panels' and model bar's requests out to the engine."""
        self.bridge.event.connect(self.on_engine_event)
        self.banner.restart_requested.connect(self.restart_engine)
        self.budget.budget_requested.connect(self.set_budget)
        self.system.policy_requested.connect(self.set_policy)
        self.system.exact_requested.connect(self.set_exact)
        self.system.int8_inputs_requested.connect(self.set_int8_inputs)
        self.model_bar.formats_requested.connect(self.set_formats)
        self.model_bar.open_folder_requested.connect(self.open_model)
        self.model_bar.library_requested.connect(self.open_library)
        self.model_bar.connect_requested.connect(self.connect_to_server)

    def _connect_chat(self) -> None:
        """The conversation list's requests to the chat, and the chat's news back to the window."""
        self.conversations.new_requested.connect(self.chat.new_chat)
        self.conversations.open_requested.connect(self.chat.open)
        self.conversations.rename_requested.connect(self.chat.rename)
        self.conversations.delete_requested.connect(self._confirm_delete)
        self.conversations.export_requested.connect(self.export_conversation)
        self.conversations.search_changed.connect(lambda _t: self.refresh_conversations())
        self.chat.conversations_changed.connect(self.refresh_conversations)
        self.chat.notice.connect(lambda text: self.statusBar().showMessage(text, 5000))
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self, self.chat.stop, context=Qt.ShortcutContext.WindowShortcut)

    def _start_frame_timer(self) -> None:
        self.frame = QTimer(self, interval=FRAME_MS)
        self.frame.timeout.connect(self.refresh)
        self.frame.start()

    def _restore_session(self) -> None:
        """The saved layout and theme, the conversation list, and the conversation open last time."""
        self._restore_layout()
        self.themes.apply()
        self.refresh_conversations()
        last = self.settings.last_conversation
        if last is not None and self.store.conversation(last) is not None:
            self.chat.open(last)
        self.statusBar().showMessage("Starting the engine…")

    # ----- layout -----
    def _dock(self, title: str, name: str, widget: QWidget) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(name)  # saveState keys the layout by objectName
        dock.setWidget(widget)
        dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable | QDockWidget.DockWidgetFeature.DockWidgetClosable
                         | QDockWidget.DockWidgetFeature.DockWidgetFloatable)
        self.docks[name] = dock
        return dock

    def _build_docks(self) -> None:
        self.docks: dict[str, QDockWidget] = {}
        area = Qt.DockWidgetArea
        self.setCorner(Qt.Corner.BottomLeftCorner, area.LeftDockWidgetArea)
        self.setCorner(Qt.Corner.BottomRightCorner, area.RightDockWidgetArea)
        sidebar = self._dock("Conversations", "dock-conversations", self.conversations)
        self.addDockWidget(area.LeftDockWidgetArea, sidebar)
        for panel in self.panels:
            self._dock(panel.title, panel.dock_name, PanelScroll(panel))
        self.conversations.setMinimumWidth(150)

    def available_geometry(self) -> QRect:
        """The screen's area for windows (without panels and docks of the desktop), in device-independent pixels."""
        screen = self.screen() or QGuiApplication.primaryScreen()
        return screen.availableGeometry()

    def _restore_layout(self) -> None:
        """The user's window and docks where they fit this screen; else a size and arrangement that do
        (the saved ones came from a larger monitor, or from before the window fitted laptops)."""
        self._restored = False
        available = self.available_geometry()
        self._wide = is_wide(available)
        saved = self.settings.geometry
        frame = saved_frame_size(saved) if saved is not None else None
        if saved is not None and frame is not None and fits(frame, available) and self.restoreGeometry(saved):
            state = self.settings.window_state
            self._restored = state is not None and self.restoreState(state)
        else:
            self.setGeometry(fitted_geometry(available))
        if not self._restored:
            arrange(self, self.docks, self._wide)

    def showEvent(self, event) -> None:
        super().showEvent(event)
        if getattr(self, "_sized", False):
            return
        self._sized = True
        QTimer.singleShot(0, self._first_shown)

    def _first_shown(self) -> None:
        keep_on_screen(self, self.available_geometry())
        if not self._restored:
            default_sizes(self, self.docks, self._wide)

    def restore_default_layout(self) -> None:
        """The default arrangement for the screen the window is on now, at a size that fits it."""
        available = self.available_geometry()
        if not fits(self.frameGeometry().size(), available):
            self.setGeometry(fitted_geometry(available))
        self._wide = is_wide(available)
        arrange(self, self.docks, self._wide)
        default_sizes(self, self.docks, self._wide)

    def _build_menus(self) -> None:
        bar = self.menuBar()
        file = bar.addMenu("&File")
        file.addAction("New chat", QKeySequence.StandardKey.New, self.chat.new_chat)
        file.addAction("Open model folder…", QKeySequence.StandardKey.Open, self.model_bar.choose_folder)
        file.addAction("Model library…", QKeySequence("Ctrl+L"), self.open_library)
        file.addAction("Connect to a server…", self.connect_to_server)
        file.addAction("Export conversation as Markdown…", lambda: self._export_current("markdown"))
        file.addAction("Export conversation as JSON…", lambda: self._export_current("json"))
        file.addSeparator()
        file.addAction("Quit", QKeySequence.StandardKey.Quit, self.close)
        view = bar.addMenu("&View")
        for dock in self.docks.values():
            view.addAction(dock.toggleViewAction())
        view.addAction("Restore default layout", self.restore_default_layout)
        view.addSeparator()
        theme_menu = view.addMenu("Theme")
        group = QActionGroup(self)
        self.theme_actions: dict[str, QAction] = {}
        for choice, label in (("system", "Follow the system"), ("light", "Light"), ("dark", "Dark")):
            action = theme_menu.addAction(label, lambda c=choice: self.set_theme(c))
            action.setCheckable(True)
            action.setChecked(self.themes.choice == choice)
            group.addAction(action)
            self.theme_actions[choice] = action
        engine = bar.addMenu("&Engine")
        engine.addAction("Stop reply", self.chat.stop)
        engine.addAction("Restart engine", self.restart_engine)

    # ----- engine -----
    def start_engine(self, model: str | None = None, budget: str | None = None) -> None:
        model = model or self.settings.last_model
        self.bridge.start()
        self.load_model(model, budget)

    def load_model(self, model: str, budget: str | None = None, expert_format: str | None = None,
                   dense_format: str | None = None) -> None:
        """Load `model`; what is not given comes from what the window remembers for it. Formats given are
        remembered for it (like a budget dragged on the slider)."""
        budget = budget or self.settings.budget_for(model)
        remembered = self.settings.formats_for(model)
        experts, dense = expert_format or remembered[0], dense_format or remembered[1]
        if self.remember and (experts, dense) != remembered:
            self.settings.set_formats_for(model, experts, dense)
        self.chat.ready = False  # messages wait for this model (the controller queues them)
        self.model_bar.set_loading(model)
        self.model_bar.show_formats(experts, dense)
        self.statusBar().showMessage(f"Loading {model}…")
        self.bridge.load(model, budget, self.settings.policy, expert_format=experts, dense_format=dense,
                         exact=self.settings.exact, int8_inputs=self.settings.int8_inputs)

    def open_model(self, path: str, budget: str | None = None, expert_format: str | None = None) -> None:
        if self.chat.streaming:
            self.chat.stop()
        self.load_model(path, budget or None, expert_format or None)

    def set_formats(self, expert_format: str, dense_format: str) -> None:
        """The model bar's pickers: reload the current model in the new formats (converted once, with progress)."""
        last = self.bridge.last_load
        if last is None or self.bridge.remote:
            return
        if self.chat.streaming:
            self.chat.stop()
        # The budget in force (live changes too), as the same share of the experts in the new format.
        model = self.bridge.model
        budget = same_share(last.budget, self.bridge.budget_bytes, model.all_expert_bytes) if model else last.budget
        if self.remember and budget != last.budget:
            self.settings.set_budget_for(last.path, budget)
        self.load_model(last.path, budget, expert_format, dense_format)

    def set_exact(self, exact: bool) -> None:
        """The System panel's Exact switch: transformers' kernels (True) or the native ones, from the next token."""
        self.bridge.set_exact(exact)
        if self.remember:
            self.settings.exact = exact

    def set_int8_inputs(self, on: bool) -> None:
        """The System panel's 8-bit inputs switch (lossy), from the next token."""
        self.bridge.set_int8_inputs(on)
        if self.remember:
            self.settings.int8_inputs = on

    def open_library(self) -> LibraryDialog:
        if self.library is None:
            self.library = LibraryDialog(self.bridge, self)
            self.library.use_requested.connect(self.open_model)
        self.library.refresh()
        self.library.show()
        self.library.raise_()
        self.library.activateWindow()
        return self.library

    def connect_to_server(self) -> None:
        dialog = ConnectDialog(self)
        if dialog.exec() == ConnectDialog.DialogCode.Accepted:
            self.use_remote(*dialog.values())

    def use_remote(self, url: str, api_key: str | None, model: str) -> None:
        """Chat with a remote OpenAI-compatible server; opening a local model comes back to our engine."""
        if self.chat.streaming:
            self.chat.stop()
        self.chat.ready = False
        self.model_bar.set_loading(url)
        self.statusBar().showMessage(f"Connecting to {url}…")
        self.bridge.connect_remote(url, api_key, model)

    def restart_engine(self) -> None:
        self.banner.hide()
        self.statusBar().showMessage("Restarting the engine…")
        if self.chat.streaming:
            self.chat.on_event(p.Error("engine-crashed", "the engine was restarted", False))
        self.chat.ready = False
        self.bridge.restart()
        if self.bridge.last_load is not None:
            self.model_bar.set_loading(self.bridge.last_load.path)

    def set_budget(self, budget: str) -> None:
        self.bridge.send(p.SetBudget(budget))
        if self.remember and self.bridge.last_load is not None:
            self.settings.set_budget_for(self.bridge.last_load.path, budget)

    def set_policy(self, policy: str) -> None:
        self.bridge.send(p.SetPolicy(policy))
        if self.remember:
            self.settings.policy = policy

    def on_engine_event(self, event) -> None:
        if p.is_library_event(event):  # the library dialog shows these; chat, panels and banner leave them alone
            if isinstance(event, p.DownloadFinished):
                self.statusBar().showMessage(f"{event.repo_id} downloaded; Model library… → Use loads it", 8000)
            elif isinstance(event, p.Error) and event.kind != "cancelled":
                self.statusBar().showMessage(event.message, 8000)
            return
        if isinstance(event, p.Error) and p.is_api_request(event.request_id):
            return  # an API client's failed request: the server's log shows it, not the chat's banner
        if isinstance(event, p.TelemetrySnapshot):
            self.history.add(event)
        if isinstance(event, p.ModelLoaded):
            for panel in self.panels:
                panel.show_remote(event.remote)
        for panel in self.panels:
            if not (panel.local_only and self.bridge.remote):
                panel.on_event(event)
        self.model_bar.on_event(event)
        self.chat.on_event(event)
        if isinstance(event, p.ModelLoaded):
            self.setWindowTitle(f"MoEScope — {event.name}")
            done = f"connected at {event.remote}" if event.remote else f"loaded in {event.load_seconds:.1f} s"
            note = f" · {event.budget_note}" if event.budget_note else ""  # e.g. the budget was raised to the minimum
            self.statusBar().showMessage(f"{event.name} {done}{note}", 8000 if note else 5000)
            if self.banner.error is not None and self.banner.error.kind in CRASH_KINDS:
                self.banner.hide()
            if self.remember and self.bridge.last_load is not None:
                self.settings.last_model = self.bridge.last_load.path
        elif isinstance(event, p.Error):
            self.banner.show_error(event)
            self.statusBar().showMessage(event.message, 8000)
        elif isinstance(event, p.Log) and event.level in ("warning", "error"):
            self.statusBar().showMessage(event.message.strip().splitlines()[-1], 8000)

    # ----- frame -----
    def refresh(self) -> None:
        self.chat.refresh()
        for panel in self.panels:
            if panel.isVisible():
                panel.refresh()

    # ----- conversations -----
    def refresh_conversations(self) -> None:
        current = self.chat.conversation.id if self.chat.conversation else None
        self.conversations.show_conversations(self.store.conversations(self.conversations.search.text()), current)

    def _confirm_delete(self, conversation_id: int) -> None:
        conversation = self.store.conversation(conversation_id)
        if conversation is None:
            return
        answer = QMessageBox.question(self, "Delete conversation", f"Delete “{conversation.title}”?")
        if answer == QMessageBox.StandardButton.Yes:
            self.chat.delete(conversation_id)

    def _export_current(self, fmt: str) -> None:
        if self.chat.conversation is not None:
            self.export_conversation(self.chat.conversation.id, fmt)

    def export_conversation(self, conversation_id: int, fmt: str, path: str | None = None) -> Path | None:
        conversation = self.store.conversation(conversation_id)
        if conversation is None:
            return None
        suffix = ".md" if fmt == "markdown" else ".json"
        if path is None:
            safe = "".join(c if c.isalnum() or c in " -_" else "_" for c in conversation.title).strip() or "conversation"
            path, _ = QFileDialog.getSaveFileName(self, "Export conversation", safe + suffix)
            if not path:
                return None
        messages = self.store.messages(conversation_id)
        text = export.to_markdown(conversation, messages) if fmt == "markdown" else export.to_json(conversation, messages)
        out = Path(path)
        out.write_text(text, encoding="utf-8")
        self.statusBar().showMessage(f"Exported to {out}", 5000)
        return out

    # ----- look -----
    def set_theme(self, choice: str) -> None:
        self.themes.set_choice(choice)
        if self.themes.choice in self.theme_actions:
            self.theme_actions[self.themes.choice].setChecked(True)
        if self.remember:
            self.settings.theme = choice

    def _apply_theme(self, theme) -> None:
        self.chat_view.apply_theme(theme)
        self.banner.apply_theme(theme)
        for panel in self.panels:
            panel.apply_theme(theme)
            panel.dirty = True

    def keyPressEvent(self, event) -> None:
        # Esc that no child used (the shortcut covers the active window; this covers the rest).
        if event.key() == Qt.Key.Key_Escape and self.chat.streaming:
            self.chat.stop()
            event.accept()
            return
        super().keyPressEvent(event)

    # ----- closing -----
    def closeEvent(self, event: QCloseEvent) -> None:
        self.frame.stop()
        self.chat.save_partial()
        if self.remember:
            self.settings.geometry = self.saveGeometry()
            self.settings.window_state = self.saveState()
            self.settings.last_conversation = self.chat.conversation.id if self.chat.conversation else None
            self.settings.sync()
        self.server.stop()
        self.bridge.stop()
        self.store.close()
        super().closeEvent(event)
