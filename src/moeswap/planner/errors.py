"""PlanError: the one exception the planner raises for bad user input.

Each message is one sentence naming the field, hardware, layout or file at fault and what to do.
The CLI prints it without a traceback and exits non-zero.
"""

from __future__ import annotations


class PlanError(ValueError):
    """Input the planner cannot plan with (unknown hardware, bad config, impossible layout, ...)."""
