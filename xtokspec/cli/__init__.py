"""The `xtokspec` command (`main`): generate, bench (`bench`, with its tables and plots in `report`) and distill."""

from .main import main

__all__ = ["main"]
