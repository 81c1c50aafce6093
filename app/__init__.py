"""MoEScope's desktop app: the Qt process. It never imports torch; the engine runs in a worker process."""

from app import qt_refcount_fix

qt_refcount_fix.apply()  # before any Qt call: see the module for the shiboken6 6.12 bug it covers
