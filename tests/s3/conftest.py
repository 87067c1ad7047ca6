"""Checkpoints on the tier's real S3 server (versitygw; the ``s3_server``, ``s3_bucket`` and
``s3_env`` fixtures come from tests/cluster/fixtures.py): the storage seam, the writer and the
reader in-process, and training processes under real signals. Helpers: tests/s3/helpers.py."""

# The uninterrupted local run every resumed run on S3 must match bit for bit (tests/runtime).
from tests.runtime.conftest import reference  # noqa: F401
