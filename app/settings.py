"""What the app remembers between runs (QSettings): window, docks, theme, model, budget, weight
formats, policy, exact kernels, 8-bit inputs."""

from __future__ import annotations

from PySide6.QtCore import QByteArray, QSettings

DEFAULT_MODEL = "demo"


class AppSettings:
    def __init__(self, path: str | None = None) -> None:
        # Under tests, XDG_CONFIG_HOME is a temp dir, so the default location is already safe.
        self.qs = QSettings(path, QSettings.Format.IniFormat) if path else QSettings("MoEScope", "moescope")

    def _get(self, key: str, default: str = "") -> str:
        value = self.qs.value(key, default)
        return str(value) if value is not None else default

    def _flag(self, key: str) -> bool:
        """A switch stored as "true"/"false" (off when never set)."""
        return self._get(key, "false") == "true"

    def _set_flag(self, key: str, on: bool) -> None:
        self.qs.setValue(key, "true" if on else "false")

    # ----- window -----
    @property
    def geometry(self) -> QByteArray | None:
        value = self.qs.value("window/geometry")
        return value if isinstance(value, QByteArray) else None

    @geometry.setter
    def geometry(self, value: QByteArray) -> None:
        self.qs.setValue("window/geometry", value)

    @property
    def window_state(self) -> QByteArray | None:
        value = self.qs.value("window/state")
        return value if isinstance(value, QByteArray) else None

    @window_state.setter
    def window_state(self, value: QByteArray) -> None:
        self.qs.setValue("window/state", value)

    # ----- look -----
    @property
    def theme(self) -> str:
        return self._get("theme", "system")

    @theme.setter
    def theme(self, value: str) -> None:
        self.qs.setValue("theme", value)

    # ----- engine -----
    @property
    def last_model(self) -> str:
        return self._get("engine/last_model", DEFAULT_MODEL) or DEFAULT_MODEL

    @last_model.setter
    def last_model(self, value: str) -> None:
        self.qs.setValue("engine/last_model", value)

    def budget_for(self, model: str) -> str:
        """Budgets are per model: 2 GiB means something different for each."""
        return self._get(f"budgets/{_key(model)}", "all") or "all"

    def set_budget_for(self, model: str, budget: str) -> None:
        self.qs.setValue(f"budgets/{_key(model)}", budget)

    def formats_for(self, model: str) -> tuple[str, str]:
        """(experts, dense) weight formats, per model like the budget: what a model can take differs."""
        return (self._get(f"expert_formats/{_key(model)}", "original") or "original",
                self._get(f"dense_formats/{_key(model)}", "original") or "original")

    def set_formats_for(self, model: str, expert_format: str, dense_format: str) -> None:
        self.qs.setValue(f"expert_formats/{_key(model)}", expert_format)
        self.qs.setValue(f"dense_formats/{_key(model)}", dense_format)

    @property
    def exact(self) -> bool:
        """Transformers' own decode kernels instead of the native ones (off by default)."""
        return self._flag("engine/exact")

    @exact.setter
    def exact(self, value: bool) -> None:
        self._set_flag("engine/exact", value)

    @property
    def int8_inputs(self) -> bool:
        """The lossy 8-bit inputs for 4-bit weights (off by default; stored as int8_prompt while it
        applied to prompts alone)."""
        return self._flag("engine/int8_inputs") or self._flag("engine/int8_prompt")

    @int8_inputs.setter
    def int8_inputs(self, value: bool) -> None:
        self._set_flag("engine/int8_inputs", value)
        self.qs.remove("engine/int8_prompt")

    @property
    def policy(self) -> str:
        return self._get("engine/policy", "lru") or "lru"

    @policy.setter
    def policy(self, value: str) -> None:
        self.qs.setValue("engine/policy", value)

    @property
    def last_conversation(self) -> int | None:
        value = self._get("chat/last_conversation", "")
        return int(value) if value.isdigit() else None

    @last_conversation.setter
    def last_conversation(self, value: int | None) -> None:
        self.qs.setValue("chat/last_conversation", "" if value is None else str(value))

    def sync(self) -> None:
        self.qs.sync()


def _key(model: str) -> str:
    # QSettings treats '/' as a group separator; keep a path as one key.
    return model.replace("\\", "_").replace("/", "|")
