"""The one exception type that means "the user's input is wrong" (exit code 2, one line)."""


class InputError(Exception):
    """Bad usage or input; the message says what is wrong and what to do."""
