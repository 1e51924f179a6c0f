"""The exceptions for bad command-line inputs: the command prints them as one
line (no traceback) and exits with status 2."""


class InputError(Exception):
    """A user-facing problem with what the command line was given: an input
    array's shape or dtype, an option this installation cannot serve. The
    command prints it as one line (no traceback) and exits with status 2."""


class FileError(InputError):
    """A user-facing problem with an input file (one line, no traceback)."""
