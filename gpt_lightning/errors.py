"""The one exception type for a user's mistake: the CLI prints its message alone, no traceback."""


class UserError(Exception):
    """Bad input from the user: the message says what was wrong and what to do about it."""
