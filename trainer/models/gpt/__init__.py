"""The GPT-2/3 family: the model and its config (`model.py`), the planner's parameter inventory
(`planner.py`) and the family's declaration (`family.py`)."""

from trainer.models.gpt.model import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
