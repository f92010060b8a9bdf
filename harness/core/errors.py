"""The one error of a configuration that can never run."""


class ConfigError(ValueError):
    """A configuration that can never run. The message names the fix; the command line turns it into one line on
    stderr and exit code 2."""
