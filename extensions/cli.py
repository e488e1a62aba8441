"""The command line of every entry script: flags built from config dataclasses
(``config_argparser``, ``configs_from_args``), and how a job ends (``run_cli``: one line and an
exit status for a failure a person can fix, or for Ctrl-C and SIGTERM).

The core's config (``tba.TBAConfig``) and every extension's are plain dataclasses whose fields
carry their help text (``plumbing.config.knob``); this module turns them into flags. The core runs
without it: ``trainer.run_tba`` takes a config object. extensions/launch.py builds every job's
command line from it; extensions/report.py and extensions/ray_searchers.py their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable

from plumbing.config import ConfigError, RunError, need


def config_argparser(description: str, *configs: type) -> argparse.ArgumentParser:
    """``--field value`` for every field of the ``configs`` dataclasses (TBAConfig and those of
    the extensions a job offers); booleans are bare flags (``--synchronous``,
    ``--no-tempered_logprobs``). Defaults are None, so that ``configs_from_args`` can tell an
    explicit flag from a preset's value. The usage is one line: every field is a flag, and
    listing them all would bury the error argparse prints under it."""
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        usage="%(prog)s [--FIELD VALUE ...]  (--help lists every field)",
    )
    for config in configs:
        group = parser.add_argument_group(config.__name__, (config.__doc__ or "").split("\n")[0])
        for f in dataclasses.fields(config):
            help_text = f"{f.metadata.get('help', '')} (default: {f.default!r})"
            if f.type in (bool, "bool"):
                group.add_argument(
                    f"--{f.name}",
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=help_text,
                )
            else:
                kind = {"int": int, "float": float, "str": str}.get(f.type, f.type)
                group.add_argument(f"--{f.name}", type=kind, default=None, help=help_text)
    return parser


def configs_from_args(args: argparse.Namespace, base: dict, *configs: type) -> list:
    """One instance of each of the ``configs`` dataclasses: the values of ``base`` (a preset, a
    dict over the fields of all of them) overridden by every flag the user gave. A key of
    ``base`` that no config has is a ConfigError (a preset's typo)."""
    names = {f.name for config in configs for f in dataclasses.fields(config)}
    unknown = sorted(set(base) - names)
    need(not unknown, f"preset values {unknown} are no field of {[c.__name__ for c in configs]}")
    out = []
    for config in configs:
        values = {}
        for f in dataclasses.fields(config):
            given = getattr(args, f.name, None)
            if given is not None:
                values[f.name] = given
            elif f.name in base:
                values[f.name] = base[f.name]
        out.append(config(**values))
    return out


def run_cli(main: Callable[[list[str]], object], argv: list[str] | None = None) -> int:
    """Run an entry script's ``main(argv)`` as a person reads its failures: a ConfigError is
    ``prog: error: ...`` and exit status 2 (argparse's style), any other RunError the same line
    and exit status 1, Ctrl-C or SIGTERM one line saying where the run stopped and how to go on
    (exit status 128 + the signal). Any other exception is a bug: its traceback stays. With
    TBA_DEBUG=1 every failure keeps its traceback. Returns the exit status."""
    prog = os.path.basename(sys.argv[0])
    debug = os.environ.get("TBA_DEBUG", "") not in ("", "0")

    def terminate(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def unraisable(hook_args) -> None:
        # A signal's KeyboardInterrupt raised inside a callback that cannot raise (a weakref
        # callback, a __del__: freeing torch.distributed's objects runs many) would be printed
        # as "Exception ignored" and dropped, and the job would run on. Send the signal again,
        # from a thread a moment later, so that its handler runs outside the callback (and
        # outside this hook, whose own exceptions are dropped too).
        if isinstance(hook_args.exc_value, KeyboardInterrupt):
            name = str(hook_args.exc_value)
            signum = signal.Signals[name] if name in SIGNAL_NAMES else signal.SIGINT
            again = threading.Timer(0.05, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
        else:
            previous_hook(hook_args)

    previous = signal.signal(signal.SIGTERM, terminate)  # run_tba sets its own while it runs
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        main(sys.argv[1:] if argv is None else argv)
    except RunError as error:
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ConfigError) else 1
    except KeyboardInterrupt as stop:
        if debug:
            traceback.print_exc()
        said = str(stop) if str(stop).startswith(("stopped by", "SIG")) else "SIGINT"
        if not said.startswith("stopped by"):  # outside run_tba: before or after training
            said = f"stopped by {said} outside training (no checkpoint was written then)"
        print(f"{prog}: {said}", file=sys.stderr)
        return 128 + signal.Signals[said.split()[2]].value
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.unraisablehook = previous_hook
    return 0


SIGNAL_NAMES = ("SIGINT", "SIGTERM")  # the signals whose handlers raise KeyboardInterrupt
