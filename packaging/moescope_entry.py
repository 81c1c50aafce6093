"""The frozen application's entry point: `MoEScope/moescope` runs this.

`multiprocessing.freeze_support()` comes first: the engine runs in a *spawned* child process, and
in a frozen app that child is this same executable started with `--multiprocessing-fork ...`
(PyInstaller's multiprocessing runtime hook makes freeze_support handle that on every OS, not only
Windows). In the child it runs the engine worker and exits; in the parent it returns at once and the
normal launcher follows: the window with no arguments, the engine CLI for a subcommand.
"""

import multiprocessing

if __name__ == "__main__":
    multiprocessing.freeze_support()
    from app.launcher import entry

    entry()
