"""Errors a user may see, each with its exit code.

Every failure the tool expects ends as one of these: the CLI prints ``str(err)``
on one line and exits with ``err.exit_code``. Codes are documented in README.md.
"""

OK = 0
USAGE = 2  # bad input or usage; also an unsafe checkout (dirty, am in progress, foreign branch)
CONFLICT = 3  # a patch of the series does not apply, even 3-way
DRIFT = 4  # upstream changed a file the overlay replaces
VERIFY = 5  # the patched tree failed verification, or a built wheel failed its checks
SOURCE = 6  # the vLLM source could not be fetched (index, network, git remote)
ENVIRONMENT = 7  # a test environment could not be built, or tests failed for reasons outside the tree
INTERRUPTED = 130  # Ctrl-C, SIGTERM, SIGHUP (128 + SIGINT, as a shell reports it)


class OverlayError(Exception):
    """Base class; ``exit_code`` says which kind of failure this is."""

    exit_code = USAGE


class UsageError(OverlayError):
    """Bad arguments, unknown ref, or a checkout it would be unsafe to touch."""

    exit_code = USAGE


class SourceError(OverlayError):
    """The vLLM source could not be fetched (package index, network, git remote)."""

    exit_code = SOURCE


class BuildError(OverlayError):
    """A wheel could not be built, or the built wheel failed its checks."""

    exit_code = VERIFY
