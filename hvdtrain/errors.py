"""The one exception type for user mistakes.

The CLI turns a UserError into a single line on stderr and exit code 2, with no traceback.
Anything else is a bug in hvdtrain and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: a config key, a value, a path. The message names it."""
