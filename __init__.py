"""lanes: LLM chat serving that keeps short requests fast."""

__version__ = "0.1.0"
