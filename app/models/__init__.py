"""The window's Qt-free parts: what the widgets show, kept apart from how (napari-style)."""
