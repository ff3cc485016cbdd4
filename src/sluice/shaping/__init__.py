"""Adaptive traffic shaping: remote replies change the limits (docs/shaping.md).

rules     the rules as data and how a reply matches one (pure)
rulefile  the YAML file, its JSON Schema, the shipped defaults
engine    replies and a clock in, actions out (pure, sans-IO)
runtime   the adapter: delivery results in, scheduler events out
"""

from sluice.shaping.engine import Apply, Bounce, Engine, Fired, Lift
from sluice.shaping.rules import Action, Observation, Rule

__all__ = ["Action", "Apply", "Bounce", "Engine", "Fired", "Lift", "Observation", "Rule"]
