"""The sidebar: new chat, search by title, and the conversations (rename, delete, export)."""

from __future__ import annotations

from PySide6.QtCore import QPoint, Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import QLineEdit, QListWidget, QListWidgetItem, QMenu, QPushButton, QVBoxLayout, QWidget

from app.models.history import Conversation

ID_ROLE = Qt.ItemDataRole.UserRole


class ConversationList(QWidget):
    new_requested = Signal()
    open_requested = Signal(int)
    rename_requested = Signal(int, str)
    delete_requested = Signal(int)
    export_requested = Signal(int, str)  # id, "markdown" | "json"
    search_changed = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._filling = False
        self.new_button = QPushButton("New chat")
        self.new_button.clicked.connect(self.new_requested)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search titles")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.search_changed)
        self.list = QListWidget()
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)  # long titles elide
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setUniformItemSizes(True)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.itemClicked.connect(self._clicked)
        self.list.itemActivated.connect(self._clicked)
        self.list.itemChanged.connect(self._renamed)
        QShortcut(QKeySequence.StandardKey.Delete, self.list, self._delete_current,
                  context=Qt.ShortcutContext.WidgetShortcut)
        QShortcut(QKeySequence(Qt.Key.Key_F2), self.list, self._rename_current, context=Qt.ShortcutContext.WidgetShortcut)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.new_button)
        layout.addWidget(self.search)
        layout.addWidget(self.list, 1)

    def show_conversations(self, conversations: list[Conversation], current: int | None) -> None:
        self._filling = True
        self.list.clear()
        for c in conversations:
            item = QListWidgetItem(c.title)
            item.setData(ID_ROLE, c.id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            item.setToolTip(c.title)
            self.list.addItem(item)
            if c.id == current:
                self.list.setCurrentItem(item)
        self._filling = False

    def titles(self) -> list[str]:
        return [self.list.item(i).text() for i in range(self.list.count())]

    def _clicked(self, item: QListWidgetItem) -> None:
        self.open_requested.emit(int(item.data(ID_ROLE)))

    def _renamed(self, item: QListWidgetItem) -> None:
        if not self._filling:
            self.rename_requested.emit(int(item.data(ID_ROLE)), item.text())

    def _current_id(self) -> int | None:
        item = self.list.currentItem()
        return int(item.data(ID_ROLE)) if item else None

    def _delete_current(self) -> None:
        cid = self._current_id()
        if cid is not None:
            self.delete_requested.emit(cid)

    def _rename_current(self) -> None:
        item = self.list.currentItem()
        if item:
            self.list.editItem(item)

    def _menu(self, pos: QPoint) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        cid = int(item.data(ID_ROLE))
        menu = QMenu(self)
        menu.addAction("Rename", lambda: self.list.editItem(item))
        menu.addAction("Export as Markdown…", lambda: self.export_requested.emit(cid, "markdown"))
        menu.addAction("Export as JSON…", lambda: self.export_requested.emit(cid, "json"))
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.delete_requested.emit(cid))
        menu.popup(self.list.viewport().mapToGlobal(pos))
