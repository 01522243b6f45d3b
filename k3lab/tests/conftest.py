"""The lab's tests share the tool's hermetic set-up: a cache folder of their own and no
progress output (``tests/conftest.py``)."""

from tests.conftest import isolated_cache, progress_said  # noqa: F401  (autouse fixtures)
