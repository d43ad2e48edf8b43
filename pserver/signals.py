"""How every pserver process stops: on SIGTERM (Kubernetes, Slurm, systemd), SIGHUP (a closed
terminal) and SIGINT (Ctrl-C), cleanly, exiting 128+signal (docs/semantics.md, "Signals").

    with stop_on_signals():
        try:
            work()
        except Stopped as e:
            clean_up()
            return e.exit_code
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
PARENT_ENV = "PSERVER_PARENT_PID"  # a child of `launch` (or a bench) stops when this process dies
PR_SET_PDEATHSIG = 1               # linux/prctl.h
# The stop signal that came (its number), or 0: what fails from now on is the stop's doing. A
# plain value, not a threading.Event: the handler runs in the main thread between any two
# bytecodes, also inside an Event's own lock, and a lock taken there again never returns.
_stopping = [0]
# Whether this process is the `pserver` command's (quiet_interrupt_while_loading finds it out, as the
# package loads): there a stop ends the process, and a second stop signal must not cut its clean-up
# or its exit short (exiting_after). A program that imports pserver, or calls pserver.cli.main (the
# tests do), keeps its own handlers.
_command = [False]


def thread_ids() -> list[int]:
    """The ids of this process's threads (Linux's /proc/self/task), for the per-thread calls
    (os.sched_setscheduler, os.sched_setaffinity); [0], the calling thread, where there is no
    /proc."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def with_parent_death(env: dict) -> dict:
    """`env` for a child that must get SIGTERM when this process dies, even by SIGKILL: the
    child arranges it itself, first thing after exec (follow_parent). Not in a preexec_fn:
    one makes subprocess fork() rather than vfork(), and a fork runs gRPC's fork handlers in
    the child, which with a channel open in this process crash a child now and then before
    its exec (8 of 300 children, SIGSEGV; with vfork 0 of 300)."""
    return {**env, PARENT_ENV: str(os.getpid())}


def follow_parent() -> None:
    """In a child started with with_parent_death's env: SIGTERM when that parent dies
    (Linux's PR_SET_PDEATHSIG), and at once if it already has. Elsewhere, nothing."""
    parent = os.environ.pop(PARENT_ENV, None)    # not passed on to our own children
    if not parent:
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return                                   # not Linux: the parent stops us on its signals
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if str(os.getppid()) != parent:              # it died before prctl: no signal would come
        os.kill(os.getpid(), signal.SIGTERM)


def quiet_interrupt_while_loading() -> None:
    """In the `pserver` command only (`python -m pserver ...`, the `pserver` script, a launched
    child): a Ctrl-C while the package loads, before main() can catch anything (seconds on a
    busy machine), or while its flags are parsed, prints one line and exits 130, not a traceback.
    exit_code hands SIGINT back to Python (interrupt_as_usual) inside its try, where a
    KeyboardInterrupt is its one line; a program that imports pserver keeps its own handler,
    and so does a process where SIGINT is ignored (a background job)."""
    # `python -m pserver...` (sys.orig_argv: the interpreter's own command line; a user's
    # `python -m theirs` importing pserver is not the command), or the `pserver` script.
    orig = getattr(sys, "orig_argv", [])
    module = next((orig[i + 1] for i, a in enumerate(orig[:-1]) if a == "-m"), "")
    command = module.split(".")[0] == "pserver" or \
        os.path.basename(sys.argv[0] if sys.argv else "") == "pserver"
    _command[0] = command
    if command and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_loading)


def _interrupted_while_loading(signum, frame) -> None:
    name = "pserver " + next((a for a in sys.argv[1:] if not a.startswith("-")), "").split("/")[-1]
    os.write(2, f"{name.strip()}: interrupted\n".encode())
    os._exit(128 + signal.SIGINT)      # nothing started yet: no child, no file, nothing to clean


def interrupt_as_usual() -> None:
    """SIGINT raises KeyboardInterrupt again (which exit_code turns into one line and exit 130)."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_loading:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def exiting_after(code: int) -> int:
    """`code`, for the command's process about to exit with it. When it is a stop's (128 + a stop
    signal, its line already printed): the stop signals are ignored from now on. Python gives
    them back to the system's default as it finalizes, and a second Ctrl-C or SIGTERM then
    killed the process by the signal (status -2, not 130, no line): 9 of 10 times with a
    second Ctrl-C 20 ms after the first. Ignored, not handled: Python resets a handler it runs
    to the default, but leaves an ignored signal ignored. (A stop inside stop_on_signals leaves
    them ignored already in a command; this covers a Ctrl-C outside, a KeyboardInterrupt.)"""
    if _command[0] and code in {128 + int(s) for s in STOP_SIGNALS}:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
    return code


def interrupt_handled() -> None:
    """Tell Python that the KeyboardInterrupt just caught is handled. CPython marks a process to die
    by SIGINT at exit (status -2, whatever sys.exit said) when a KeyboardInterrupt leaves any
    exec() or eval() of a string, even if it is caught later: dataclasses and namedtuple create
    their methods so, and a Ctrl-C while a module defining one loads got 'interrupted' and -2
    (CI saw it). An exec of a string clears the mark as it starts."""
    exec("pass", {})


def stopping() -> bool:
    """Whether this process got a stop signal. A Ctrl-C reaches every process of the terminal's
    group at once: a shard that it stops first is then no news worth a line in a worker."""
    return bool(_stopping[0])


class Stopped(BaseException):
    """Raised in the main thread by a stop signal. A BaseException, as KeyboardInterrupt is,
    so that no `except Exception` on the way up swallows it, while every `finally` runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def stop_on_signals():
    """Inside: the first stop signal raises Stopped in the main thread; later ones are
    ignored, so the clean-up that Stopped starts is not cut short. The previous handlers
    come back on leaving."""
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    came: list[int] = []

    def handler(signum, frame):
        # Signals may come in a burst (a parent's death sends SIGTERM as a terminal's SIGHUP
        # comes): a second one runs this again before the first has ignored them. It takes
        # no lock (one taken by the code it interrupted would never be given back: a shard
        # hung so in its Event.wait) and leaves the first one's Stopped to go on.
        if came:
            return
        came.append(signum)
        _stopping[0] = signum
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    for s in STOP_SIGNALS:
        signal.signal(s, handler)
    try:
        yield
    finally:
        if not (came and _command[0]):     # a command stopped: its clean-up and exit go on ignoring them
            for s, h in previous.items():
                signal.signal(s, h)
