"""The files a run reads and writes, checked before it starts (flags.validate calls check_paths): what it
reads exists and is text; where it writes can be written, found out without creating anything.

A check raises ValueError naming the flag and the path (cli/flags.py makes it the one error line).

Accounting for this file: nothing is held or sent.
"""

from __future__ import annotations

import os


def check_paths(args) -> None:
    """The files the run reads exist and are text; the ones it writes can be written, checked now rather than
    at the first write (a trace file is written after all the training)."""
    if args.data is not None:
        check_text_file("--data", args.data)
    for flag, path in (("--out-dir", args.out_dir), ("--ckpt-dir", args.ckpt_dir),
                       ("--tensorboard", args.tensorboard)):
        if path is not None:
            check_writable(flag, path, directory=True)
    for flag, path in (("--metrics-file", args.metrics_file), ("--trace-file", args.trace_file)):
        if path is not None:
            check_writable(flag, path, directory=False)


def check_text_file(flag: str, path: str) -> None:
    """`path` is a non-empty text file (no NUL byte in its first 64 KiB): a corpus to tokenize."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r} is not a file; give a text file, or leave {flag} out for the built-in"
                         f" corpus")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{flag} {path!r} is empty; give a text file with something in it")
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if b"\0" in head:
        raise ValueError(f"{flag} {path!r} is a binary file (it holds NUL bytes); give a UTF-8 text file")


def check_writable(flag: str, path: str, directory: bool) -> None:
    """`path` can be created (or is already there as the right kind, and writable), creating nothing to find
    out: the nearest directory that exists at or above it (a file's own directory must exist; a directory is
    created with its parents) can be written and entered (os.access W_OK | X_OK), and is not on a kernel
    filesystem (/proc, /sys: access() lets root through, but no file can be made there)."""
    if path == "":
        raise ValueError(f"{flag} '' names nothing; give a path")
    path = os.path.abspath(path)
    if os.path.exists(path):
        if directory and not os.path.isdir(path):
            raise ValueError(f"{flag} {path!r} is a file, not a directory")
        if not directory and os.path.isdir(path):
            raise ValueError(f"{flag} {path!r} is a directory; give a file name")
        if not directory and (not os.access(path, os.W_OK) or _kernel_filesystem(path)):
            raise ValueError(f"{flag} {path!r} exists and cannot be written")
    nearest = path if directory else os.path.dirname(path)
    if not directory and not os.path.isdir(nearest):
        raise ValueError(f"{flag} {path!r}: the directory {nearest!r} does not exist or cannot be written")
    while not os.path.exists(nearest):
        nearest = os.path.dirname(nearest)
    if not os.path.isdir(nearest):
        raise ValueError(f"{flag} {path!r} lies under {nearest!r}, which is a file, not a directory")
    kernel = _kernel_filesystem(nearest)
    if not os.access(nearest, os.W_OK | os.X_OK) or kernel:
        raise ValueError(f"{flag} {path!r}: the directory {nearest!r} cannot be written"
                         + (f" (a {kernel} filesystem: the kernel's, not for files)" if kernel else ""))


# Filesystems through which the kernel shows its own state: a directory of theirs takes no new file.
_KERNEL_FILESYSTEMS = {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
                       "pstore", "bpf", "devpts", "mqueue", "efivarfs", "fusectl", "binfmt_misc", "selinuxfs"}


def _kernel_filesystem(path: str) -> str | None:
    """The type of the filesystem `path` is on when it is one of _KERNEL_FILESYSTEMS (the mount whose point is
    the longest prefix of its real path, in /proc/self/mounts); None otherwise, or where there is no such file."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    real, best = os.path.realpath(path), ("", None)
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, kind)
    return best[1] if best[1] in _KERNEL_FILESYSTEMS else None
