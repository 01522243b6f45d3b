"""The lab's tests share the tool's hermetic set-up: a cache folder of their own, no
progress output, and git with the suite's identity and no user or system config
(``tests/conftest.py``)."""

from tests.conftest import hermetic_git, isolated_cache, progress_said  # noqa: F401  (autouse fixtures)
