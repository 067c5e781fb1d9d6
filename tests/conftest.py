"""Shared test setup. Mooncake logs every connection at INFO; tests keep it to errors."""

from __future__ import annotations

import os

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
