"""Moved to components/sla/corpus.py; kept so that code written before the move still imports."""

from components.sla.corpus import *  # noqa: F401,F403
